"""Staged search for :class:`~langchain_craft.CraftRetriever`'s speculative pipelining: a
``VectorStoreRetriever`` over langchain-community's ``FAISS`` vector store whose faiss index is
an IVF index, searched in stages (:class:`craft_rag.engine.IVFStagedSearch`), each stage's
top-k as the store's own ``Document`` objects.

The staged search repeats what ``FAISS.similarity_search`` does without a filter: embed the
query with the store's embedding function, L2-normalise it when the store does, search the
index (here in stages, the index's ``nprobe`` split), map faiss ids through
``index_to_docstore_id`` to the docstore. The last stage's top-k is the store's own result
(ties aside). langchain-community is optional: without it nothing is staged.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever

from craft_rag.engine import IVFStagedSearch

_STAGED_SEARCH_KWARGS = frozenset({"k", "fetch_k"})
"""``search_kwargs`` a staged search honours (``fetch_k`` only matters with a filter)."""


class FaissIVFStages:
    """The staged search of one ``FAISS`` vector store (the index's ``nprobe`` split into
    ``search.stages`` stages). Read-only; cost per query: one query embedding, the staged
    search and one docstore look-up per document per stage."""

    __slots__ = ("_store", "search")

    def __init__(self, store: Any, search: IVFStagedSearch) -> None:
        self._store = store
        self.search = search

    @property
    def stages(self) -> int:
        return self.search.stages

    def __call__(self, query: str, k: int) -> Iterator[list[Document]]:
        """The top-``k`` documents after each stage (the last is the final top-k)."""
        import faiss
        import numpy as np

        store = self._store
        embeddings = store.embeddings  # an Embeddings, or None for a plain function
        embedding = (
            embeddings.embed_query(query)
            if embeddings is not None
            else store.embedding_function(query)
        )
        vector = np.array([embedding], dtype="float32")
        if getattr(store, "_normalize_L2", False):  # FAISS(normalize_L2=True), as its search
            faiss.normalize_L2(vector)
        for stage in self.search.search(vector, k):
            docs: list[Document] = []
            for i in stage.ids:
                doc_id = store.index_to_docstore_id[i]
                doc = store.docstore.search(doc_id)
                if not isinstance(doc, Document):
                    msg = f"the FAISS docstore has no document for id {doc_id!r}"
                    raise ValueError(msg)
                docs.append(doc)
            yield docs


def faiss_ivf_stages(retriever: BaseRetriever, stages: int) -> FaissIVFStages | None:
    """The staged search of ``retriever`` when it is a plain similarity
    ``VectorStoreRetriever`` (``search_type="similarity"``, no filter or threshold: only
    ``k``/``fetch_k`` in ``search_kwargs``) over a langchain-community ``FAISS`` store holding
    a faiss IVF index; ``None`` otherwise (it is then searched as usual). ``ValueError`` for
    bad ``stages``."""
    from langchain_core.vectorstores import VectorStoreRetriever

    try:
        from langchain_community.vectorstores import FAISS
    except ImportError:  # no langchain-community: nothing to stage
        return None
    if not isinstance(retriever, VectorStoreRetriever):
        return None
    store = retriever.vectorstore
    if (
        not isinstance(store, FAISS)
        or retriever.search_type != "similarity"
        or not set(retriever.search_kwargs) <= _STAGED_SEARCH_KWARGS
    ):
        return None
    try:
        search = IVFStagedSearch(store.index, stages=stages)
    except ValueError as exc:
        if "IVF index" in str(exc):
            return None  # a flat, HNSW or id-mapped faiss index: searched as usual
        raise
    return FaissIVFStages(store, search)


def base_k(retriever: BaseRetriever) -> int:
    """The ``k`` a plain ``VectorStoreRetriever`` searches with (its ``search_kwargs``, else
    ``FAISS.similarity_search``'s default 4)."""
    k = getattr(retriever, "search_kwargs", {}).get("k", 4)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        msg = f"the wrapped retriever's search_kwargs['k'] must be an int >= 1, got {k!r}"
        raise ValueError(msg)
    return k
