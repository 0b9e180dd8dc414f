"""Conversation-scoped chunk dedup (paper §4.3): ``ChunkMap: conv_id -> {chunk_id}``.

A chunk already sent in an earlier turn of the same conversation is removed from the current
turn (and reported); its KV is already part of the conversation's prompt prefix. Earlier turns'
chunk orders and token ids are frozen here, so the append-only prompt is rendered from this one
store (:class:`ConversationStore`, the seam :class:`ConversationStoreProtocol` names): the
planner records a served turn's keys and tokens in one ``record_turn``, the engine's renderer
(:mod:`craft_rag.engine.conversation_prompts`) only reads it.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from craft_rag.chunk import Chunk
from craft_rag.conversation_types import (
    _FORMAT,
    DEFAULT_MAX_CONVERSATIONS,
    DEFAULT_TTL_S,
    ConversationHistory,
    ConversationState,
    ConversationStoreProtocol,
)
from craft_rag.types import ChunkKey, ConversationId
from craft_rag.validation import (
    check_int,
    check_number,
    validate_conversation_id,
)

__all__ = [
    "DEFAULT_MAX_CONVERSATIONS",
    "DEFAULT_TTL_S",
    "ConversationHistory",
    "ConversationRegistry",
    "ConversationState",
    "ConversationStore",
    "ConversationStoreProtocol",
]


class ConversationStore:
    """The one conversation store: per conversation the sent chunk keys, the frozen turns
    (keys and token ids), the turn in flight; bounded by LRU count and idle TTL, with an
    injected clock. The salt is structural: an engine keeps one store per cache salt (its
    salt's planner's, :class:`craft_rag.engine.planners.PlannerNamespaces`).

    Invariants: at most ``max_conversations`` entries, ordered least recently used first, but
    a conversation with a turn in flight (held since less than ``ttl_s``) is never evicted or
    expired, so the bound may be exceeded by the number of turns in flight; each ``sent``
    set is exactly the union of that conversation's live turns (``turns[live_from:]``);
    ``tokens`` is parallel to ``turns`` and None for every dropped turn. Expired conversations
    (idle longer than ``ttl_s``) are treated as new and purged on the next write.
    Thread-safe (one re-entrant lock; callers holding a planner's lock take it second).

    **Replicated** (:attr:`replicated`, a planner sharing a store sets it): the conversations,
    their LRU order, expiry and evictions must be a function of the shared commit log alone,
    so that every worker holds the same ones. A turn in flight is then a local mark beside the
    state (``_holds``): it refuses a second turn in flight and keeps the history from being
    exported or overwritten, but neither starts, moves, refreshes nor protects a conversation
    (a turn in flight is not in the log). The bound then holds exactly.
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
        self._lock = threading.RLock()
        self._states: OrderedDict[ConversationId, ConversationState] = OrderedDict()
        self.replicated = False
        """Shared-store mode (see the class docstring). Owner: the planner."""
        self._holds: dict[ConversationId, float] = {}
        """Replicated mode: conversation -> when its turn in flight was held (local only)."""

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, conversation_id: object) -> bool:
        return conversation_id in self._states

    def _held(self, state: ConversationState, now: float) -> bool:
        since = state.held_since
        return since is not None and (self.ttl_s is None or now - since <= self.ttl_s)

    def _live(self, conversation_id: ConversationId) -> ConversationState | None:
        state = self._states.get(conversation_id)
        if state is None:
            return None
        now = self._clock()
        if self.ttl_s is not None and now - state.last_used > self.ttl_s:
            return state if not self.replicated and self._held(state, now) else None
        return state

    def _in_flight(
        self, conversation_id: ConversationId, state: ConversationState | None, now: float
    ) -> bool:
        """A turn of the conversation is held (planned, not yet recorded or released)."""
        if not self.replicated:
            return state is not None and self._held(state, now)
        since = self._holds.get(conversation_id)
        return since is not None and (self.ttl_s is None or now - since <= self.ttl_s)

    def adopt_holds(self, other: ConversationStore) -> None:
        """Take ``other``'s turns in flight (a replicated store replaced by a snapshot's)."""
        with self._lock:
            self._holds.update(other._holds)

    def turn_count(self, conversation_id: ConversationId) -> int:
        """Turns recorded for a live conversation (0 if unknown or expired). O(1)."""
        with self._lock:
            state = self._live(conversation_id)
            return len(state.turns) if state else 0

    def turns(self, conversation_id: ConversationId) -> list[tuple[ChunkKey, ...]]:
        """Frozen chunk orders of the earlier turns (empty if unknown or expired)."""
        with self._lock:
            state = self._live(conversation_id)
            return list(state.turns) if state else []

    def history(self, conversation_id: ConversationId) -> ConversationHistory | None:
        """The live turns of a known conversation (None if unknown or expired). Read-only.
        O(turns)."""
        with self._lock:
            state = self._live(conversation_id)
            if state is None:
                return None
            return ConversationHistory(
                turns=tuple(state.tokens[state.live_from :]),
                keys=tuple(state.turns[state.live_from :]),
                turn_count=len(state.turns),
                dropped_since=state.dropped_since,
                in_flight=self._in_flight(conversation_id, state, self._clock()),
                version=state.version,
                last_used=state.last_used,
            )

    def split(
        self, conversation_id: ConversationId, chunks: Iterable[Chunk]
    ) -> tuple[list[Chunk], list[Chunk]]:
        """``(new, already_sent)`` for this turn's chunks, each list in input order. Read-only.
        O(k)."""
        chunks = list(chunks)  # read once: a generator would be empty for the second pass
        with self._lock:
            state = self._live(conversation_id)
            if state is None:
                return chunks, []
            new = [c for c in chunks if c.key not in state.sent]
            seen = [c for c in chunks if c.key in state.sent]
            return new, seen

    def hold(self, conversation_id: ConversationId) -> bool:
        """Mark a turn of the conversation in flight (planned, not yet recorded or released):
        until then it is neither evicted nor expired. An unknown conversation is started
        (with no turns). False when a turn was already in flight (it stays held). O(1)."""
        cid = _checked_id(conversation_id)
        with self._lock:
            if self.replicated:  # a local mark only: the log decides the state
                now = self._clock()
                if self._in_flight(cid, None, now):
                    return False
                if len(self._holds) >= self.max_conversations:  # drop stale marks
                    self._holds = {
                        c: t for c, t in self._holds.items() if self._in_flight(c, None, now)
                    }
                self._holds[cid] = now
                return True
            now = self._now()
            state = self._live(cid)
            if state is None:
                state = ConversationState(last_used=now)
                self._states[cid] = state
            elif self._held(state, now):
                return False
            state.held_since = now
            state.last_used = now
            self._states.move_to_end(cid)
            self._evict(now)
            return True

    def release(self, conversation_id: ConversationId) -> None:
        """The turn in flight was not served: the conversation is as it was (one without
        turns stays known, as an idle entry). O(1)."""
        with self._lock:
            if self.replicated:
                self._holds.pop(conversation_id, None)
                return
            state = self._states.get(conversation_id)
            if state is None:
                return
            state.held_since = None
            self._evict(self._clock(), expire=False)

    def record_turn(
        self,
        conversation_id: ConversationId,
        ordered: Sequence[ChunkKey],
        tokens: Sequence[int] | None = None,
    ) -> int:
        """Freeze a turn: its chunk order and (when known) its token ids, in one record; ends
        the turn in flight. Returns the turn's 1-based index. Refreshes the LRU position,
        purges expired conversations and evicts beyond the bound. Amortised O(k + tokens).
        ``ValueError`` (nothing changed) for a bad id, keys that are not distinct strings or
        token ids that are not ints >= 0."""
        cid = _checked_id(conversation_id)
        turn = tuple(ordered)
        if not all(isinstance(k, str) and k for k in turn) or len(set(turn)) != len(turn):
            msg = f"ordered: must be distinct non-empty chunk keys, got {list(turn)[:5]!r}"
            raise ValueError(msg)
        ids = None if tokens is None else tuple(tokens)
        if ids is not None and not all(type(t) is int and t >= 0 for t in ids):
            msg = f"tokens: must be token ids (ints >= 0), got {list(ids)[:5]!r}"
            raise ValueError(msg)
        with self._lock:
            now = self._now()
            if self.replicated:
                self._holds.pop(cid, None)
            state = self._live(cid)
            if state is None:
                state = ConversationState()
                self._states[cid] = state
            state.turns.append(turn)
            state.tokens.append(ids)
            state.sent.update(turn)
            state.last_used = now
            state.held_since = None
            state.dropped_since = 0
            self._states.move_to_end(cid)
            self._evict(now)
            return len(state.turns)

    def forget_oldest_turns(self, conversation_id: ConversationId, n: int) -> int:
        """The prompt no longer holds the ``n`` oldest live turns (dropped to fit a history
        budget or the context): their chunks stop counting as sent unless a later live turn
        carries them too, their tokens are freed, and the next turn reports them. Returns how
        many turns were dropped (0 for an unknown conversation). O(chunks of the live
        turns)."""
        check_int(n, "n", minimum=0)
        with self._lock:
            state = self._live(conversation_id)
            if state is None or n == 0:
                return 0
            n = min(n, len(state.turns) - state.live_from)
            for i in range(state.live_from, state.live_from + n):
                state.tokens[i] = None
            state.live_from += n
            state.dropped_since += n
            state.sent = {k for t in state.turns[state.live_from :] for k in t}
            return n

    def end(self, conversation_id: ConversationId) -> bool:
        """Forget a conversation (end of session), a turn in flight included. True if it was
        known. O(1)."""
        with self._lock:
            self._holds.pop(conversation_id, None)
            return self._states.pop(conversation_id, None) is not None

    def clear(self) -> None:
        with self._lock:
            self._states.clear()
            self._holds.clear()

    # ---- the shared-store copy of the token history (craft_rag.stores.histories) ----------

    def export(
        self, conversation_id: ConversationId, version: int
    ) -> tuple[ConversationHistory, int] | None:
        """The idle conversation's live turns (all known here) and its turn count, marking the
        token history as matching store seq ``version``; None when unknown, in flight or not
        fully known. O(turns)."""
        with self._lock:
            history = self.history(conversation_id)
            if history is None or history.in_flight or None in history.turns:
                return None
            self._states[conversation_id].version = max(history.version, version)
            return history, history.turn_count

    def adopt(
        self,
        conversation_id: ConversationId,
        stored: ConversationHistory,
        version: int,
    ) -> bool:
        """Fill the token ids of live turns from another worker's copy (``stored``, whose
        ``turn_count`` says which turns it holds), at store seq ``version``. Only turns whose
        chunk keys agree are filled; the dropped-turn count is taken when both copies hold the
        same turns. False (nothing changed) for an unknown conversation, one in flight here or
        a copy not newer than the local one. O(tokens)."""
        with self._lock:
            state = self._live(conversation_id)
            if (
                state is None
                or self._in_flight(conversation_id, state, self._clock())
                or state.version >= version
            ):
                return False
            first = stored.turn_count - len(stored.turns)
            for j, (ids, keys) in enumerate(zip(stored.turns, stored.keys, strict=True)):
                i = first + j
                if state.live_from <= i < len(state.turns) and state.turns[i] == keys:
                    state.tokens[i] = ids
            if stored.turn_count == len(state.turns):
                state.dropped_since = stored.dropped_since
            state.version = version
            return True

    def import_history(
        self, conversation_id: ConversationId, history: ConversationHistory
    ) -> bool:
        """Take in a conversation moved from another store (another replica's engine, its
        :meth:`history`): its live turns (chunk keys and token ids), its turn count (dropped
        turns count, as empty turns) and the turns dropped since its last one; no turn in
        flight. False (nothing changed) when the conversation is live here with turns or a
        turn in flight. ``ValueError`` (nothing changed) for a bad id, a history with a turn
        not known (None), keys that are not distinct strings per turn or token ids that are
        not ints >= 0; ``RuntimeError`` on a replicated store (its log alone decides its
        conversations). O(tokens)."""
        cid = _checked_id(conversation_id)
        if not isinstance(history, ConversationHistory):
            msg = f"history: must be a ConversationHistory, got {type(history).__name__}"
            raise ValueError(msg)
        keys = [tuple(t) for t in history.keys]
        if len(history.turns) != len(keys) or not (
            len(keys) <= history.turn_count and 0 <= history.dropped_since <= history.turn_count
        ):
            msg = (
                f"history: {len(history.turns)} token turns, {len(keys)} key turns, "
                f"turn_count {history.turn_count}, dropped_since {history.dropped_since}"
            )
            raise ValueError(msg)
        tokens: list[tuple[int, ...]] = []
        for i, (ids, turn) in enumerate(zip(history.turns, keys, strict=True)):
            if ids is None or not all(type(t) is int and t >= 0 for t in ids):
                msg = f"history.turns[{i}]: must be known token ids (ints >= 0)"
                raise ValueError(msg)
            if not all(isinstance(k, str) and k for k in turn) or len(set(turn)) != len(turn):
                msg = f"history.keys[{i}]: must be distinct non-empty chunk keys"
                raise ValueError(msg)
            tokens.append(tuple(ids))
        if self.replicated:
            msg = "a replicated store's conversations follow its shared log; import nothing"
            raise RuntimeError(msg)
        with self._lock:
            now = self._now()
            state = self._live(cid)
            if state is not None and (state.turns or self._held(state, now)):
                return False
            dropped = history.turn_count - len(keys)
            self._states[cid] = ConversationState(
                sent={k for t in keys for k in t},
                turns=[()] * dropped + keys,
                last_used=now,
                live_from=dropped,
                tokens=[None] * dropped + list(tokens),
                dropped_since=history.dropped_since,
            )
            self._states.move_to_end(cid)
            self._evict(now)
            return True

    def carry_tokens(self, other: ConversationStore) -> None:
        """Take ``other``'s token ids (and history version) for every turn both stores hold
        with the same keys at the same index, where this one does not know them (a snapshot,
        which carries none, replacing a worker's own state). O(turns of common
        conversations)."""
        with self._lock:
            for cid, state in self._states.items():
                mine = other._states.get(cid)
                if mine is None:
                    continue
                for i in range(state.live_from, min(len(state.turns), len(mine.turns))):
                    ids = mine.tokens[i]
                    if state.tokens[i] is None and ids is not None and (
                        state.turns[i] == mine.turns[i]
                    ):
                        state.tokens[i] = ids
                # The version says "my tokens match the store's history up to this seq": only
                # true when every live turn is known (else load_history must fill them).
                if None not in state.tokens[state.live_from :]:
                    state.version = max(state.version, mine.version)

    def _now(self) -> float:
        now = self._clock()
        if self._states:
            # Never behind the newest entry (a clock that stepped back, or state loaded from a
            # process whose clock ran ahead): the LRU order must follow last_used.
            now = max(now, next(reversed(self._states.values())).last_used)
        return now

    def _evict(self, now: float, *, expire: bool = True) -> None:
        """Purge expired conversations (``expire``), then the least recently used beyond the
        bound but the newest; one with a turn in flight stays. Caller holds the lock."""
        replicated = self.replicated  # holds are local: they protect nothing then
        if expire and self.ttl_s is not None:
            for cid, state in list(self._states.items()):
                if now - state.last_used <= self.ttl_s:
                    break
                if replicated or not self._held(state, now):
                    del self._states[cid]
        while len(self._states) > self.max_conversations:
            newest = next(reversed(self._states))  # the one just written stays
            victim = next(
                (
                    c for c, s in self._states.items()
                    if c != newest and (replicated or not self._held(s, now))
                ),
                None,
            )
            if victim is None:
                return
            del self._states[victim]

    def to_json(self, *, snapshot: bool = False) -> dict[str, Any]:
        """Every conversation with at least one turn, least recently used first; token ids
        and the dropped-turn count only where there are some. A turn in flight is not saved
        (its plan cannot be committed after a load): past the bound (conversations held by
        one), the newest ``max_conversations`` are saved, as releasing the holds leaves.

        ``snapshot``: a shared store's snapshot, bounded by the conversations' live chunk
        keys: no token ids nor history versions (each worker keeps its own; the store's
        per-conversation history records hold them, :mod:`craft_rag.stores.histories`), and
        dropped turns as empty key lists (only their count is still used). O(size)."""
        with self._lock:
            kept = [(c, s) for c, s in self._states.items() if s.turns]
            items = []
            for cid, s in kept[-self.max_conversations :]:
                item: dict[str, Any] = {
                    "id": cid,
                    "turns": [list(t) for t in s.turns],
                    "last_used": s.last_used,
                    "live_from": s.live_from,
                }
                if snapshot:
                    live = s.live_from
                    item["turns"] = [[] if i < live else list(t) for i, t in enumerate(s.turns)]
                    if s.dropped_since:
                        item["dropped"] = s.dropped_since
                    items.append(item)
                    continue
                if any(t is not None for t in s.tokens):
                    item["tokens"] = [None if t is None else list(t) for t in s.tokens]
                if s.dropped_since:
                    item["dropped"] = s.dropped_since
                if s.version:
                    item["version"] = s.version
                items.append(item)
            return {
                "format": _FORMAT,
                "max_conversations": self.max_conversations,
                "ttl_s": self.ttl_s,
                "conversations": items,
            }

    @classmethod
    def from_json(
        cls,
        data: dict[str, Any],
        *,
        clock: Callable[[], float] = time.monotonic,
        path: str = "",
    ) -> ConversationStore:
        """Rebuild a store saved by :meth:`to_json`, validating all of it first: one
        ``ValueError`` naming the JSON path (under ``path``) of the first bad field (more
        conversations than the bound, an empty, non-string or repeated id, a turn repeating a
        key, ``live_from`` outside the turns, ``last_used`` out of LRU order, token ids that
        are not one list of ints >= 0 (or null) per turn, tokens kept for a dropped turn).
        O(size)."""
        from craft_rag.conversation_io import states_from_json

        max_conversations, ttl_s, states = states_from_json(data, clock, path)
        store = cls(max_conversations, ttl_s, clock=clock)
        store._states = states
        return store

    def _check_invariants(self) -> None:
        with self._lock:
            now = self._clock()
            ttl = self.ttl_s
            # Over the bound only by turns in flight (a stale hold has expired: purged next).
            held = [
                s for s in self._states.values()
                if self._held(s, now) or (ttl is not None and now - s.last_used > ttl)
            ]
            assert len(self._states) - self.max_conversations <= len(held)
            last = float("-inf")
            for state in self._states.values():
                assert 0 <= state.live_from <= len(state.turns)
                assert len(state.tokens) == len(state.turns)
                assert all(t is None for t in state.tokens[: state.live_from])
                assert state.sent == {k for t in state.turns[state.live_from :] for k in t}
                assert state.last_used >= last, "LRU order must follow last_used"
                last = state.last_used


ConversationRegistry = ConversationStore
"""The former name (the planner's chunk registry is now the one conversation store)."""


def _checked_id(conversation_id: object) -> ConversationId:
    cid = validate_conversation_id(conversation_id)
    if cid is None:
        msg = "conversation_id: must be a non-empty string, got None"
        raise ValueError(msg)
    return cid
