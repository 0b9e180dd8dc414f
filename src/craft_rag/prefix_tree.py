"""Chunk-Prefix Tree (CP-Tree, paper §4.1-4.2): cached chunk-prefixes with their KV metadata.

Each node is one chunk; the path from the root to a node is a chunk-prefix whose KV the engine
holds. Nodes carry where that KV lives, the chunk's token span within the prefix, the engine's
block hashes for the full blocks ending inside the chunk, a hit count and the last access time.
A sub-prefix of a cached path is reusable too ("prefix slicing"): matching just stops earlier.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from craft_rag.prefix_eviction import Entry, evict_over_bound, push_entry, rebuild_heap
from craft_rag.prefix_nodes import (
    NO_CHILDREN,
    KVLocation,
    NodeMetadata,
    OneChild,
    PrefixMatch,
    PrefixNode,
    add_child,
    new_leaf,
)
from craft_rag.prefix_removal import PrefixRemoval
from craft_rag.prefix_tree_checks import check_spans_contiguous, check_tree, walk
from craft_rag.prefix_tree_io import tree_from_json, tree_to_json
from craft_rag.types import BlockHash, ChunkKey
from craft_rag.validation import check_int, materialise

__all__ = [
    "DEFAULT_MAX_NODES",
    "ChunkPrefixTree",
    "KVLocation",
    "NodeMetadata",
    "PrefixMatch",
    "PrefixNode",
]

DEFAULT_MAX_NODES = 65_536
_NO_SPAN = (None, None)


class ChunkPrefixTree(PrefixRemoval):
    """A radix-like tree of chunk-prefixes, bounded to ``max_nodes`` nodes.

    Invariants (:meth:`_check_invariants`): parent/child links agree; ``depth`` is the path
    length; ``len(self)`` counts live non-root nodes and is <= ``max_nodes``; the block index maps
    exactly the block hashes held by live nodes; a child's span starts where its parent's ends
    when both are known. When the bound is exceeded the least recently accessed *leaf* is evicted
    first (a lazy priority queue keyed by ``(last_access, stamp)``, see
    :mod:`craft_rag.prefix_eviction`), so inner nodes of hot paths survive.
    Time comes from the injected ``clock``.
    """

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
        # The leaf queue (prefix_eviction.py): entries in key order, and the out-of-order ones.
        self._leaf_fifo: deque[Entry] = deque()
        self._leaf_heap: list[Entry] = []
        self._next_stamp = 0  # push order of leaf-queue entries; persisted with the tree
        self.evictions = 0
        # +1 on every call that may add or remove nodes (_extend, _unlink, clear): a match
        # taken at version v is still this tree's match while the version is v.
        self._version = 0

    def __len__(self) -> int:
        return self._size

    # ---- lookup -------------------------------------------------------------------------------

    def match(self, keys: Sequence[ChunkKey]) -> PrefixMatch:
        """Longest cached chunk-prefix of ``keys`` (§4.2 lookup). O(len of match). No side
        effects: hits are recorded by :meth:`touch`."""
        nodes: list[PrefixNode] = []
        node = self.root
        try:
            for key in keys:
                child = node.children.get(key)
                if child is None:
                    break
                nodes.append(child)
                node = child
        except TypeError:  # free unless raised: an unhashable key, or keys not iterable
            msg = "keys: must be an iterable of chunk keys (strings)"
            raise ValueError(msg) from None
        return PrefixMatch(tuple(nodes))

    def match_subset(self, keys: Iterable[ChunkKey]) -> PrefixMatch:
        """Longest cached path all of whose chunks are in ``keys`` (a set match, any order).

        Ties go to the path whose deepest node was accessed most recently, then to the smaller
        key sequence, so the choice is deterministic. Cost: O(visited nodes * min(k, fan-out));
        only nodes whose chunk is in the set are visited, at most k levels deep.
        """
        try:
            wanted = keys if isinstance(keys, (set, frozenset, dict)) else set(keys)
        except TypeError:
            msg = "keys: must be an iterable of chunk keys (strings)"
            raise ValueError(msg) from None
        return PrefixMatch(tuple(self._subset_path(wanted)))

    def _subset_path(
        self, wanted: set[ChunkKey] | frozenset[ChunkKey] | dict[ChunkKey, Any]
    ) -> list[PrefixNode]:
        """:meth:`match_subset` for a set (or a dict keyed by chunk key): the path's nodes,
        root side first ([] for none). Breadth first, one level per chunk of the path: the
        best node is the best (latest access, then smaller path) of the deepest level that
        has a node, so only that level is compared. Same nodes visited as depth first."""
        # A path never repeats a key (insert() refuses that), so no visited-set is needed.
        k = len(wanted)
        level: list[PrefixNode] = [self.root]
        while True:
            below: list[PrefixNode] = []
            add = below.append
            for node in level:
                children = node.children
                if type(children) is dict:  # a fork: walk the smaller side
                    if len(children) > k:
                        get = children.get
                        for key in wanted:
                            child = get(key)
                            if child is not None:
                                add(child)
                    else:
                        for key, child in children.items():
                            if key in wanted:
                                add(child)
                elif children is not NO_CHILDREN:  # a chain link: one membership test
                    only = children.child  # type: ignore[attr-defined]  # a OneChild
                    if only.key in wanted:
                        add(only)
            if not below:
                break
            level = below
        best = level[0]
        if best is self.root:
            return []
        if len(level) > 1:
            best_time = best.last_access
            for node in level:
                seen = node.last_access
                if seen > best_time or (
                    seen == best_time and node is not best and node.path() < best.path()
                ):
                    best, best_time = node, seen
        path: list[PrefixNode] = []
        cur: PrefixNode | None = best
        root = self.root
        while cur is not root and cur is not None:
            path.append(cur)
            cur = cur.parent
        path.reverse()
        return path

    def _matched(self, keys: Sequence[ChunkKey]) -> list[PrefixNode]:
        """:meth:`match` for keys the caller already checked (the planner's commit): the matched
        nodes as a list, no :class:`PrefixMatch`. O(len of match)."""
        nodes: list[PrefixNode] = []
        node = self.root
        for key in keys:
            children = node.children
            if type(children) is OneChild:
                child = children.child
                if child.key != key:
                    break
            else:
                found = children.get(key)
                if found is None:
                    break
                child = found
            nodes.append(child)
            node = child
        return nodes

    # ---- mutation (the only methods that change the tree) -------------------------------------

    def touch(self, match: PrefixMatch) -> None:
        """Record a reuse of ``match``: +1 hit and ``last_access = now`` on each node. O(len)."""
        self._touch(match.nodes)

    def _touch(self, nodes: Sequence[PrefixNode]) -> None:
        """:meth:`touch` for the nodes of a match. O(len)."""
        self._touch_at(nodes, self._clock())

    def _touch_at(self, nodes: Sequence[PrefixNode], now: float) -> None:
        """:meth:`_touch` at the time ``now``. O(len)."""
        for node in nodes:
            if node.alive:
                node.hit_count += 1
                node.last_access = now
                if not node.children:
                    self._push_leaf(node)

    def insert(
        self,
        keys: Sequence[ChunkKey],
        *,
        metadata: Sequence[NodeMetadata] | None = None,
        location: KVLocation | None = None,
    ) -> PrefixMatch:
        """Insert (or refresh) the chunk-prefix ``keys`` and return its nodes.

        Existing nodes keep their hits; metadata given for a position overwrites that node's span
        and block hashes. New nodes get ``last_access = now``. May evict least recently used
        leaves (never one of the nodes just inserted, unless ``len(keys) > max_nodes``).

        A node whose span changes (another prompt head length, a re-tokenized chunk) holds
        different KV than before, and so does everything recorded below it: its children whose
        spans no longer start where it ends are removed (with their subtrees), so spans stay
        contiguous. ``ValueError`` before any change for repeated or non-string keys, a
        metadata length mismatch, or a span that would not start where its parent's ends.
        O(len(keys) + evictions + removed stale nodes) (an eviction is O(1) from the leaf
        queue's in-order part, O(log) for an entry that arrived out of order).
        """
        keys = materialise(keys, "keys")
        if not all(type(key) is str and key for key in keys):  # one pass; str subclasses below
            for i, key in enumerate(keys):
                if not isinstance(key, str) or not key:
                    msg = f"keys[{i}]: must be a non-empty string (a chunk key), got {key!r}"
                    raise ValueError(msg)
        if metadata is not None:
            metadata = materialise(metadata, "metadata")
            if len(metadata) != len(keys):
                msg = f"metadata has {len(metadata)} entries for {len(keys)} keys"
                raise ValueError(msg)
            if not all(type(meta) is NodeMetadata for meta in metadata):
                for i, meta in enumerate(metadata):
                    if not isinstance(meta, NodeMetadata):
                        msg = f"metadata[{i}]: must be a NodeMetadata, got {type(meta).__name__}"
                        raise ValueError(msg)
        if len(set(keys)) != len(keys):
            msg = "a chunk-prefix cannot repeat a chunk key"
            raise ValueError(msg)
        if location is not None and not isinstance(location, KVLocation):
            msg = f"location: must be a KVLocation or None, got {type(location).__name__}"
            raise ValueError(msg)
        spans: list[tuple[int, int] | None] | None = None
        hashes: list[tuple[BlockHash, ...] | None] | None = None
        if metadata is not None:
            check_spans_contiguous(self.root, keys, metadata)
            spans = [meta.token_span for meta in metadata]
            hashes = [meta.block_hashes for meta in metadata]
        self._extend(keys, spans, hashes, location)
        return PrefixMatch(tuple(self._matched(keys)))

    def _extend(
        self,
        keys: Sequence[ChunkKey],
        spans: Sequence[tuple[int, int] | None] | None,
        hashes: Sequence[tuple[BlockHash, ...] | None] | None,
        location: KVLocation | None,
        matched: Sequence[PrefixNode] = (),
        touch: bool = False,
        run: tuple[int, Sequence[int]] | None = None,
    ) -> None:
        """:meth:`insert` for arguments already checked: distinct non-empty string ``keys``,
        ``spans[i]`` / ``hashes[i]`` (None: keep the node's) of the same length, spans
        contiguous. The planner's commit checks its arguments once and calls this (no
        second pass per request). ``matched``: the nodes of a leading part of ``keys`` the
        caller has just walked (:meth:`_matched`, nothing changed since): not looked up
        again. ``touch``: ``matched`` is the whole cached part of ``keys`` (the tree's
        match, cut where stale nodes were removed); first :meth:`_touch` it, in the same pass
        (same clock reads, hits and queue entries as the two calls). ``run``: instead of ``spans``,
        contiguous spans as ``(first token, each key's token count)``, added up here (each
        span starts on the very int its predecessor ends on). O(len(keys) + evictions +
        stale nodes)."""
        touched = self._clock() if touch else 0.0  # _touch's clock read comes first
        self._version += 1
        now = self._clock()
        node = self.root
        n = len(keys)
        bound, counts = run if run is not None else (0, ())  # the running span boundary
        known = len(matched)
        i = 0
        while i < n:  # the part of the path already cached
            if i < known:
                child = matched[i]
                if touch:  # as _touch: a hit; a leaf (only the last can be) queued then
                    child.hit_count += 1
                    child.last_access = touched
                    if not child.children:
                        self._push_leaf(child)
            elif touch:  # ``matched`` is the whole cached part: the rest is new
                break
            else:
                key = keys[i]
                children = node.children
                if type(children) is OneChild:
                    child = children.child
                    if child.key != key:
                        break
                else:
                    found = children.get(key)
                    if found is None:
                        break
                    child = found
            child.last_access = now
            if location is not None:
                child.location = location
            old_end = child.token_end
            if run is not None:
                child.token_start = bound
                bound = child.token_end = bound + counts[i]
            elif spans is not None:
                span = spans[i]
                if span is not None:
                    child.token_start, child.token_end = span
            if hashes is not None:
                block_hashes = hashes[i]
                if block_hashes is not None:
                    self._set_hashes(child, block_hashes)
            # Children start where this node ended before (invariant), so only a changed
            # (or newly known) end can leave stale children: the scan is O(fan-out), and a
            # hot chunk's node has thousands of children (a scan per commit would dominate it).
            if child.children and child.token_end != old_end:
                if touch and i + 1 < known:  # _touch would have seen them all first
                    self._touch_at(matched[i + 1 : known], touched)
                touch = False
                self._remove_stale_children(child)
                known = 0  # the nodes below may be gone: look them up
            node = child
            i += 1
        if i < n:  # the new part: every node below a new one is new
            depth = node.depth
            first = True
            start: int | None
            end: int | None
            for j in range(i, n):
                key = keys[j]
                depth += 1
                if run is not None:
                    start = bound
                    end = bound = bound + counts[j]
                else:
                    start, end = (spans[j] or _NO_SPAN) if spans is not None else _NO_SPAN
                child = new_leaf(key, node, depth, start, end, location, now)
                if first:
                    add_child(node, key, child)
                    first = False
                else:  # below a new node: its first and only child
                    node.children = OneChild(child)
                if hashes is not None:
                    block_hashes = hashes[j]
                    if block_hashes is not None:
                        self._set_hashes(child, block_hashes)
                node = child
            self._size += n - i
        last = node if n else None
        if last is not None and last.children is NO_CHILDREN:
            self._push_leaf(last)
        if self._size > self.max_nodes:
            evict_over_bound(self, last)

    # ---- internals ----------------------------------------------------------------------------

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

    def _push_leaf(self, node: PrefixNode) -> None:
        """Queue ``node`` (a leaf) under a fresh stamp: an O(1) append when its access time
        is no older than the newest entry's (a fresh stamp sorts after every other)."""
        stamp = self._next_stamp
        self._next_stamp = stamp + 1
        node.heap_stamp = stamp
        seen = node.last_access
        fifo = self._leaf_fifo
        if fifo and not fifo[-1][0] <= seen:
            push_entry(fifo, self._leaf_heap, (seen, stamp, node))
        else:
            fifo.append((seen, stamp, node))
        if len(fifo) + len(self._leaf_heap) > 4 * self._size + 64:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        rebuild_heap(self)

    # ---- persistence --------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """Plain-JSON state: nodes in pre-order with their parent's index (see
        :func:`craft_rag.prefix_tree_io.tree_to_json`). O(size)."""
        return tree_to_json(self)

    @classmethod
    def from_json(
        cls,
        data: dict[str, Any],
        *,
        clock: Callable[[], float] = time.monotonic,
        path: str = "",
    ) -> ChunkPrefixTree:
        """Rebuild a tree saved by :meth:`to_json`, validating the whole structure first (see
        :mod:`craft_rag.prefix_tree_io`): one ``ValueError`` naming the JSON path (under
        ``path``) of the first bad field. O(size)."""
        return tree_from_json(data, clock=clock, path=path)

    def iter_paths(self) -> list[tuple[ChunkKey, ...]]:
        """Every root-to-node path (for tests and inspection). O(size * depth)."""
        return [node.path() for node in self._walk()]

    def _walk(self) -> list[PrefixNode]:
        return walk(self.root)

    def _check_invariants(self) -> None:
        check_tree(self)
