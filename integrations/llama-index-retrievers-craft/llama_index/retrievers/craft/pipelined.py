"""Staged search for :class:`~llama_index.retrievers.craft.CraftRetriever`'s speculative
pipelining: a ``VectorIndexRetriever`` over a ``FaissVectorStore`` whose faiss index is an IVF
index, searched in stages (:class:`craft_rag.engine.IVFStagedSearch`), each
stage's top-k as LlamaIndex nodes.

LlamaIndex exposes no public way to reach a retriever's vector store, embedding model and
node table, so this module reads the ``VectorIndexRetriever``'s own attributes (checked, with
``None`` returned for anything it does not recognise: the retriever then searches as usual).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle

from craft_rag.engine import IVFStagedSearch

StagedNodes = Callable[[QueryBundle], Iterator[list[NodeWithScore]]]
"""A query's top-k nodes after each stage of a search (the last is the final top-k)."""


class FaissIVFStages:
    """The staged search of one ``VectorIndexRetriever`` over a faiss IVF index (its
    ``similarity_top_k``, the index's ``nprobe`` split into ``search.stages`` stages).
    Read-only; cost per query: one embedding (unless the bundle carries it), the staged search
    and one docstore read per stage."""

    __slots__ = ("_retriever", "search")

    def __init__(self, retriever: Any, search: IVFStagedSearch) -> None:
        self._retriever = retriever
        self.search = search

    @property
    def stages(self) -> int:
        return self.search.stages

    def __call__(self, query_bundle: QueryBundle) -> Iterator[list[NodeWithScore]]:
        import numpy as np

        retriever = self._retriever
        embedding = query_bundle.embedding
        if embedding is None:
            embedding = retriever._embed_model.get_agg_embedding_from_queries(
                query_bundle.embedding_strs
            )
        table = retriever._index.index_struct.nodes_dict
        vector = np.asarray(embedding, dtype="float32")
        for stage in self.search.search(vector, retriever.similarity_top_k):
            nodes = retriever._docstore.get_nodes([table[str(i)] for i in stage.ids])
            yield [
                NodeWithScore(node=node, score=score)
                for node, score in zip(nodes, stage.scores, strict=True)
            ]


def faiss_ivf_stages(retriever: BaseRetriever, stages: int) -> FaissIVFStages | None:
    """The staged search of ``retriever`` when it is a plain ``VectorIndexRetriever`` (no
    filters, default query mode) over a ``FaissVectorStore``
    holding a faiss IVF index; ``None`` otherwise. ``ValueError`` for bad ``stages``."""
    from llama_index.core.indices.vector_store.retrievers import VectorIndexRetriever
    from llama_index.core.vector_stores.types import VectorStoreQueryMode

    try:
        from llama_index.vector_stores.faiss import FaissVectorStore
    except ImportError:  # no faiss store installed: nothing to stage
        return None
    if not isinstance(retriever, VectorIndexRetriever):
        return None
    store = getattr(retriever, "_vector_store", None)
    # FaissVectorStore.query honours no node or doc id restriction (as_retriever passes every
    # node id) and refuses filters: a plain retriever without filters is searched alike.
    filtered = getattr(retriever, "_filters", None) is not None
    mode = getattr(retriever, "_vector_store_query_mode", None)
    if not isinstance(store, FaissVectorStore) or filtered or mode != VectorStoreQueryMode.DEFAULT:
        return None
    try:
        search = IVFStagedSearch(store.client, stages=stages)
    except ValueError as exc:
        if "IVF index" in str(exc):
            return None  # a flat or HNSW faiss index: searched as usual
        raise
    return FaissIVFStages(retriever, search)
