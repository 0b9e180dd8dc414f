"""Keep the CP-Tree true to vLLM's prefix cache: its KV cache events.

:class:`KVEventSync` subscribes to vLLM's ZMQ publisher (``KVEventsConfig(publisher="zmq",
endpoint="ipc://...")``; the publisher binds ipc endpoints, the subscriber connects) on a
daemon thread and forwards ``BlockRemoved`` to ``planner.on_blocks_removed`` and
``AllBlocksCleared`` to ``planner.on_all_blocks_cleared``. The expected hashes it checks come
from :class:`~craft_rag.engine.block_hashes.BlockHasher` (re-exported here).

Wire format (vLLM 0.32, msgpack via msgspec): each message is ``[topic, seq (8 bytes
big-endian), payload]``; the payload is an array ``[ts, events, dp_rank]`` and each event a map
with a ``"type"`` tag. Decoding and validation live in :mod:`craft_rag.engine.kv_event_wire`
(re-exported here); unknown event types are counted (``unknown_events``) and ignored.

Consistency: events arrive asynchronously (vLLM's publisher thread, then this thread). A block
evicted between a request's completion and its planner commit can leave a stale CP-Tree node; the
next commit that matches it sees fewer cached chunks than predicted and removes it
(``reused_chunks`` in :meth:`craft_rag.planner.CraftPlanner.commit`). A gap in sequence numbers
(dropped messages: evictions may be lost) or a sequence number going back (the engine or server
restarted: its cache is empty) resyncs by clearing: ``on_all_blocks_cleared`` before the batch is
applied, counted in :attr:`KVEventStats.gaps` / :attr:`KVEventStats.restarts`. Tiers
(``residency``, :mod:`~craft_rag.engine.kv_residency`): a removal reaches the listener once no
medium holds its block, a new cheapest medium its ``on_blocks_moved``.

Lost batches: nothing a peer sends stops the subscriber thread. A message with the wrong part
count, a bad sequence frame, an undecodable payload or any malformed event (:class:`MalformedBatch`:
wrong types, out-of-range values, truncated msgpack, garbage) is refused whole, counted in
``undecodable``, and treated like a sequence gap: the listener is cleared (resync) and, when the
sequence number was readable, the barrier passes it. The same for an over-size message
(``oversized``), a dropped connection (``disconnects``) and a listener that raised
(``listener_errors``). Each loss logs a warning on ``craft_rag.engine.kv_events``, at most one per
:data:`WARN_INTERVAL_S` (60 s); the next says how many were not logged.

Bounds (the publisher is a network peer): one message is at most ``max_message_bytes``
(:data:`MAX_MESSAGE_BYTES`, 2 MiB: a step of ~350,000 tokens at 5 wire bytes each; vLLM steps
carry a few thousand). ZMQ's ``MAXMSGSIZE`` refuses a bigger frame before reading it (libzmq then
drops the connection; the sync resyncs and reconnects on a new socket), and the total size is
checked again before decoding. Decoding a message costs O(its size) time and transient Python
objects of roughly 10-20x its size for well-formed batches (at most ~40 MiB at the cap), freed
once the batch is applied; frames past the third are read and dropped. The recent-events log
(:meth:`KVEventSync.recent_events`) keeps at most :data:`RECENT_EVENTS` (4,096) events and
:data:`RECENT_HASHES` (65,536) block hashes, without token ids and with only the first block's
extra keys: about 8 MiB at most, whatever the prompt length.

Our own resets: vLLM queues ``AllBlocksCleared`` at ``reset_prefix_cache`` but publishes it only
with its *next* step's batch, i.e. with the first request after the reset. The engine empties the
planners itself at reset time and calls :meth:`KVEventSync.expect_clear`; without that, the late
event could land after that first request's commit (over a server there is no event barrier:
the HTTP answer and the ZMQ batch race) and wipe what it committed. An expected clear is counted
in :attr:`KVEventStats.own_clears` and not forwarded; a gap or restart forgets expectations (a
lost batch may have held the event; clearing again is the safe side).

Over a vLLM server (:mod:`craft_rag.engine.backends.server.backend`) the endpoint is
``tcp://HOST:PORT`` (its publisher binds ``tcp://*:PORT``; ZMQ reconnects after a restart) and
hashes are 64-bit ints; :meth:`KVEventSync.set_hasher` makes the sync check that the first block
of each unsalted stored chain hashes as expected (``hash_mismatches`` > 0: wrong seed/algorithm)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from functools import partial
from typing import Any

from craft_rag.engine.block_hashes import (
    DEFAULT_NONE_HASH_SEED,
    BlockHasher,
    hash_function,
    sha256_pickle,
)
from craft_rag.engine.kv_event_state import (
    RECENT_EVENTS,
    RECENT_HASHES,
    KVEventStats,
    RecentEvents,
)
from craft_rag.engine.kv_event_wire import (
    MEDIUM_GPU,
    AllCleared,
    BlocksRemoved,
    BlocksStored,
    DecodedBatch,
    KVEvent,
    MalformedBatch,
    decode_batch,
    decode_event_batch,
    decode_seq,
)
from craft_rag.engine.kv_residency import EvictionListener, TierResidency

__all__ = [
    "DEFAULT_NONE_HASH_SEED",
    "MAX_MESSAGE_BYTES",
    "RECENT_EVENTS",
    "RECENT_HASHES",
    "AllCleared",
    "BlockHasher",
    "BlocksRemoved",
    "BlocksStored",
    "EvictionListener",
    "KVEvent",
    "KVEventStats",
    "KVEventSync",
    "MalformedBatch",
    "decode_event_batch",
    "hash_function",
    "sha256_pickle",
]

_LOG = logging.getLogger("craft_rag.engine.kv_events")
MAX_MESSAGE_BYTES = 2 << 20
"""Default cap on one KV event message (module doc, "Bounds")."""
WARN_INTERVAL_S = 60.0


class KVEventSync:
    """Subscribes to a vLLM KV event endpoint and applies evictions to a planner.

    Start it *before* the engine binds the endpoint: ZMQ connects lazily, so no early batch is
    lost to the subscription handshake. One daemon thread owns the SUB socket; the planner is
    thread-safe (its own lock), so callbacks run on that thread. Nothing a peer sends stops that
    thread: every lost batch resyncs (module doc). ``close()`` stops and joins it.
    ``max_message_bytes`` caps one message (module doc, "Bounds").
    """

    def __init__(
        self,
        endpoint: str,
        listener: EvictionListener | None = None,
        *,
        topic: bytes = b"",
        clock: Callable[[], float] = time.monotonic,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
    ) -> None:
        try:
            import zmq
        except ImportError as exc:
            msg = "KV event sync needs pyzmq (a vllm dependency): pip install pyzmq"
            raise ImportError(msg) from exc
        if isinstance(max_message_bytes, bool) or not isinstance(max_message_bytes, int):
            msg = f"max_message_bytes must be an int, got {type(max_message_bytes).__name__}"
            raise ValueError(msg)
        if max_message_bytes < 1024:
            msg = f"max_message_bytes must be at least 1024, got {max_message_bytes}"
            raise ValueError(msg)
        self.endpoint = endpoint
        self.max_message_bytes = max_message_bytes
        self.stats = KVEventStats()
        self._listener = listener
        self._clock = clock
        self._recent = RecentEvents()
        self.residency = TierResidency()  # owner: the subscriber thread
        self._hasher: BlockHasher | None = None
        self._expected_clears = 0  # AllCleared events of resets the listener already applied
        self._cond = threading.Condition()
        self._topic = topic
        self._warn_at = float("-inf")  # next time a lost batch may be logged (rate limit)
        self._unlogged = 0  # lost batches since the last warning
        self._ctx = zmq.Context()
        try:
            self._sock, self._monitor = self._open()
        except zmq.ZMQError as exc:
            self._ctx.term()
            msg = f"KV event endpoint {endpoint!r} cannot be connected: {exc}"
            raise ValueError(msg) from exc
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="craft-kv-events", daemon=True)
        self._thread.start()

    def _open(self) -> tuple[Any, Any]:
        """A connected SUB socket and its disconnect monitor. MAXMSGSIZE makes ZMQ refuse a
        bigger frame unread, dropping the connection for good (libzmq does not reconnect after
        a protocol error): the monitor tells :meth:`_run` to resync and open a new socket."""
        import zmq

        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, self._topic)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            sock.connect(self.endpoint)
        except zmq.ZMQError:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)  # else Context.term() would wait for it forever
            raise
        return sock, monitor

    def _close_sockets(self) -> None:
        """Close the socket and its monitor; safe on sockets already closed or half-opened."""
        import zmq

        closes = (
            self._sock.disable_monitor,
            partial(self._monitor.close, linger=0),
            partial(self._sock.close, linger=0),
        )
        for close in closes:
            with suppress(zmq.ZMQError):  # already closed (a reopen that failed halfway)
                close()

    def set_hasher(self, hasher: BlockHasher | None) -> None:
        """Check stored first blocks against ``hasher`` (see the module doc)."""
        with self._cond:
            self._hasher = hasher

    def set_listener(self, listener: EvictionListener | None) -> None:
        """Route future evictions to ``listener`` (e.g. a new planner)."""
        with self._cond:
            self._listener = listener

    def expect_clear(self) -> None:
        """Announce a reset whose clear the listener already applied (or will apply now): the
        next ``AllCleared`` event is that reset's and is not forwarded (module doc). Call it
        *before* sending the reset; :meth:`cancel_clear` if the reset did not happen."""
        with self._cond:
            self._expected_clears += 1

    def cancel_clear(self) -> None:
        """Withdraw one :meth:`expect_clear` (the reset failed: no event will come)."""
        with self._cond:
            self._expected_clears = max(0, self._expected_clears - 1)

    def _own_clear(self) -> bool:
        with self._cond:
            if self._expected_clears == 0:
                return False
            self._expected_clears -= 1
            return True

    # ---- the subscriber thread -----------------------------------------------------------------

    def _run(self) -> None:
        import zmq

        poller = self._poller()
        reopen = False
        while not self._stop.is_set():
            try:
                if reopen:
                    poller = self._reopen()
                    reopen = False
                ready = dict(poller.poll(50))
                if self._monitor in ready and self._disconnected():
                    self._lost("disconnects", "the connection dropped (a frame over "
                               "max_message_bytes, a publisher restart or a network error)")
                    reopen = True
                    continue
                if self._sock in ready:
                    message = self._recv()
                    if message is not None:
                        self._handle(*message)
            except zmq.ZMQError as exc:
                if self._stop.is_set():
                    break
                self._lost("disconnects", f"socket error {exc.errno}")
                reopen = True  # tried again next round, however often it fails
            except Exception as exc:  # last resort: nothing a peer sends may end this thread
                self._lost("undecodable", f"unexpected {type(exc).__name__}")
                self._stop.wait(0.05)

    def _poller(self) -> Any:
        import zmq

        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        return poller

    def _disconnected(self) -> bool:
        """Drain the monitor; whether it reported a disconnect (the only event it watches)."""
        import zmq

        seen = False
        while True:
            try:
                self._monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return seen
            seen = True

    def _reopen(self) -> Any:
        """A fresh socket after a dropped connection, at most one per 0.1 s (a peer that keeps
        sending over-size frames costs a resync per reconnect, not a busy loop)."""
        self._stop.wait(0.1)
        self._close_sockets()
        self._sock, self._monitor = self._open()
        return self._poller()

    def _recv(self) -> tuple[list[bytes], int, int] | None:
        """One message as (its first three frames, its part count, its total bytes). Frames
        past the third are read and dropped: memory stays at three frames of at most
        ``max_message_bytes`` each whatever the part count."""
        import zmq

        try:
            frame: bytes = self._sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return None
        frames: list[bytes] = []
        parts = total = 0
        while True:
            parts += 1
            total += len(frame)
            if parts <= 3:
                frames.append(frame)
            if not self._sock.getsockopt(zmq.RCVMORE):
                return frames, parts, total
            frame = self._sock.recv(zmq.NOBLOCK)  # the rest of a message arrives with it

    def _handle(self, frames: Sequence[bytes], parts: int, total: int) -> None:
        """Validate one message, then apply it or count it lost (module doc)."""
        if parts != 3:
            self._lost("undecodable", f"{parts} message parts, expected 3")
            return
        try:
            seq = decode_seq(frames[1])
        except MalformedBatch as exc:
            self._lost("undecodable", str(exc))
            return
        if total > self.max_message_bytes:  # transports where ZMQ does not enforce MAXMSGSIZE
            self._lost("oversized", f"{total} bytes > max_message_bytes", seq)
            return
        try:
            batch = decode_batch(frames[2])
        except MalformedBatch as exc:
            self._lost("undecodable", str(exc), seq)
            return
        try:
            self._apply(seq, batch)
        except Exception as exc:  # the listener failed: what it holds may be stale
            self._lost("listener_errors", f"the listener raised {type(exc).__name__}", seq)

    def _apply(self, seq: int, batch: DecodedBatch) -> None:
        with self._cond:
            listener, hasher = self._listener, self._hasher
        stats = self.stats
        stats.unknown_events += batch.unknown
        last = stats.last_seq
        if last >= 0 and (seq > last + 1 or seq < last):
            # Lost batches (evictions we never heard) or a restarted engine (empty cache):
            # the CP-Tree can no longer be trusted; resync by clearing it.
            if seq < last:
                stats.restarts += 1
            else:
                stats.gaps += 1
            with self._cond:
                self._expected_clears = 0
            self.residency.clear()
            if listener is not None:
                listener.on_all_blocks_cleared()
        residency = self.residency
        for event in batch.events:
            if isinstance(event, BlocksStored):
                stats.blocks_stored += len(event.hashes)
                residency.stored(event.hashes, event.medium)
                if hasher is not None and event.medium in (None, MEDIUM_GPU):
                    self._check_hash(hasher, event)
            elif isinstance(event, BlocksRemoved):
                gone = residency.removed(event.hashes, event.medium)
                stats.blocks_removed += len(event.hashes)
                if listener is not None and gone:
                    stats.nodes_removed += listener.on_blocks_removed(gone)
            else:
                stats.clears += 1
                residency.pool_cleared()
                if self._own_clear():
                    stats.own_clears += 1  # already applied at reset time (module doc)
                elif listener is not None:
                    listener.on_all_blocks_cleared()
        stats.nodes_moved += residency.flush_moves(listener)
        # Advance the sequence only once the batch is applied: wait_through relies on it.
        with self._cond:
            stats.last_seq = seq if seq < last else max(last, seq)
            stats.batches += 1
            self._recent.extend(batch.events)
            stats.last_event_time = self._clock()
            self._cond.notify_all()

    def _lost(self, counter: str, reason: str, seq: int | None = None) -> None:
        """A batch (or a stretch of them) is lost: count it, warn (rate-limited), resync by
        clearing the listener, and let the barrier pass ``seq`` when it is known."""
        stats = self.stats
        self._warn(reason)
        with self._cond:
            self._expected_clears = 0  # the lost batch may have held our reset's event
            listener = self._listener
        self.residency.clear()
        if listener is not None:
            try:
                listener.on_all_blocks_cleared()
            except Exception as exc:
                stats.listener_errors += 1
                self._warn(f"the listener's resync raised {type(exc).__name__}")
        with self._cond:  # counted once resynced: a reader of the count sees the clear done
            setattr(stats, counter, getattr(stats, counter) + 1)
            if seq is not None:
                stats.last_seq = seq
            stats.last_event_time = self._clock()
            self._cond.notify_all()

    def _warn(self, reason: str) -> None:
        """At most one warning per :data:`WARN_INTERVAL_S`; the next one says how many more
        batches were lost in between (``stats`` has every count)."""
        now = self._clock()
        if now < self._warn_at:
            self._unlogged += 1
            return
        more = f"; {self._unlogged} more since the last warning" if self._unlogged else ""
        _LOG.warning(
            "KV events from %s: lost a batch (%s); resynced by clearing the CP-Tree%s",
            self.endpoint,
            reason,
            more,
        )
        self._warn_at = now + WARN_INTERVAL_S
        self._unlogged = 0

    def _check_hash(self, hasher: BlockHasher, event: BlocksStored) -> None:
        """Compare an unsalted chain's first block with the hash we would expect for it."""
        keys = event.extra_keys
        if event.parent is not None or not event.hashes or (keys and any(keys[:1])):
            return
        size = hasher.block_size
        if event.block_size != size or len(event.token_ids) < size:
            return
        expected = hasher.block_hashes(event.token_ids[:size])
        self.stats.hash_checks += 1
        if expected[0] != event.hashes[0]:
            self.stats.hash_mismatches += 1

    # ---- waiting on events ---------------------------------------------------------------------

    def recent_events(self) -> list[KVEvent]:
        """The recent events, oldest first, slimmed and bounded (``RecentEvents``: no token
        ids, at most 4,096 events and 65,536 hashes). O(n) copy."""
        with self._cond:
            return list(self._recent.events)

    def clear_recent(self) -> None:
        with self._cond:
            self._recent.clear()

    def wait_for(self, predicate: Callable[[list[KVEvent]], bool], timeout: float = 5.0) -> bool:
        """Block until ``predicate(recent_events())`` holds or ``timeout`` seconds pass.
        Returns whether it held."""
        deadline = self._clock() + timeout
        with self._cond:
            while not predicate(list(self._recent.events)):
                remaining = deadline - self._clock()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True

    def wait_through(self, seq: int, timeout: float = 2.0) -> bool:
        """Block until the batch with sequence number ``seq`` (and every earlier one still on
        the wire) has been applied or counted lost, or ``timeout`` passes (counted in
        ``barrier_timeouts``). ``seq < 0`` returns at once."""
        deadline = self._clock() + timeout
        with self._cond:
            while self.stats.last_seq < seq:
                remaining = deadline - self._clock()
                if remaining <= 0:
                    self.stats.barrier_timeouts += 1
                    return False
                self._cond.wait(remaining)
            return True

    def wait_quiet(self, quiet: float = 0.2, timeout: float = 5.0) -> None:
        """Block until no batch has arrived for ``quiet`` seconds (or ``timeout`` passes): a
        practical "all events so far are applied" for tests and benchmarks."""
        start = self._clock()
        while self._clock() - start < timeout:
            time.sleep(quiet / 4)
            with self._cond:
                last = self.stats.last_event_time
            if self._clock() - max(last, start) >= quiet:
                return

    def close(self) -> None:
        """Stop the thread and close the sockets. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._close_sockets()
        self._ctx.term()

