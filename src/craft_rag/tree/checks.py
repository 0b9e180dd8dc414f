"""The CP-Tree's checks, kept apart from its operations: the invariant check
(:meth:`craft_rag.tree.ChunkPrefixTree.check_invariants`; tests and stress runs call it after
every step),
``insert``'s span-contiguity check, and the node walk."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

from craft_rag.tree.eviction import LeafQueue
from craft_rag.tree.nodes import NO_CHILDREN, NodeMetadata, OneChild, PrefixNode
from craft_rag.types import BlockHash, ChunkKey


def check_tree(
    root: PrefixNode,
    size: int,
    max_nodes: int,
    by_block: dict[BlockHash, PrefixNode],
    queue: LeafQueue,
) -> None:
    """Assert every invariant of the tree under ``root`` with node count ``size``, block index
    ``by_block`` and leaf queue ``queue`` (see :class:`craft_rag.tree.ChunkPrefixTree`).
    O(size)."""
    count = 0
    blocks: dict[BlockHash, PrefixNode] = {}
    leaves: list[PrefixNode] = []
    stack: list[PrefixNode] = [root]
    assert root.key is None and root.depth == 0
    while stack:
        node = stack.pop()
        children = node.children
        # Leaves share NO_CHILDREN, one child is a OneChild, two or more a dict.
        if not children:
            assert children is NO_CHILDREN, "a leaf must hold the shared NO_CHILDREN"
        elif type(children) is not OneChild:
            assert type(children) is dict and len(children) >= 2, "one child is a OneChild"
        for key, child in children.items():
            assert child.alive, "dead node still linked"
            assert child.key == key and child.parent is node
            assert child.depth == node.depth + 1
            if (
                node is not root
                and child.token_start is not None
                and node.token_end is not None
            ):
                assert child.token_start == node.token_end, "spans must be contiguous"
            if child.token_start is not None:
                assert child.token_end is not None and child.token_start <= child.token_end
            for h in child.block_hashes:
                owner = blocks.setdefault(h, child)
                assert owner is child, "a block hash is held by two nodes"
            if not child.children:
                leaves.append(child)
            count += 1
            stack.append(child)
    assert count == size, f"size {size} != {count} linked nodes"
    assert size <= max_nodes
    assert blocks.keys() == by_block.keys()
    for h, node in by_block.items():
        assert node.alive and h in node.block_hashes
    # Every leaf has exactly one valid queue entry, keyed by its current last access; the
    # queue's deque part is in key order.
    fifo = queue.fifo
    assert all(a < b for a, b in pairwise(fifo)), "leaf queue out of order"
    valid = {
        id(node): seen
        for seen, stamp, node in (*fifo, *queue.heap)
        if node.alive and not node.children and node.heap_stamp == stamp
    }
    assert len(valid) == len(leaves), "a leaf is missing from the leaf queue"
    for leaf in leaves:
        assert valid.get(id(leaf)) == leaf.last_access, "stale leaf-queue entry"
        assert 0 <= leaf.heap_stamp < queue.next_stamp
    _check_no_repeated_key_on_a_path(root)
    stamps = [n.heap_stamp for n in walk(root) if n.heap_stamp >= 0]
    assert len(set(stamps)) == len(stamps), "two nodes share a leaf-queue stamp"
    assert len(set(map(id, blocks.values()))) <= count


def check_spans_contiguous(
    root: PrefixNode, keys: Sequence[ChunkKey], metadata: Sequence[NodeMetadata]
) -> None:
    """For :meth:`craft_rag.tree.ChunkPrefixTree.insert`: refuse (``ValueError``) metadata
    whose span would not start where the node before it ends (that node's new span, else its
    recorded one). Read-only; O(len(keys))."""
    node: PrefixNode | None = root
    parent_end: int | None = None
    for i, key in enumerate(keys):
        existing = node.children.get(key) if node is not None else None
        span = metadata[i].token_span
        if span is not None and i > 0 and parent_end is not None and span[0] != parent_end:
            msg = (
                f"metadata[{i}]: token span {span} does not start where chunk {i - 1} ends "
                f"({parent_end}); spans of a chunk-prefix are contiguous"
            )
            raise ValueError(msg)
        if span is not None:
            parent_end = span[1]
        else:
            parent_end = existing.token_end if existing is not None else None
        node = existing


def walk(root: PrefixNode) -> list[PrefixNode]:
    """Every node below ``root``, depth-first (children in reverse insertion order). O(size)."""
    out: list[PrefixNode] = []
    stack = list(root.children.values())
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out


def _check_no_repeated_key_on_a_path(root: PrefixNode) -> None:
    """Depth-first with the current path's keys in a set: O(size)."""
    on_path: set[ChunkKey] = set()
    stack: list[tuple[PrefixNode, bool]] = [(c, True) for c in root.children.values()]
    while stack:
        node, entering = stack.pop()
        assert node.key is not None
        if not entering:
            on_path.discard(node.key)
            continue
        assert node.key not in on_path, "a path repeats a chunk key"
        on_path.add(node.key)
        stack.append((node, False))
        stack.extend((c, True) for c in node.children.values())
