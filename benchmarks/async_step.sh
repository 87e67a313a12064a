#!/usr/bin/env bash
# Sync vs async (rollout.async_steps=1) step time on the default job (SmolLM2-135M-Instruct, 4 prompts
# x 8 samples x 24 tokens, 4 minibatches), a few steps each, run one after the other, held-out eval off.
#   bash benchmarks/async_step.sh [STEPS]     -> benchmarks/results/async_step.md
# Timing on a shared machine is noisy: compare rows of one run only, and read the load average noted.
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-4}
OUT=benchmarks/results
RUNS=$(mktemp -d)
export HF_HUB_OFFLINE=1 PYTHONPATH=${PYTHONPATH:-$PWD}
{ echo "# sync vs async step time ($(date -u +%Y-%m-%dT%H:%MZ), $STEPS steps, load average: $(cut -d' ' -f1-3 /proc/loadavg))"
  echo
  echo "| run | steps | s/step | response tok/s | peak GPU MiB | rollout-vs-trainer gap (max) | staleness drift (mean abs) |"
  echo "|---|---|---|---|---|---|---|"; } > "$OUT/async_step.md"
common=(steps="$STEPS" output_dir="$RUNS" progress=false tensorboard=false eval_before=false task.eval_size=0 logging.samples_every=0)
python -m gspo train run_name=sync_2threads num_threads=2 "${common[@]}"
python -m gspo train run_name=async1_1plus1 num_threads=1 rollout.async_steps=1 rollout.async_threads=1 "${common[@]}"
cp "$OUT/async_step.md" "$RUNS/results.md"
for r in sync_2threads async1_1plus1; do python scripts/gpu_check_summary.py "$RUNS" "$r" "$RUNS/$r"; done
cp "$RUNS/results.md" "$OUT/async_step.md"
python - "$RUNS" >> "$OUT/async_step.md" <<'PY'
import json, sys, statistics
from pathlib import Path
print("\nPer phase, median over steps 2..N (s):\n")
for r in ("sync_2threads", "async1_1plus1"):
    rows = [json.loads(x) for x in (Path(sys.argv[1]) / r / "metrics.jsonl").read_text().splitlines()]
    rows = [x for x in rows if "train/loss" in x][1:]
    keys = sorted({k for x in rows for k in x if k.startswith("time/")})
    print(f"- {r}: " + ", ".join(f"{k[5:-2]} {statistics.median(x[k] for x in rows):.2f}" for k in keys))
PY
cat "$OUT/async_step.md"
