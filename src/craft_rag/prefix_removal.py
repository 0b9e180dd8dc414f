"""The CP-Tree's removals (a subtree, the nodes owning evicted KV blocks, everything), as a
mixin of :class:`craft_rag.prefix_tree.ChunkPrefixTree` (split from it to keep each module
short; the tree's LRU eviction is :mod:`craft_rag.prefix_eviction`). Every removal bumps the
tree's ``_version`` (a match taken before is walked again) and queues a parent left childless
as a leaf. Owner: the tree; not thread-safe, like the tree."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

from craft_rag.prefix_eviction import Entry
from craft_rag.prefix_nodes import NO_CHILDREN, KVLocation, PrefixNode, drop_child
from craft_rag.prefix_nodes import block_hash_tuple as _block_hashes
from craft_rag.types import BlockHash


class PrefixRemoval:
    """``remove`` / ``remove_blocks`` / ``relocate_blocks`` / ``clear`` of the tree."""

    root: PrefixNode
    _size: int
    _version: int
    _by_block: dict[BlockHash, PrefixNode]
    _leaf_fifo: deque[Entry]
    _leaf_heap: list[Entry]
    _push_leaf: Callable[[PrefixNode], None]  # the tree's: queue a leaf

    def remove(self, node: PrefixNode) -> int:
        """Remove ``node`` and its whole subtree (their KV prefixes depend on it). Returns the
        number of nodes removed. O(subtree + depth). ``ValueError`` for the root or a node of
        another tree."""
        if node is self.root:
            msg = "cannot remove the root; use clear()"
            raise ValueError(msg)
        if not isinstance(node, PrefixNode):
            msg = f"node: must be a PrefixNode of this tree, got {type(node).__name__}"
            raise ValueError(msg)
        if not node.alive:
            return 0
        top = node
        while top.parent is not None:
            top = top.parent
        if top is not self.root:
            msg = "node: belongs to another ChunkPrefixTree; remove it from its own tree"
            raise ValueError(msg)
        return self._unlink(node)

    def _unlink(self, node: PrefixNode) -> int:
        """:meth:`remove` for a live non-root node known to be this tree's (one the tree found
        itself: the leaf queue, a node's children, the block index): no O(depth) ownership
        walk. Returns the number of nodes removed."""
        parent = node.parent
        assert parent is not None and node.key is not None
        self._version += 1
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
            self._push_leaf(parent)
        return removed

    def remove_blocks(self, hashes: Iterable[BlockHash | int]) -> int:
        """Drop the nodes owning any of ``hashes`` (KV evicted by the engine), with subtrees.
        Unknown hashes are ignored (the engine caches blocks the tree never indexed). O(#hashes +
        removed). Hashes are bytes or ints (:func:`craft_rag.types.as_block_hash`);
        ``ValueError`` (nothing removed) for any other type."""
        removed = 0
        for h in _block_hashes(hashes):
            node = self._by_block.get(h)
            if node is not None and node.alive:
                removed += self._unlink(node)
        return removed

    def relocate_blocks(self, hashes: Iterable[BlockHash | int], location: KVLocation) -> int:
        """Record that the KV of the nodes owning ``hashes`` moved to ``location``.
        ``ValueError`` (nothing moved) for a hash that is not bytes or int, or a bad location."""
        if not isinstance(location, KVLocation):
            msg = f"location: must be a KVLocation, got {type(location).__name__}"
            raise ValueError(msg)
        moved = 0
        for h in _block_hashes(hashes):
            node = self._by_block.get(h)
            if node is not None and node.alive and node.location != location:
                node.location = location
                moved += 1
        return moved

    def clear(self) -> None:
        """Forget every node (the engine dropped all cached KV). O(size)."""
        self._version += 1
        stack = list(self.root.children.values())
        while stack:
            cur = stack.pop()
            cur.alive = False
            stack.extend(cur.children.values())
            cur.children = NO_CHILDREN
        self.root.children = NO_CHILDREN
        self._size = 0
        self._by_block.clear()
        self._leaf_fifo.clear()
        self._leaf_heap.clear()

    def _remove_stale_children(self, node: PrefixNode) -> None:
        """Drop the children of ``node`` recorded under an older span of it (their KV followed
        tokens that are no longer there)."""
        end = node.token_end
        stale = [
            c for c in node.children.values() if c.token_start is not None and c.token_start != end
        ]
        for child in stale:
            self._unlink(child)
