"""The store's public result types (which tier a block is in, the store's counters) and its
internal entry record, kept here so the store module holds only the store's logic."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from craft_rag.kvtiers.keys import BlockKey


class Tier(enum.Enum):
    """Where a block can be loaded from."""

    RAM = "ram"
    DISK = "disk"


class DiskState(enum.Enum):
    """An entry's place in the disk tier (store-internal): no file, write queued, file written."""

    NONE = 0
    PENDING = 1
    ON_DISK = 2


@dataclass(slots=True)
class TierStats:
    """A snapshot of the store's counters (monotonic since open) and occupancy."""

    ram_entries: int = 0
    ram_bytes: int = 0
    disk_entries: int = 0
    disk_bytes: int = 0
    ram_hits: int = 0
    ram_misses: int = 0
    """gets not served from RAM (served from disk or not at all)."""
    disk_hits: int = 0
    disk_misses: int = 0
    """gets served by neither tier (absent, token mismatch or corrupt)."""
    ram_evictions: int = 0
    disk_evictions: int = 0
    copy_downs: int = 0
    promotions: int = 0
    corrupt_drops: int = 0
    token_mismatches: int = 0
    disk_writes: int = 0
    write_errors: int = 0
    pending_writes: int = 0
    write_throughs: int = 0
    """blocks queued for disk when they entered RAM (``write_through``)."""
    write_through_skips: int = 0
    """blocks left RAM-only because the writer's queue was full (copied down later)."""


@dataclass(slots=True)
class StoreEntry:
    """One block of a :class:`~craft_rag.kvtiers.store.TieredBlockStore` (store-internal);
    fields are mutated only under that store's lock."""

    key: BlockKey
    parent: BlockKey | None
    token_ids: tuple[int, ...]
    prefix_tokens: int
    size: int
    cost_s: float
    ram: bytes | None = None
    disk: DiskState = DiskState.NONE
    pending: bytes | None = None
    write_gen: int = 0
    """Store-unique id of the queued disk write; a job whose id differs is stale and skipped."""
    pins: int = 0
