#!/usr/bin/env bash
# The SmolLM2 tool-use run of results/tools/README.md (2-core CPU; writes results/tools/run/).
set -euo pipefail
cd "$(dirname "$0")/../.."
OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} HF_HUB_OFFLINE=1 python -m gspo train configs/tools/arithmetic_python.yaml \
  output_dir=results/tools run_name=run progress=false logging.samples_every=1 "$@"
