"""Moved to craft_rag.tree (craft_rag.tree.tree); alias kept for one release."""

from craft_rag.tree import (
    DEFAULT_MAX_NODES,
    ChunkPrefixTree,
    KVLocation,
    NodeMetadata,
    PrefixMatch,
    PrefixNode,
)

__all__ = [
    "DEFAULT_MAX_NODES",
    "ChunkPrefixTree",
    "KVLocation",
    "NodeMetadata",
    "PrefixMatch",
    "PrefixNode",
]
