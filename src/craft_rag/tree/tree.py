"""Chunk-Prefix Tree (CP-Tree, paper §4.1-4.2): cached chunk-prefixes with their KV metadata.

Each node is one chunk; the path from the root to a node is a chunk-prefix whose KV the engine
holds. Nodes carry where that KV lives, the chunk's token span within the prefix, the engine's
block hashes for the full blocks ending inside the chunk, a hit count and the last access time.
A sub-prefix of a cached path is reusable too ("prefix slicing"): matching just stops earlier.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from craft_rag.tree.checks import check_spans_contiguous, check_tree, walk
from craft_rag.tree.insert import extend
from craft_rag.tree.io import tree_from_json, tree_to_json
from craft_rag.tree.match import match_nodes as _match_nodes
from craft_rag.tree.match import subset_path as _subset_path
from craft_rag.tree.nodes import KVLocation, NodeMetadata, PrefixMatch, PrefixNode
from craft_rag.tree.removal import PrefixRemoval
from craft_rag.types import BlockHash, ChunkKey
from craft_rag.validation import materialise

# The value types (nodes, match, metadata) and DEFAULT_MAX_NODES are public from the package
# (craft_rag.tree), which re-exports this module's one class.
__all__ = ["ChunkPrefixTree"]


class ChunkPrefixTree(PrefixRemoval):
    """A radix-like tree of chunk-prefixes, bounded to ``max_nodes`` nodes.

    Invariants (:meth:`check_invariants`): parent/child links agree; ``depth`` is the path
    length; ``len(self)`` counts live non-root nodes and is <= ``max_nodes``; the block index maps
    exactly the block hashes held by live nodes; a child's span starts where its parent's ends
    when both are known. When the bound is exceeded the least recently accessed *leaf* is evicted
    first (a lazy priority queue keyed by ``(last_access, stamp)``, see
    :mod:`craft_rag.tree.eviction`), so inner nodes of hot paths survive.
    Time comes from the injected ``clock`` (``ChunkPrefixTree(max_nodes=65_536, *, clock=
    time.monotonic)``; ``ValueError`` for a bound < 1 or a clock that is not callable).
    """

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
        return PrefixMatch(tuple(_subset_path(self, wanted)))

    subset_path = _subset_path
    """``subset_path(wanted)``: :meth:`match_subset` for a set (or a dict keyed by chunk key)
    the caller built: the path's nodes, root side first ([] for none)."""

    match_nodes = _match_nodes
    """``match_nodes(keys)``: :meth:`match` for keys the caller already checked (the planner's
    plan and commit): the matched nodes as a list, no :class:`PrefixMatch`. O(len of match)."""

    # ---- mutation (the only methods that change the tree) -------------------------------------

    def touch(self, match: PrefixMatch) -> None:
        """Record a reuse of ``match``: +1 hit and ``last_access = now`` on each node. O(len)."""
        self._touch_at(match.nodes, self._clock())

    def touch_nodes(self, nodes: Sequence[PrefixNode]) -> None:
        """:meth:`touch` for the nodes of a match (:meth:`match_nodes`). O(len)."""
        self._touch_at(nodes, self._clock())

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
        extend(self, keys, spans, hashes, location)
        return PrefixMatch(tuple(_match_nodes(self, keys)))

    insert_trusted = extend
    """:meth:`insert` for arguments the caller checked, as
    ``insert_trusted(keys, spans, hashes, location, matched=(), touch=False, run=None)``: see
    :func:`craft_rag.tree.insert.extend` (the planner's commit; no second validation pass)."""

    # ---- persistence --------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """Plain-JSON state: nodes in pre-order with their parent's index (see
        :func:`craft_rag.tree.io.tree_to_json`). O(size)."""
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
        :mod:`craft_rag.tree.io`): one ``ValueError`` naming the JSON path (under
        ``path``) of the first bad field. O(size)."""
        return tree_from_json(data, lambda max_nodes: cls(max_nodes, clock=clock), path=path)

    def iter_paths(self) -> list[tuple[ChunkKey, ...]]:
        """Every root-to-node path (for tests and inspection). O(size * depth)."""
        return [node.path() for node in self._walk()]

    def _walk(self) -> list[PrefixNode]:
        return walk(self.root)

    def check_invariants(self) -> None:
        """Assert every invariant (see the class; tests and stress runs). O(size)."""
        check_tree(self.root, self._size, self.max_nodes, self._by_block, self._leaves)

    _check_invariants = check_invariants  # the name tests and older callers use
