"""The CP-Tree's LRU-leaf eviction (:func:`evict_over_bound`, past the bound) and leaf queue.

Leaves wait in a lazy priority queue keyed by ``(last_access, stamp)``: a leaf re-pushed, grown
or removed leaves a stale entry behind, skipped when popped, and the queue is rebuilt from the
leaves when entries outnumber live leaves 4 to 1. Stamps are unique (push order), so the pop
order is fully determined by the keys, not by the queue's layout.

The queue is two parts (commits push and pop it): ``_leaf_fifo``, a deque of entries in
increasing key order, and ``_leaf_heap``, a min-heap of the entries that arrived out of order.
Almost every push is a leaf just touched or inserted (key ``(now, fresh stamp)``, the largest
yet with a monotonic clock): an O(1) append. A parent left childless keeps its older access
time and a clock may step back: those go to the heap. Popping takes the smaller of the two
heads, O(1) when the heap is empty, instead of an O(log n) sift through a heap of every leaf
(65,536 at the default bound, scattered in memory). The entries and keys are exactly those one
heap would hold, so every pop, hence every eviction, is the same. Owner: the tree.

Not thread-safe, like the tree itself: the two parts, the nodes' stamps and the tree's
``_next_stamp`` change together, so callers serialise the tree's calls (a shared
:class:`~craft_rag.planner.CraftPlanner` makes each of its own under its one lock).
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import TYPE_CHECKING

from craft_rag.prefix_nodes import NO_CHILDREN, OneChild, PrefixNode

if TYPE_CHECKING:
    from craft_rag.prefix_tree import ChunkPrefixTree

Entry = tuple[float, int, PrefixNode]
"""A leaf-queue entry: ``(last_access, stamp, node)``; live while ``node.heap_stamp == stamp``."""


def push_entry(fifo: deque[Entry], heap: list[Entry], entry: Entry) -> None:
    """Queue ``entry``: appended to ``fifo`` if it sorts after its last entry, else into
    ``heap``. O(1), or O(log heap) out of order."""
    if not fifo or fifo[-1] < entry:
        fifo.append(entry)
    else:
        heapq.heappush(heap, entry)


def pop_entry(fifo: deque[Entry], heap: list[Entry]) -> Entry | None:
    """The queue's smallest entry, removed (None when empty). O(1) from ``fifo``, else
    O(log heap)."""
    if fifo:
        if heap and heap[0] < fifo[0]:
            return heapq.heappop(heap)
        return fifo.popleft()
    return heapq.heappop(heap) if heap else None


def rebuild_heap(tree: ChunkPrefixTree) -> None:
    """The leaf queue from the leaves alone (drops stale entries), all in ``fifo``, sorted.
    O(size log size); runs after >= 3 pushes per live leaf."""
    entries: list[Entry] = []
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
            entries.append((cur.last_access, cur.heap_stamp, cur))
    entries.sort()
    tree._leaf_heap.clear()
    fifo = tree._leaf_fifo
    fifo.clear()
    fifo.extend(entries)


def evict_over_bound(tree: ChunkPrefixTree, protect: PrefixNode | None) -> None:
    """Evict least recently accessed leaves (by ``(last_access, stamp)``) until the bound
    holds, never ``protect`` (the path just inserted) unless nothing else is left. A leaf's
    parent left childless becomes a leaf: its entry is stamped at once (same stamps as
    pushing it) and is the next one popped when nothing queued is older (as along an evicted
    chain), else it is queued. Entries have distinct keys, so the pop order, hence every
    eviction, is that of one heap holding every entry."""
    if tree._size <= tree.max_nodes:
        return
    fifo, heap = tree._leaf_fifo, tree._leaf_heap
    root, by_block = tree.root, tree._by_block
    heappop = heapq.heappop
    skipped: list[Entry] = []
    pending: Entry | None = None
    over = tree._size - tree.max_nodes
    evicted = 0
    stamp_next = tree._next_stamp
    while evicted < over:
        if pending is not None and not (
            (fifo and fifo[0] < pending) or (heap and heap[0] < pending)
        ):  # the childless parent is the oldest: next, and live (stamped just now)
            entry = pending
            pending = None
            node = entry[2]
        else:
            if pending is not None:  # an older entry first; the parent waits in the queue
                push_entry(fifo, heap, pending)
                pending = None
            if fifo:
                entry = heappop(heap) if heap and heap[0] < fifo[0] else fifo.popleft()
            elif heap:
                entry = heappop(heap)
            else:
                break
            _, stamp, node = entry
            if not node.alive or node.children or node.heap_stamp != stamp:
                continue  # stale entry: the node died, grew children or was re-pushed
        if node is protect:
            skipped.append(entry)
            continue
        # _unlink() of a leaf, inline (one per evicted node), drop_child() inline too
        parent: PrefixNode = node.parent  # type: ignore[assignment]  # a leaf: never the root
        siblings = parent.children
        if type(siblings) is OneChild:
            parent.children = NO_CHILDREN
        else:
            del siblings[node.key]  # type: ignore[attr-defined]  # a dict (no cast call: hot)
            if len(siblings) == 1:
                parent.children = OneChild(next(iter(siblings.values())))
        node.alive = False
        if node.block_hashes:  # (no iterator for the usual empty tuple)
            for h in node.block_hashes:
                if by_block.get(h) is node:
                    del by_block[h]
        evicted += 1
        if parent is not root and parent.children is NO_CHILDREN:
            parent.heap_stamp = stamp_next
            pending = (parent.last_access, stamp_next, parent)
            stamp_next += 1
    tree._next_stamp = stamp_next
    tree._size -= evicted
    tree.evictions += evicted
    if pending is not None:
        push_entry(fifo, heap, pending)
    for entry in skipped:
        push_entry(fifo, heap, entry)
    if len(fifo) + len(heap) > 4 * tree._size + 64:
        rebuild_heap(tree)
    # Only the path just inserted is left above the bound: trim it from its leaf end.
    while tree._size > tree.max_nodes and protect is not None and protect.alive:
        above = protect.parent
        tree._unlink(protect)
        tree.evictions += 1
        protect = above if above is not tree.root else None
