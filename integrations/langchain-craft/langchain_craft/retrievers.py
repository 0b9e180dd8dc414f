"""``CraftRetriever``: any LangChain retriever, with CRAFT's order applied to its results.

Speculative retrieval pipelining (opt-in, ``speculative=SpeculativePrefill(engine)``): when the
wrapped retriever is a plain similarity ``VectorStoreRetriever`` over langchain-community's
``FAISS`` store holding a faiss IVF index, the search runs in ``stages`` stages and the engine
prefills each changed partial top-k while the search goes on
(:mod:`craft_rag.engine.pipelining`); the documents come back in the final set's plan order,
the plan left pending for ``ChatCraftVLLM`` (``CraftReorder(commit=False)``: it claims and
serves that plan, hitting the speculation's prefill) or committed at once (``commit=True``).
Any other retriever, a call with other search arguments than ``k``, or a conversation that
deduplicates (``keeps_earlier_chunks=True`` and a conversation id) is searched and reordered
as without it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from typing import Any

from langchain_core.callbacks import (
    AsyncCallbackManagerForRetrieverRun,
    CallbackManagerForRetrieverRun,
)
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnableConfig, ensure_config
from pydantic import Field, PrivateAttr, field_validator, model_validator

from craft_rag import Chunk
from craft_rag.engine import PipelineReport, SpeculativePrefill
from langchain_craft._documents import (
    CraftDocuments,
    conversation_id_from_config,
    split_documents,
)
from langchain_craft._pipelined import FaissIVFStages, base_k, faiss_ivf_stages
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
    the planner's O(k log k). ``speculative``/``stages``: opt-in speculative retrieval
    pipelining (see the module docstring; the base retriever's callbacks do not run then, as
    it is not invoked). ``ValueError`` for bad settings.
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

    speculative: SpeculativePrefill | None = Field(
        default=None,
        exclude=True,
        description=(
            "Opt-in speculative retrieval pipelining over this engine (a faiss IVF index behind "
            "a FAISS vector-store retriever; any other retriever is searched as usual)."
        ),
    )
    stages: int = Field(
        default=4, description="Stages of a pipelined IVF search (the index's nprobe split)."
    )

    _staged: FaissIVFStages | None = PrivateAttr(default=None)
    _last_pipeline: PipelineReport | None = PrivateAttr(default=None)

    @field_validator("k")
    @classmethod
    def _valid_k(cls, k: int | None) -> int | None:
        return _check_k(k)

    @field_validator("stages", mode="before")
    @classmethod
    def _valid_stages(cls, stages: object) -> int:
        if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
            msg = f"stages must be an int >= 1, got {stages!r}"
            raise ValueError(msg)
        return stages

    @field_validator("speculative", mode="before")
    @classmethod
    def _valid_speculative(cls, speculative: object) -> SpeculativePrefill | None:
        if speculative is not None and not isinstance(speculative, SpeculativePrefill):
            msg = (
                "speculative must be a craft_rag.engine.SpeculativePrefill, got "
                f"{type(speculative).__name__}"
            )
            raise ValueError(msg)
        return speculative

    @model_validator(mode="after")
    def _stage(self) -> CraftRetriever:
        if self.speculative is not None:
            if self.reorder.planner is not self.speculative.engine.planner:
                msg = (
                    "speculative pipelining plans with the engine's planner: pass "
                    "reorder=CraftReorder(planner=engine.planner, commit=False)"
                )
                raise ValueError(msg)
            self._staged = faiss_ivf_stages(self.retriever, self.stages)
        return self

    @property
    def pipelined(self) -> bool:
        """Whether retrievals may run the speculative pipeline (opted in, over a faiss IVF
        index); a call with a deduplicating conversation or other search arguments than ``k``
        is still searched as usual."""
        return self._staged is not None and self.speculative is not None

    @property
    def last_pipeline(self) -> PipelineReport | None:
        """The report of the last pipelined retrieval (``None``: none yet)."""
        return self._last_pipeline

    def _pipelines(self, conversation_id: str | None, kwargs: dict[str, Any]) -> bool:
        reorder = self.reorder
        conversation = conversation_id or reorder.conversation_id
        deduplicates = reorder.keeps_earlier_chunks and conversation is not None
        return self.pipelined and not kwargs and not deduplicates

    def _pipeline(self, query: str, k: int | None) -> CraftDocuments:
        """The staged search driving speculative prefills; the final set's plan (pending for
        ``ChatCraftVLLM``, or committed with ``commit=True``) orders the documents."""
        staged, speculative = self._staged, self.speculative
        assert staged is not None and speculative is not None
        top_k = k if k is not None else base_k(self.retriever)
        by_key: dict[str, Document] = {}
        passthrough: list[Sequence[Document]] = [()]

        def stages() -> Iterator[tuple[Chunk, ...]]:
            for docs in staged(query, top_k):
                split = split_documents(docs, self.reorder.id_key)
                by_key.update(zip((c.key for c in split.chunks), split.plannable, strict=True))
                passthrough[0] = split.passthrough
                yield split.chunks

        out = speculative.prepare(stages(), query, total=staged.stages)
        self._last_pipeline = out.report
        plan = out.result
        if self.reorder.commit:
            self.reorder.planner.commit(plan)
        return CraftDocuments(
            [*(by_key[c.key] for c in plan.ordered), *passthrough[0]],
            plan=plan,
            repeated_in_request=[by_key[c.key] for c in plan.repeated_in_request],
            passthrough=passthrough[0],
            committed=self.reorder.commit,
        )

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
        if self._pipelines(conversation_id, kwargs):
            return self._pipeline(query, k)
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
        if self._pipelines(conversation_id, kwargs):  # the search and speculations block
            return await asyncio.to_thread(self._pipeline, query, k)
        docs = await self.retriever.ainvoke(
            query, {"callbacks": run_manager.get_child()}, **self._base_kwargs(k, kwargs)
        )
        return self._finish(docs, k, conversation_id)
