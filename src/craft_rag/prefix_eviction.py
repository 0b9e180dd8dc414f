"""The CP-Tree's LRU-leaf eviction (:meth:`ChunkPrefixTree._evict_over_bound`) and its heap.

Leaves sit in a lazy min-heap keyed by ``(last_access, stamp)``; a leaf re-pushed, grown or
removed leaves a stale entry behind, skipped when popped, and the heap is rebuilt from the
leaves when stale entries outnumber live ones 4 to 1. Stamps are unique (push order), so the
pop order is fully determined by the keys, not by the heap's layout. Owner: the tree.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from craft_rag.prefix_nodes import PrefixNode, drop_child

if TYPE_CHECKING:
    from craft_rag.prefix_tree import ChunkPrefixTree


def rebuild_heap(tree: ChunkPrefixTree) -> None:
    """The leaf heap from the leaves alone (drops stale entries). O(size)."""
    heap: list[tuple[float, int, PrefixNode]] = []
    stack = list(tree.root.children.values())
    while stack:
        cur = stack.pop()
        if cur.children:
            stack.extend(cur.children.values())
        else:
            # Keep each leaf's stamp: stamps order leaves with equal access times (a coarse
            # clock), and fresh ones in walk order would change which of them goes first.
            if cur.heap_stamp < 0:
                cur.heap_stamp = tree._next_stamp
                tree._next_stamp += 1
            heap.append((cur.last_access, cur.heap_stamp, cur))
    heapq.heapify(heap)
    tree._leaf_heap = heap


def evict_over_bound(tree: ChunkPrefixTree, protect: PrefixNode | None) -> None:
    """Evict least recently accessed leaves (by ``(last_access, stamp)``) until the bound
    holds, never ``protect`` (the path just inserted) unless nothing else is left. A leaf's
    parent left childless becomes a leaf: its heap entry is stamped at once (same stamps as
    pushing it) and goes in with the next pop (``heappushpop``: one sift, and none when it
    is itself the oldest, as along an evicted chain). Entries have distinct keys, so the
    pop order, hence every eviction, is that of push-then-pop."""
    if tree._size <= tree.max_nodes:
        return
    heap = tree._leaf_heap
    root, by_block = tree.root, tree._by_block
    skipped: list[tuple[float, int, PrefixNode]] = []
    pending: tuple[float, int, PrefixNode] | None = None
    while tree._size > tree.max_nodes:
        if pending is not None:
            entry = heapq.heappushpop(heap, pending)
            pending = None
        elif heap:
            entry = heapq.heappop(heap)
        else:
            break
        _, stamp, node = entry
        if not node.alive or node.children or node.heap_stamp != stamp:
            continue  # stale entry: the node died, grew children or was re-pushed
        if node is protect:
            skipped.append(entry)
            continue
        # _unlink() of a leaf, inline (one per evicted node)
        parent = node.parent
        assert parent is not None and node.key is not None
        drop_child(parent, node.key)
        node.alive = False
        for h in node.block_hashes:
            if by_block.get(h) is node:
                del by_block[h]
        tree._size -= 1
        tree.evictions += 1
        if parent is not root and not parent.children:
            stamp = tree._next_stamp
            tree._next_stamp += 1
            parent.heap_stamp = stamp
            pending = (parent.last_access, stamp, parent)
    if pending is not None:
        heapq.heappush(heap, pending)
    for entry in skipped:
        heapq.heappush(heap, entry)
    if len(heap) > 4 * tree._size + 64:
        rebuild_heap(tree)
    # Only the path just inserted is left above the bound: trim it from its leaf end.
    while tree._size > tree.max_nodes and protect is not None and protect.alive:
        parent = protect.parent
        tree._unlink(protect)
        tree.evictions += 1
        protect = parent if parent is not tree.root else None
