"""Dense top-k retrieval over a fixed passage list, returning craft-rag chunks."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from craft_rag.chunk import Chunk
from craft_rag.types import ChunkKey
from craft_rag_bench.datasets import Passage
from craft_rag_bench.retrieval.cache import embed_passages
from craft_rag_bench.retrieval.embedder import Embedder, Embeddings
from craft_rag_bench.retrieval.index import IndexInfo, build_index


def check_k(k: int) -> int:
    """Return ``k`` if it is an int >= 1, else raise ``ValueError``."""
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        msg = f"k (top-k) must be an int >= 1, got {k!r}"
        raise ValueError(msg)
    return k


def check_query(query: str) -> str:
    """Return ``query`` if it is a non-blank string, else raise ``ValueError``."""
    if not isinstance(query, str) or not query.strip():
        msg = f"query must be a non-empty string, got {query!r}"
        raise ValueError(msg)
    return query


class Retriever:
    """faiss search over ``passages`` with a MiniLM query encoder.

    Invariants: row ``i`` of the index is ``passages[i]``; passage ids are unique (they become
    chunk keys). A search returns chunks keyed by passage id, with ``text = passage.content`` and
    ``score`` = cosine similarity, best first; ``metadata`` holds ``title``, ``dataset``, ``rank``.
    The retriever is read-only after :meth:`build`; searches from several threads are safe as far
    as faiss and torch are (one encoder call at a time is the tested path).
    """

    def __init__(
        self,
        passages: Sequence[Passage],
        embeddings: Embeddings,
        index: Any,
        info: IndexInfo,
        embedder: Embedder,
    ) -> None:
        if len(passages) != embeddings.shape[0] or index.ntotal != len(passages):
            msg = (
                f"{len(passages)} passages but {embeddings.shape[0]} embeddings and "
                f"{index.ntotal} indexed vectors"
            )
            raise ValueError(msg)
        self.passages: tuple[Passage, ...] = tuple(passages)
        self.embeddings = embeddings
        self.info = info
        self.embedder = embedder
        self._index = index

    @classmethod
    def build(
        cls,
        passages: Sequence[Passage],
        *,
        embedder: Embedder | None = None,
        kind: str = "ivf",
        nlist: int | None = None,
        nprobe: int | None = None,
        cache_dir: Path | None = None,
        show_progress: bool = True,
    ) -> Retriever:
        """Embed ``passages`` (cached on disk, see :mod:`craft_rag_bench.retrieval.cache`) and
        index them.

        Cost: minutes of CPU the first time for ~10k passages, then ~1 s (cache read + index
        build). Raises ``ValueError`` for no passages, duplicate ids, or a bad index kind."""
        if not passages:
            msg = "cannot build a retriever over zero passages"
            raise ValueError(msg)
        seen: set[str] = set()
        for p in passages:
            if p.id in seen:
                msg = f"duplicate passage id {p.id!r}: ids become chunk keys and must be unique"
                raise ValueError(msg)
            seen.add(p.id)
        embedder = embedder if embedder is not None else Embedder()
        vectors = embed_passages(
            passages, embedder, cache_dir=cache_dir, show_progress=show_progress
        )
        index, info = build_index(vectors, kind, nlist=nlist, nprobe=nprobe)
        return cls(passages, vectors, index, info, embedder)

    def _check_invariants(self) -> None:
        """Assert row alignment, id uniqueness and unit-norm rows. O(n·d)."""
        n = len(self.passages)
        assert self.embeddings.shape == (n, self.info.dim), self.embeddings.shape
        assert self._index.ntotal == n == self.info.n_vectors
        assert len({p.id for p in self.passages}) == n, "duplicate passage ids"
        norms = np.linalg.norm(self.embeddings, axis=1)
        assert np.allclose(norms, 1.0, atol=1e-3), "embeddings must be L2-normalised"

    def __len__(self) -> int:
        return len(self.passages)

    def search(self, query: str, k: int = 5) -> list[Chunk]:
        """Top-``k`` chunks for one query. Cost: one encoder call (~5-20 ms) plus the index scan.

        Returns ``min(k, len(self))`` chunks, fewer only when an IVF probe reaches fewer
        vectors. Raises ``ValueError`` for ``k < 1`` or a blank query."""
        return self.search_batch([query], k)[0]

    def search_batch(
        self, queries: Sequence[str], k: int = 5, *, show_progress: bool = False
    ) -> list[list[Chunk]]:
        """Top-``k`` chunks for each query, encoding queries in batches. Same contract as
        :meth:`search`; ``show_progress`` draws a tqdm bar on stderr over the queries."""
        check_k(k)
        if isinstance(queries, str):
            msg = "search_batch() takes a sequence of queries; use search() for one"
            raise ValueError(msg)
        for q in queries:
            check_query(q)
        if not queries:
            return []
        progress: Any = None
        if show_progress:
            from tqdm import tqdm

            progress = tqdm(total=len(queries), desc="retrieving", unit="q", file=sys.stderr)
        try:
            vectors = self.embedder.encode(list(queries), progress=progress)
        finally:
            if progress is not None:
                progress.close()
        return self.search_vectors(vectors, k)

    def search_vectors(self, vectors: Embeddings, k: int = 5) -> list[list[Chunk]]:
        """Top-``k`` chunks for already-embedded queries (``(m, dim)`` unit rows)."""
        check_k(k)
        k_eff = min(k, len(self.passages))
        scores, ids = self._index.search(np.ascontiguousarray(vectors, dtype=np.float32), k_eff)
        out: list[list[Chunk]] = []
        for row_scores, row_ids in zip(scores, ids, strict=True):
            chunks: list[Chunk] = []
            for score, idx in zip(row_scores, row_ids, strict=True):
                if idx < 0:  # faiss pads with -1 when the probed lists hold < k vectors
                    continue
                p = self.passages[int(idx)]
                chunks.append(
                    Chunk(
                        key=ChunkKey(p.id),
                        text=p.content,
                        score=float(score),
                        metadata={"title": p.title, "dataset": p.dataset, "rank": len(chunks)},
                    )
                )
            out.append(chunks)
        return out
