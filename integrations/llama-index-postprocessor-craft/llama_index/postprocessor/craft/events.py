"""LlamaIndex instrumentation events emitted around a CRAFT reorder and a CRAFT commit.

Subscribe with a ``BaseEventHandler`` on ``llama_index.core.instrumentation.get_dispatcher()``
(the root dispatcher sees every event). The end event carries the whole :class:`craft_rag.Plan`
and the nodes it dropped, so a handler can log exactly what CRAFT did to a request.
"""

from __future__ import annotations

from typing import Any

from llama_index.core.schema import NodeWithScore, QueryType
from llama_index_instrumentation.base import BaseEvent  # = llama_index.core's BaseEvent

from craft_rag import CommitResult, Plan


class CraftReorderStartEvent(BaseEvent):
    """A reorder is about to run on ``nodes`` (the input, in retriever order)."""

    query: QueryType | None = None
    nodes: list[NodeWithScore]
    conversation_id: str | None = None
    policy: str

    @classmethod
    def class_name(cls) -> str:
        return "CraftReorderStartEvent"


class CraftReorderEndEvent(BaseEvent):
    """A reorder finished.

    ``nodes`` is the output (planned order, then pass-through nodes); ``removed_duplicates``
    were already sent earlier in the conversation; ``repeated_in_request`` repeated a chunk key
    within this request; ``passthrough`` could not be planned (non-text or empty) and were kept
    at the end. ``plan`` is ``None`` only when there was nothing to plan. ``committed`` says
    whether the planner state was updated now (``commit_mode="postprocess"``) or is left to the
    engine (``"engine"``).
    """

    nodes: list[NodeWithScore]
    removed_duplicates: list[NodeWithScore]
    repeated_in_request: list[NodeWithScore]
    passthrough: list[NodeWithScore]
    plan: Plan | None = None
    committed: bool = False

    @classmethod
    def class_name(cls) -> str:
        return "CraftReorderEndEvent"


class CraftCommitEvent(BaseEvent):
    """A plan was committed to the planner.

    ``source="postprocess"``: the postprocessor committed it without reuse information;
    ``result`` is the planner's :class:`craft_rag.CommitResult`. ``source="engine"``: the CRAFT
    engine served the plan (``plan=``) and committed it with what vLLM reused; ``reuse`` is the
    engine's :class:`craft_rag.engine.results.ReuseReport` (cached tokens, reused chunks, TTFT;
    its ``plan_id`` is ``plan.plan_id``) and ``result`` is ``None`` (the engine keeps the
    planner's own result to itself).
    """

    plan: Plan
    result: CommitResult | None = None
    source: str
    reuse: Any = None

    @classmethod
    def class_name(cls) -> str:
        return "CraftCommitEvent"
