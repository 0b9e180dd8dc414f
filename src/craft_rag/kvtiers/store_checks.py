"""The invariant checker of :class:`craft_rag.kvtiers.store.TieredBlockStore` (tests call it
after every step of seeded stress runs). Kept apart so the store module stays one concept."""

from __future__ import annotations

from typing import Any

from craft_rag.kvtiers import disk_tier
from craft_rag.kvtiers.keys import BlockKey
from craft_rag.kvtiers.tier_types import DiskState, Tier


def check_store(store: Any, check_files: bool) -> None:
    """Assert the invariants of ``store`` (a :class:`~craft_rag.kvtiers.store.TieredBlockStore`,
    typed ``Any`` so this module need not import the store that imports it); the caller holds
    the store's lock. O(n)."""
    children: dict[Tier, dict[BlockKey, int]] = {tier: {} for tier in Tier}
    for key, entry in store._entries.items():
        assert entry.key == key and entry.pins >= 0
        assert entry.ram is not None or entry.disk is not DiskState.NONE, "entry in no tier"
        assert (entry.ram is not None) == (key in store._members[Tier.RAM])
        assert (entry.disk is not DiskState.NONE) == (key in store._members[Tier.DISK])
        assert (entry.pending is not None) == (entry.disk is DiskState.PENDING)
        assert entry.ram is None or len(entry.ram) == entry.size
        for tier in Tier:
            if key in store._members[tier] and entry.parent is not None:
                counts = children[tier]
                counts[entry.parent] = counts.get(entry.parent, 0) + 1
    for tier in Tier:
        members = store._members[tier]
        assert members <= store._entries.keys()
        assert members == store._policies[tier].keys()
        assert store._used[tier] == sum(store._entries[k].size for k in members)
        assert store._used[tier] <= store._cap[tier]
        assert children[tier] == store._children[tier]
        heap = store._heaps[tier].items()
        for key in members:
            order = store._leaf_order(key, tier)
            assert order is None or (order, key) in heap, "a leaf is missing from the heap"
    if check_files and store._dir is not None:
        names = {p.name for p in store._dir.glob(f"*{disk_tier.SUFFIX}")}
        expected = {
            disk_tier.block_path(store._dir, e.key).name
            for e in store._entries.values()
            if e.disk is DiskState.ON_DISK
        }
        assert expected <= names, "indexed block file missing"
