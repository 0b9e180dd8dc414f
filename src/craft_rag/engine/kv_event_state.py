"""What :class:`~craft_rag.engine.kv_events.KVEventSync` keeps: its counters and a bounded log
of recent events (bounds in the :mod:`craft_rag.engine.kv_events` doc, "Bounds")."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from craft_rag.engine.kv_event_wire import BlocksRemoved, BlocksStored, KVEvent

RECENT_EVENTS = 4096
RECENT_HASHES = 65_536
_MAX_KEY_LEN = 256  # a salt is at most 256 characters


@dataclass(slots=True)
class KVEventStats:
    """Counters since start. Owner: the :class:`KVEventSync` thread (read them anywhere).

    ``batches`` counts applied batches; a lost one is counted in exactly one of ``undecodable``
    (malformed: parts, sequence frame, payload, any event), ``oversized`` (over
    ``max_message_bytes``), ``disconnects`` (the connection dropped: a frame over the cap, a
    restart, a network error) or ``listener_errors`` (the listener raised), and resynced.
    """

    batches: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    clears: int = 0
    nodes_removed: int = 0
    nodes_moved: int = 0
    """CP-Tree nodes whose KV location changed (pool, RAM tier, disk tier): tier moves."""
    gaps: int = 0
    restarts: int = 0
    hash_checks: int = 0
    hash_mismatches: int = 0
    undecodable: int = 0
    oversized: int = 0
    disconnects: int = 0
    listener_errors: int = 0
    unknown_events: int = 0
    barrier_timeouts: int = 0
    own_clears: int = 0
    last_seq: int = -1
    last_event_time: float = 0.0


class RecentEvents:
    """Bounded log of recent events for callers that want to inspect them (tests, debugging).

    Invariant: at most :data:`RECENT_EVENTS` events holding at most :data:`RECENT_HASHES` block
    hashes in all, oldest dropped first; stored events keep hashes, parent, block size and the
    first block's extra keys only (module doc, "Bounds"). Owner: :class:`KVEventSync`, under its
    condition. Cost: O(hashes) per event appended.
    """

    __slots__ = ("events", "hashes", "sizes")

    def __init__(self) -> None:
        self.events: deque[KVEvent] = deque()
        self.sizes: deque[int] = deque()
        self.hashes = 0

    def extend(self, events: Iterable[KVEvent]) -> None:
        for event in events:
            slim = _slim(event)
            size = len(slim.hashes) if isinstance(slim, BlocksStored | BlocksRemoved) else 0
            self.events.append(slim)
            self.sizes.append(size)
            self.hashes += size
            while len(self.events) > RECENT_EVENTS or self.hashes > RECENT_HASHES:
                self.events.popleft()
                self.hashes -= self.sizes.popleft()

    def clear(self) -> None:
        self.events.clear()
        self.sizes.clear()
        self.hashes = 0


def _slim(event: KVEvent) -> KVEvent:
    """What the recent log keeps of ``event``: no token ids (they were most of the memory),
    at most :data:`RECENT_HASHES` hashes, and only a small first extra-keys entry (the salt)."""
    if isinstance(event, BlocksRemoved):
        if len(event.hashes) <= RECENT_HASHES:
            return event
        return BlocksRemoved(event.hashes[:RECENT_HASHES], event.medium)
    if not isinstance(event, BlocksStored):
        return event
    keys = event.extra_keys
    first = keys[0] if keys else None
    small = isinstance(first, tuple) and all(
        (isinstance(k, str | bytes) and len(k) <= _MAX_KEY_LEN) or isinstance(k, int) for k in first
    )
    return BlocksStored(
        hashes=event.hashes[:RECENT_HASHES],
        parent=event.parent,
        token_ids=(),
        block_size=event.block_size,
        extra_keys=(first,) if small else None,
        medium=event.medium,
    )
