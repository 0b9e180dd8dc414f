"""faiss inner-product indexes over L2-normalised embeddings (inner product = cosine).

Kinds, looked up in :data:`INDEX_KINDS`:

- ``flat``: exact search (``IndexFlatIP``); O(n·d) per query, no training.
- ``ivf``: ``IndexIVFFlat`` with ``nlist`` k-means lists, of which ``nprobe`` are scanned per
  query; needs training on the vectors. faiss wants >= 39 training points per list, so ``nlist``
  is clamped to ``n // 39``; below 2 lists IVF is pointless and a flat index is built instead.
  Clamping an explicit ``nlist``/``nprobe`` and the flat fallback are logged and recorded in
  :attr:`IndexInfo.note` (the default ``nlist`` is clamped silently).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from craft_rag_bench.retrieval.embedder import Embeddings

log = logging.getLogger(__name__)

MIN_POINTS_PER_LIST = 39
"""faiss's k-means warns below this many training points per centroid."""

FAISS_INSTALL_HINT = "install faiss with: pip install 'craft-rag[retrieval]' (faiss-cpu)"


@dataclass(frozen=True, slots=True)
class IndexInfo:
    """What was built. ``kind`` may differ from ``requested_kind`` (see ``note``)."""

    kind: str
    requested_kind: str
    n_vectors: int
    dim: int
    nlist: int | None = None
    nprobe: int | None = None
    note: str | None = None


def _faiss() -> Any:
    try:
        import faiss
    except ImportError as e:
        raise ImportError(FAISS_INSTALL_HINT) from e
    return faiss


def default_nlist(n: int) -> int:
    """~4·sqrt(n) lists (a common IVF rule), before clamping to ``n // 39`` (on the 15,065-
    passage union: 491, clamped to 386)."""
    return max(1, round(4 * math.sqrt(n)))


def default_nprobe(nlist: int) -> int:
    """Scan 1/8 of the lists (at least 1). Measured on the 15,065-passage union (386 lists,
    nprobe 48, 1,000 SQuAD questions): recall@5 0.97 of the exact top-5 at ~1/6 of the flat
    scan's time (see docs/workloads.md)."""
    return max(1, nlist // 8)


def _build_flat(
    vectors: Embeddings, nlist: int | None, nprobe: int | None, requested: str
) -> tuple[Any, IndexInfo]:
    faiss = _faiss()
    n, dim = vectors.shape
    index = faiss.IndexFlatIP(dim)
    index.add(vectors)
    note = None
    if requested != "flat":
        note = (
            f"{n} vectors are too few for IVF (needs >= {2 * MIN_POINTS_PER_LIST} for 2 lists); "
            "built an exact flat index instead"
        )
        log.warning(note)
    return index, IndexInfo("flat", requested, n, dim, note=note)


def _build_ivf(
    vectors: Embeddings, nlist: int | None, nprobe: int | None, requested: str
) -> tuple[Any, IndexInfo]:
    faiss = _faiss()
    n, dim = vectors.shape
    wanted = nlist if nlist is not None else default_nlist(n)
    usable = min(wanted, n // MIN_POINTS_PER_LIST)
    if usable < 2:
        return _build_flat(vectors, None, None, requested)
    notes: list[str] = []
    if usable < wanted and nlist is not None:  # the default is clamped silently
        notes.append(
            f"nlist {wanted} clamped to {usable} ({n} vectors, >= {MIN_POINTS_PER_LIST} per list)"
        )
    probe = nprobe if nprobe is not None else default_nprobe(usable)
    if probe > usable:
        notes.append(f"nprobe {probe} clamped to nlist {usable}")
        probe = usable
    quantizer = faiss.IndexFlatIP(dim)
    index = faiss.IndexIVFFlat(quantizer, dim, usable, faiss.METRIC_INNER_PRODUCT)
    index.train(vectors)  # k-means with faiss's fixed default seed: deterministic
    index.add(vectors)
    index.nprobe = probe
    note = "; ".join(notes) or None
    if note:
        log.warning(note)
    return index, IndexInfo("ivf", requested, n, dim, nlist=usable, nprobe=probe, note=note)


IndexBuilder = Callable[[Embeddings, int | None, int | None, str], tuple[Any, IndexInfo]]

INDEX_KINDS: Mapping[str, IndexBuilder] = {"flat": _build_flat, "ivf": _build_ivf}
"""Index kind -> builder. The names are the CLI's ``--index`` choices."""


def build_index(
    vectors: Embeddings, kind: str = "ivf", *, nlist: int | None = None, nprobe: int | None = None
) -> tuple[Any, IndexInfo]:
    """Build a faiss index over ``vectors`` (``(n, d)`` float32, unit rows).

    Cost: flat O(n·d); IVF adds k-means training (~1 s for 15k x 384 on 2 cores). Raises
    ``ValueError`` for an unknown kind (naming the valid ones), non-positive ``nlist``/``nprobe``,
    or an empty or non-2-D array."""
    if kind not in INDEX_KINDS:
        msg = f"unknown index kind {kind!r}; valid kinds: {', '.join(INDEX_KINDS)}"
        raise ValueError(msg)
    for name, value in (("nlist", nlist), ("nprobe", nprobe)):
        if value is not None and value < 1:
            msg = f"{name} must be >= 1, got {value}"
            raise ValueError(msg)
    if vectors.ndim != 2 or vectors.shape[0] == 0:
        msg = f"need a non-empty (n, d) array of embeddings, got shape {vectors.shape}"
        raise ValueError(msg)
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    return INDEX_KINDS[kind](vectors, nlist, nprobe, kind)
