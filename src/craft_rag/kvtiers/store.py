"""A bounded two-tier (host RAM, local disk) store of KV blocks, keyed by chain keys.

Invariants (all checked by :meth:`TieredBlockStore._check_invariants`):

- every indexed entry is in at least one tier; an entry is in RAM iff it holds its payload and
  on disk iff its file is written or queued (``PENDING``, payload held until the writer is done);
- each tier's used bytes are the sum of its entries' payload sizes and never exceed its capacity
  (file headers, ``disk_tier.header_bytes``, are not counted);
- eviction is leaf-only per tier along the chunk-prefix chain: an entry with a child in the same
  tier is never a victim, so a tier never holds a block whose prefix it just dropped first;
- RAM eviction copies a block down to disk once (not if it is already there, e.g. written
  through); disk eviction deletes the file; pinned entries are never evicted;
- a payload is returned only if its tokens equal the caller's and, from disk, its checksums and
  header match the index: a corrupt, truncated or foreign file is dropped (recompute instead).

One lock guards all state (policies included). Disk writes run on one background thread so
:meth:`put` never waits on disk I/O; disk reads run on the caller's thread outside the lock
(the entry is pinned meanwhile). One store owns its directory: two live stores on one directory
are not supported (each would delete the other's in-flight temp files on open).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import fields
from pathlib import Path

from craft_rag.kvtiers import disk_tier
from craft_rag.kvtiers.cost_model import PrefillCostModel, default_cost_model
from craft_rag.kvtiers.keys import KEY_BYTES, BlockKey
from craft_rag.kvtiers.leaf_heap import LeafHeap, Order
from craft_rag.kvtiers.policies import TierPolicy, get_tier_policy
from craft_rag.kvtiers.store_checks import check_store
from craft_rag.kvtiers.tier_types import DiskState, StoreEntry, Tier, TierStats

__all__ = ["Tier", "TierStats", "TieredBlockStore"]  # Tier/TierStats re-exported for importers


class TieredBlockStore:
    """RAM + disk tiers of KV block payloads with a per-tier replacement policy.

    ``ram_bytes``/``disk_bytes`` bound payload bytes per tier (0 disables RAM; disk needs
    ``disk_dir``). ``policy`` names a :data:`craft_rag.kvtiers.policies.TIER_POLICIES` entry
    (one instance per tier). ``cost_model`` prices blocks for PGDSF (default: the documented CPU
    estimate). ``promote`` copies a disk hit up to RAM. ``persist_on_close`` copies RAM-only
    blocks down to disk on :meth:`close` so a restart finds them. ``write_through`` also queues
    each block entering RAM for disk (same payload object, no copy): a crash loses at most the
    writer's queue; with ``max_queued_writes`` jobs queued the block stays RAM-only (counted in
    ``write_through_skips``, copied down on eviction or close). Opening on an existing
    directory rebuilds the disk index from the file headers (see :meth:`_open_disk`)."""

    def __init__(
        self,
        ram_bytes: int,
        disk_bytes: int,
        disk_dir: Path | None,
        policy: str = "pgdsf",
        cost_model: PrefillCostModel | None = None,
        clock: Callable[[], float] = time.monotonic,
        *,
        promote: bool = True,
        persist_on_close: bool = True,
        write_through: bool = False,
        max_queued_writes: int = 1024,
    ) -> None:
        if ram_bytes < 0 or disk_bytes < 0 or max_queued_writes < 1:
            msg = (
                f"tier sizes must be >= 0 bytes and max_queued_writes >= 1, got ram {ram_bytes},"
                f" disk {disk_bytes}, max_queued_writes {max_queued_writes}"
            )
            raise ValueError(msg)
        if (disk_dir is None) != (disk_bytes == 0):
            msg = "pass both disk_dir and disk_bytes > 0 for a disk tier, or neither"
            raise ValueError(msg)
        self._cap = {Tier.RAM: ram_bytes, Tier.DISK: disk_bytes}
        self._dir = disk_tier.prepare_dir(disk_dir) if disk_dir is not None else None
        self._policies: dict[Tier, TierPolicy] = {
            tier: get_tier_policy(policy, clock) for tier in Tier
        }
        self._cost = cost_model if cost_model is not None else default_cost_model()
        self._promote = promote
        self._persist_on_close = persist_on_close
        self._write_through = write_through and self._dir is not None
        self._max_queued = max_queued_writes
        self._lock = threading.Lock()
        self._entries: dict[BlockKey, StoreEntry] = {}
        self._members: dict[Tier, set[BlockKey]] = {tier: set() for tier in Tier}
        self._used = {tier: 0 for tier in Tier}
        # children[tier][k]: entries in `tier` whose parent is k (k itself may be absent)
        self._children: dict[Tier, dict[BlockKey, int]] = {tier: {} for tier in Tier}
        self._heaps = {tier: LeafHeap() for tier in Tier}  # each tier's leaves, by rank
        self._stats = TierStats()
        self._closed = False
        self._queue: queue.Queue[tuple[BlockKey, int] | None] = queue.Queue()
        self._gen = 0  # source of write_gen values
        self._writer: threading.Thread | None = None
        if self._dir is not None:
            self._open_disk(self._dir)
            self._writer = threading.Thread(
                target=self._write_loop, name="kvtiers-writer", daemon=True
            )
            self._writer.start()

    def put(
        self,
        key: BlockKey,
        parent: BlockKey | None,
        token_ids: Sequence[int],
        payload: bytes,
        prefix_tokens: int,
    ) -> bool:
        """Store a block's payload; ``False`` if it is already present (counted as a use) or
        cannot fit (larger than both tiers, or no evictable room).

        Goes to RAM if RAM is enabled (and, with ``write_through``, is queued for disk too),
        else straight to disk (queued for the writer). May evict RAM leaves (each copied down
        to disk once) and disk leaves (files deleted). Cost: O(log n) amortised per eviction
        (the tier's leaf heap); never waits on disk I/O.
        """
        if len(key) != KEY_BYTES or (parent is not None and len(parent) != KEY_BYTES):
            msg = f"keys are {KEY_BYTES}-byte digests from chain_keys()"
            raise ValueError(msg)
        if not token_ids or not payload or prefix_tokens < 0:
            msg = "need >= 1 token id, a non-empty payload and prefix_tokens >= 0"
            raise ValueError(msg)
        with self._lock:
            if self._closed:
                msg = "store is closed"
                raise RuntimeError(msg)
            existing = self._entries.get(key)
            if existing is not None:
                self._touch(existing)
                return False
            entry = StoreEntry(
                key,
                parent,
                tuple(token_ids),
                prefix_tokens,
                len(payload),
                self._cost.block_cost(prefix_tokens, len(token_ids)),
            )
            if self._cap[Tier.RAM] >= entry.size and self._make_room(Tier.RAM, entry.size, parent):
                self._entries[key] = entry
                entry.ram = payload
                self._add(entry, Tier.RAM, 1)
                if self._write_through:
                    self._queue_write_through(entry, payload)
                return True
            disk_fits = self._dir is not None and self._cap[Tier.DISK] >= entry.size
            if disk_fits and self._make_room(Tier.DISK, entry.size, parent):
                self._entries[key] = entry
                self._queue_write(entry, payload, 1)
                return True
            return False

    def lookup(self, keys: Sequence[BlockKey]) -> list[Tier]:
        """Tiers of the longest run of leading ``keys`` present (RAM wins if in both).

        Changes no counter and no priority. Cost: O(len(result)).
        """
        with self._lock:
            return self._lookup(keys)

    def lookup_and_pin(self, keys: Sequence[BlockKey]) -> list[Tier]:
        """:meth:`lookup` and :meth:`pin` of the found keys in one atomic step."""
        with self._lock:
            tiers = self._lookup(keys)
            for key in keys[: len(tiers)]:
                self._entries[key].pins += 1
            return tiers

    def pin(self, keys: Sequence[BlockKey]) -> None:
        """Protect ``keys`` from eviction until :meth:`unpin` (counted: pin twice, unpin twice).

        All or nothing: ``KeyError`` if any key is absent. Cost: O(len(keys)).
        """
        with self._lock:
            missing = [k for k in keys if k not in self._entries]
            if missing:
                raise KeyError(f"{len(missing)} key(s) not in the store; pin after lookup")
            for key in keys:
                self._entries[key].pins += 1

    def unpin(self, keys: Sequence[BlockKey]) -> None:
        """Undo one :meth:`pin` per key. Keys dropped since (corrupt) are skipped.

        ``RuntimeError`` if a present key is not pinned. Cost: O(len(keys)).
        """
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is None:
                    continue
                if entry.pins == 0:
                    msg = "unpin() without a matching pin()"
                    raise RuntimeError(msg)
                entry.pins -= 1

    def get(self, key: BlockKey, token_ids: Sequence[int]) -> bytes | None:
        """The verified payload of ``key``, or ``None`` (absent, token mismatch, corrupt file).

        ``token_ids`` must equal the block's stored token ids (else ``None``, entry kept). A RAM
        hit costs a tuple compare; a disk hit one file read plus blake2b over the payload
        (outside the lock), then an optional copy-up to RAM. A file that fails verification
        is deleted and counted in ``corrupt_drops``.
        """
        tokens = tuple(token_ids)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or tokens != entry.token_ids:
                self._stats.token_mismatches += entry is not None
                self._stats.ram_misses += 1
                self._stats.disk_misses += 1
                return None
            if entry.ram is not None:
                self._stats.ram_hits += 1
                self._touch(entry)
                return entry.ram
            self._stats.ram_misses += 1
            payload = entry.pending
            entry.pins += 1
        if payload is None:
            payload = self._read_verified(entry)
        with self._lock:
            try:
                if payload is None:
                    self._stats.corrupt_drops += 1
                    self._stats.disk_misses += 1
                    if entry.disk is not DiskState.NONE:
                        self._drop_disk(entry, evicted=False)
                    return None
                self._stats.disk_hits += 1
                self._touch(entry)
                wanted = self._promote and entry.ram is None and self._cap[Tier.RAM] >= entry.size
                if wanted and self._make_room(Tier.RAM, entry.size, entry.parent):
                    on_disk = entry.disk is not DiskState.NONE
                    entry.ram = payload
                    self._add(
                        entry, Tier.RAM, self._policies[Tier.DISK].frequency(key) if on_disk else 1
                    )
                    self._stats.promotions += 1
                return payload
            finally:
                entry.pins -= 1
                self._forget_if_gone(entry)

    def peek(self, key: BlockKey, token_ids: Sequence[int]) -> bytes | None:
        """The RAM payload of ``key`` (or the one queued for disk), or ``None`` (absent, token
        mismatch, on disk only). Not an access: no counter, recency or promotion changes (a
        read-back of chunk-caches, not a load). Cost: a dict lookup and a tuple compare."""
        tokens = tuple(token_ids)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or tokens != entry.token_ids:
                return None
            return entry.ram if entry.ram is not None else entry.pending

    def stats(self) -> TierStats:
        """A copy of the counters with current occupancy. O(n) (counts queued writes)."""
        with self._lock:
            snap = TierStats(**{f.name: getattr(self._stats, f.name) for f in fields(TierStats)})
            snap.ram_entries = len(self._members[Tier.RAM])
            snap.disk_entries = len(self._members[Tier.DISK])
            snap.ram_bytes = self._used[Tier.RAM]
            snap.disk_bytes = self._used[Tier.DISK]
            snap.pending_writes = sum(e.disk is DiskState.PENDING for e in self._entries.values())
            return snap

    def flush(self) -> None:
        """Block until every queued disk write is done. Cost: the pending writes' I/O."""
        if self._writer is not None:
            self._queue.join()

    def close(self) -> None:
        """Copy RAM-only blocks down (``persist_on_close``), flush, stop the writer. Idempotent."""
        with self._lock:
            if self._closed:
                return
            if self._persist_on_close and self._dir is not None:
                # insertion order puts parents before their children, which leaf-only eviction needs
                for entry in list(self._entries.values()):
                    if entry.ram is not None and entry.disk is DiskState.NONE:
                        self._copy_down(entry, entry.ram)
            self._closed = True
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join()

    def __enter__(self) -> TieredBlockStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _lookup(self, keys: Sequence[BlockKey]) -> list[Tier]:
        tiers: list[Tier] = []
        for key in keys:
            entry = self._entries.get(key)
            if entry is None:
                break
            tiers.append(Tier.RAM if entry.ram is not None else Tier.DISK)
        return tiers

    def _touch(self, entry: StoreEntry) -> None:
        """Count one use of ``entry`` in every tier holding it (a get, or a repeated put)."""
        for tier in Tier:
            if entry.key in self._members[tier]:
                self._policies[tier].on_access(entry.key)
                self._push_if_leaf(entry.key, tier)

    def _add(self, entry: StoreEntry, tier: Tier, frequency: int) -> None:
        self._members[tier].add(entry.key)
        self._used[tier] += entry.size
        if entry.parent is not None:
            counts = self._children[tier]
            counts[entry.parent] = counts.get(entry.parent, 0) + 1
        self._policies[tier].on_insert(entry.key, entry.size, entry.cost_s, frequency)
        self._push_if_leaf(entry.key, tier)

    def _remove(self, entry: StoreEntry, tier: Tier, evicted: bool) -> None:
        self._members[tier].discard(entry.key)
        self._used[tier] -= entry.size
        if entry.parent is not None:
            counts = self._children[tier]
            counts[entry.parent] -= 1
            if counts[entry.parent] == 0:
                del counts[entry.parent]
        self._policies[tier].on_remove(entry.key, evicted=evicted)
        if entry.parent is not None:
            self._push_if_leaf(entry.parent, tier)  # it may just have become a leaf

    def _leaf_order(self, key: BlockKey, tier: Tier) -> Order | None:
        """``key``'s rank if it is a leaf member of ``tier`` (an eviction candidate)."""
        if key in self._members[tier] and key not in self._children[tier]:
            return self._policies[tier].order(key)
        return None

    def _push_if_leaf(self, key: BlockKey, tier: Tier) -> None:
        order = self._leaf_order(key, tier)
        if order is not None:
            self._heaps[tier].push(order, key)

    def _forget_if_gone(self, entry: StoreEntry) -> None:
        if (
            entry.ram is None
            and entry.disk is DiskState.NONE
            and self._entries.get(entry.key) is entry
        ):
            del self._entries[entry.key]

    def _make_room(self, tier: Tier, size: int, keep: BlockKey | None = None) -> bool:
        """Evict leaves of ``tier`` until ``size`` more bytes fit; ``False`` if they cannot.

        ``keep`` is the parent of the block about to enter: never evicted for its own child
        (the child would be unreachable by a lookup that starts at or before the parent).
        May evict some entries and still fail (the rest pinned or not leaves). The victim is
        what ``policy.victim`` would pick among the evictable leaves, found in O(log n)
        amortised through the tier's :class:`LeafHeap`.
        """
        heap = self._heaps[tier]
        while self._used[tier] + size > self._cap[tier]:
            victim = heap.pop_min(
                lambda k: self._leaf_order(k, tier),
                lambda k: self._entries[k].pins == 0 and k != keep,
            )
            if victim is None:
                return False
            self._evict(self._entries[victim], tier)
        members = self._members[tier]
        leaves = ((o, k) for k in members if (o := self._leaf_order(k, tier)) is not None)
        heap.maybe_rebuild(leaves, len(members))
        return True

    def _evict(self, entry: StoreEntry, tier: Tier) -> None:
        if tier is Tier.RAM:
            payload = entry.ram
            assert payload is not None
            freq = self._policies[Tier.RAM].frequency(entry.key)
            entry.ram = None
            self._remove(entry, Tier.RAM, evicted=True)
            self._stats.ram_evictions += 1
            entry.pins += 1  # the copy-down must not evict the entry itself from disk
            try:
                if entry.disk is DiskState.NONE and self._dir is not None:
                    self._copy_down(entry, payload, freq)
            finally:
                entry.pins -= 1
        else:
            self._drop_disk(entry, evicted=True)
            self._stats.disk_evictions += 1
        self._forget_if_gone(entry)

    def _copy_down(self, entry: StoreEntry, payload: bytes, frequency: int = 1) -> None:
        if self._cap[Tier.DISK] >= entry.size and self._make_room(
            Tier.DISK, entry.size, entry.parent
        ):
            self._queue_write(entry, payload, frequency)
            self._stats.copy_downs += 1

    def _queue_write_through(self, entry: StoreEntry, payload: bytes) -> None:
        """Queue a block that just entered RAM for disk too, unless the writer is behind
        (``max_queued_writes`` jobs, stale ones included: the bound is on the writer's backlog,
        so the scheduler's thread never waits for it)."""
        if self._queue.qsize() >= self._max_queued:
            self._stats.write_through_skips += 1
            return
        if self._cap[Tier.DISK] >= entry.size and self._make_room(
            Tier.DISK, entry.size, entry.parent
        ):
            self._queue_write(entry, payload, 1)
            self._stats.write_throughs += 1

    def _queue_write(self, entry: StoreEntry, payload: bytes, frequency: int) -> None:
        entry.disk = DiskState.PENDING
        entry.pending = payload
        self._gen += 1
        entry.write_gen = self._gen
        self._add(entry, Tier.DISK, frequency)
        self._queue.put((entry.key, entry.write_gen))

    def _drop_disk(self, entry: StoreEntry, evicted: bool) -> None:
        """Take ``entry`` out of the disk tier; delete its file (a queued write is discarded)."""
        assert self._dir is not None
        if entry.disk is DiskState.ON_DISK:
            disk_tier.remove_block(self._dir, entry.key)
        entry.disk = DiskState.NONE
        entry.pending = None
        entry.write_gen = 0
        self._remove(entry, Tier.DISK, evicted)

    def _read_verified(self, entry: StoreEntry) -> bytes | None:
        """Read ``entry``'s file (lock not held); ``None`` unless it matches the index fully."""
        assert self._dir is not None
        try:
            header, payload = disk_tier.read_block(self._dir, entry.key)
        except (disk_tier.CorruptBlock, OSError):
            return None
        got = (header.token_ids, header.parent, header.prefix_tokens, len(payload))
        want = (entry.token_ids, entry.parent, entry.prefix_tokens, entry.size)
        return payload if got == want else None

    def _write_loop(self) -> None:
        """The writer thread: writes queued blocks, discarding jobs whose entry moved on."""
        assert self._dir is not None
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                self._write_one(self._dir, job)
            finally:
                self._queue.task_done()

    def _write_one(self, folder: Path, job: tuple[BlockKey, int]) -> None:
        key, gen = job
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.write_gen != gen or entry.pending is None:
                return
            payload = entry.pending
        try:
            disk_tier.write_block(
                folder, key, entry.parent, entry.token_ids, entry.prefix_tokens, payload
            )
            ok = True
        except OSError:
            ok = False
        with self._lock:
            current = self._entries.get(key) is entry and entry.write_gen == gen
            if not ok:
                self._stats.write_errors += 1
                if current:
                    self._drop_disk(entry, evicted=False)
                    self._forget_if_gone(entry)
            elif current:
                entry.disk = DiskState.ON_DISK
                entry.pending = None
                self._stats.disk_writes += 1
            elif self._entries.get(key) is None or self._entries[key].disk is DiskState.NONE:
                disk_tier.remove_block(folder, key)

    def _open_disk(self, folder: Path) -> None:
        """Warm restart: index the valid block files (headers only, oldest first).

        Corrupt files carrying our magic are deleted and counted in ``corrupt_drops``; other
        files are left alone. Evicts down to ``disk_bytes`` if the directory holds more.
        """
        headers, corrupt = disk_tier.load_headers(folder)
        self._stats.corrupt_drops += corrupt
        with self._lock:
            for header in headers:
                entry = StoreEntry(
                    header.key,
                    header.parent,
                    header.token_ids,
                    header.prefix_tokens,
                    header.payload_len,
                    self._cost.block_cost(header.prefix_tokens, len(header.token_ids)),
                    disk=DiskState.ON_DISK,
                )
                self._entries[entry.key] = entry
                self._add(entry, Tier.DISK, 1)
            self._make_room(Tier.DISK, 0)

    def _check_invariants(self, check_files: bool = False) -> None:
        """Assert every invariant in the module docstring. O(n) (+ a directory listing)."""
        with self._lock:
            check_store(self, check_files)
