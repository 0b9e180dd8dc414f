#!/usr/bin/env bash
# The test command: set up .venv if needed, then lint (ruff), type-check (mypy --strict on the
# core) and run every test suite in one pytest process (one shared vLLM engine per session).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0
.venv/bin/ruff check src tests integrations examples benchmarks
.venv/bin/mypy
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
