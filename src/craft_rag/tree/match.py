"""The CP-Tree's lookups: the longest cached prefix of a key sequence (:func:`match_nodes`) and
the longest cached path drawn from a key set (:func:`subset_path`). Read-only; they are the
methods of the same names of :class:`craft_rag.tree.ChunkPrefixTree` (bound as they are: no
wrapper call on the per-request path), behind its ``match`` and ``match_subset``."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice
from typing import Any

from craft_rag.tree.nodes import NO_CHILDREN, OneChild, PrefixNode
from craft_rag.tree.state import TreeState
from craft_rag.types import ChunkKey


def match_nodes(
    tree: TreeState, keys: Sequence[ChunkKey], below: PrefixNode | None = None, start: int = 0
) -> list[PrefixNode]:
    """:meth:`ChunkPrefixTree.match` for keys the caller already checked (the planner's plan
    and commit): the matched nodes as a list, no :class:`PrefixMatch`. O(len of match).
    ``below``/``start``: walk ``keys[start:]`` from node ``below`` instead of the root (the
    tree's insert, going on down a path it has walked to ``below``)."""
    nodes: list[PrefixNode] = []
    node = tree.root if below is None else below
    for key in islice(keys, start, None) if start else keys:
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


def subset_path(
    tree: TreeState, wanted: set[ChunkKey] | frozenset[ChunkKey] | dict[ChunkKey, Any]
) -> list[PrefixNode]:
    """:meth:`ChunkPrefixTree.match_subset` for a set (or a dict keyed by chunk key): the
    path's nodes, root side first ([] for none). Breadth first, one level per chunk of the path: the
    best node is the best (latest access, then smaller path) of the deepest level that
    has a node, so only that level is compared. Same nodes visited as depth first."""
    # A path never repeats a key (``insert`` refuses that), so no visited-set is needed.
    k = len(wanted)
    root = tree.root
    level: list[PrefixNode] = [root]
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
    if best is root:
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
    root = root
    while cur is not root and cur is not None:
        path.append(cur)
        cur = cur.parent
    path.reverse()
    return path
