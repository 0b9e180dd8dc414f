"""CraftRetriever: any LlamaIndex retriever, its results in CRAFT order.

For pipelines that take a retriever but no postprocessors (routers, agents' retriever tools,
``ContextChatEngine``...). It applies exactly the postprocessor's core call, so a retriever and a
postprocessor sharing one :class:`~llama_index.postprocessor.craft.CraftReorderPostprocessor`
(or one planner) plan consistently.
"""

from __future__ import annotations

from typing import Any

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle
from llama_index.postprocessor.craft import CraftReorderPostprocessor


class CraftRetriever(BaseRetriever):
    """Wraps ``retriever``; every retrieval is reordered by ``reorderer`` (a new default
    :class:`CraftReorderPostprocessor` when not given; extra keyword arguments configure it).

    Sync and async retrieval call the wrapped retriever's own sync/async method, then the same
    :meth:`CraftReorderPostprocessor.reorder`.
    """

    def __init__(
        self,
        retriever: BaseRetriever,
        reorderer: CraftReorderPostprocessor | None = None,
        **reorderer_kwargs: Any,
    ) -> None:
        if not isinstance(retriever, BaseRetriever):
            msg = f"retriever must be a llama_index BaseRetriever, got {type(retriever).__name__}"
            raise ValueError(msg)
        if reorderer is not None and reorderer_kwargs:
            msg = f"pass either reorderer= or its settings ({sorted(reorderer_kwargs)}), not both"
            raise ValueError(msg)
        self._retriever = retriever
        self._reorderer = reorderer or CraftReorderPostprocessor(**reorderer_kwargs)
        # No object_map: the wrapped retriever already resolves IndexNode objects itself.
        super().__init__(callback_manager=retriever.callback_manager)

    @property
    def retriever(self) -> BaseRetriever:
        return self._retriever

    @property
    def reorderer(self) -> CraftReorderPostprocessor:
        return self._reorderer

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        nodes = self._retriever.retrieve(query_bundle)
        return self._reorderer.reorder(nodes, query_bundle).nodes

    async def _aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        nodes = await self._retriever.aretrieve(query_bundle)
        return self._reorderer.reorder(nodes, query_bundle).nodes
