"""Small faiss indexes for tests of speculative retrieval pipelining
(:class:`~craft_rag.scheduling.pipelining.IVFStagedSearch` and the framework retrievers built on
it), so that every integration's tests build the IVF index the same way::

    from craft_rag.testing.indexes import make_faiss_index

    index = make_faiss_index(vectors, ivf=True, nlist=16)  # trained, not yet filled

faiss is imported lazily (``pip install 'craft-rag[retrieval]'``); the core does not need it.
"""

from __future__ import annotations

from typing import Any

from craft_rag.validation import check_int

__all__ = ["make_faiss_index"]


def make_faiss_index(vectors: Any, *, ivf: bool, nlist: int) -> Any:
    """An empty faiss L2 index for ``vectors`` (a float32 ``(n, dim)`` array), which the caller
    adds itself (directly or through a vector store). With ``ivf``: an ``IndexIVFFlat`` of
    ``nlist`` lists trained on ``vectors``, with ``nprobe = nlist`` (every list is searched, so
    a staged search's final stage is exact); without: an exact ``IndexFlatL2``, the baseline a
    non-IVF index gets. Cost: one k-means training over ``vectors`` when ``ivf``; nothing is
    added. Raises ``ValueError`` for ``nlist < 1`` and ``ImportError`` (with the install hint)
    without faiss."""
    check_int(nlist, "nlist", minimum=1)
    try:
        import faiss
    except ImportError as e:
        msg = "make_faiss_index needs faiss: pip install 'craft-rag[retrieval]' (or faiss-cpu)"
        raise ImportError(msg) from e
    dim = int(vectors.shape[1])
    if not ivf:
        return faiss.IndexFlatL2(dim)
    index = faiss.IndexIVFFlat(faiss.IndexFlatL2(dim), dim, nlist)
    index.train(vectors)
    index.nprobe = nlist  # every list: the final stage is exact
    return index
