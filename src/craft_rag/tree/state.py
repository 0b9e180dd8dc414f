"""The CP-Tree's fields and the primitives its operations share (:class:`TreeState`, the base of
:class:`craft_rag.tree.ChunkPrefixTree`): linking block hashes, touching nodes, unlinking a
subtree, evicting past the bound. The operations themselves are :mod:`craft_rag.tree.insert`,
:mod:`craft_rag.tree.removal` and :mod:`craft_rag.tree.match`. Not thread-safe: a
:class:`~craft_rag.planner.CraftPlanner` makes each call under its one lock."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from craft_rag.tree.eviction import LeafQueue
from craft_rag.tree.nodes import NO_CHILDREN, PrefixNode, drop_child
from craft_rag.types import BlockHash
from craft_rag.validation import check_int

DEFAULT_MAX_NODES = 65_536


class TreeState:
    """A tree's nodes (under ``root``), node count, block index and leaf queue.

    ``version`` grows by one on every call that may add or remove nodes (an insert, an
    unlink, a clear): a match taken at version v is still this tree's match while the
    version is v. Read it; only the tree writes it."""

    def __init__(
        self,
        max_nodes: int = DEFAULT_MAX_NODES,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_nodes = check_int(max_nodes, "max_nodes", minimum=1)
        if not callable(clock):
            msg = f"clock: must be a callable returning seconds, got {type(clock).__name__}"
            raise ValueError(msg)
        self._clock = clock
        self.root = PrefixNode(key=None, parent=None, depth=0)
        self._size = 0
        self._by_block: dict[BlockHash, PrefixNode] = {}
        # The leaf queue and LRU eviction (tree.eviction); stamps are persisted with the tree.
        self._leaves = LeafQueue(self.root, self._by_block)
        self.evictions = 0
        self.version = 0

    def __len__(self) -> int:
        return self._size

    def _set_hashes(self, node: PrefixNode, block_hashes: tuple[BlockHash, ...]) -> None:
        by_block = self._by_block
        for h in node.block_hashes:
            if by_block.get(h) is node:
                del by_block[h]
        node.block_hashes = block_hashes = tuple(block_hashes)
        for h in block_hashes:
            # A block hash names one KV block, so one node: a later claim takes it from an
            # earlier owner, which would otherwise keep a hash the index no longer maps.
            owner = by_block.get(h)
            if owner is not None and owner is not node:
                owner.block_hashes = tuple(x for x in owner.block_hashes if x != h)
            by_block[h] = node

    def _touch_at(self, nodes: Sequence[PrefixNode], now: float) -> None:
        """A reuse of ``nodes`` at the time ``now``: +1 hit, ``last_access = now``. O(len)."""
        leaves = self._leaves
        for node in nodes:
            if node.alive:
                node.hit_count += 1
                node.last_access = now
                if not node.children:
                    leaves.push(node, self._size)

    def _unlink(self, node: PrefixNode) -> int:
        """Remove a live non-root node of this tree and its subtree (one the tree found itself:
        the leaf queue, a node's children, the block index; no O(depth) ownership walk).
        Returns the number of nodes removed; a parent left childless is queued as a leaf."""
        parent = node.parent
        assert parent is not None and node.key is not None
        self.version += 1
        drop_child(parent, node.key)
        by_block = self._by_block
        if not node.children:  # a leaf (every eviction): no walk
            node.alive = False
            for h in node.block_hashes:
                if by_block.get(h) is node:
                    del by_block[h]
            removed = 1
        else:
            removed = 0
            stack = [node]
            while stack:
                cur = stack.pop()
                cur.alive = False
                removed += 1
                for h in cur.block_hashes:
                    if by_block.get(h) is cur:
                        del by_block[h]
                stack.extend(cur.children.values())
                cur.children = NO_CHILDREN
        self._size -= removed
        if parent is not self.root and not parent.children:
            self._leaves.push(parent, self._size)
        return removed

    def _remove_stale_children(self, node: PrefixNode) -> None:
        """Drop the children of ``node`` recorded under an older span of it (their KV followed
        tokens that are no longer there)."""
        end = node.token_end
        stale = [
            c for c in node.children.values() if c.token_start is not None and c.token_start != end
        ]
        for child in stale:
            self._unlink(child)

    def _evict_over_bound(self, protect: PrefixNode | None) -> None:
        """Evict LRU leaves until ``max_nodes`` holds (:meth:`LeafQueue.evict`), never
        ``protect`` (the path just inserted) unless nothing else is left: then that path is
        trimmed from its leaf end."""
        evicted = self._leaves.evict(self._size, self.max_nodes, protect)
        self._size -= evicted
        self.evictions += evicted
        while self._size > self.max_nodes and protect is not None and protect.alive:
            above = protect.parent
            self._unlink(protect)
            self.evictions += 1
            protect = above if above is not self.root else None
