"""CraftRetriever: any LlamaIndex retriever, its results in CRAFT order.

For pipelines that take a retriever but no postprocessors (routers, agents' retriever tools,
``ContextChatEngine``...). It applies exactly the postprocessor's core call, so a retriever and a
postprocessor sharing one :class:`~llama_index.postprocessor.craft.CraftReorderPostprocessor`
(or one planner) plan consistently.

Speculative retrieval pipelining (opt-in, ``speculative=SpeculativePrefill(engine)``): when the
wrapped retriever searches a faiss IVF index (a ``VectorIndexRetriever`` over a
``FaissVectorStore``), the search runs in stages and the engine prefills each changed partial
top-k while the search goes on (:mod:`craft_rag.engine.pipelining`); the nodes come back in
the final set's plan order, the plan left pending for the engine path
(``commit_mode="engine"``: ``CraftVLLM``/``CraftSynthesizer`` claim and serve it, hitting the
speculation's prefill) or committed at once (``"postprocess"``). Any other retriever, or a
conversation that deduplicates, is searched and reordered as without it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from typing import Any

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle
from llama_index.postprocessor.craft import CraftReorderPostprocessor, split_nodes
from llama_index.retrievers.craft.pipelined import FaissIVFStages, faiss_ivf_stages

from craft_rag import Chunk
from craft_rag.engine import PipelineReport, SpeculativePrefill


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
        *,
        speculative: SpeculativePrefill | None = None,
        stages: int = 4,
        **reorderer_kwargs: Any,
    ) -> None:
        if not isinstance(retriever, BaseRetriever):
            msg = f"retriever must be a llama_index BaseRetriever, got {type(retriever).__name__}"
            raise ValueError(msg)
        if reorderer is not None and reorderer_kwargs:
            msg = f"pass either reorderer= or its settings ({sorted(reorderer_kwargs)}), not both"
            raise ValueError(msg)
        if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
            msg = f"stages must be an int >= 1, got {stages!r}"
            raise ValueError(msg)
        self._retriever = retriever
        self._reorderer = reorderer or CraftReorderPostprocessor(**reorderer_kwargs)
        self._speculative = speculative
        self._staged: FaissIVFStages | None = None
        self.last_pipeline: PipelineReport | None = None
        """The report of the last pipelined retrieval (``None``: none yet). Read-only."""
        if speculative is not None:
            if not isinstance(speculative, SpeculativePrefill):
                msg = (
                    "speculative must be a craft_rag.engine.SpeculativePrefill, got "
                    f"{type(speculative).__name__}"
                )
                raise ValueError(msg)
            if self._reorderer.planner is not speculative.engine.planner:
                msg = (
                    "speculative pipelining plans with the engine's planner: pass "
                    "CraftReorderPostprocessor(planner=engine.planner, commit_mode='engine')"
                )
                raise ValueError(msg)
            self._staged = faiss_ivf_stages(retriever, stages)
        # No object_map: the wrapped retriever already resolves IndexNode objects itself.
        super().__init__(callback_manager=retriever.callback_manager)

    @property
    def retriever(self) -> BaseRetriever:
        return self._retriever

    @property
    def reorderer(self) -> CraftReorderPostprocessor:
        return self._reorderer

    @property
    def pipelined(self) -> bool:
        """Whether retrievals run the speculative pipeline (opted in, over a faiss IVF index,
        and no deduplicating conversation)."""
        reorderer = self._reorderer
        conversation = reorderer.conversation_id is not None and reorderer.deduplicates
        return self._staged is not None and self._speculative is not None and not conversation

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        if self.pipelined:
            return self._pipeline(query_bundle)
        nodes = self._retriever.retrieve(query_bundle)
        return self._reorderer.reorder(nodes, query_bundle).nodes

    async def _aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        if self.pipelined:  # the search and the speculations block: off the event loop
            return await asyncio.to_thread(self._pipeline, query_bundle)
        nodes = await self._retriever.aretrieve(query_bundle)
        return self._reorderer.reorder(nodes, query_bundle).nodes

    def _pipeline(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        """The staged search driving speculative prefills; the final set's plan (pending for
        the engine path, or committed in ``postprocess`` mode) orders the nodes."""
        staged, speculative = self._staged, self._speculative
        assert staged is not None and speculative is not None
        key_source = self._reorderer.key_source
        by_key: dict[str, NodeWithScore] = {}
        passthrough: list[Sequence[NodeWithScore]] = [()]

        def stages() -> Iterator[tuple[Chunk, ...]]:
            for nodes in staged(query_bundle):
                split = split_nodes(nodes, key_source)
                by_key.update(zip((c.key for c in split.chunks), split.plannable, strict=True))
                passthrough[0] = split.passthrough
                yield split.chunks

        out = speculative.prepare(stages(), query_bundle.query_str, total=staged.stages)
        self.last_pipeline = out.report
        plan = out.result
        if self._reorderer.commit_mode == "postprocess":
            self._reorderer.planner.commit(plan)
        return [by_key[c.key] for c in plan.ordered] + list(passthrough[0])
