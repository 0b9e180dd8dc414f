"""Conversation-scoped chunk dedup (paper §4.3): ``ChunkMap: conv_id -> {chunk_id}``.

A chunk already sent in an earlier turn of the same conversation is removed from the current
turn (and reported); its KV is already part of the conversation's prompt prefix. Earlier turns'
chunk orders are frozen here so the append-only prompt can be rebuilt.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from craft_rag.chunk import Chunk
from craft_rag.types import ChunkKey, ConversationId
from craft_rag.validation import (
    check_int,
    check_number,
    state_dict,
    state_error,
    state_format,
    state_int,
    state_keys,
    state_list,
    state_number,
    state_path,
    validate_conversation_id,
)

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
        self.max_conversations = check_int(max_conversations, "max_conversations", minimum=1)
        if ttl_s is not None:
            try:
                ttl_s = check_number(ttl_s, "ttl_s", positive=True)
            except ValueError as exc:
                msg = f"{exc} (or None: no expiry); pass seconds, e.g. 3600.0 for an hour"
                raise ValueError(msg) from None
        if not callable(clock):
            msg = f"clock: must be a callable returning seconds, got {type(clock).__name__}"
            raise ValueError(msg)
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
        self, conversation_id: ConversationId, chunks: Iterable[Chunk]
    ) -> tuple[list[Chunk], list[Chunk]]:
        """``(new, already_sent)`` for this turn's chunks, each list in input order. Read-only.
        O(k)."""
        chunks = list(chunks)  # read once: a generator would be empty for the second pass
        state = self._live(conversation_id)
        if state is None:
            return chunks, []
        new = [c for c in chunks if c.key not in state.sent]
        seen = [c for c in chunks if c.key in state.sent]
        return new, seen

    def record_turn(self, conversation_id: ConversationId, ordered: Sequence[ChunkKey]) -> int:
        """Freeze a turn's chunk order; returns the turn's 1-based index. Refreshes the LRU
        position, purges expired conversations and evicts beyond the bound. Amortised O(k).
        ``ValueError`` (nothing changed) for a bad id or keys that are not distinct strings."""
        cid = validate_conversation_id(conversation_id)
        if cid is None:
            msg = "conversation_id: must be a non-empty string, got None"
            raise ValueError(msg)
        turn = tuple(ordered)
        if not all(isinstance(k, str) and k for k in turn) or len(set(turn)) != len(turn):
            msg = f"ordered: must be distinct non-empty chunk keys, got {list(turn)[:5]!r}"
            raise ValueError(msg)
        now = self._clock()
        if self._states:
            # Never behind the newest entry (a clock that stepped back, or state loaded from a
            # process whose clock ran ahead): the LRU order must follow last_used.
            now = max(now, next(reversed(self._states.values())).last_used)
        state = self._live(conversation_id)
        if state is None:
            state = ConversationState()
            self._states[conversation_id] = state
        state.turns.append(turn)
        state.sent.update(turn)
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
        check_int(n, "n", minimum=0)
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
        cls,
        data: dict[str, Any],
        *,
        clock: Callable[[], float] = time.monotonic,
        path: str = "",
    ) -> ConversationRegistry:
        """Rebuild a registry saved by :meth:`to_json`, validating all of it first: one
        ``ValueError`` naming the JSON path (under ``path``) of the first bad field (more
        conversations than the bound, an empty, non-string or repeated id, a turn repeating a
        key, ``live_from`` outside the turns, ``last_used`` out of LRU order). O(size)."""
        state_format(data, path, _FORMAT, "conversation state")
        state_dict(data, path, required=("format", "max_conversations", "ttl_s", "conversations"))
        for name in ("max_conversations", "ttl_s"):
            value = data[name]
            if name == "ttl_s" and value is None:
                continue
            if name == "max_conversations":
                state_int(value, state_path(path, name), minimum=1)
            else:
                state_number(value, state_path(path, name), positive=True)
        reg = cls(data["max_conversations"], data["ttl_s"], clock=clock)
        items_path = state_path(path, "conversations")
        items = state_list(data["conversations"], items_path, max_len=reg.max_conversations)
        states: OrderedDict[ConversationId, ConversationState] = OrderedDict()
        last = float("-inf")
        for i, raw in enumerate(items):
            where = state_path(items_path, i)
            item = state_dict(
                raw, where, required=("id", "turns", "last_used"), optional=("live_from",)
            )
            id_path = state_path(where, "id")
            try:
                cid = validate_conversation_id(item["id"], id_path)
            except ValueError as exc:
                raise state_error(id_path, str(exc).removeprefix(f"{id_path}: ")) from None
            if cid is None:
                raise state_error(id_path, "must be a non-empty string, got None")
            if cid in states:
                raise state_error(id_path, f"repeats conversation id {cid!r}")
            turns_path = state_path(where, "turns")
            turns = [
                tuple(ChunkKey(k) for k in state_keys(t, state_path(turns_path, j)))
                for j, t in enumerate(state_list(item["turns"], turns_path))
            ]
            live_from = state_int(
                item.get("live_from", 0),
                state_path(where, "live_from"),
                minimum=0,
                maximum=len(turns),
            )
            last_used = state_number(item["last_used"], state_path(where, "last_used"))
            if last_used < last:
                raise state_error(
                    state_path(where, "last_used"),
                    f"{last_used} is earlier than the conversation before it ({last}); "
                    "conversations are saved least recently used first",
                )
            last = last_used
            states[cid] = ConversationState(
                sent={k for t in turns[live_from:] for k in t},
                turns=turns,
                last_used=last_used,
                live_from=live_from,
            )
        # Times past this process's clock (saved by a process whose clock ran ahead, e.g. a
        # monotonic clock before a reboot) are brought back to now, keeping their order.
        now = reg._clock()
        for state in states.values():
            state.last_used = min(state.last_used, now)
        reg._states = states
        return reg

    def _check_invariants(self) -> None:
        assert len(self._states) <= self.max_conversations
        last = float("-inf")
        for state in self._states.values():
            assert 0 <= state.live_from <= len(state.turns)
            assert state.sent == {k for t in state.turns[state.live_from :] for k in t}
            assert state.last_used >= last, "LRU order must follow last_used"
            last = state.last_used
