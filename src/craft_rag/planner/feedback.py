"""The engine's KV-cache events as a planner hears them (:class:`KVFeedback`, a base of
:class:`craft_rag.planner.CraftPlanner`): evicted blocks drop CP-Tree nodes, moved blocks
relocate them, a full clear empties the tree. Each takes the planner's lock."""

from __future__ import annotations

import threading
from collections.abc import Iterable

from craft_rag.tree import ChunkPrefixTree, KVLocation
from craft_rag.types import BlockHash


class KVFeedback:
    """The KV-event half of :class:`~craft_rag.planner.CraftPlanner` (see the module)."""

    prefix_tree: ChunkPrefixTree
    _lock: threading.Lock

    def on_blocks_removed(self, hashes: Iterable[BlockHash | int]) -> int:
        """The engine evicted these blocks: drop the CP-Tree nodes owning them (count).
        Hashes are bytes or ints (normalised by :func:`craft_rag.types.as_block_hash`);
        ``ValueError`` (nothing changed) for any other type."""
        with self._lock:
            return self.prefix_tree.remove_blocks(hashes)

    def on_blocks_moved(self, hashes: Iterable[BlockHash | int], location: KVLocation) -> int:
        """The engine moved these blocks to another tier/replica: update node locations."""
        with self._lock:
            return self.prefix_tree.relocate_blocks(hashes, location)

    def on_all_blocks_cleared(self) -> None:
        """The engine dropped its whole prefix cache: empty the CP-Tree."""
        with self._lock:
            self.prefix_tree.clear()
