"""Where the evaluation harness finds its data and caches its indexes.

``CRAFT_RAG_DATA`` overrides the shared/data folder (datasets); embedding indexes are cached
under ``CRAFT_RAG_HOME`` (see :func:`craft_rag.paths.craft_home`) in ``indexes/``.
"""

from __future__ import annotations

import os
from pathlib import Path

from craft_rag.paths import craft_home


def index_cache_dir() -> Path:
    """Folder of cached corpus embeddings (content-keyed files, safe to delete)."""
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
    repo_root = Path(__file__).resolve().parents[4]  # benchmarks/craft-rag-bench/src/<pkg>/
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
