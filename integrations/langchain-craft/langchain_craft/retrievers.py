"""``CraftRetriever``: any LangChain retriever, with CRAFT's order applied to its results."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.callbacks import (
    AsyncCallbackManagerForRetrieverRun,
    CallbackManagerForRetrieverRun,
)
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnableConfig, ensure_config
from pydantic import Field, field_validator

from langchain_craft._documents import CraftDocuments, conversation_id_from_config
from langchain_craft.reorder import CraftReorder


def _check_k(k: Any) -> int | None:
    if k is None:
        return None
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        msg = f"k must be an int >= 1 or None (keep everything), got {k!r}"
        raise ValueError(msg)
    return k


class CraftRetriever(BaseRetriever):
    """Wraps ``retriever``: retrieve, keep its top ``k`` (relevance order), then plan with CRAFT.

    The result is a :class:`CraftDocuments` (a list) in CRAFT order; documents are the base
    retriever's own objects. ``k`` is also passed on to the base retriever (vector-store
    retrievers honour it; others ignore it), so ``invoke(query, k=3)`` works either way. The
    conversation id comes from ``config["configurable"]`` as for :class:`CraftReorder`, whose
    settings (planner, commit mode, id key) this retriever uses. Cost: the base retriever plus
    the planner's O(k log k).
    """

    retriever: BaseRetriever = Field(description="The retriever whose results are reordered.")
    reorder: CraftReorder = Field(
        default_factory=CraftReorder,
        description="The CRAFT step (planner, commit mode, conversation keys) to apply.",
    )
    k: int | None = Field(
        default=None,
        description="Keep the base retriever's top k documents before planning; None keeps all.",
    )

    @field_validator("k")
    @classmethod
    def _valid_k(cls, k: int | None) -> int | None:
        return _check_k(k)

    def invoke(
        self, input: str, config: RunnableConfig | None = None, **kwargs: Any
    ) -> list[Document]:
        config = ensure_config(config)
        conversation_id = conversation_id_from_config(config, self.reorder.conversation_keys)
        return super().invoke(input, config, conversation_id=conversation_id, **kwargs)

    async def ainvoke(
        self, input: str, config: RunnableConfig | None = None, **kwargs: Any
    ) -> list[Document]:
        config = ensure_config(config)
        conversation_id = conversation_id_from_config(config, self.reorder.conversation_keys)
        return await super().ainvoke(input, config, conversation_id=conversation_id, **kwargs)

    def _base_kwargs(self, k: int | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        return {**kwargs, "k": k} if k is not None else kwargs

    def _finish(
        self, documents: Sequence[Document], k: int | None, conversation_id: str | None
    ) -> CraftDocuments:
        kept = list(documents)[:k] if k is not None else documents
        return self.reorder.plan_documents(kept, conversation_id)

    def _get_relevant_documents(
        self,
        query: str,
        *,
        run_manager: CallbackManagerForRetrieverRun,
        conversation_id: str | None = None,
        k: int | None = None,
        **kwargs: Any,
    ) -> list[Document]:
        k = _check_k(k if k is not None else self.k)
        docs = self.retriever.invoke(
            query, {"callbacks": run_manager.get_child()}, **self._base_kwargs(k, kwargs)
        )
        return self._finish(docs, k, conversation_id)

    async def _aget_relevant_documents(
        self,
        query: str,
        *,
        run_manager: AsyncCallbackManagerForRetrieverRun,
        conversation_id: str | None = None,
        k: int | None = None,
        **kwargs: Any,
    ) -> list[Document]:
        k = _check_k(k if k is not None else self.k)
        docs = await self.retriever.ainvoke(
            query, {"callbacks": run_manager.get_child()}, **self._base_kwargs(k, kwargs)
        )
        return self._finish(docs, k, conversation_id)
