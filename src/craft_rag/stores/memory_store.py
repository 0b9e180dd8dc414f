"""``memory://``: the store interface inside one process (planners in one process share it).

Same semantics as the SQLite and Redis stores (the contract suite runs on all three), but the
state dies with the process. Useful to share one namespace between several planners of one
process, and as the reference the other backends are tested against.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from craft_rag.redact import redact_url
from craft_rag.stores import base

_OPTIONS = base.SNAPSHOT_EVERY_OPTION


@dataclass(slots=True)
class _Namespace:
    """One namespace's state. Owner: :class:`MemoryStore` (under its lock)."""

    head: int = 0
    log: list[base.LogEntry] = field(default_factory=list)  # contiguous, ends at head
    conversations: dict[str, tuple[int, float | None]] = field(default_factory=dict)
    histories: dict[str, tuple[int, str, float | None]] = field(default_factory=dict)
    """conversation -> (version, history JSON, expiry time or None)."""
    snapshot: base.Snapshot | None = None
    fingerprint: str | None = None
    tokens: dict[str, int] = field(default_factory=dict)
    """append token -> its entry's seq (trimmed with the log)."""
    voids: dict[str, float] = field(default_factory=dict)
    """append token settled as never written -> when the void expires."""


def _after(log: list[base.LogEntry], since: int) -> list[base.LogEntry]:
    """Entries with ``seq > since`` of a contiguous log. O(entries returned)."""
    if not log:
        return []
    return log[max(0, since - log[0].seq + 1) :]


class MemoryStore(base.StateStore):
    """In-process store. Invariants: each log is contiguous and ends at ``head``; a
    conversation record is ``(last seq, expiry time or None)``. ``clock`` (wall seconds) times
    the conversation TTL. Every call is O(entries returned) under one lock."""

    def __init__(
        self,
        *,
        snapshot_every: int = base.DEFAULT_SNAPSHOT_EVERY,
        clock: Callable[[], float] = time.time,
        url: str = "memory://",
    ) -> None:
        self.url = url
        self.snapshot_every = snapshot_every
        self._clock = clock
        self._lock = threading.Lock()
        self._spaces: dict[str, _Namespace] = {}  # owner: _lock

    @classmethod
    def from_url(cls, url: str) -> MemoryStore:
        rest = url[len("memory://") :]
        where, _, query = rest.partition("?")
        if where:
            msg = (
                f"store URL {redact_url(url)!r}: memory:// takes no host or path (one store "
                "per process)"
            )
            raise ValueError(msg)
        options = base.parse_options(url, query, _OPTIONS)
        return cls(
            snapshot_every=base.snapshot_every_option(url, options), url=url.split("?", 1)[0]
        )

    def _space(self, namespace: str) -> _Namespace:
        space = self._spaces.get(namespace)
        if space is None:
            space = self._spaces[base.check_namespace(namespace)] = _Namespace()
        return space

    def attach(self, namespace: str, fingerprint: str) -> None:
        with self._lock:
            space = self._space(namespace)
            if space.fingerprint is None:
                space.fingerprint = fingerprint
            elif space.fingerprint != fingerprint:
                raise self._fingerprint_mismatch(namespace, space.fingerprint)

    def _range(self, namespace: str, since: int) -> tuple[int, list[base.LogEntry]]:
        with self._lock:
            space = self._space(namespace)
            return space.head, _after(space.log, since)

    def _append(
        self, namespace: str, request: base.AppendRequest
    ) -> tuple[int, list[base.LogEntry]]:
        conversation, token = request.conversation, request.token
        with self._lock:
            space = self._space(namespace)
            now = self._clock()
            if token is not None and space.voids.get(token, now) > now:
                raise request.voided()
            if conversation is not None:
                last, expires = space.conversations.get(conversation, (0, None))
                if expires is not None and expires <= now:
                    last = 0
                request.check_last(last)
            space.head += 1
            space.log.append(base.LogEntry(space.head, request.data))
            if token is not None:
                space.tokens[token] = space.head
            if conversation is not None:
                space.conversations[conversation] = (space.head, request.expiry(now))
                if space.head % 1024 == 0:
                    space.conversations = {
                        c: r for c, r in space.conversations.items() if r[1] is None or r[1] > now
                    }
                    space.histories = {
                        c: h for c, h in space.histories.items() if h[2] is None or h[2] > now
                    }
            return space.head, _after(space.log, request.since)

    def settle(self, namespace: str, token: str) -> int:
        with self._lock:
            space = self._space(namespace)
            seq = space.tokens.get(token)
            if seq is not None:
                return seq
            now = self._clock()
            space.voids = {t: e for t, e in space.voids.items() if e > now}
            space.voids[token] = now + base.TOKEN_VOID_TTL_S
            return 0

    def put_history(
        self, namespace: str, conversation: str, version: int, data: str, ttl_s: float | None
    ) -> bool:
        with self._lock:
            space = self._space(namespace)
            now = self._clock()
            current = space.histories.get(conversation)
            live = current is not None and (current[2] is None or current[2] > now)
            if live and current is not None and current[0] >= version:
                return False
            expiry = now + ttl_s if ttl_s is not None else None
            space.histories[conversation] = (version, data, expiry)
            return True

    def get_history(self, namespace: str, conversation: str) -> base.HistoryRecord:
        with self._lock:
            space = self._space(namespace)
            now = self._clock()
            last, expires = space.conversations.get(conversation, (0, None))
            if expires is not None and expires <= now:
                last = 0
            stored = space.histories.get(conversation)
            if stored is None or (stored[2] is not None and stored[2] <= now):
                return base.HistoryRecord(last)
            return base.HistoryRecord(last, stored[0], stored[1])

    def _snapshot(self, namespace: str) -> base.Snapshot | None:
        with self._lock:
            return self._space(namespace).snapshot

    def put_snapshot(self, namespace: str, snapshot: base.Snapshot, keep_from: int) -> None:
        with self._lock:
            space = self._space(namespace)
            if space.snapshot is None or space.snapshot.seq < snapshot.seq:
                space.snapshot = snapshot
            if space.log and space.log[0].seq < keep_from:
                del space.log[: keep_from - space.log[0].seq]
                space.tokens = {t: s for t, s in space.tokens.items() if s >= keep_from}

    def clear(self, namespace: str) -> None:
        with self._lock:
            self._spaces.pop(base.check_namespace(namespace), None)
