"""The CP-Tree's LRU-leaf eviction: :class:`LeafQueue`, the object each tree owns that queues its
leaves and evicts the least recently accessed ones past the tree's bound.

Leaves wait in a lazy priority queue keyed by ``(last_access, stamp)``: a leaf re-pushed, grown
or removed leaves a stale entry behind, skipped when popped, and the queue is rebuilt from the
leaves when entries outnumber live leaves 4 to 1. Stamps are unique (push order), so the pop
order is fully determined by the keys, not by the queue's layout.

The queue is two parts (commits push and pop it): ``fifo``, a deque of entries in
increasing key order, and ``heap``, a min-heap of the entries that arrived out of order.
Almost every push is a leaf just touched or inserted (key ``(now, fresh stamp)``, the largest
yet with a monotonic clock): an O(1) append. A parent left childless keeps its older access
time and a clock may step back: those go to the heap. Popping takes the smaller of the two
heads, O(1) when the heap is empty, instead of an O(log n) sift through a heap of every leaf
(65,536 at the default bound, scattered in memory). The entries and keys are exactly those one
heap would hold, so every pop, hence every eviction, is the same. Owner: one tree.

Not thread-safe, like the tree itself: the two parts, the nodes' stamps and the queue's
``next_stamp`` change together, so callers serialise the tree's calls (a shared
:class:`~craft_rag.planner.CraftPlanner` makes each of its own under its one lock).
"""

from __future__ import annotations

import heapq
from collections import deque

from craft_rag.tree.nodes import NO_CHILDREN, OneChild, PrefixNode
from craft_rag.types import BlockHash

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


class LeafQueue:
    """One tree's leaves by ``(last_access, stamp)``, and its LRU-leaf eviction (see the module).

    Holds the tree's ``root`` and block index (``by_block``: the tree's own dict, never
    replaced) to unlink the leaves it evicts; the tree keeps its node count and calls
    :meth:`evict` past its bound. ``next_stamp``: the next push's stamp (saved with the tree)."""

    __slots__ = ("by_block", "fifo", "heap", "next_stamp", "root")

    def __init__(self, root: PrefixNode, by_block: dict[BlockHash, PrefixNode]) -> None:
        self.root = root
        self.by_block = by_block
        self.fifo: deque[Entry] = deque()
        self.heap: list[Entry] = []
        self.next_stamp = 0

    def __len__(self) -> int:
        """Entries queued, stale ones included. O(1)."""
        return len(self.fifo) + len(self.heap)

    def push(self, node: PrefixNode, live: int) -> None:
        """Queue ``node`` (a leaf) under a fresh stamp: an O(1) append when its access time
        is no older than the newest entry's (a fresh stamp sorts after every other). ``live``:
        the tree's node count (entries past 4 per live node + 64 rebuild the queue)."""
        stamp = self.next_stamp
        self.next_stamp = stamp + 1
        node.heap_stamp = stamp
        seen = node.last_access
        fifo = self.fifo
        if fifo and not fifo[-1][0] <= seen:
            push_entry(fifo, self.heap, (seen, stamp, node))
        else:
            fifo.append((seen, stamp, node))
        if len(fifo) + len(self.heap) > 4 * live + 64:
            self.rebuild()

    def clear(self) -> None:
        """Drop every entry (the tree was emptied). O(entries)."""
        self.fifo.clear()
        self.heap.clear()

    def rebuild(self) -> None:
        """The queue from the leaves alone (drops stale entries), all in ``fifo``, sorted.
        O(size log size); runs after >= 3 pushes per live leaf."""
        entries: list[Entry] = []
        stack = list(self.root.children.values())
        while stack:
            cur = stack.pop()
            if cur.children:
                stack.extend(cur.children.values())
            else:
                # Keep each leaf's stamp: stamps order leaves with equal access times (a coarse
                # clock), and fresh ones in walk order would change which of them goes first.
                if cur.heap_stamp < 0:
                    cur.heap_stamp = self.next_stamp
                    self.next_stamp += 1
                entries.append((cur.last_access, cur.heap_stamp, cur))
        entries.sort()
        self.heap.clear()
        fifo = self.fifo
        fifo.clear()
        fifo.extend(entries)

    def evict(self, size: int, max_nodes: int, protect: PrefixNode | None) -> int:
        """Evict least recently accessed leaves (by ``(last_access, stamp)``) of a tree of
        ``size`` nodes until ``max_nodes`` hold, never ``protect`` (the path just inserted);
        returns how many (the tree subtracts them; it trims ``protect``'s path itself when
        nothing else is left). A leaf's parent left childless becomes a leaf: its entry is
        stamped at once (same stamps as pushing it) and is the next one popped when nothing
        queued is older (as along an evicted chain), else it is queued. Entries have distinct
        keys, so the pop order, hence every eviction, is that of one heap holding every
        entry."""
        if size <= max_nodes:
            return 0
        fifo, heap = self.fifo, self.heap
        root, by_block = self.root, self.by_block
        heappop = heapq.heappop
        skipped: list[Entry] = []
        pending: Entry | None = None
        over = size - max_nodes
        evicted = 0
        stamp_next = self.next_stamp
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
            # The tree's _unlink() of a leaf, inline (one per evicted node), drop_child() too
            parent: PrefixNode = node.parent  # type: ignore[assignment]  # a leaf: never root
            siblings = parent.children
            if type(siblings) is OneChild:
                parent.children = NO_CHILDREN
            else:
                del siblings[node.key]  # type: ignore[attr-defined]  # a dict (no cast: hot)
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
        self.next_stamp = stamp_next
        if pending is not None:
            push_entry(fifo, heap, pending)
        for entry in skipped:
            push_entry(fifo, heap, entry)
        if len(fifo) + len(heap) > 4 * (size - evicted) + 64:
            self.rebuild()
        return evicted
