"""The CP-Tree's insert for checked arguments (:func:`extend`, the tree's ``insert_trusted``):
walk the cached part of a chunk-prefix (refreshing access times, spans, block hashes,
dropping children left under an old span), add the new part, evict past the bound. The
checking ``insert`` is :meth:`craft_rag.tree.ChunkPrefixTree.insert`."""

from __future__ import annotations

from collections.abc import Sequence

from craft_rag.tree.match import match_nodes
from craft_rag.tree.nodes import NO_CHILDREN, KVLocation, OneChild, PrefixNode, add_child, new_leaf
from craft_rag.tree.state import TreeState
from craft_rag.types import BlockHash, ChunkKey

_NO_SPAN = (None, None)


def extend(
    tree: TreeState,
    keys: Sequence[ChunkKey],
    spans: Sequence[tuple[int, int] | None] | None,
    hashes: Sequence[tuple[BlockHash, ...] | None] | None,
    location: KVLocation | None,
    matched: Sequence[PrefixNode] = (),
    touch: bool = False,
    run: tuple[int, Sequence[int]] | None = None,
) -> None:
    """:meth:`ChunkPrefixTree.insert` for arguments already checked (the tree's
    ``insert_trusted``): distinct non-empty string ``keys``, ``spans[i]`` / ``hashes[i]``
    (None: keep the node's) of the same length, spans contiguous. The planner's commit checks
    its arguments once and calls this (no second pass per request). ``matched``: the nodes of
    a leading part of ``keys`` the caller has just walked (``match_nodes``, nothing changed
    since): not looked up again. ``touch``: ``matched`` is the whole cached part of ``keys``
    (the tree's match, cut where stale nodes were removed); first touch it, in the same pass
    (same clock reads, hits and queue entries as the two calls). ``run``: instead of ``spans``,
    contiguous spans as ``(first token, each key's token count)``, added up here (each
    span starts on the very int its predecessor ends on). O(len(keys) + evictions +
    stale nodes)."""
    touched = tree._clock() if touch else 0.0  # the touch's clock read comes first
    tree.version += 1
    now = tree._clock()
    node = tree.root
    leaves = tree._leaves
    n = len(keys)
    bound, counts = run if run is not None else (0, ())  # the running span boundary
    known = len(matched)
    i = 0
    while i < n:  # the part of the path already cached
        if i < known:
            child = matched[i]
            if touch:  # as a touch: a hit; a leaf (only the last can be) queued then
                child.hit_count += 1
                child.last_access = touched
                if not child.children:
                    leaves.push(child, tree._size)
        elif touch:  # ``matched`` is the whole cached part: the rest is new
            break
        else:  # look up the rest of the cached part below ``node`` (nothing changes it first)
            matched = [*matched[:i], *match_nodes(tree, keys, node, i)]
            known = len(matched)
            if known == i:
                break
            continue
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
                tree._set_hashes(child, block_hashes)
        # Children start where this node ended before (invariant), so only a changed
        # (or newly known) end can leave stale children: the scan is O(fan-out), and a
        # hot chunk's node has thousands of children (a scan per commit would dominate it).
        if child.children and child.token_end != old_end:
            if touch and i + 1 < known:  # a touch would have seen them all first
                tree._touch_at(matched[i + 1 : known], touched)
            touch = False
            tree._remove_stale_children(child)
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
                    tree._set_hashes(child, block_hashes)
            node = child
        tree._size += n - i
    last = node if n else None
    if last is not None and last.children is NO_CHILDREN:
        leaves.push(last, tree._size)
    if tree._size > tree.max_nodes:
        tree._evict_over_bound(last)
