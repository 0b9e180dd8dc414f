"""The reorderer of a :class:`~llama_index.llms.craft_vllm.CraftVLLM`: CRAFT's order for the
engine's planner, with the engine's turn fitting before a conversation turn is planned.

A plan handed to the engine with ``plan=`` holds its conversation from the moment it is made,
and the engine fits and renders a held conversation as it is: it neither drops turns for room
nor loads the turns another worker served (``CraftEngine.fit_turn``'s contract: "make room for
a turn before planning it yourself"). So a turn planned here first calls ``fit_turn``, as
:class:`~llama_index.llms.craft_vllm.CraftChatEngine` does: that one call brings the
conversation's prompt history up to date from a shared store (a turn served by another worker)
and drops the oldest turns the new one would not fit beside, so the plan only removes chunks
that the rendered prompt still carries.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from llama_index.core.bridge.pydantic import PrivateAttr
from llama_index.core.schema import NodeWithScore, QueryBundle, QueryType
from llama_index.postprocessor.craft import (
    CraftReorderPostprocessor,
    CraftReorderResult,
    split_nodes,
)

from craft_rag import CraftPlanner, validate_conversation_id
from craft_rag.engine import CraftEngine


class EngineReorderer(CraftReorderPostprocessor):
    """A :class:`CraftReorderPostprocessor` in ``commit_mode="engine"`` on the planner of
    ``engine`` for ``cache_salt``; built by :meth:`CraftVLLM.reorderer`.

    Invariant: a turn of a conversation that :attr:`deduplicates` is planned only after
    ``engine.fit_turn`` for its chunks (all of them, before dedup), question and
    ``max_tokens``, so the turns the engine renders before it are the ones the plan's dedup
    counted on (another worker's turn included). Costs one store round trip more per
    conversation turn on a shared store (two when another worker served the last turn) and
    O(chunk text) to size the turn; nothing for turns without a conversation.
    """

    _engine: CraftEngine = PrivateAttr()
    _cache_salt: str | None = PrivateAttr(default=None)
    _max_tokens: int = PrivateAttr()

    def __init__(
        self,
        engine: CraftEngine,
        *,
        planner: CraftPlanner,
        cache_salt: str | None,
        max_tokens: int,
        **data: Any,
    ) -> None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            msg = f"max_tokens must be an int >= 1 (the turn's reply budget), got {max_tokens!r}"
            raise ValueError(msg)
        data.setdefault("commit_mode", "engine")
        super().__init__(planner=planner, **data)
        self._engine = engine
        self._cache_salt = cache_salt
        self._max_tokens = max_tokens

    @property
    def max_tokens(self) -> int:
        """The reply budget the conversation is fitted for (the synthesizer's ``max_tokens``)."""
        return self._max_tokens

    def reorder(
        self,
        nodes: Iterable[NodeWithScore],
        query: QueryType | None = None,
        *,
        conversation_id: object = None,
        park: bool = True,
    ) -> CraftReorderResult:
        """:meth:`CraftReorderPostprocessor.reorder`, after ``engine.fit_turn`` when the turn
        deduplicates against a conversation (see the class). ``query`` is the question the
        turn's prompt will carry (``None``: sized as empty; the engine's own fit at render time
        then refuses a plan whose removed chunks it had to drop, never renders it)."""
        nodes = list(nodes)  # read once: a generator feeds both the fit and the plan
        conv = self._turn_conversation(conversation_id)
        if conv is not None:
            chunks = split_nodes(nodes, self.key_source).chunks
            self._engine.fit_turn(
                chunks,
                _question(query),
                conversation_id=conv,
                max_tokens=self._max_tokens,
                cache_salt=self._cache_salt,
            )
        return super().reorder(nodes, query, conversation_id=conversation_id, park=park)

    def _turn_conversation(self, conversation_id: object) -> str | None:
        """The conversation the plan will deduplicate against (None: no fit needed)."""
        if not self.deduplicates:
            return None
        conv: str | None = validate_conversation_id(conversation_id)
        return conv if conv is not None else self.conversation_id


def _question(query: QueryType | None) -> str:
    if isinstance(query, QueryBundle):
        return query.query_str
    return query if isinstance(query, str) else ""
