"""Where craft-rag keeps prepared models, indexes and data by default.

``CRAFT_RAG_HOME`` (default ``~/.cache/craft-rag``) roots everything; ``CRAFT_RAG_MODEL_DIR``
overrides the embedded model folder and ``CRAFT_RAG_DATA`` the shared/data folder.
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def craft_home() -> Path:
    return Path(os.environ.get("CRAFT_RAG_HOME", Path.home() / ".cache" / "craft-rag"))


def default_model_dir() -> Path:
    """Folder of the prepared embedded model (HF format: config, safetensors, tokenizer)."""
    override = os.environ.get("CRAFT_RAG_MODEL_DIR")
    return Path(override) if override else craft_home() / "models" / DEFAULT_MODEL_NAME


def index_cache_dir() -> Path:
    return craft_home() / "indexes"


def shared_data_dir() -> Path:
    """shared/data: ``CRAFT_RAG_DATA`` if set (non-empty), else ``../shared/data`` from the
    checkout root or the working directory. An explicit ``CRAFT_RAG_DATA`` that is not an
    existing folder is an error (``FileNotFoundError`` naming it), never silently replaced by
    the default location; no folder found raises ``FileNotFoundError`` naming the variable."""
    override = os.environ.get("CRAFT_RAG_DATA")
    if override:
        folder = Path(override).expanduser()
        if not folder.is_dir():
            what = "is not a folder" if folder.exists() else "does not exist"
            msg = (
                f"CRAFT_RAG_DATA={override} {what}; point it at the shared/data folder that holds "
                "squad/, hotpotqa/, mtrag/ ... (or unset it to use ../shared/data)"
            )
            raise FileNotFoundError(msg)
        return folder
    repo_root = Path(__file__).resolve().parents[2]
    candidates = [repo_root.parent / "shared" / "data", Path.cwd().parent / "shared" / "data"]
    for candidate in candidates:
        if candidate.is_dir():
            return candidate
    msg = (
        "shared/data not found (looked in "
        + ", ".join(str(c) for c in candidates)
        + "); set CRAFT_RAG_DATA to the folder that holds squad/, hotpotqa/, mtrag/ ..."
    )
    raise FileNotFoundError(msg)
