"""A CP-Tree saved (:meth:`craft_rag.tree.ChunkPrefixTree.to_json`) and read back with the
whole structure checked (:meth:`craft_rag.tree.ChunkPrefixTree.from_json`).

A state file is untrusted input: a hand-edited or corrupted file must not build a tree that
breaks the tree's invariants (a path repeating a key makes ``plan()`` return a chunk twice, a
parent index of ``-2`` attaches a node to the wrong parent). Every field is checked before the
tree is built, and the first violation is one ``ValueError`` naming its JSON path
(``"prefix_tree.nodes[3].parent: ..."``).

The saved layout (``to_json``): nodes in pre-order, each naming its parent's index (``-1`` for
the root). Pre-order is required, which lets the reader keep only the current root-to-node path
(a stack) to check parents and repeated keys in O(1) per node.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, TypeVar

from craft_rag.tree.nodes import KVLocation, PrefixNode, add_child
from craft_rag.tree.state import TreeState
from craft_rag.types import BlockHash, ChunkKey, as_block_hash
from craft_rag.validation import (
    state_dict,
    state_error,
    state_format,
    state_int,
    state_list,
    state_number,
    state_path,
    state_str,
)

FORMAT = "craft-rag/prefix-tree/v1"
_HEX = re.compile(r"(?:[0-9a-fA-F]{2})+")
# Counters that grow by one per event get headroom below MAX_INT, so a loaded tree can run (and
# be saved and loaded again) for 2**62 more events.
_MAX_COUNTER = 2**62
_NODE_FIELDS = ("parent", "key", "span", "location", "blocks", "hits", "last_access")

T = TypeVar("T", bound=TreeState)


def tree_to_json(tree: TreeState) -> dict[str, Any]:
    """``tree``'s plain-JSON state (:meth:`ChunkPrefixTree.to_json`): nodes in pre-order with
    their parent's index, which :func:`tree_from_json` reads back. O(size)."""
    nodes: list[dict[str, Any]] = []
    stack: list[tuple[PrefixNode, int]] = [
        (c, -1) for c in reversed(list(tree.root.children.values()))
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
        "format": FORMAT,
        "max_nodes": tree.max_nodes,
        "next_stamp": tree._leaves.next_stamp,
        "nodes": nodes,
    }


def tree_from_json(data: object, make: Callable[[int], T], path: str = "") -> T:
    """Build a tree from ``to_json`` data, checking everything first: ``make(max_nodes)`` gives
    the empty tree (the caller's class and clock) that the saved nodes fill.
    O(nodes + block hashes)."""
    state_format(data, path, FORMAT, "prefix tree")
    assert isinstance(data, dict)
    state_dict(data, path, required=("format", "max_nodes", "nodes"), optional=("next_stamp",))
    max_nodes = state_int(data["max_nodes"], state_path(path, "max_nodes"), minimum=1)
    nodes_path = state_path(path, "nodes")
    items = state_list(data["nodes"], nodes_path, max_len=max_nodes)

    tree = make(max_nodes)
    built: list[PrefixNode] = []
    path_nodes: list[int] = []  # indices of the current root-to-node path (pre-order)
    on_path: dict[int, int] = {}  # index -> position in path_nodes
    path_keys: set[str] = set()
    owner_of: dict[BlockHash, int] = {}
    stamps: dict[int, int] = {}
    for i, raw in enumerate(items):
        where = state_path(nodes_path, i)
        item = state_dict(raw, where, required=_NODE_FIELDS, optional=("stamp",))
        parent_index = _parent_index(item["parent"], state_path(where, "parent"), i, on_path)
        # Unwind the path to the parent: pre-order lists a node right after its parent's
        # earlier descendants, so its parent is always on the current path.
        keep = on_path[parent_index] + 1 if parent_index >= 0 else 0
        for gone in path_nodes[keep:]:
            del on_path[gone]
            key_gone = built[gone].key
            assert key_gone is not None
            path_keys.discard(key_gone)
        del path_nodes[keep:]
        parent = tree.root if parent_index < 0 else built[parent_index]

        key_path = state_path(where, "key")
        key = ChunkKey(state_str(item["key"], key_path))
        if key in parent.children:
            raise state_error(key_path, f"duplicate sibling key {key!r} under the same parent")
        if key in path_keys:
            raise state_error(key_path, f"repeats chunk key {key!r} already on its path")
        start, end = _span(item["span"], state_path(where, "span"))
        if (
            parent is not tree.root
            and start is not None
            and parent.token_end is not None
            and start != parent.token_end
        ):
            raise state_error(
                state_path(where, "span"),
                f"starts at {start}, not where its parent's span ends ({parent.token_end}); "
                "spans of a chunk-prefix are contiguous",
            )
        location = _location(item["location"], state_path(where, "location"), KVLocation)
        blocks_path = state_path(where, "blocks")
        hashes = _hashes(item["blocks"], blocks_path)
        for j, h in enumerate(hashes):
            first = owner_of.setdefault(h, i)
            if first != i:
                raise state_error(
                    state_path(blocks_path, j),
                    f"block hash {h.hex()} is already held by nodes[{first}]; a block names "
                    "one node",
                )
        stamp = state_int(
            item.get("stamp", -1), state_path(where, "stamp"), minimum=-1, maximum=_MAX_COUNTER
        )
        if stamp >= 0:
            other = stamps.setdefault(stamp, i)
            if other != i:
                raise state_error(
                    state_path(where, "stamp"), f"{stamp} is also the stamp of nodes[{other}]"
                )
        node = PrefixNode(
            key=key,
            parent=parent,
            depth=parent.depth + 1,
            token_start=start,
            token_end=end,
            location=location,
            block_hashes=hashes,
            hit_count=state_int(
                item["hits"], state_path(where, "hits"), minimum=0, maximum=_MAX_COUNTER
            ),
            last_access=state_number(item["last_access"], state_path(where, "last_access")),
            heap_stamp=stamp,
        )
        add_child(parent, key, node)
        for h in hashes:
            tree._by_block[h] = node
        tree._size += 1
        built.append(node)
        on_path[i] = len(path_nodes)
        path_nodes.append(i)
        path_keys.add(key)

    # Saved stamps keep the eviction order among equal access times; new ones come after.
    least = max(stamps, default=-1) + 1
    if "next_stamp" in data:
        next_path = state_path(path, "next_stamp")
        tree._leaves.next_stamp = state_int(
            data["next_stamp"], next_path, minimum=least, maximum=_MAX_COUNTER
        )
    else:
        tree._leaves.next_stamp = least
    tree._leaves.rebuild()
    return tree


def _parent_index(value: object, where: str, index: int, on_path: dict[int, int]) -> int:
    parent = state_int(value, where, minimum=-1, maximum=max(index - 1, -1))
    if parent >= 0 and parent not in on_path:
        raise state_error(
            where,
            f"nodes[{parent}] is not an ancestor of the node before this one; nodes must be "
            "saved in pre-order (as to_json writes them)",
        )
    return parent


def _span(value: object, where: str) -> tuple[int | None, int | None]:
    items = state_list(value, where)
    if len(items) != 2:
        raise state_error(where, f"must be [start, end], got {len(items)} items")
    if items[0] is None and items[1] is None:
        return None, None
    start = state_int(items[0], state_path(where, 0), minimum=0)
    end = state_int(items[1], state_path(where, 1), minimum=0)
    if start > end:
        raise state_error(where, f"start {start} > end {end}")
    return start, end


def _location(value: object, where: str, kv_location: Any) -> Any:
    if value is None:
        return None
    items = state_list(value, where)
    if len(items) != 2:
        raise state_error(where, f"must be [engine_id, tier] or null, got {len(items)} items")
    return kv_location(
        engine_id=state_str(items[0], state_path(where, 0)),
        tier=state_str(items[1], state_path(where, 1)),
    )


def _hashes(value: object, where: str) -> tuple[BlockHash, ...]:
    out: list[BlockHash] = []
    for j, raw in enumerate(state_list(value, where)):
        item_path = state_path(where, j)
        text = state_str(raw, item_path)
        if not _HEX.fullmatch(text):
            raise state_error(item_path, f"must be a hex string, got {text[:40]!r}")
        try:
            out.append(as_block_hash(bytes.fromhex(text), item_path))
        except ValueError as exc:
            raise state_error(item_path, str(exc).removeprefix(f"{item_path}: ")) from None
    return tuple(out)
