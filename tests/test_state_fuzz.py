"""Issue 11 item 2: planner state files are validated as a whole.

First the issue's reproducers, each one ``ValueError`` naming the JSON path. Then a seeded
fuzzer: valid state files (plans and commits with conversations, token spans, block hashes,
KV locations, forgotten turns) are mutated (any leaf to any JSON value, string leaves swapped,
keys and list items deleted or duplicated). Every mutant either loads, passes
``_check_invariants()`` and survives a further plan/commit/save/load round, or raises
``ValueError``; no other exception type.
"""

from __future__ import annotations

import copy
import json
import math
import random
from collections.abc import Callable
from typing import Any

import pytest

from craft_rag.chunk import make_chunk
from craft_rag.planner import CraftPlanner, PlannerConfig
from craft_rag.prefix_tree import KVLocation
from craft_rag.types import BlockHash

MUTANTS = 2000


class FakeClock:
    def __init__(self, start: float = 50.0) -> None:
        self.now = start

    def __call__(self) -> float:
        self.now += 0.25
        return self.now


def _drive(planner: CraftPlanner, rng: random.Random, steps: int) -> None:
    names = [f"doc-{i}" for i in range(9)]
    for step in range(steps):
        picked = rng.sample(names, rng.randint(1, 4))
        conv = rng.choice([None, None, "conv-a", "conv-b", "会話"])
        chunks = [
            make_chunk(f"text {n}", id=n, num_tokens=3 + int(n[-1])) for n in picked
        ]
        plan = planner.plan(chunks, conv)
        keys = plan.keys
        kwargs: dict[str, Any] = {"prefix_tokens": 12}
        if step % 3:
            kwargs["block_hashes"] = [
                [BlockHash(("/".join(keys[: i + 1])).encode())] for i in range(len(keys))
            ]
        if step % 4 == 0:
            kwargs["location"] = KVLocation("gpu-1", "cpu")
        planner.commit(plan, **kwargs)
    planner._check_invariants()


def _states() -> list[dict[str, Any]]:
    out = []
    for seed, config in enumerate(
        [
            PlannerConfig(policy="tree", window=6, max_tree_nodes=12, max_conversations=3),
            PlannerConfig(policy="frequency", threshold=1, window=None, conversation_ttl_s=None),
            PlannerConfig(policy="retriever", promotion="served", dedup=False, max_tree_nodes=5),
        ]
    ):
        planner = CraftPlanner(config, clock=FakeClock())
        _drive(planner, random.Random(seed), 14)
        if seed == 1:
            planner.forget_turns("conv-a", 1)
        out.append(json.loads(json.dumps(planner.to_json())))
    return out


STATES = _states()


def test_the_seed_states_are_rich_enough() -> None:
    for state in STATES:
        assert CraftPlanner.from_json(copy.deepcopy(state)).to_json() == state
    first = STATES[0]
    assert len(first["prefix_tree"]["nodes"]) >= 4 and first["conversations"]["conversations"]
    assert any(n["blocks"] for n in first["prefix_tree"]["nodes"])
    assert any(n["span"][0] is not None for n in first["prefix_tree"]["nodes"])


# ---- the reproducers -------------------------------------------------------------------


def _node_with_child(state: dict[str, Any]) -> tuple[int, int]:
    nodes = state["prefix_tree"]["nodes"]
    for i, node in enumerate(nodes):
        if node["parent"] >= 0:
            return node["parent"], i
    raise AssertionError("no node with a parent")


def _repeat_key_on_path(s: dict[str, Any]) -> None:
    parent, child = _node_with_child(s)
    s["prefix_tree"]["nodes"][child]["key"] = s["prefix_tree"]["nodes"][parent]["key"]


def _duplicate_sibling(s: dict[str, Any]) -> None:
    roots = [n for n in s["prefix_tree"]["nodes"] if n["parent"] == -1]
    assert len(roots) >= 2
    roots[1]["key"] = roots[0]["key"]


def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(s: dict[str, Any]) -> None:
        target: Any = s
        for part in path[:-1]:
            target = target[part]
        target[path[-1]] = value

    return mutate


def _delete(path: tuple[Any, ...]) -> Callable[[dict[str, Any]], None]:
    def mutate(s: dict[str, Any]) -> None:
        target: Any = s
        for part in path[:-1]:
            target = target[part]
        del target[path[-1]]

    return mutate


def _many_conversations(s: dict[str, Any]) -> None:
    convs = s["conversations"]["conversations"]
    for i in range(4):
        convs.append({"id": f"extra-{i}", "turns": [["doc-1"]], "last_used": 1e9 + i})


def _broken_lru(s: dict[str, Any]) -> None:
    convs = s["conversations"]["conversations"]
    assert len(convs) >= 2
    first, last = convs[0]["last_used"], convs[-1]["last_used"]
    convs[0]["last_used"], convs[-1]["last_used"] = last + 5, first


def _child_span_inverted(s: dict[str, Any]) -> None:
    _, child = _node_with_child(s)
    start, end = s["prefix_tree"]["nodes"][child]["span"]
    s["prefix_tree"]["nodes"][child]["span"] = [end + 1, start]


def _forward_parent(s: dict[str, Any]) -> None:
    _, child = _node_with_child(s)
    s["prefix_tree"]["nodes"][child]["parent"] = len(s["prefix_tree"]["nodes"])


REPRODUCERS: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("repeated key on a tree path", _repeat_key_on_path, r"prefix_tree\.nodes\[\d+\]\.key"),
    ("duplicate sibling keys", _duplicate_sibling, r"prefix_tree\.nodes\[\d+\]\.key"),
    ("parent -2", _set(("prefix_tree", "nodes", 1, "parent"), -2), r"nodes\[1\]\.parent"),
    ("forward parent", _forward_parent, r"prefix_tree\.nodes\[\d+\]\.parent"),
    ("max_nodes below the node count", _set(("prefix_tree", "max_nodes"), 2), r"prefix_tree"),
    ("span start > end", _child_span_inverted, r"prefix_tree\.nodes\[\d+\]\.span"),
    ("too many conversations", _many_conversations, r"conversations\.conversations"),
    ("broken LRU order", _broken_lru, r"conversations\.conversations\[\d+\]\.last_used"),
    ("table window != config", _set(("access_table", "window"), 50), r"access_table\.window"),
    ("requests: 'abc'", _set(("access_table", "requests"), "abc"), r"access_table\.requests"),
    ("null key", _set(("prefix_tree", "nodes", 0, "key"), None), r"nodes\[0\]\.key"),
    ("null request key", _set(("access_table", "requests", 0, 0), None), r"requests\[0\]\[0\]"),
    ("missing config", _delete(("config",)), "config"),
    ("missing node field", _delete(("prefix_tree", "nodes", 0, "hits")), r"nodes\[0\]"),
    ("huge int", _set(("prefix_tree", "nodes", 0, "hits"), 10**400), r"nodes\[0\]\.hits"),
    ("huge float", _set(("prefix_tree", "nodes", 0, "last_access"), 10**400), "last_access"),
    ("bool as int", _set(("config", "window"), True), r"config\.window"),
    ("string bool", _set(("config", "dedup"), "no"), r"config\.dedup"),
    ("ttl '1h'", _set(("config", "conversation_ttl_s"), "1h"), r"config\.conversation_ttl_s"),
    ("unknown config", _set(("config", "colour"), "red"), "config"),
    ("NaN time", _set(("prefix_tree", "nodes", 0, "last_access"), math.nan), "last_access"),
    ("bad hex", _set(("prefix_tree", "nodes", 0, "blocks"), ["zz"]), r"blocks\[0\]"),
    ("tree bound != config", _set(("prefix_tree", "max_nodes"), 13), r"prefix_tree\.max_nodes"),
    ("foreign format", _set(("format",), "other"), "format"),
]


@pytest.mark.parametrize(("case", "mutate", "where"), REPRODUCERS, ids=[r[0] for r in REPRODUCERS])
def test_each_reproducer_is_one_value_error_naming_the_path(
    case: str, mutate: Callable[[dict[str, Any]], None], where: str
) -> None:
    state = copy.deepcopy(STATES[0])
    mutate(state)
    with pytest.raises(ValueError, match=where) as info:
        CraftPlanner.from_json(state)
    assert type(info.value) is ValueError, case


# ---- the fuzzer ------------------------------------------------------------------------------


def _leaves(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Paths to every value in the document (containers included, so whole lists/objects are
    replaced too)."""
    out = [path] if path else []
    if isinstance(value, dict):
        for key, item in value.items():
            out.extend(_leaves(item, (*path, key)))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            out.extend(_leaves(item, (*path, i)))
    return out


def _get(doc: Any, path: tuple[Any, ...]) -> Any:
    for part in path:
        doc = doc[part]
    return doc


def _random_value(rng: random.Random, strings: list[str]) -> Any:
    pool: list[Any] = [
        None, True, False, 0, 1, -1, -2, 2, 7, 2**31, 2**63, 2**64, -(2**63), 10**30, 10**400,
        0.5, -0.0, 1e308, math.nan, math.inf, -math.inf, "", "x", "\ud800", "0", "1h",
        [], {}, [None, None], [1, 2], [0, 0], ["a", "b"], {"k": 1}, [[]], ["00ff"],
    ]
    if rng.random() < 0.35 and strings:
        return rng.choice(strings)
    return copy.deepcopy(rng.choice(pool))


def mutate(doc: dict[str, Any], rng: random.Random) -> str:
    """Apply one random mutation in place; returns what it did."""
    paths = _leaves(doc)
    strings = [v for p in paths if isinstance(v := _get(doc, p), str)]
    kind = rng.random()
    if kind < 0.55:
        path = rng.choice(paths)
        value = _random_value(rng, strings)
        _get(doc, path[:-1])[path[-1]] = value
        return f"set {path} = {value!r}"
    if kind < 0.7:
        string_paths = [p for p in paths if isinstance(_get(doc, p), str)]
        a, b = rng.choice(string_paths), rng.choice(string_paths)
        va, vb = _get(doc, a), _get(doc, b)
        _get(doc, a[:-1])[a[-1]], _get(doc, b[:-1])[b[-1]] = vb, va
        return f"swap {a} <-> {b}"
    containers = [p for p in paths if isinstance(_get(doc, p), (dict, list)) and _get(doc, p)]
    path = rng.choice(containers) if containers else ()
    target = _get(doc, path)
    if isinstance(target, dict):
        key = rng.choice(list(target))
        del target[key]
        return f"delete {(*path, key)}"
    i = rng.randrange(len(target))
    if kind < 0.85:
        del target[i]
        return f"delete {(*path, i)}"
    target.insert(rng.randrange(len(target) + 1), copy.deepcopy(target[i]))
    return f"duplicate {(*path, i)}"


def _use(planner: CraftPlanner, rng: random.Random) -> None:
    """A further plan/commit/save/load round on a loaded planner."""
    _drive(planner, rng, 3)
    planner.on_blocks_removed([BlockHash(b"doc-1"), 12345])
    data = json.loads(json.dumps(planner.to_json()))
    again = CraftPlanner.from_json(data, clock=planner._clock)
    again._check_invariants()
    assert again.to_json() == planner.to_json()


def test_fuzzed_state_files_load_cleanly_or_raise_value_error() -> None:
    rng = random.Random(20261123)
    outcomes = {"loaded": 0, "refused": 0}
    for n in range(MUTANTS):
        doc = copy.deepcopy(rng.choice(STATES))
        done = [mutate(doc, rng) for _ in range(rng.choice([1, 1, 1, 2, 3]))]
        text = json.dumps(doc)  # what a file holds (NaN/Infinity included, as json writes them)
        try:
            planner = CraftPlanner.from_json(json.loads(text), clock=FakeClock(1000.0))
        except ValueError:
            outcomes["refused"] += 1
            continue
        except Exception as exc:  # pragma: no cover - the failure report
            pytest.fail(f"mutant {n} ({done}) raised {type(exc).__name__}: {exc}")
        try:
            planner._check_invariants()
            _use(planner, random.Random(n))
        except Exception as exc:  # pragma: no cover - the failure report
            pytest.fail(f"mutant {n} ({done}) loaded but then {type(exc).__name__}: {exc}")
        outcomes["loaded"] += 1
    # Both outcomes are exercised: the fuzzer is neither all-refused nor all-harmless.
    assert outcomes["loaded"] > MUTANTS // 20 and outcomes["refused"] > MUTANTS // 4, outcomes
