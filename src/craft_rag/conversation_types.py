"""The value types of the conversation store (:mod:`craft_rag.conversation`): one conversation's
state, the read-only view a prompt is rendered from, and the seam another store plugs into.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from craft_rag.chunk import Chunk
from craft_rag.types import ChunkKey, ConversationId

DEFAULT_MAX_CONVERSATIONS = 10_000
"""A planner's conversation bound (``PlannerConfig.max_conversations``, a
:class:`~craft_rag.conversation.ConversationStore`'s default). An engine's default planner keeps
fewer: :data:`craft_rag.engine.planners.ENGINE_MAX_CONVERSATIONS` (1,024), the bound's one other
default (its conversations also keep their prompts' token ids)."""
DEFAULT_TTL_S = 3600.0
_FORMAT = "craft-rag/conversations/v1"


@dataclass(slots=True)
class ConversationState:
    """One conversation. Owner: :class:`ConversationStore` (under its lock).

    ``turns[:live_from]`` were dropped from the conversation's prompt (history budget, context
    length): their chunks are no longer "already sent" and are sent again if retrieved again.
    They still count as turns (``turn_count``), so turn numbers stay stable. ``tokens[i]`` is
    turn ``i``'s stored segment (chunks, question, reply, close) as the engine rendered it;
    None once dropped, or while not known here (a turn another worker served, until its
    history is loaded, :mod:`craft_rag.stores.histories`)."""

    sent: set[ChunkKey] = field(default_factory=set)
    turns: list[tuple[ChunkKey, ...]] = field(default_factory=list)
    last_used: float = 0.0
    live_from: int = 0
    tokens: list[tuple[int, ...] | None] = field(default_factory=list)
    dropped_since: int = 0
    """Turns dropped since the last recorded turn (the next turn reports them)."""
    held_since: float | None = None
    """When the turn in flight was planned (None: none in flight)."""
    version: int = 0
    """The shared-store seq the token history matches (0: never stored or loaded)."""


@dataclass(frozen=True, slots=True)
class ConversationHistory:
    """A read-only view of one conversation's live turns (what a prompt is rendered from)."""

    turns: tuple[tuple[int, ...] | None, ...]
    """Token ids of each live turn (None: not known here, see :class:`ConversationState`)."""
    keys: tuple[tuple[ChunkKey, ...], ...]
    """The chunk keys each live turn carries (parallel to ``turns``)."""
    turn_count: int
    """Every turn recorded, dropped ones included."""
    dropped_since: int
    in_flight: bool
    version: int
    last_used: float = 0.0
    """When its last turn was recorded (a shared store: the committing worker's clock)."""

    @property
    def tokens(self) -> int:
        """Tokens of the live turns known here."""
        return sum(len(t) for t in self.turns if t is not None)


class ConversationStoreProtocol(Protocol):
    """The seam where another conversation store plugs in (the planner and the engine's
    renderer use only these). Every method is O(1) or O(chunks of one conversation)."""

    def turn_count(self, conversation_id: ConversationId) -> int: ...

    def split(
        self, conversation_id: ConversationId, chunks: Iterable[Chunk]
    ) -> tuple[list[Chunk], list[Chunk]]: ...

    def history(self, conversation_id: ConversationId) -> ConversationHistory | None: ...

    def hold(self, conversation_id: ConversationId) -> bool: ...

    def release(self, conversation_id: ConversationId) -> None: ...

    def record_turn(
        self,
        conversation_id: ConversationId,
        ordered: Sequence[ChunkKey],
        tokens: Sequence[int] | None = None,
    ) -> int: ...

    def forget_oldest_turns(self, conversation_id: ConversationId, n: int) -> int: ...

    def end(self, conversation_id: ConversationId) -> bool: ...
