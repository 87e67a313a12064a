#!/usr/bin/env bash
# Sync vs async (rollout.async_steps=1) step time on SmolLM2-135M-Instruct, a few steps each, run one
# after the other, held-out eval off. Extra key=value arguments go to both runs (default: the
# default job; the committed result used a smaller batch, see its header).
#   bash benchmarks/async_step.sh [STEPS] [key=value ...]     -> benchmarks/results/async_step.md
# Timing on a shared machine is noisy: compare rows of one run only, and read the load average noted.
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-4}
shift || true
EXTRA=("$@")
OUT=benchmarks/results
RUNS=$(mktemp -d)
export HF_HUB_OFFLINE=1 PYTHONPATH=${PYTHONPATH:-$PWD}
{ echo "# sync vs async step time ($(date -u +%Y-%m-%dT%H:%MZ), $STEPS steps, load average: $(cut -d' ' -f1-3 /proc/loadavg))"
  echo
  echo "Overrides: ${EXTRA[*]:-none (the default job)}"
  echo
  echo "| run | steps | s/step | response tok/s | peak GPU MiB | rollout-vs-trainer gap (max) | staleness drift (mean abs) |"
  echo "|---|---|---|---|---|---|---|"; } > "$OUT/async_step.md"
common=(steps="$STEPS" output_dir="$RUNS" progress=false tensorboard=false eval_before=false task.eval_size=0 logging.samples_every=0 "${EXTRA[@]}")
python -m gspo train run_name=sync_2threads num_threads=2 "${common[@]}"
python -m gspo train run_name=async1_1plus1 num_threads=1 rollout.async_steps=1 rollout.async_threads=1 "${common[@]}"
cp "$OUT/async_step.md" "$RUNS/results.md"
for r in sync_2threads async1_1plus1; do python scripts/gpu_check_summary.py "$RUNS" "$r" "$RUNS/$r"; done
cp "$RUNS/results.md" "$OUT/async_step.md"
python scripts/gpu_check_summary.py --phases "$RUNS/sync_2threads" "$RUNS/async1_1plus1" >> "$OUT/async_step.md"
cat "$OUT/async_step.md"
