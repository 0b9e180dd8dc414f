"""Issue 16: a CP-Tree node with one child holds a 40-byte :class:`OneChild` instead of a dict.
It must read exactly like the dict ``{child.key: child}`` (the router walks ``children`` with
``get``, ``in``, ``[]`` and ``keys() & wanted``), and linking / unlinking children must move a
node between NO_CHILDREN, OneChild and dict keeping insertion order."""

from __future__ import annotations

import random
import sys

import pytest

from craft_rag.prefix_nodes import NO_CHILDREN, OneChild, PrefixNode, add_child, drop_child
from craft_rag.prefix_tree import ChunkPrefixTree
from craft_rag.types import ChunkKey


def _node(key: str, parent: PrefixNode | None = None) -> PrefixNode:
    return PrefixNode(ChunkKey(key), parent, 0 if parent is None else parent.depth + 1)


def test_one_child_reads_like_the_one_entry_dict() -> None:
    root = _node("r")
    child = _node("a", root)
    add_child(root, ChunkKey("a"), child)
    one, plain = root.children, {"a": child}
    assert type(one) is OneChild
    assert one.get("a") is child and one.get("b") is None and one.get("b", 7) == 7
    assert one["a"] is child
    with pytest.raises(KeyError):
        one["b"]
    assert ("a" in one, "b" in one) == ("a" in plain, "b" in plain)
    assert list(one) == list(plain) and len(one) == len(plain) == 1 and bool(one)
    assert one.keys() & {"a", "b"} == plain.keys() & {"a", "b"} == {"a"}
    assert not one.keys().isdisjoint({"a"}) and one.keys().isdisjoint({"z"})
    assert list(one.values()) == [child] and list(one.items()) == [("a", child)]
    assert dict(one) == plain
    for bad in (["a"], {"a": 1}):  # unhashable: a TypeError, as dict.get / `in` raise
        with pytest.raises(TypeError):
            one.get(bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            bad in one  # noqa: B015
    assert sys.getsizeof(one) < sys.getsizeof(plain) / 3


def test_add_and_drop_children_move_between_the_three_forms_in_order() -> None:
    rng = random.Random(5)
    root = _node("r")
    model: dict[str, PrefixNode] = {}
    for _ in range(2000):
        key = f"k{rng.randrange(8)}"
        if key in model:
            drop_child(root, ChunkKey(key))
            del model[key]
        else:
            child = _node(key, root)
            add_child(root, ChunkKey(key), child)
            model[key] = child
        children = root.children
        assert list(children.items()) == list(model.items())  # same insertion order
        if not model:
            assert children is NO_CHILDREN
        elif len(model) == 1:
            assert type(children) is OneChild
        else:
            assert type(children) is dict


def test_chains_use_one_child_and_eviction_keeps_the_forms() -> None:
    tree = ChunkPrefixTree(max_nodes=30)
    rng = random.Random(2)
    for _ in range(300):
        keys = rng.sample([f"c{i}" for i in range(12)], rng.randint(1, 6))
        tree.insert([ChunkKey(k) for k in keys])
        tree._check_invariants()  # leaves NO_CHILDREN, one child OneChild, else a dict
    inner = [n for n in tree._walk() if n.children]
    assert any(type(n.children) is OneChild for n in inner)
    assert any(type(n.children) is dict for n in [tree.root, *inner])
    assert tree.evictions > 0
