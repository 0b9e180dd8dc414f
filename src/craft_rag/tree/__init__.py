"""The Chunk-Prefix Tree (CP-Tree, paper §4.1-4.2): cached chunk-prefixes with their KV metadata.

Modules: :mod:`~craft_rag.tree.nodes` (node, match, location, metadata value types),
:mod:`~craft_rag.tree.tree` (:class:`ChunkPrefixTree`, the public operations),
:mod:`~craft_rag.tree.state` (its fields and shared primitives), :mod:`~craft_rag.tree.match`
(lookups), :mod:`~craft_rag.tree.insert` (insert of checked arguments),
:mod:`~craft_rag.tree.removal`, :mod:`~craft_rag.tree.eviction` (the leaf queue and LRU
eviction, an object each tree owns), :mod:`~craft_rag.tree.checks` (invariants) and
:mod:`~craft_rag.tree.io` (the JSON codec). Callers outside this package use the public names
below and the tree's public methods only.
"""

from craft_rag.tree.nodes import KVLocation, NodeMetadata, PrefixMatch, PrefixNode
from craft_rag.tree.state import DEFAULT_MAX_NODES
from craft_rag.tree.tree import ChunkPrefixTree

__all__ = [
    "DEFAULT_MAX_NODES",
    "ChunkPrefixTree",
    "KVLocation",
    "NodeMetadata",
    "PrefixMatch",
    "PrefixNode",
]
