"""The CP-Tree's removals (a subtree, the nodes owning evicted KV blocks, everything), as a
base of :class:`craft_rag.tree.ChunkPrefixTree` (the tree's LRU eviction is
:mod:`craft_rag.tree.eviction`). Every removal bumps the tree's ``version`` (a match taken
before is walked again) and queues a parent left childless as a leaf. Owner: the tree; not
thread-safe, like the tree."""

from __future__ import annotations

from collections.abc import Iterable

from craft_rag.tree.nodes import NO_CHILDREN, KVLocation, PrefixNode
from craft_rag.tree.nodes import block_hash_tuple as _block_hashes
from craft_rag.tree.state import TreeState
from craft_rag.types import BlockHash


class PrefixRemoval(TreeState):
    """``remove`` / ``remove_blocks`` / ``relocate_blocks`` / ``clear`` of the tree."""

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
        self.version += 1
        stack = list(self.root.children.values())
        while stack:
            cur = stack.pop()
            cur.alive = False
            stack.extend(cur.children.values())
            cur.children = NO_CHILDREN
        self.root.children = NO_CHILDREN
        self._size = 0
        self._by_block.clear()
        self._leaves.clear()
