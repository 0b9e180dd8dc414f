"""Issue 16's planner-cost cuts keep every decision: the CP-Tree's two-part leaf queue pops what
one heap would, eviction takes the least recently used leaf (checked by brute force on a copy,
with a clock that steps back and one that stands still), the tree order's set-matched nodes are
its order's match, plan()'s one-comprehension key map splits repeats like the item loop, a
saved and reloaded planner (its leaf queue rebuilt in one sorted part) decides what the original
does for hundreds of requests after, commit reads plan()'s tree match only while the tree is
unchanged (deciding what a planner that walks the tree every time decides), and the fast
builders of nodes, plans and results build what the constructors build."""

from __future__ import annotations

import heapq
import json
import random
from collections import deque
from typing import Any

import pytest

from craft_rag.access_table import ChunkAccessTable
from craft_rag.chunk import Chunk
from craft_rag.ordering import OrderingContext, TreeOrder
from craft_rag.planner import CraftPlanner, PlannerConfig
from craft_rag.tree import ChunkPrefixTree, PrefixNode
from craft_rag.tree.eviction import Entry, pop_entry, push_entry
from craft_rag.tree.state import TreeState
from craft_rag.types import ChunkKey


class SteppingClock:
    """Moves forward, stands still or steps back (``time.time`` under NTP) at random."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.now = 1000.0

    def __call__(self) -> float:
        self.now += self.rng.choice([0.0, 0.0, 1.0, 1.0, 1.0, -2.5])
        return self.now


def test_leaf_queue_pops_like_one_heap() -> None:
    rng = random.Random(7)
    fifo: deque[Entry] = deque()
    heap: list[Entry] = []
    reference: list[Entry] = []
    node = PrefixNode(key=None, parent=None, depth=0)
    now, stamp = 0.0, 0
    for _ in range(20_000):
        if rng.random() < 0.55:
            now += rng.choice([0.0, 1.0])
            seen = now if rng.random() < 0.8 else now - rng.randrange(50)  # an older leaf
            entry = (seen, stamp, node)
            stamp += 1
            push_entry(fifo, heap, entry)
            heapq.heappush(reference, entry)
        else:
            want = heapq.heappop(reference) if reference else None
            assert pop_entry(fifo, heap) == want
        assert all(a < b for a, b in zip(fifo, list(fifo)[1:], strict=False))
    assert sorted([*fifo, *heap]) == sorted(reference)


def _reference_evict(tree: ChunkPrefixTree, protect: tuple[ChunkKey, ...] | None) -> None:
    """The bound's rule by brute force: the leaf with the least ``(last_access, stamp)`` goes
    first, never the path just inserted while another leaf is left (then it is trimmed from its
    leaf end); a parent left childless is stamped at once (``_unlink`` pushes it)."""
    while len(tree) > tree.max_nodes:
        leaves = [n for n in tree._walk() if not n.children and n.path() != protect]
        if not leaves:
            break
        victim = min(leaves, key=lambda n: (n.last_access, n.heap_stamp))
        tree._unlink(victim)
        tree.evictions += 1
    node = tree.root
    for key in protect or ():
        node = node.children[key]
    while len(tree) > tree.max_nodes and node is not tree.root:
        parent = node.parent
        assert parent is not None
        tree._unlink(node)
        node = parent


def _copy(tree: ChunkPrefixTree) -> ChunkPrefixTree:
    data = tree.to_json()
    data["max_nodes"] = max(tree.max_nodes, len(tree))  # over the bound while it evicts
    copy = ChunkPrefixTree.from_json(data, clock=tree._clock)
    copy.max_nodes = tree.max_nodes
    return copy


@pytest.mark.parametrize(("seed", "max_nodes", "k"), [(1, 12, 4), (2, 40, 6), (3, 5, 3)])
def test_eviction_takes_the_least_recently_used_leaf_with_any_clock(
    seed: int, max_nodes: int, k: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(seed)
    tree = ChunkPrefixTree(max_nodes, clock=SteppingClock(rng))
    real = TreeState._evict_over_bound
    checked = [0]

    def evict_and_compare(target: TreeState, protect: PrefixNode | None) -> None:
        assert isinstance(target, ChunkPrefixTree)
        expected = _copy(target)
        _reference_evict(expected, protect.path() if protect is not None else None)
        real(target, protect)
        assert target.to_json() == expected.to_json()
        checked[0] += 1

    monkeypatch.setattr(TreeState, "_evict_over_bound", evict_and_compare)
    for _ in range(600):
        keys = rng.sample([ChunkKey(f"c{i}") for i in range(12)], rng.randint(1, k))
        if rng.random() < 0.3:  # a reuse: hits and a fresh access time on a cached prefix
            tree.touch(tree.match(keys))
        tree.insert(keys)
        if rng.random() < 0.05 and len(tree):
            tree.remove(rng.choice(tree._walk()))
        tree._check_invariants()
    assert checked[0] > 100


def test_tree_order_matched_nodes_are_its_orders_match() -> None:
    rng = random.Random(3)
    tree = ChunkPrefixTree(200)
    table = ChunkAccessTable(50)
    context = OrderingContext(table, tree)
    policy = TreeOrder()
    chunks = [Chunk(key=ChunkKey(f"c{i}"), text="", num_tokens=4) for i in range(15)]
    for _ in range(800):
        request = rng.sample(chunks, rng.randint(1, 7))
        ordered, nodes = policy.order_matched(request, context)
        keys = [c.key for c in ordered]
        assert ordered == policy.order(request, context)
        assert sorted(keys) == sorted(c.key for c in request)
        assert nodes == list(tree.match(keys).nodes)
        assert nodes == list(tree.match_subset(keys).nodes)
        table.record(keys)
        tree.insert(keys[: rng.randint(1, len(keys))])


class TaggedChunk(Chunk):
    """A Chunk subclass (plan() accepts any Chunk)."""

    __slots__ = ()


def test_plan_key_map_splits_repeats_and_accepts_subclasses() -> None:
    planner = CraftPlanner(PlannerConfig(policy="tree", window=10))
    a, b, c = (Chunk(key=ChunkKey(k), text=k, num_tokens=3) for k in "abc")
    a2 = Chunk(key=ChunkKey("a"), text="other text", num_tokens=3)
    plan = planner.plan([a, b, a2, c, b])
    assert set(plan.ordered) == {a, b, c}  # the first occurrence of each key is kept
    assert plan.repeated_in_request == (a2, b)
    planner.commit(plan, prefix_tokens=0)
    tagged = TaggedChunk(key=ChunkKey("t"), text="t", num_tokens=3)
    plan = planner.plan([tagged, a, b])
    assert tagged in plan.ordered and plan.repeated_in_request == ()
    assert plan.matched_chunks == 2  # a, b: the path served before
    with pytest.raises(ValueError, match=r"chunks\[1\] is a str"):
        planner.plan([a, "b"])  # type: ignore[list-item]


class SteeredClock:
    """Reads ``now``; only the test moves it (so ``to_json`` reads change nothing)."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


_STEPS = {"still": (0.0,), "back": (0.0, 1.0, 1.0, -2.0), "tick": (1.0,)}


def _drive(
    planner: CraftPlanner, clock: SteeredClock, rng: random.Random, n: int, mode: str
) -> list[Any]:
    """``n`` seeded requests (empty ones, k=1, repeated keys, conversations, stale reuse)."""
    out: list[Any] = []
    for _ in range(n):
        clock.now += rng.choice(_STEPS[mode])
        ids = [rng.randrange(30) for _ in range(rng.randint(0, 6))]
        conv = f"c{rng.randrange(3)}" if rng.random() < 0.2 else None
        plan = planner.plan([Chunk(key=ChunkKey(f"k{i}"), text="", num_tokens=4) for i in ids],
                            conv)
        stale = plan.turn == 1 and rng.random() < 0.1  # the engine had less than planned
        reused = rng.randint(0, len(plan.ordered)) if stale else None
        result = planner.commit(plan, prefix_tokens=rng.choice([None, 0, 8]), reused_chunks=reused)
        out.append((plan.keys, plan.matched_chunks, plan.matched_tokens, result))
        planner._check_invariants()
    return out


@pytest.mark.parametrize("mode", ["still", "back", "tick"])
@pytest.mark.parametrize("max_nodes", [1, 3, 17, 60])
def test_reloaded_planner_keeps_deciding_like_the_original(mode: str, max_nodes: int) -> None:
    config = PlannerConfig(policy="tree", window=20, max_tree_nodes=max_nodes)
    clock = SteeredClock()
    planner = CraftPlanner(config, clock=clock)
    _drive(planner, clock, random.Random(1), 300, mode)
    if mode == "back" and max_nodes >= 17:  # out-of-order entries: the reload re-lays them
        assert planner.prefix_tree._leaves.heap
    evicted_before = planner.prefix_tree.evictions
    twin_clock = SteeredClock(clock.now)
    twin = CraftPlanner.from_json(json.loads(json.dumps(planner.to_json())), clock=twin_clock)
    assert twin.to_json() == planner.to_json()
    mine = _drive(planner, clock, random.Random(2), 400, mode)
    theirs = _drive(twin, twin_clock, random.Random(2), 400, mode)
    assert mine == theirs
    assert twin.to_json() == planner.to_json()
    assert planner.prefix_tree.evictions - evicted_before == twin.prefix_tree.evictions > 0


def _interleaved(planner: CraftPlanner, clock: SteeredClock, seed: int) -> list[Any]:
    """Plans made in batches of 1-3 and committed in shuffled order, KV events between: a
    plan's tree match is current at some commits and stale at others."""
    rng = random.Random(seed)
    out: list[Any] = []
    sent: list[int] = []  # block hashes committed so far
    for _ in range(250):
        clock.now += rng.choice([0.0, 1.0])
        plans = []
        for _ in range(rng.randint(1, 3)):
            ids = [rng.randrange(25) for _ in range(rng.randint(1, 5))]
            plans.append(planner.plan([Chunk(key=ChunkKey(f"k{i}"), text="", num_tokens=4)
                                       for i in ids]))
        rng.shuffle(plans)
        for plan in plans:
            if rng.random() < 0.02:
                planner.on_all_blocks_cleared()
            elif sent and rng.random() < 0.2:
                out.append(planner.on_blocks_removed(rng.sample(sent, min(2, len(sent)))))
            rows = [[rng.getrandbits(20)] for _ in plan.ordered] if rng.random() < 0.5 else None
            sent.extend(row[0] for row in rows or ())
            reused = rng.randint(0, len(plan.ordered)) if rng.random() < 0.1 else None
            out.append((plan.keys, plan.matched_chunks, planner.commit(
                plan, prefix_tokens=rng.choice([0, 8]), block_hashes=rows, reused_chunks=reused
            )))
    return out


def test_commit_reads_the_plans_match_only_while_the_tree_is_unchanged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = PlannerConfig(policy="tree", window=20, max_tree_nodes=30)
    clock = SteeredClock()
    planner = CraftPlanner(config, clock=clock)
    walks: list[int] = []
    matched = ChunkPrefixTree.match_nodes

    def counted(tree: ChunkPrefixTree, keys: Any) -> list[PrefixNode]:
        walks.append(len(keys))
        return matched(tree, keys)

    monkeypatch.setattr(ChunkPrefixTree, "match_nodes", counted)
    chunks = [Chunk(key=ChunkKey(k), text="", num_tokens=4) for k in "abc"]
    planner.commit(planner.plan(chunks), prefix_tokens=0, block_hashes=[[1], [2], [3]])
    assert walks == []  # plan -> commit, nothing in between: plan()'s match is read
    first, second = planner.plan(chunks[:2]), planner.plan(chunks[1:])
    planner.commit(second, prefix_tokens=0)
    planner.commit(first, prefix_tokens=0)  # the tree grew since ``first`` was made
    assert walks == [2]
    plan = planner.plan(chunks)
    assert plan.matched_chunks == 3
    assert planner.on_blocks_removed([2]) == 2  # the KV of b (and c after it) is gone
    assert planner.commit(plan, prefix_tokens=0).reused_chunks == 1  # walked again: a only
    assert walks == [2, 3]
    monkeypatch.undo()
    # The same decisions and state as a planner that walks the tree at every commit.
    reading_clock, walking_clock = SteeredClock(), SteeredClock()
    reading = CraftPlanner(config, clock=reading_clock)
    walking = CraftPlanner(config, clock=walking_clock)
    decided = _interleaved(reading, reading_clock, 5)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("craft_rag.plan_lease.PlanLease.match", lambda self, tree: None)
        assert decided == _interleaved(walking, walking_clock, 5)
    assert json.dumps(reading.to_json()) == json.dumps(walking.to_json())


def test_fast_builders_build_what_the_constructors_build() -> None:
    from dataclasses import FrozenInstanceError, fields

    from craft_rag.plans import Plan, made_plan, made_result
    from craft_rag.prefix_nodes import NO_CHILDREN, new_leaf

    root = PrefixNode(key=None, parent=None, depth=0)
    built = new_leaf(ChunkKey("a"), root, 1, 3, 7, None, 5.0)
    want = PrefixNode(ChunkKey("a"), root, 1, NO_CHILDREN, 3, 7, None, (), 0, 5.0)
    assert all(getattr(built, f.name) == getattr(want, f.name) for f in fields(PrefixNode))
    chunk = Chunk(key=ChunkKey("a"), text="", num_tokens=1)
    plan = made_plan(4, (chunk,), (), (), 1, 9, "c", 2, "tree", 7, (ChunkKey("a"),))
    public = Plan(4, (chunk,), (), (), 1, 9, "c", 2, "tree", 7)
    assert type(plan) is Plan and plan == public and hash(plan) == hash(public)
    assert plan.keys == public.keys == ("a",)
    with pytest.raises(FrozenInstanceError):
        plan.turn = 3  # type: ignore[misc]
    assert made_result(1, 2, 0, 1) is made_result(1, 2, 0, 1)  # equal results are shared


def test_a_turn_records_its_token_ids_only_in_a_conversation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The engine's turn code (here through replay) hands commit the turn's ids only when a
    # conversation will keep them; a single request's would be checked (O(prompt)) and dropped.
    from craft_rag.chunk import make_chunk
    from craft_rag.replay import replay
    from craft_rag.tokenizer import HashingTokenizer
    from craft_rag.trace import TraceRequest
    from craft_rag.types import ConversationId

    seen: list[tuple[str | None, int | None]] = []
    commit = CraftPlanner.commit

    def spy(self: CraftPlanner, plan: Any, **kwargs: Any) -> Any:
        tokens = kwargs.get("turn_tokens")
        seen.append((plan.conversation_id, None if tokens is None else len(tokens)))
        return commit(self, plan, **kwargs)

    monkeypatch.setattr(CraftPlanner, "commit", spy)
    chunks = tuple(make_chunk(f"passage {n} " * 20, id=n) for n in ("a", "b", "c"))
    trace = [
        TraceRequest(id="single", query="q1", chunks=chunks),
        TraceRequest(id="t1", query="q2", chunks=chunks[:2],
                     conversation_id=ConversationId("chat"), turn=1, answer="yes"),
        TraceRequest(id="t2", query="q3", chunks=chunks[1:],
                     conversation_id=ConversationId("chat"), turn=2, answer="no"),
    ]
    result = replay(trace, PlannerConfig(), HashingTokenizer())
    assert seen[0] == (None, None)
    assert [cid for cid, _ in seen[1:]] == ["chat", "chat"]
    assert all(n is not None and n > 20 for _, n in seen[1:])
    assert result.prefix_overlap >= 0  # the replay ran to the end
