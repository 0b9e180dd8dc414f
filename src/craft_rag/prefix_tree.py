"""Chunk-Prefix Tree (CP-Tree, paper §4.1-4.2): cached chunk-prefixes with their KV metadata.

Each node is one chunk; the path from the root to a node is a chunk-prefix whose KV the engine
holds. Nodes carry where that KV lives, the chunk's token span within the prefix, the engine's
block hashes for the full blocks ending inside the chunk, a hit count and the last access time.
A sub-prefix of a cached path is reusable too ("prefix slicing"): matching just stops earlier.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from craft_rag.types import BlockHash, ChunkKey

DEFAULT_MAX_NODES = 65_536
_FORMAT = "craft-rag/prefix-tree/v1"


@dataclass(frozen=True, slots=True)
class KVLocation:
    """Where a prefix's KV lives: which engine (replica) and which memory tier."""

    engine_id: str = "local"
    tier: str = "device"


@dataclass(slots=True, eq=False)
class PrefixNode:
    """One chunk at one position of a chunk-prefix. Owner: :class:`ChunkPrefixTree` only.

    ``token_start``/``token_end`` is the chunk's ``[start, end)`` span within the prompt (None when
    token counts were never supplied); ``block_hashes`` are the engine's hashes of the full KV
    blocks whose last token falls inside that span.
    """

    key: ChunkKey | None
    parent: PrefixNode | None
    depth: int
    children: dict[ChunkKey, PrefixNode] = field(default_factory=dict)
    token_start: int | None = None
    token_end: int | None = None
    location: KVLocation | None = None
    block_hashes: tuple[BlockHash, ...] = ()
    hit_count: int = 0
    last_access: float = 0.0
    alive: bool = True
    heap_stamp: int = -1  # stamp of this node's current entry in the leaf heap

    def path(self) -> tuple[ChunkKey, ...]:
        """Chunk keys from the root to this node. O(depth)."""
        keys: list[ChunkKey] = []
        node: PrefixNode | None = self
        while node is not None and node.key is not None:
            keys.append(node.key)
            node = node.parent
        return tuple(reversed(keys))


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """Result of a lookup: the matched nodes, root side first."""

    nodes: tuple[PrefixNode, ...]

    @property
    def length(self) -> int:
        return len(self.nodes)

    @property
    def keys(self) -> tuple[ChunkKey, ...]:
        return tuple(n.key for n in self.nodes if n.key is not None)

    @property
    def tokens(self) -> int | None:
        """Tokens of the matched prefix (end of the last node's span), None if unknown."""
        return self.nodes[-1].token_end if self.nodes else 0

    def sliced(self, length: int) -> PrefixMatch:
        """The sub-prefix of the first ``length`` chunks (prefix slicing; no storage)."""
        return PrefixMatch(self.nodes[:length])


@dataclass(frozen=True, slots=True)
class NodeMetadata:
    """Metadata to attach to one node on insert (any field left None is kept as is)."""

    token_span: tuple[int, int] | None = None
    block_hashes: tuple[BlockHash, ...] | None = None


class ChunkPrefixTree:
    """A radix-like tree of chunk-prefixes, bounded to ``max_nodes`` nodes.

    Invariants (:meth:`_check_invariants`): parent/child links agree; ``depth`` is the path
    length; ``len(self)`` counts live non-root nodes and is <= ``max_nodes``; the block index maps
    exactly the block hashes held by live nodes; a child's span starts where its parent's ends
    when both are known. When the bound is exceeded the least recently accessed *leaf* is evicted
    first (a lazy min-heap keyed by ``last_access``), so inner nodes of hot paths survive.
    Time comes from the injected ``clock``.
    """

    def __init__(
        self,
        max_nodes: int = DEFAULT_MAX_NODES,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(max_nodes, int) or max_nodes < 1:
            msg = f"max_nodes must be a positive int, got {max_nodes!r}"
            raise ValueError(msg)
        self.max_nodes = max_nodes
        self._clock = clock
        self.root = PrefixNode(key=None, parent=None, depth=0)
        self._size = 0
        self._by_block: dict[BlockHash, PrefixNode] = {}
        self._leaf_heap: list[tuple[float, int, PrefixNode]] = []
        self._next_stamp = 0  # push order of leaf-heap entries; persisted with the tree
        self.evictions = 0

    def __len__(self) -> int:
        return self._size

    # ---- lookup -------------------------------------------------------------------------------

    def match(self, keys: Sequence[ChunkKey]) -> PrefixMatch:
        """Longest cached chunk-prefix of ``keys`` (§4.2 lookup). O(len of match). No side
        effects: hits are recorded by :meth:`touch`."""
        nodes: list[PrefixNode] = []
        node = self.root
        for key in keys:
            child = node.children.get(key)
            if child is None:
                break
            nodes.append(child)
            node = child
        return PrefixMatch(tuple(nodes))

    def match_subset(self, keys: Iterable[ChunkKey]) -> PrefixMatch:
        """Longest cached path all of whose chunks are in ``keys`` (a set match, any order).

        Ties go to the path whose deepest node was accessed most recently, then to the smaller
        key sequence, so the choice is deterministic. Cost: O(visited nodes * min(k, fan-out));
        only nodes whose chunk is in the set are visited, at most k levels deep.
        """
        wanted = keys if isinstance(keys, (set, frozenset, dict)) else set(keys)
        best_node = self.root
        best_depth, best_time = 0, float("-inf")
        # A path never repeats a key (insert() refuses that), so no visited-set is needed.
        stack = [self.root]
        while stack:
            children = stack.pop().children
            if not children:
                continue
            if len(children) <= len(wanted):
                candidates = [c for k, c in children.items() if k in wanted]
            else:
                candidates = [children[k] for k in wanted if k in children]
            for child in candidates:
                depth, seen = child.depth, child.last_access
                if depth > best_depth or (
                    depth == best_depth
                    and (
                        seen > best_time
                        or (seen == best_time and child.path() < best_node.path())
                    )
                ):
                    best_node, best_depth, best_time = child, depth, seen
                stack.append(child)
        if best_node is self.root:
            return PrefixMatch(())
        path: list[PrefixNode] = []
        cur: PrefixNode | None = best_node
        while cur is not None and cur is not self.root:
            path.append(cur)
            cur = cur.parent
        return PrefixMatch(tuple(reversed(path)))

    # ---- mutation (the only methods that change the tree) -------------------------------------

    def touch(self, match: PrefixMatch) -> None:
        """Record a reuse of ``match``: +1 hit and ``last_access = now`` on each node. O(len)."""
        now = self._clock()
        for node in match.nodes:
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
        O(len(keys) + evictions * log(heap)).
        """
        if metadata is not None and len(metadata) != len(keys):
            msg = f"metadata has {len(metadata)} entries for {len(keys)} keys"
            raise ValueError(msg)
        if len(set(keys)) != len(keys):
            msg = "a chunk-prefix cannot repeat a chunk key"
            raise ValueError(msg)
        now = self._clock()
        node = self.root
        nodes: list[PrefixNode] = []
        for i, key in enumerate(keys):
            child = node.children.get(key)
            if child is None:
                child = PrefixNode(key=key, parent=node, depth=node.depth + 1, last_access=now)
                node.children[key] = child
                self._size += 1
            else:
                child.last_access = now
            if location is not None:
                child.location = location
            if metadata is not None:
                self._set_metadata(child, metadata[i])
            nodes.append(child)
            node = child
        if nodes and not nodes[-1].children:
            self._push_leaf(nodes[-1])
        self._evict_over_bound(protect=nodes[-1] if nodes else None)
        return PrefixMatch(tuple(n for n in nodes if n.alive))

    def remove(self, node: PrefixNode) -> int:
        """Remove ``node`` and its whole subtree (their KV prefixes depend on it). Returns the
        number of nodes removed. O(subtree)."""
        if node is self.root:
            msg = "cannot remove the root; use clear()"
            raise ValueError(msg)
        if not node.alive:
            return 0
        parent = node.parent
        assert parent is not None and node.key is not None
        del parent.children[node.key]
        removed = 0
        stack = [node]
        while stack:
            cur = stack.pop()
            cur.alive = False
            removed += 1
            for h in cur.block_hashes:
                if self._by_block.get(h) is cur:
                    del self._by_block[h]
            stack.extend(cur.children.values())
            cur.children = {}
        self._size -= removed
        if parent is not self.root and not parent.children:
            self._push_leaf(parent)
        return removed

    def remove_blocks(self, hashes: Iterable[BlockHash]) -> int:
        """Drop the nodes owning any of ``hashes`` (KV evicted by the engine), with subtrees.
        Unknown hashes are ignored (the engine caches blocks the tree never indexed). O(#hashes +
        removed)."""
        removed = 0
        for h in hashes:
            node = self._by_block.get(h)
            if node is not None and node.alive:
                removed += self.remove(node)
        return removed

    def relocate_blocks(self, hashes: Iterable[BlockHash], location: KVLocation) -> int:
        """Record that the KV of the nodes owning ``hashes`` moved to ``location``."""
        moved = 0
        for h in hashes:
            node = self._by_block.get(h)
            if node is not None and node.alive and node.location != location:
                node.location = location
                moved += 1
        return moved

    def clear(self) -> None:
        """Forget every node (the engine dropped all cached KV). O(size)."""
        stack = list(self.root.children.values())
        while stack:
            cur = stack.pop()
            cur.alive = False
            stack.extend(cur.children.values())
            cur.children = {}
        self.root.children = {}
        self._size = 0
        self._by_block.clear()
        self._leaf_heap.clear()

    # ---- internals ----------------------------------------------------------------------------

    def _set_metadata(self, node: PrefixNode, meta: NodeMetadata) -> None:
        if meta.token_span is not None:
            start, end = meta.token_span
            if not 0 <= start <= end:
                msg = f"token span must satisfy 0 <= start <= end, got {meta.token_span}"
                raise ValueError(msg)
            node.token_start, node.token_end = start, end
        if meta.block_hashes is not None:
            for h in node.block_hashes:
                if self._by_block.get(h) is node:
                    del self._by_block[h]
            node.block_hashes = tuple(meta.block_hashes)
            for h in node.block_hashes:
                # A block hash names one KV block, so one node: a later claim takes it from an
                # earlier owner, which would otherwise keep a hash the index no longer maps.
                owner = self._by_block.get(h)
                if owner is not None and owner is not node:
                    owner.block_hashes = tuple(x for x in owner.block_hashes if x != h)
                self._by_block[h] = node

    def _push_leaf(self, node: PrefixNode) -> None:
        stamp = self._next_stamp
        self._next_stamp += 1
        node.heap_stamp = stamp
        heapq.heappush(self._leaf_heap, (node.last_access, stamp, node))
        if len(self._leaf_heap) > 4 * self._size + 64:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        heap: list[tuple[float, int, PrefixNode]] = []
        stack = list(self.root.children.values())
        while stack:
            cur = stack.pop()
            if cur.children:
                stack.extend(cur.children.values())
            else:
                # Keep each leaf's stamp: stamps order leaves with equal access times (a coarse
                # clock), and fresh ones in walk order would change which of them goes first.
                if cur.heap_stamp < 0:
                    cur.heap_stamp = self._next_stamp
                    self._next_stamp += 1
                heap.append((cur.last_access, cur.heap_stamp, cur))
        heapq.heapify(heap)
        self._leaf_heap = heap

    def _evict_over_bound(self, protect: PrefixNode | None) -> None:
        skipped: list[tuple[float, int, PrefixNode]] = []
        while self._size > self.max_nodes and self._leaf_heap:
            entry = heapq.heappop(self._leaf_heap)
            _, stamp, node = entry
            if not node.alive or node.children or node.heap_stamp != stamp:
                continue  # stale entry: the node died, grew children or was re-pushed
            if node is protect:
                skipped.append(entry)
                continue
            self.remove(node)
            self.evictions += 1
        for entry in skipped:
            heapq.heappush(self._leaf_heap, entry)
        # Only the path just inserted is left above the bound: trim it from its leaf end.
        while self._size > self.max_nodes and protect is not None and protect.alive:
            parent = protect.parent
            self.remove(protect)
            self.evictions += 1
            protect = parent if parent is not self.root else None

    # ---- persistence --------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """Plain-JSON state: nodes in pre-order with their parent's index. O(size)."""
        nodes: list[dict[str, Any]] = []
        stack: list[tuple[PrefixNode, int]] = [
            (c, -1) for c in reversed(list(self.root.children.values()))
        ]
        while stack:
            node, parent_index = stack.pop()
            index = len(nodes)
            nodes.append(
                {
                    "parent": parent_index,
                    "key": node.key,
                    "span": [node.token_start, node.token_end],
                    "location": None
                    if node.location is None
                    else [node.location.engine_id, node.location.tier],
                    "blocks": [h.hex() for h in node.block_hashes],
                    "hits": node.hit_count,
                    "last_access": node.last_access,
                    "stamp": node.heap_stamp,
                }
            )
            stack.extend((c, index) for c in reversed(list(node.children.values())))
        return {
            "format": _FORMAT,
            "max_nodes": self.max_nodes,
            "next_stamp": self._next_stamp,
            "nodes": nodes,
        }

    @classmethod
    def from_json(
        cls, data: dict[str, Any], *, clock: Callable[[], float] = time.monotonic
    ) -> ChunkPrefixTree:
        """Rebuild a tree saved by :meth:`to_json`. Raises ``ValueError`` on a foreign format."""
        if not isinstance(data, dict) or data.get("format") != _FORMAT:
            msg = f"not a craft-rag prefix tree (expected format {_FORMAT!r})"
            raise ValueError(msg)
        tree = cls(max_nodes=int(data["max_nodes"]), clock=clock)
        built: list[PrefixNode] = []
        for item in data["nodes"]:
            parent = tree.root if item["parent"] == -1 else built[item["parent"]]
            key = ChunkKey(str(item["key"]))
            start, end = item["span"]
            loc = item["location"]
            node = PrefixNode(
                key=key,
                parent=parent,
                depth=parent.depth + 1,
                token_start=start,
                token_end=end,
                location=None if loc is None else KVLocation(engine_id=loc[0], tier=loc[1]),
                block_hashes=tuple(BlockHash(bytes.fromhex(h)) for h in item["blocks"]),
                hit_count=int(item["hits"]),
                last_access=float(item["last_access"]),
                heap_stamp=int(item.get("stamp", -1)),
            )
            parent.children[key] = node
            for h in node.block_hashes:
                tree._by_block[h] = node
            tree._size += 1
            built.append(node)
        # Saved stamps keep the eviction order among equal access times; new ones come after.
        tree._next_stamp = int(
            data.get("next_stamp", max((n.heap_stamp for n in built), default=-1) + 1)
        )
        tree._rebuild_heap()
        return tree

    def iter_paths(self) -> list[tuple[ChunkKey, ...]]:
        """Every root-to-node path (for tests and inspection). O(size * depth)."""
        out: list[tuple[ChunkKey, ...]] = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node.path())
            stack.extend(node.children.values())
        return out

    def _check_invariants(self) -> None:
        count = 0
        blocks: dict[BlockHash, PrefixNode] = {}
        leaves: list[PrefixNode] = []
        stack: list[PrefixNode] = [self.root]
        assert self.root.key is None and self.root.depth == 0
        while stack:
            node = stack.pop()
            for key, child in node.children.items():
                assert child.alive, "dead node still linked"
                assert child.key == key and child.parent is node
                assert child.depth == node.depth + 1
                if (
                    node is not self.root
                    and child.token_start is not None
                    and node.token_end is not None
                ):
                    assert child.token_start == node.token_end, "spans must be contiguous"
                if child.token_start is not None:
                    assert child.token_end is not None and child.token_start <= child.token_end
                for h in child.block_hashes:
                    blocks[h] = child
                if not child.children:
                    leaves.append(child)
                count += 1
                stack.append(child)
        assert count == self._size, f"size {self._size} != {count} linked nodes"
        assert self._size <= self.max_nodes
        assert blocks.keys() == self._by_block.keys()
        for h, node in self._by_block.items():
            assert node.alive and h in node.block_hashes
        # Every leaf has exactly one valid heap entry, keyed by its current last access.
        valid = {
            id(node): seen
            for seen, stamp, node in self._leaf_heap
            if node.alive and not node.children and node.heap_stamp == stamp
        }
        assert len(valid) == len(leaves), "a leaf is missing from the eviction heap"
        for leaf in leaves:
            assert valid.get(id(leaf)) == leaf.last_access, "stale eviction-heap entry"
            assert 0 <= leaf.heap_stamp < self._next_stamp
        assert len(set(map(id, blocks.values()))) <= count
