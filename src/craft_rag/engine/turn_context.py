"""One RAG turn's view of its conversation, read once: :class:`TurnContext`.

A turn used to look its conversation up at every step (fit, layout, the ended check, render,
settle: six reads of the salt's store, five of them O(turns) copies of its history). Now the
turn reads the history ONCE, before planning, and every later step works on this value (what
stays is the planner's own O(1) turn count after planning, which catches an
``end_conversation`` between plan and render): fit drops whole oldest turns
(through the planner, which logs them with a shared store) and derives the view that follows
instead of reading it again; layout, render and the post-commit history budget all see the
same turns.

Why one read is enough: from the read to the commit nothing but this turn changes the
conversation's live turns here. The planner holds the conversation from ``plan`` to
``commit``/``abort`` (one turn in flight at a time), and the drops this turn makes are applied
to the view as they are made. What can still move it is outside the turn: an
``end_conversation`` from another thread, or (a shared store) another worker's entries pulled
by ``plan``. Both change the conversation's turn count, so the caller compares the plan's turn
with :attr:`TurnContext.next_turn` and reads the view again on a mismatch
(:meth:`TurnContext.read_again`, the one case with a second read).

State: none; a frozen value per turn. Cost of :meth:`TurnContext.open`: one O(turns) read of
the salt's conversation store (with a shared store, first the round trip that brings its
history up to date), measuring the turn (tokenizing uncached chunks), and the
layout prediction (O(history + chunk tokens)) when a layout policy is on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

from craft_rag.chunk import Chunk
from craft_rag.conversation import ConversationHistory
from craft_rag.engine.turn_layout import LayoutChoice
from craft_rag.prompt import PromptAssembler
from craft_rag.stores.histories import load_history
from craft_rag.types import CacheSalt, ChunkKey, ConversationId

if TYPE_CHECKING:
    from craft_rag.planner import CraftPlanner


class TurnRenderer(Protocol):
    """What :meth:`TurnContext.open` needs of the renderer
    (:class:`~craft_rag.engine.conversation_prompts.ConversationPrompts`): a protocol, so
    this module sits below the renderer that imports it (no import cycle)."""

    max_model_len: int
    chat_assembler: PromptAssembler

    def turn_token_count(
        self, chunks: Sequence[Chunk], question: str, conversation_id: str | None = None
    ) -> int: ...

    def choose_layout(
        self, view: TurnContext, chunks: Sequence[Chunk], question: str, *, block_size: int
    ) -> LayoutChoice | None: ...

__all__ = ["TurnContext"]


@dataclass(frozen=True, slots=True)
class TurnContext:
    """What fit -> layout -> plan -> render -> commit need to know of one turn's conversation,
    read once (see the module docstring). A single request (no conversation) has
    ``conversation_id=None`` and ``history=None``.

    Invariants: ``history`` is the salt's planner's view of the conversation's live turns
    after this turn's fit (``dropped_to_fit`` oldest turns forgotten, counted in its
    ``dropped_since``); ``planner`` owns that conversation (its store is the only writer)."""

    conversation_id: str | None
    cache_salt: CacheSalt | None = None
    planner: CraftPlanner | None = None
    """The salt's planner: plans, commits and forgets this turn's conversation."""
    history: ConversationHistory | None = None
    """Live turns when read, minus the ones fit dropped (None: unknown conversation)."""
    max_tokens: int = 0
    """The reply's budget: ``max_model_len - max_tokens`` is the prompt's room."""
    turn_tokens: int = 0
    """Tokens of the turn's own segment (all its chunks and the question): an upper bound."""
    planned: bool = False
    """A caller's plan already holds the conversation (the turn in flight is this one)."""
    dropped_to_fit: int = 0
    lost_keys: frozenset[ChunkKey] = frozenset()
    """Keys no kept turn carries after fit's drop: a caller's plan may not have removed them."""
    layout: LayoutChoice | None = None

    # ---- building ------------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        renderer: TurnRenderer,
        planner: CraftPlanner,
        conversation_id: str | None,
        cache_salt: CacheSalt | None,
        chunks: Sequence[Chunk],
        question: str,
        *,
        max_tokens: int,
        planned: bool = False,
        layout_chunks: Sequence[Chunk] | None = None,
        block_size: int = 1,
    ) -> TurnContext:
        """Read the conversation once and get the turn ready to plan: with a shared store, bring
        the history up to date first (another worker may have served the last turn:
        :func:`~craft_rag.stores.histories.load_history`); measure the turn, drop the
        oldest whole turns that keep it from fitting ``renderer.max_model_len`` (forgotten
        through ``planner``: dedup may only count chunks still in the prompt), then choose
        its layout over ``layout_chunks`` (None: no layout, e.g. ``fit_turn``). An unknown
        conversation, or one with another turn in flight (unless ``planned``), is left as it
        is (``render`` or the planner report those)."""
        load_history(planner, conversation_id)
        view = cls(
            conversation_id,
            cache_salt,
            planner,
            cls._read(planner, conversation_id),
            max_tokens,
            renderer.turn_token_count(chunks, question, conversation_id),
            planned,
        )
        view = view._fit(len(renderer.chat_assembler.head_ids), renderer.max_model_len)
        if layout_chunks is None:
            return view
        layout = renderer.choose_layout(view, layout_chunks, question, block_size=block_size)
        return replace(view, layout=layout)

    @staticmethod
    def _read(planner: CraftPlanner, conversation_id: str | None) -> ConversationHistory | None:
        if conversation_id is None:
            return None
        return planner.conversations.history(ConversationId(conversation_id))

    def read_again(self) -> TurnContext:
        """The view read anew (the conversation moved since :meth:`open`: see the module
        docstring); fit and layout as decided then. One O(turns) read."""
        assert self.planner is not None
        return replace(self, history=self._read(self.planner, self.conversation_id))

    def _fit(self, head_tokens: int, max_model_len: int) -> TurnContext:
        """Drop the oldest whole turns until head + history + ``turn_tokens`` + ``max_tokens``
        fits ``max_model_len``; the view after the drop. O(turns)."""
        history, cid = self.history, self.conversation_id
        if cid is None or history is None or (history.in_flight and not self.planned):
            return self
        room = max_model_len - self.max_tokens - head_tokens - self.turn_tokens
        n, left = 0, history.tokens
        while n < len(history.turns) and left > room:
            left -= len(history.turns[n] or ())
            n += 1
        if n == 0:
            return self
        dropped = {k for keys in history.keys[:n] for k in keys}
        kept = {k for keys in history.keys[n:] for k in keys}
        assert self.planner is not None
        self.planner.forget_turns(cid, n)
        return replace(
            self,
            history=replace(
                history,
                turns=history.turns[n:],
                keys=history.keys[n:],
                dropped_since=history.dropped_since + n,
            ),
            dropped_to_fit=n,
            lost_keys=frozenset(dropped - kept),
        )

    # ---- reading the view ----------------------------------------------------------------

    @property
    def turns(self) -> tuple[tuple[int, ...] | None, ...]:
        """Token ids of the live turns (None: a turn not known here)."""
        return self.history.turns if self.history is not None else ()

    @property
    def next_turn(self) -> int:
        """The 1-based index this turn gets (what ``plan`` must say; 1 for a new or single
        request)."""
        return (self.history.turn_count if self.history is not None else 0) + 1
