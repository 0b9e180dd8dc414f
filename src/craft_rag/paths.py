"""Where craft-rag keeps prepared models by default.

``CRAFT_RAG_HOME`` (default ``~/.cache/craft-rag``) roots everything; ``CRAFT_RAG_MODEL_DIR``
overrides the embedded model folder. The evaluation harness's data and index folders live in
``craft_rag_bench.paths``.
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def craft_home() -> Path:
    """``CRAFT_RAG_HOME`` or ``~/.cache/craft-rag``: the root of every default folder."""
    return Path(os.environ.get("CRAFT_RAG_HOME", Path.home() / ".cache" / "craft-rag"))


def default_model_dir() -> Path:
    """Folder of the prepared embedded model (HF format: config, safetensors, tokenizer)."""
    override = os.environ.get("CRAFT_RAG_MODEL_DIR")
    return Path(override) if override else craft_home() / "models" / DEFAULT_MODEL_NAME
