"""Moved to craft_rag.tree.nodes; alias kept for one release."""

from craft_rag.tree.nodes import (
    NO_CHILDREN,
    KVLocation,
    NodeMetadata,
    OneChild,
    PrefixMatch,
    PrefixNode,
    add_child,
    block_hash_tuple,
    drop_child,
    new_leaf,
)

__all__ = [
    "NO_CHILDREN",
    "KVLocation",
    "NodeMetadata",
    "OneChild",
    "PrefixMatch",
    "PrefixNode",
    "add_child",
    "block_hash_tuple",
    "drop_child",
    "new_leaf",
]
