"""Keep the CP-Tree true to vLLM's prefix cache: expected block hashes and KV cache events.

Two halves:

* :class:`BlockHasher` computes the hashes vLLM will give a prompt's full KV blocks, the way
  ``vllm.v1.core.kv_cache_utils`` does: ``h_0 = H((NONE_HASH, tokens[0:B], extra))``,
  ``h_j = H((h_{j-1}, tokens[jB:(j+1)B], None))`` where ``H`` is the configured
  ``prefix_caching_hash_algo`` (default ``sha256`` over a pickle) and ``NONE_HASH = H(seed)``
  (seed ``PYTHONHASHSEED`` if set, else ``"vllm-none-hash"``). KV events report hashes either
  as those bytes or, when ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` is on (vLLM's default), as
  their low 64 bits as an int; :meth:`BlockHasher.external` applies the same conversion, then
  :func:`craft_rag.types.as_block_hash`, so expected and reported hashes compare equal.
* :class:`KVEventSync` subscribes to vLLM's ZMQ publisher (``KVEventsConfig(publisher="zmq",
  endpoint="ipc://...")``; the publisher binds ipc endpoints, the subscriber connects) on a
  daemon thread and forwards ``BlockRemoved`` to ``planner.on_blocks_removed`` and
  ``AllBlocksCleared`` to ``planner.on_all_blocks_cleared``.

Wire format (vLLM 0.32, msgpack via msgspec): each message is ``[topic, seq (8 bytes
big-endian), payload]``; the payload is an array ``[ts, events, dp_rank]`` and each event a map
with a ``"type"`` tag (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``). Unknown event
types are counted and ignored.

Consistency: events arrive asynchronously (vLLM's publisher thread, then this thread). A block
evicted between a request's completion and its planner commit can leave a stale CP-Tree node;
the next commit that matches it sees fewer cached chunks than predicted and removes it
(``reused_chunks`` in :meth:`craft_rag.planner.CraftPlanner.commit`). A gap in sequence numbers
(dropped messages: evictions may be lost) or a sequence number going back (the engine or server
restarted: its cache is empty) resyncs by clearing: ``on_all_blocks_cleared`` before the batch
is applied, counted in :attr:`KVEventStats.gaps` / :attr:`KVEventStats.restarts`.

Our own resets: vLLM queues ``AllBlocksCleared`` at ``reset_prefix_cache`` but publishes it only
with its *next* step's batch, i.e. with the first request after the reset. The engine empties the
planners itself at reset time and calls :meth:`KVEventSync.expect_clear`; without that, the late
event could land after that first request's commit (over a server there is no event barrier:
the HTTP answer and the ZMQ batch race) and wipe what it committed. An expected clear is counted
in :attr:`KVEventStats.own_clears` and not forwarded; a gap or restart forgets expectations (a
lost batch may have held the event; clearing again is the safe side).

Over a vLLM server (:mod:`craft_rag.engine.server_backend`) the endpoint is ``tcp://HOST:PORT``
(the server's publisher binds ``tcp://*:PORT``; ZMQ reconnects by itself after a restart) and
hashes are 64-bit ints; with :meth:`KVEventSync.set_hasher` the sync also checks that the first
block of each unsalted stored chain hashes as expected (:attr:`KVEventStats.hash_mismatches`
> 0 means the CP-Tree cannot hear evictions: wrong ``hash_seed``/algorithm).
"""

from __future__ import annotations

import hashlib
import importlib
import os
import pickle
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from craft_rag.types import BlockHash, as_block_hash

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
_INT_HASH_MASK = (1 << 64) - 1


def sha256_pickle(obj: Any) -> bytes:
    """vLLM's ``sha256`` prefix-caching hash: SHA-256 of the highest-protocol pickle."""
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def hash_function(algo: str) -> Callable[[Any], bytes]:
    """The block hash function for a ``prefix_caching_hash_algo`` name. ``sha256`` is
    implemented here; the others come from vLLM (``ImportError`` without it)."""
    if algo == "sha256":
        return sha256_pickle
    try:
        hashing: Any = importlib.import_module("vllm.utils.hashing")
    except ImportError as exc:
        msg = f"hash algo {algo!r} needs vllm installed: pip install 'craft-rag[cpu]'"
        raise ImportError(msg) from exc
    fn: Callable[[Any], bytes] = hashing.get_hash_fn_by_name(algo)
    return fn


@dataclass(frozen=True, slots=True)
class BlockHasher:
    """Computes vLLM's chained block hashes for a token sequence.

    Invariant: ``none_hash`` is the parent of the first block, exactly as the engine's
    ``kv_cache_utils.NONE_HASH``; ``int_hashes`` mirrors how the engine reports hashes in KV
    events. Cost: one hash of ``block_size`` token ids per full block.
    """

    block_size: int
    hash_fn: Callable[[Any], bytes]
    none_hash: bytes
    int_hashes: bool

    def __post_init__(self) -> None:
        if self.block_size < 1:
            msg = f"block_size must be >= 1, got {self.block_size}"
            raise ValueError(msg)

    @classmethod
    def for_algo(
        cls,
        block_size: int,
        algo: str = "sha256",
        *,
        int_hashes: bool = True,
        seed: str | None = None,
    ) -> BlockHasher:
        """A hasher built independently of a running engine. ``seed`` defaults to
        ``PYTHONHASHSEED`` or vLLM's fixed default (correct for cryptographic algos; xxhash
        engines use a random per-process seed unless ``PYTHONHASHSEED`` is set)."""
        fn = hash_function(algo)
        resolved = seed if seed is not None else os.environ.get("PYTHONHASHSEED")
        if resolved is None:
            resolved = DEFAULT_NONE_HASH_SEED
        return cls(block_size, fn, fn(resolved), int_hashes)

    @classmethod
    def from_engine(cls, vllm_config: Any) -> BlockHasher:
        """The hasher of an in-process engine: its hash block size and algorithm, the
        ``NONE_HASH`` it initialised, and the event hash format it publishes."""
        envs: Any = importlib.import_module("vllm.envs")
        kv_cache_utils: Any = importlib.import_module("vllm.v1.core.kv_cache_utils")
        cache = vllm_config.cache_config
        block_size = int(getattr(cache, "hash_block_size", None) or cache.block_size)
        algo = str(cache.prefix_caching_hash_algo)
        int_hashes = bool(envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
        # In-process engines initialised NONE_HASH in this interpreter; with a separate engine
        # core process it is unset here and derived from the seed as that process did.
        none_hash = getattr(kv_cache_utils, "NONE_HASH", None)
        if none_hash is None:
            return cls.for_algo(block_size, algo, int_hashes=int_hashes)
        return cls(block_size, hash_function(algo), bytes(none_hash), int_hashes)

    def raw_hashes(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[bytes]:
        """Engine-internal hashes of every full block of ``token_ids`` (the partial last block
        has none). ``cache_salt`` is mixed into the first block as vLLM does."""
        out: list[bytes] = []
        parent = self.none_hash
        size = self.block_size
        for start in range(0, len(token_ids) - size + 1, size):
            extra = (("cache_salt", cache_salt),) if start == 0 and cache_salt else None
            parent = self.hash_fn((parent, tuple(token_ids[start : start + size]), extra))
            out.append(parent)
        return out

    def external(self, raw: bytes) -> BlockHash:
        """``raw`` as KV events report it, normalised to a :data:`BlockHash`."""
        if self.int_hashes:
            return as_block_hash(int.from_bytes(raw, "big") & _INT_HASH_MASK)
        return as_block_hash(raw)

    def block_hashes(
        self, token_ids: Sequence[int], cache_salt: str | None = None
    ) -> list[BlockHash]:
        """Hashes of the full blocks of ``token_ids`` as KV events will report them."""
        return [self.external(h) for h in self.raw_hashes(token_ids, cache_salt)]

    def per_chunk(
        self, hashes: Sequence[BlockHash], chunk_spans: Sequence[tuple[int, int]]
    ) -> list[list[BlockHash]]:
        """For each ``[start, end)`` chunk span, the hashes of the full blocks whose last token
        lies inside it (block ``j`` ends at token ``(j + 1) * block_size - 1``). O(blocks)."""
        out: list[list[BlockHash]] = []
        size = self.block_size
        for start, end in chunk_spans:
            first = start // size  # block j ends inside iff start < (j+1)*size <= end
            last = end // size  # exclusive
            out.append([hashes[j] for j in range(first, min(last, len(hashes)))])
        return out


# ---- events ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BlocksStored:
    """vLLM cached these full blocks (chained: ``parent`` precedes ``hashes[0]``)."""

    hashes: tuple[BlockHash, ...]
    parent: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    extra_keys: tuple[Any, ...] | None = None
    """Per block, the extra hash keys vLLM published (the ``cache_salt`` of a salted prompt's
    first block), untagged; ``None`` when the engine sent none."""


@dataclass(frozen=True, slots=True)
class BlocksRemoved:
    """vLLM evicted these blocks from its prefix cache."""

    hashes: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True)
class AllCleared:
    """vLLM dropped its whole prefix cache (``reset_prefix_cache``)."""


KVEvent = BlocksStored | BlocksRemoved | AllCleared


def decode_event_batch(payload: bytes) -> list[KVEvent]:
    """Parse one published payload into typed events (unknown types are skipped).
    ``ValueError`` when the payload is not a KV event batch."""
    import msgpack

    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        msg = f"undecodable KV event payload ({len(payload)} bytes): {exc}"
        raise ValueError(msg) from exc
    if not isinstance(batch, list | tuple) or len(batch) < 2 or not isinstance(batch[1], list):
        msg = f"not a KV event batch: {type(batch).__name__}"
        raise ValueError(msg)
    events: list[KVEvent] = []
    for raw in batch[1]:
        if not isinstance(raw, dict):
            continue
        kind = raw.get("type")
        if kind == "BlockStored":
            parent = raw.get("parent_block_hash")
            events.append(
                BlocksStored(
                    hashes=tuple(as_block_hash(h) for h in raw.get("block_hashes", ())),
                    parent=as_block_hash(parent) if parent is not None else None,
                    token_ids=tuple(raw.get("token_ids", ())),
                    block_size=int(raw.get("block_size", 0)),
                    extra_keys=_extra_keys(raw.get("extra_keys")),
                )
            )
        elif kind == "BlockRemoved":
            events.append(
                BlocksRemoved(tuple(as_block_hash(h) for h in raw.get("block_hashes", ())))
            )
        elif kind == "AllBlocksCleared":
            events.append(AllCleared())
    return events


def _extra_keys(raw: object) -> tuple[Any, ...] | None:
    if not isinstance(raw, list | tuple):
        return None
    return tuple(tuple(k) if isinstance(k, list) else k for k in raw)


class EvictionListener(Protocol):
    """What :class:`KVEventSync` drives: the planner's engine-feedback half."""

    def on_blocks_removed(self, hashes: Iterable[BlockHash]) -> int: ...

    def on_all_blocks_cleared(self) -> None: ...


@dataclass(slots=True)
class KVEventStats:
    """Counters since start. Owner: the :class:`KVEventSync` thread (read them anywhere)."""

    batches: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    clears: int = 0
    nodes_removed: int = 0
    gaps: int = 0
    restarts: int = 0
    hash_checks: int = 0
    hash_mismatches: int = 0
    undecodable: int = 0
    barrier_timeouts: int = 0
    own_clears: int = 0
    last_seq: int = -1
    last_event_time: float = 0.0


@dataclass(slots=True)
class _Recent:
    """Bounded log of recent events for callers that want to inspect them (tests, debugging)."""

    events: deque[KVEvent] = field(default_factory=lambda: deque(maxlen=4096))


class KVEventSync:
    """Subscribes to a vLLM KV event endpoint and applies evictions to a planner.

    Start it *before* the engine binds the endpoint: ZMQ connects lazily, so no early batch is
    lost to the subscription handshake. One daemon thread owns the SUB socket; the planner is
    thread-safe (its own lock), so callbacks run on that thread. ``close()`` stops and joins it.
    """

    def __init__(
        self,
        endpoint: str,
        listener: EvictionListener | None = None,
        *,
        topic: bytes = b"",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        try:
            import zmq
        except ImportError as exc:
            msg = "KV event sync needs pyzmq (a vllm dependency): pip install pyzmq"
            raise ImportError(msg) from exc
        self.endpoint = endpoint
        self.stats = KVEventStats()
        self._listener = listener
        self._clock = clock
        self._recent = _Recent()
        self._hasher: BlockHasher | None = None
        self._expected_clears = 0  # AllCleared events of resets the listener already applied
        self._cond = threading.Condition()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, topic)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="craft-kv-events", daemon=True)
        self._thread.start()

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

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(50):
                continue
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                continue
            except zmq.ZMQError:
                if self._stop.is_set():
                    break
                raise
            self._handle(frames)

    def _handle(self, frames: Sequence[bytes]) -> None:
        if len(frames) != 3:
            self.stats.undecodable += 1
            return
        _, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big", signed=True)
        try:
            events = decode_event_batch(payload)
        except ValueError:
            self.stats.undecodable += 1
            events = []
        with self._cond:
            listener, hasher = self._listener, self._hasher
        stats = self.stats
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
            if listener is not None:
                listener.on_all_blocks_cleared()
        for event in events:
            if isinstance(event, BlocksStored):
                stats.blocks_stored += len(event.hashes)
                if hasher is not None:
                    self._check_hash(hasher, event)
            elif isinstance(event, BlocksRemoved):
                stats.blocks_removed += len(event.hashes)
                if listener is not None:
                    stats.nodes_removed += listener.on_blocks_removed(event.hashes)
            else:
                stats.clears += 1
                if self._own_clear():
                    stats.own_clears += 1  # already applied at reset time (module doc)
                elif listener is not None:
                    listener.on_all_blocks_cleared()
        # Advance the sequence only once the batch is applied: wait_through relies on it.
        with self._cond:
            stats.last_seq = seq if seq < last else max(last, seq)
            stats.batches += 1
            self._recent.events.extend(events)
            stats.last_event_time = self._clock()
            self._cond.notify_all()

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

    def recent_events(self) -> list[KVEvent]:
        """The last (up to 4,096) events received, oldest first. O(n) copy."""
        with self._cond:
            return list(self._recent.events)

    def clear_recent(self) -> None:
        with self._cond:
            self._recent.events.clear()

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
        the wire) has been applied, or ``timeout`` passes (counted in ``barrier_timeouts``).
        ``seq < 0`` returns at once."""
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
        """Stop the thread and close the socket. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._sock.close(linger=0)
        self._ctx.term()
