"""Conversation-scoped chunk dedup (paper §4.3): ``ChunkMap: conv_id -> {chunk_id}``.

A chunk already sent in an earlier turn of the same conversation is removed from the current
turn (and reported); its KV is already part of the conversation's prompt prefix. Earlier turns'
chunk orders are frozen here so the append-only prompt can be rebuilt.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from craft_rag.chunk import Chunk
from craft_rag.types import ChunkKey, ConversationId

DEFAULT_MAX_CONVERSATIONS = 10_000
DEFAULT_TTL_S = 3600.0
_FORMAT = "craft-rag/conversations/v1"


@dataclass(slots=True)
class ConversationState:
    """Chunks sent so far in one conversation. Owner: :class:`ConversationRegistry`.

    ``turns[:live_from]`` were dropped from the conversation's prompt (history budget, context
    length): their chunks are no longer "already sent" and are sent again if retrieved again.
    They still count as turns (``turn_count``), so turn numbers stay stable."""

    sent: set[ChunkKey] = field(default_factory=set)
    turns: list[tuple[ChunkKey, ...]] = field(default_factory=list)
    last_used: float = 0.0
    live_from: int = 0


class ConversationRegistry:
    """Per-conversation chunk sets, bounded by LRU count and idle TTL.

    Invariants: at most ``max_conversations`` entries, ordered least recently used first; each
    ``sent`` set is exactly the union of that conversation's live frozen turns
    (``turns[live_from:]``). Expired
    conversations (idle longer than ``ttl_s``) are treated as new and purged on the next write.
    """

    def __init__(
        self,
        max_conversations: int = DEFAULT_MAX_CONVERSATIONS,
        ttl_s: float | None = DEFAULT_TTL_S,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(max_conversations, int) or max_conversations < 1:
            msg = f"max_conversations must be a positive int, got {max_conversations!r}"
            raise ValueError(msg)
        if ttl_s is not None and ttl_s <= 0:
            msg = f"ttl_s must be > 0 or None (no expiry), got {ttl_s!r}"
            raise ValueError(msg)
        self.max_conversations = max_conversations
        self.ttl_s = ttl_s
        self._clock = clock
        self._states: OrderedDict[ConversationId, ConversationState] = OrderedDict()

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, conversation_id: object) -> bool:
        return conversation_id in self._states

    def _live(self, conversation_id: ConversationId) -> ConversationState | None:
        state = self._states.get(conversation_id)
        if state is None:
            return None
        if self.ttl_s is not None and self._clock() - state.last_used > self.ttl_s:
            return None
        return state

    def turn_count(self, conversation_id: ConversationId) -> int:
        """Turns recorded for a live conversation (0 if unknown or expired). O(1)."""
        state = self._live(conversation_id)
        return len(state.turns) if state else 0

    def turns(self, conversation_id: ConversationId) -> list[tuple[ChunkKey, ...]]:
        """Frozen chunk orders of the earlier turns (empty if unknown or expired)."""
        state = self._live(conversation_id)
        return list(state.turns) if state else []

    def split(
        self, conversation_id: ConversationId, chunks: Sequence[Chunk]
    ) -> tuple[list[Chunk], list[Chunk]]:
        """``(new, already_sent)`` for this turn's chunks, each list in input order. Read-only.
        O(k)."""
        state = self._live(conversation_id)
        if state is None:
            return list(chunks), []
        new = [c for c in chunks if c.key not in state.sent]
        seen = [c for c in chunks if c.key in state.sent]
        return new, seen

    def record_turn(self, conversation_id: ConversationId, ordered: Sequence[ChunkKey]) -> int:
        """Freeze a turn's chunk order; returns the turn's 1-based index. Refreshes the LRU
        position, purges expired conversations and evicts beyond the bound. Amortised O(k)."""
        now = self._clock()
        state = self._live(conversation_id)
        if state is None:
            state = ConversationState()
            self._states[conversation_id] = state
        state.turns.append(tuple(ordered))
        state.sent.update(ordered)
        state.last_used = now
        self._states.move_to_end(conversation_id)
        self._expire(now)
        while len(self._states) > self.max_conversations:
            self._states.popitem(last=False)
        return len(state.turns)

    def forget_oldest_turns(self, conversation_id: ConversationId, n: int) -> int:
        """The prompt no longer holds the ``n`` oldest live turns (dropped to fit a history
        budget): their chunks stop counting as sent unless a later live turn carries them too.
        Returns how many turns were dropped (0 for an unknown conversation). O(chunks of the
        live turns)."""
        if n < 0:
            msg = f"n must be >= 0, got {n}"
            raise ValueError(msg)
        state = self._live(conversation_id)
        if state is None or n == 0:
            return 0
        n = min(n, len(state.turns) - state.live_from)
        state.live_from += n
        state.sent = {k for t in state.turns[state.live_from :] for k in t}
        return n

    def end(self, conversation_id: ConversationId) -> bool:
        """Forget a conversation (end of session). True if it was known. O(1)."""
        return self._states.pop(conversation_id, None) is not None

    def _expire(self, now: float) -> None:
        if self.ttl_s is None:
            return
        while self._states:
            oldest_id, oldest = next(iter(self._states.items()))
            if now - oldest.last_used <= self.ttl_s:
                break
            del self._states[oldest_id]

    def to_json(self) -> dict[str, Any]:
        return {
            "format": _FORMAT,
            "max_conversations": self.max_conversations,
            "ttl_s": self.ttl_s,
            "conversations": [
                {
                    "id": cid,
                    "turns": [list(t) for t in s.turns],
                    "last_used": s.last_used,
                    "live_from": s.live_from,
                }
                for cid, s in self._states.items()
            ],
        }

    @classmethod
    def from_json(
        cls, data: dict[str, Any], *, clock: Callable[[], float] = time.monotonic
    ) -> ConversationRegistry:
        if not isinstance(data, dict) or data.get("format") != _FORMAT:
            msg = f"not craft-rag conversation state (expected format {_FORMAT!r})"
            raise ValueError(msg)
        reg = cls(data["max_conversations"], data["ttl_s"], clock=clock)
        for item in data["conversations"]:
            turns = [tuple(ChunkKey(str(k)) for k in t) for t in item["turns"]]
            live_from = int(item.get("live_from", 0))
            state = ConversationState(
                sent={k for t in turns[live_from:] for k in t},
                turns=turns,
                last_used=float(item["last_used"]),
                live_from=live_from,
            )
            reg._states[ConversationId(str(item["id"]))] = state
        return reg

    def _check_invariants(self) -> None:
        assert len(self._states) <= self.max_conversations
        last = float("-inf")
        for state in self._states.values():
            assert 0 <= state.live_from <= len(state.turns)
            assert state.sent == {k for t in state.turns[state.live_from :] for k in t}
            assert state.last_used >= last, "LRU order must follow last_used"
            last = state.last_used
