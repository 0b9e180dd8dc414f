"""Tier residency as KV events: which blocks entered or left the RAM and disk tiers.

The store keys blocks by our own chain keys (:mod:`craft_rag.kvtiers.keys`); the CP-Tree knows
vLLM's block hashes (what the pool's KV events carry). The connector learns the pair when it
saves a block or finds one in a tier for a request (vLLM's ``request.block_hashes``) and hands it
to :meth:`TierEventLog.learn`. :class:`ReportingStore` tells the log whenever a key's tier
membership changes; :meth:`TierEventLog.take` turns the changes since the last take into
:class:`TierChange` records, which the connector publishes as vLLM ``BlockStored`` /
``BlockRemoved`` events (medium ``CPU`` for RAM, ``STORAGE`` for disk) through ``take_events``.

Each take reports the net change per key against what was last reported (a RAM eviction that
copies the block down is "stored on disk" and "removed from RAM", never a moment in no tier), all
stores of a take before its removals, so a subscriber never sees a resident block pass through
"nowhere". A key that is in no tier after a take is forgotten.

Bounds: the log holds one entry per learned key that is in a tier (what the tiers hold bounds
it), plus keys learned since the last take (one step's saves and hits). Framework-free: no vLLM.
Lock order: the store's lock, then the log's (the store's hooks run under its lock; ``take``
reads the store without holding the log's lock).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from craft_rag.kvtiers.keys import BlockKey
from craft_rag.kvtiers.store import TieredBlockStore
from craft_rag.kvtiers.tier_types import Tier

__all__ = ["BlockInfo", "ReportingStore", "TierChange", "TierEventLog"]

EventHash = Hashable
"""vLLM's block hash as its events carry it (bytes, or an int under
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``); opaque here."""


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """A block as the store holds it: its tiers, parent key and token ids."""

    tiers: frozenset[Tier]
    parent: BlockKey | None
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class TierChange:
    """One block entered (``stored``) or left ``tier``; ``parent_hash`` is the parent block's
    vLLM hash when known (a stored block's), ``token_ids`` its tokens (empty for a removal)."""

    block_hash: Any
    tier: Tier
    stored: bool
    parent_hash: Any = None
    token_ids: tuple[int, ...] = ()


@dataclass(slots=True)
class _Known:
    block_hash: Any
    told: frozenset[Tier] = frozenset()  # the tiers last reported for the key


class TierEventLog:
    """Learned key -> vLLM hash pairs and the keys changed since the last :meth:`take`.

    Invariants: every dirty key is learned; a learned key not dirty has been reported in at
    least one tier. Thread-safe (one lock; the store's hooks call :meth:`changed` from the
    scheduler thread and the store's disk writer).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._known: dict[BlockKey, _Known] = {}
        self._dirty: dict[BlockKey, None] = {}  # insertion-ordered set

    def __len__(self) -> int:
        with self._lock:
            return len(self._known)

    def learn(self, key: BlockKey, block_hash: EventHash) -> None:
        """``key`` is vLLM's block ``block_hash``; reported at the next take if a tier holds
        it. A key learned before keeps its first hash (they are equal by construction). O(1)."""
        with self._lock:
            if key not in self._known:
                self._known[key] = _Known(block_hash)
                self._dirty[key] = None

    def changed(self, key: BlockKey) -> None:
        """The store's hook: ``key``'s tier membership changed. Unlearned keys are ignored
        (nothing to name them by). O(1)."""
        with self._lock:
            if key in self._known:
                self._dirty[key] = None

    def take(self, describe: Callable[[BlockKey], BlockInfo | None]) -> list[TierChange]:
        """The net changes since the last take, stores first (see the module); ``describe``
        reads a key's current state from the store. O(changed keys)."""
        with self._lock:
            dirty, self._dirty = self._dirty, {}
        stores: list[TierChange] = []
        removals: list[TierChange] = []
        for key in dirty:
            info = describe(key)
            now = info.tiers if info is not None else frozenset()
            with self._lock:
                known = self._known.get(key)
                if known is None:
                    continue
                told, known.told = known.told, now
                if not now:
                    del self._known[key]
                    self._dirty.pop(key, None)  # nothing left to report by this name
                parent = self._known.get(info.parent) if info and info.parent else None
            for tier in sorted(now - told, key=lambda t: t.value):
                assert info is not None
                stores.append(TierChange(
                    known.block_hash, tier, True,
                    parent.block_hash if parent is not None else None, info.token_ids,
                ))
            for tier in sorted(told - now, key=lambda t: t.value):
                removals.append(TierChange(known.block_hash, tier, False))
        return stores + removals

    def _check_invariants(self) -> None:
        with self._lock:
            assert all(k in self._known for k in self._dirty)
            assert all(
                v.told for k, v in self._known.items() if k not in self._dirty
            ), "a learned key that is in no tier was kept"


class ReportingStore(TieredBlockStore):
    """A :class:`TieredBlockStore` that tells a :class:`TierEventLog` about every change of a
    key's tier membership. ``_add`` and ``_remove`` are the store's only two membership
    changes (its invariants: every put, eviction, copy-down, promotion, dropped corrupt file
    and warm-restart index entry goes through them), so they are the hooks."""

    def __init__(self, *args: Any, events: TierEventLog, **kwargs: Any) -> None:
        self.events = events  # before the base's __init__: a warm restart adds entries there
        super().__init__(*args, **kwargs)

    def __enter__(self) -> ReportingStore:
        return self

    def _add(self, entry: Any, tier: Tier, frequency: int) -> None:
        super()._add(entry, tier, frequency)
        self.events.changed(entry.key)

    def _remove(self, entry: Any, tier: Tier, evicted: bool) -> None:
        super()._remove(entry, tier, evicted)
        self.events.changed(entry.key)

    def describe(self, key: BlockKey) -> BlockInfo | None:
        """``key``'s tiers, parent and tokens (``None``: absent). O(1)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            tiers = frozenset(t for t in Tier if key in self._members[t])
            return BlockInfo(tiers, entry.parent, entry.token_ids)
