"""CraftPlanner (issue 3, item 6): plan/commit, the paper's §4.2 and §4.3 examples, bad input,
KV events, persistence, threads, and random interleavings against the invariants."""

from __future__ import annotations

import json
import random
import threading
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import craft_rag.planner.planner as planner_module
from craft_rag.chunk import Chunk, make_chunk
from craft_rag.planner import CraftPlanner, Plan, PlannerConfig
from craft_rag.prefix_tree import KVLocation
from craft_rag.testing import FakeClock
from craft_rag.types import BlockHash, ChunkKey, ConversationId


def make_chunks(*names: str, tokens: int | None = None) -> list[Chunk]:
    return [make_chunk(f"text of {n}", id=n, num_tokens=tokens) for n in names]


def make_planner(clock: FakeClock | None = None, **config: object) -> CraftPlanner:
    return CraftPlanner(PlannerConfig(**config), clock=clock or FakeClock())


def chained_hashes(keys: tuple[ChunkKey, ...]) -> list[list[BlockHash]]:
    """One block per chunk whose hash names the whole prefix up to it, as an engine's chained
    block hashes do."""
    return [[BlockHash("/".join(keys[: i + 1]).encode())] for i in range(len(keys))]


def block(*path: str) -> BlockHash:
    return BlockHash("/".join(path).encode())


def tree_paths(planner: CraftPlanner) -> set[tuple[str, ...]]:
    return {tuple(p) for p in planner.prefix_tree.iter_paths()}


def counts(planner: CraftPlanner, *names: str) -> dict[str, int]:
    return {n: planner.access_table.count(ChunkKey(n)) for n in names}


# ---- the paper's §4.2 example, step by step ------------------------------------------------------


def test_paper_section_4_2_example_step_by_step() -> None:
    planner = make_planner(policy="frequency", threshold=2)
    gpu1 = KVLocation("gpu1", "device")
    assert planner.config.promotion_rule == "threshold"

    # "Assume the CA-Table contains C1 and C2 with access counts of 1, and the CP-Tree is empty."
    seed = planner.plan(make_chunks("C1", "C2"))
    planner.commit(seed, location=gpu1)
    assert counts(planner, "C1", "C2") == {"C1": 1, "C2": 1}
    assert len(planner.prefix_tree) == 0

    # Request [C1, C2, C5]: no prefix found; table -> C1:2, C2:2, C5:1; insert [C1, C2] on GPU1.
    p1 = planner.plan(make_chunks("C1", "C2", "C5", tokens=100))
    assert p1.keys == ("C1", "C2", "C5")
    assert p1.matched_chunks == 0
    r1 = planner.commit(p1, prefix_tokens=10, block_hashes=chained_hashes(p1.keys), location=gpu1)
    assert (r1.reused_chunks, r1.inserted_path) == (0, 2)
    assert counts(planner, "C1", "C2", "C5") == {"C1": 2, "C2": 2, "C5": 1}
    assert tree_paths(planner) == {("C1",), ("C1", "C2")}
    c1, c2 = planner.prefix_tree.match([ChunkKey("C1"), ChunkKey("C2")]).nodes
    assert c2.parent is c1
    assert c1.location == c2.location == gpu1
    assert (c1.token_start, c1.token_end, c2.token_start, c2.token_end) == (10, 110, 110, 210)
    planner._check_invariants()

    # Request [C1, C2, C6]: [C1, C2] is found and reused; C6 (count 1) does not extend the tree.
    p2 = planner.plan(make_chunks("C1", "C2", "C6", tokens=100))
    assert p2.keys == ("C1", "C2", "C6")
    assert (p2.matched_chunks, p2.matched_tokens) == (2, 210)
    r2 = planner.commit(
        p2, prefix_tokens=10, reused_chunks=2, block_hashes=chained_hashes(p2.keys), location=gpu1
    )
    assert (r2.reused_chunks, r2.inserted_path, r2.stale_nodes_removed) == (2, 0, 0)
    assert counts(planner, "C1", "C2", "C6") == {"C1": 3, "C2": 3, "C6": 1}
    assert tree_paths(planner) == {("C1",), ("C1", "C2")}

    # The same request again: [C1, C2] reused once more, C6 reaches T=2 -> extend with C6.
    p3 = planner.plan(make_chunks("C1", "C2", "C6", tokens=100))
    assert p3.keys == ("C1", "C2", "C6") and p3.matched_chunks == 2
    r3 = planner.commit(
        p3, prefix_tokens=10, reused_chunks=2, block_hashes=chained_hashes(p3.keys), location=gpu1
    )
    assert (r3.reused_chunks, r3.inserted_path) == (2, 3)
    assert counts(planner, "C1", "C2", "C6") == {"C1": 4, "C2": 4, "C6": 2}
    assert tree_paths(planner) == {("C1",), ("C1", "C2"), ("C1", "C2", "C6")}
    c6 = planner.prefix_tree.match([ChunkKey(k) for k in ("C1", "C2", "C6")]).nodes[2]
    assert (c6.token_start, c6.token_end, c6.location) == (210, 310, gpu1)
    assert [n.hit_count for n in planner.prefix_tree.match(list(p3.keys)).nodes] == [2, 2, 0]
    next_plan = planner.plan(make_chunks("C1", "C2", "C6", tokens=100))
    assert (next_plan.matched_chunks, next_plan.matched_tokens) == (3, 310)
    planner._check_invariants()

    # The KV of [C1, C2] moves from GPU1 to CPU memory: the entries are updated.
    cpu = KVLocation("gpu1", "cpu")
    assert planner.on_blocks_moved([block("C1"), block("C1", "C2")], cpu) == 2
    c1, c2, c6 = planner.prefix_tree.match(list(p3.keys)).nodes
    assert (c1.location, c2.location, c6.location) == (cpu, cpu, gpu1)

    # The KV is removed entirely: the nodes go (C2's descendants depend on it).
    assert planner.on_blocks_removed([block("C1", "C2")]) == 2
    assert tree_paths(planner) == {("C1",)}
    assert planner.plan(make_chunks("C1", "C2", "C6")).matched_chunks == 1
    assert planner.on_blocks_removed([block("C1"), block("unknown")]) == 1
    assert len(planner.prefix_tree) == 0
    planner._check_invariants()


# ---- the paper's §4.3 examples -------------------------------------------------------------------


def test_paper_section_4_3_two_turn_dedup() -> None:
    planner = make_planner(policy="frequency")
    t1 = planner.plan(make_chunks("C1", "C2", "C3"), conversation_id="conv")
    assert t1.turn == 1 and t1.removed_duplicates == ()
    planner.commit(t1)
    t2 = planner.plan(make_chunks("C2", "C3", "C4"), conversation_id="conv")
    assert t2.turn == 2
    assert t2.keys == ("C4",)  # only C4 is computed
    assert [c.key for c in t2.removed_duplicates] == ["C2", "C3"]  # ... and C2, C3 reported
    assert t2.matched_chunks == 0  # later turns extend the conversation's own prefix
    planner.commit(t2)
    assert planner.conversations.turns(ConversationId("conv")) == [("C1", "C2", "C3"), ("C4",)]
    # removed duplicates still count as retrieved in the CA-Table
    assert counts(planner, "C2", "C3", "C4") == {"C2": 2, "C3": 2, "C4": 1}
    assert planner.stats.chunks_removed_by_dedup == 2
    assert planner.stats.chunks_retrieved == 6


def test_paper_request_dedup_example() -> None:
    # Turn 1 [C1..C5]; turn 2 retrieves [C1, C3, C6, C7, C8] -> only C6, C7, C8 are sent.
    planner = make_planner(policy="retriever")
    planner.commit(planner.plan(make_chunks("C1", "C2", "C3", "C4", "C5"), conversation_id="c"))
    t2 = planner.plan(make_chunks("C1", "C3", "C6", "C7", "C8"), conversation_id="c")
    assert t2.keys == ("C6", "C7", "C8")
    assert [c.key for c in t2.removed_duplicates] == ["C1", "C3"]


def test_dedup_can_be_disabled() -> None:
    planner = make_planner(policy="retriever", dedup=False)
    planner.commit(planner.plan(make_chunks("A", "B"), conversation_id="c"))
    t2 = planner.plan(make_chunks("B", "C"), conversation_id="c")
    assert t2.keys == ("B", "C") and t2.removed_duplicates == () and t2.turn == 2


def test_end_conversation_forgets_sent_chunks() -> None:
    planner = make_planner()
    planner.commit(planner.plan(make_chunks("A"), conversation_id="c"))
    assert planner.end_conversation("c") is True
    assert planner.end_conversation("c") is False
    again = planner.plan(make_chunks("A"), conversation_id="c")
    assert again.keys == ("A",) and again.turn == 1


def test_conversation_ttl_expiry_through_the_planner() -> None:
    clock = FakeClock()
    planner = make_planner(clock, conversation_ttl_s=60.0)
    planner.commit(planner.plan(make_chunks("A"), conversation_id="c"))
    clock.tick(61)
    again = planner.plan(make_chunks("A"), conversation_id="c")
    assert again.keys == ("A",) and again.turn == 1


def test_only_new_chunks_of_a_turn_are_ordered() -> None:
    planner = make_planner(policy="frequency")
    for _ in range(3):
        planner.commit(planner.plan(make_chunks("Z")))  # Z is hot
    planner.commit(planner.plan(make_chunks("B", "A"), conversation_id="c"))
    t2 = planner.plan(make_chunks("A", "Y", "Z", "X"), conversation_id="c")
    assert t2.keys == ("Z", "X", "Y")
    assert planner.conversations.turns(ConversationId("c"))[0] == ("A", "B")


# ---- bad input -----------------------------------------------------------------------------------


def test_empty_request_gives_an_empty_plan() -> None:
    planner = make_planner()
    plan = planner.plan([])
    assert plan.ordered == () and plan.removed_duplicates == () and plan.repeated_in_request == ()
    assert (plan.matched_chunks, plan.matched_tokens, plan.turn) == (0, 0, 1)
    result = planner.commit(plan)
    assert (result.reused_chunks, result.inserted_path) == (0, 0)
    assert len(planner.prefix_tree) == 0
    planner._check_invariants()


def test_duplicates_within_a_request_keep_the_first_and_report_the_rest() -> None:
    planner = make_planner(policy="retriever")
    first = make_chunk("first text", id="x")
    second = make_chunk("second text", id="x")
    other = make_chunk("y text", id="y")
    third = make_chunk("third text", id="x")
    plan = planner.plan([first, other, second, third])
    assert plan.ordered == (first, other)
    assert plan.ordered[0].text == "first text"
    assert plan.repeated_in_request == (second, third)
    assert plan.retrieved_count == 4
    planner.commit(plan)
    assert planner.access_table.count(ChunkKey("x")) == 1
    assert planner.stats.chunks_repeated_in_request == 2


def test_content_keyed_duplicates_are_detected() -> None:
    planner = make_planner()
    plan = planner.plan([make_chunk("same"), make_chunk("other"), make_chunk("same")])
    assert len(plan.ordered) == 2 and len(plan.repeated_in_request) == 1


@pytest.mark.parametrize("item", ["a string", {"id": "x", "text": "t"}, None, 3])
def test_non_chunk_items_are_rejected_with_a_fix(item: object) -> None:
    planner = make_planner()
    with pytest.raises(ValueError, match=r"chunks\[1\].*make_chunk"):
        planner.plan([make_chunk("ok"), item])
    assert planner.stats.plans == 0


@pytest.mark.parametrize("conv", [5, "", b"c"])
def test_bad_conversation_id(conv: object) -> None:
    with pytest.raises(ValueError, match="conversation_id"):
        make_planner().plan(make_chunks("A"), conversation_id=conv)


def test_committing_a_plan_twice_is_misuse() -> None:
    planner = make_planner()
    plan = planner.plan(make_chunks("A", "B"))
    planner.commit(plan)
    before = json.dumps(planner.to_json())
    with pytest.raises(RuntimeError, match="already committed"):
        planner.commit(plan)
    assert json.dumps(planner.to_json()) == before
    assert planner.stats.commits == 1


def test_a_plan_from_another_planner_is_refused() -> None:
    a, b = make_planner(), make_planner()
    plan = a.plan(make_chunks("A"))
    own = b.plan(make_chunks("B"))
    assert plan.plan_id == own.plan_id == 1  # ids count per planner
    with pytest.raises(RuntimeError, match="another CraftPlanner"):
        b.commit(plan)
    b.commit(own)  # b's own plan with the same id is untouched
    a.commit(plan)
    assert a.access_table.count(ChunkKey("A")) == 1 and b.access_table.count(ChunkKey("A")) == 0


def test_a_plan_made_before_save_cannot_be_committed_after_load() -> None:
    planner = make_planner()
    in_flight = planner.plan(make_chunks("A"))
    loaded = CraftPlanner.from_json(planner.to_json())
    fresh = loaded.plan(make_chunks("B"))
    assert fresh.plan_id == in_flight.plan_id
    with pytest.raises(RuntimeError, match="loaded"):
        loaded.commit(in_flight)
    loaded.commit(fresh)


def test_too_old_plans_cannot_be_committed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(planner_module, "_MAX_PENDING", 2)
    planner = make_planner()
    oldest = planner.plan(make_chunks("A"))
    planner.plan(make_chunks("B"))
    newest = planner.plan(make_chunks("C"))
    with pytest.raises(RuntimeError, match="too old"):
        planner.commit(oldest)
    planner.commit(newest)


def test_a_plan_never_committed_changes_nothing() -> None:
    planner = make_planner(policy="tree")
    planner.commit(planner.plan(make_chunks("A", "B")))
    before = json.dumps(planner.to_json())
    planner.plan(make_chunks("A", "B", "C"), conversation_id="c")
    assert json.dumps(planner.to_json()) == before


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"chunk_token_counts": [1]}, "chunk_token_counts"),
        ({"block_hashes": [[]]}, "block_hashes"),
        ({"reused_chunks": 3}, "reused_chunks"),
        ({"reused_chunks": -1}, "reused_chunks"),
    ],
)
def test_commit_rejects_mismatched_arguments(kwargs: dict[str, object], message: str) -> None:
    planner = make_planner()
    plan = planner.plan(make_chunks("A", "B"))
    with pytest.raises(ValueError, match=message):
        planner.commit(plan, **kwargs)
    planner.commit(plan)  # a rejected commit leaves the plan committable


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"policy": "random"}, "policy"),
        ({"promotion": "always"}, "promotion"),
        ({"threshold": 0}, "threshold"),
        ({"threshold": 1.5}, "threshold"),
    ],
)
def test_bad_config(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        PlannerConfig(**kwargs)


def test_default_promotion_rule_per_policy() -> None:
    assert PlannerConfig(policy="tree").promotion_rule == "served"
    assert PlannerConfig(policy="frequency").promotion_rule == "threshold"
    assert PlannerConfig(policy="retriever").promotion_rule == "threshold"
    assert PlannerConfig(policy="frequency", promotion="served").promotion_rule == "served"


def test_unicode_ids_and_text() -> None:
    planner = make_planner(policy="tree")
    chunks = [make_chunk("東京は日本の首都です", id="文書:0"), make_chunk("🗼 Tokyo tower")]
    plan = planner.plan(chunks, conversation_id="会話-1")
    planner.commit(plan)
    again = planner.plan(list(reversed(chunks)))
    assert again.keys == plan.keys and again.matched_chunks == 2
    loaded = CraftPlanner.from_json(json.loads(json.dumps(planner.to_json())))
    assert loaded.to_json() == planner.to_json()


@pytest.mark.parametrize("policy", ["retriever", "frequency", "tree"])
def test_10000_chunks_in_one_request(policy: str) -> None:
    planner = make_planner(policy=policy, threshold=1)
    chunks = [make_chunk(id=f"doc-{i}:0", num_tokens=3) for i in range(10_000)]
    # Correctness at size only: its cost is measured by `craft-rag bench overhead`, not here.
    for _ in range(3):
        plan = planner.plan(chunks)
        planner.commit(plan, prefix_tokens=5)
    assert len(plan.ordered) == 10_000
    assert plan.matched_chunks == 10_000
    assert plan.matched_tokens == 5 + 3 * 10_000
    planner._check_invariants()


# ---- commit details ------------------------------------------------------------------------------


def test_commit_removes_stale_nodes_the_engine_no_longer_had() -> None:
    planner = make_planner(policy="retriever", threshold=1)
    planner.commit(planner.plan(make_chunks("A", "B", "C")))
    assert len(planner.prefix_tree) == 3
    plan = planner.plan(make_chunks("A", "B", "C"))
    assert plan.matched_chunks == 3
    result = planner.commit(plan, reused_chunks=1)
    assert result.reused_chunks == 1
    assert result.stale_nodes_removed == 2
    # threshold rule: [A] reused, next chunk B is hot -> [A, B] is inserted again
    assert result.inserted_path == 2
    assert tree_paths(planner) == {("A",), ("A", "B")}
    assert planner.stats.predicted_chunks == 3 and planner.stats.reused_chunks == 1


def test_commit_with_explicit_token_counts() -> None:
    planner = make_planner(policy="retriever", threshold=1)
    plan = planner.plan(make_chunks("A", "B"))
    planner.commit(plan, prefix_tokens=4, chunk_token_counts=[6, 10])
    assert planner.plan(make_chunks("A", "B")).matched_tokens == 20
    assert planner.plan(make_chunks("A", "Z")).matched_tokens == 10


def test_unknown_token_counts_give_unknown_matched_tokens() -> None:
    planner = make_planner(policy="retriever", threshold=1)
    planner.commit(planner.plan(make_chunks("A")))
    plan = planner.plan(make_chunks("A"))
    assert plan.matched_chunks == 1 and plan.matched_tokens is None


def test_all_blocks_cleared_empties_the_tree_but_not_the_table() -> None:
    planner = make_planner(policy="tree")
    planner.commit(planner.plan(make_chunks("A", "B")))
    planner.on_all_blocks_cleared()
    assert len(planner.prefix_tree) == 0
    assert planner.access_table.count(ChunkKey("A")) == 1
    assert planner.plan(make_chunks("A", "B")).matched_chunks == 0


def test_tree_policy_gives_a_repeated_set_its_served_order() -> None:
    planner = make_planner(policy="tree")
    first = planner.plan(make_chunks("D", "B", "C", "A"))
    planner.commit(first)
    for names in (["B", "X"], ["B", "Y"], ["C", "Y"]):  # counts drift between repeats
        planner.commit(planner.plan(make_chunks(*names)))
    repeat = planner.plan(make_chunks("A", "C", "D", "B"))
    assert repeat.keys == first.keys
    assert repeat.matched_chunks == 4


# ---- persistence ---------------------------------------------------------------------------------


def _drive(planner: CraftPlanner, requests: list[tuple[list[str], str | None]]) -> list[Plan]:
    plans = []
    for names, conv in requests:
        plan = planner.plan(make_chunks(*names, tokens=5), conversation_id=conv)
        planner.commit(plan, prefix_tokens=3, block_hashes=chained_hashes(plan.keys))
        plans.append(plan)
    return plans


def _plan_view(plan: Plan) -> tuple[object, ...]:
    return (
        plan.keys,
        tuple(c.key for c in plan.removed_duplicates),
        tuple(c.key for c in plan.repeated_in_request),
        plan.matched_chunks,
        plan.matched_tokens,
        plan.turn,
        plan.policy,
    )


@pytest.mark.parametrize("policy", ["retriever", "frequency", "tree"])
def test_save_load_round_trip_gives_the_same_future_plans(policy: str, tmp_path: Path) -> None:
    rng = random.Random(7)
    names = [f"k{i}" for i in range(9)]

    def requests(n: int) -> list[tuple[list[str], str | None]]:
        return [
            (rng.sample(names, rng.randint(1, 5)), rng.choice([None, None, "c1", "c2"]))
            for _ in range(n)
        ]

    clock = FakeClock()  # coarse: many equal access times
    config = {"policy": policy, "window": 6, "max_tree_nodes": 7, "max_conversations": 1}
    original = make_planner(clock, **config)
    _drive(original, requests(30))
    path = tmp_path / "state.json"
    original.save(path)
    assert not path.with_suffix(".json.tmp").exists()
    loaded = CraftPlanner.load(path, clock=clock)
    loaded._check_invariants()
    assert loaded.to_json() == original.to_json()
    assert loaded.config == original.config
    future = requests(40)
    assert [_plan_view(p) for p in _drive(loaded, future)] == [
        _plan_view(p) for p in _drive(original, future)
    ]
    assert loaded.to_json() == original.to_json()


def test_load_rejects_foreign_state(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"format": "craft-rag/access-table/v1"}))
    with pytest.raises(ValueError, match="planner"):
        CraftPlanner.load(path)


# ---- threads -------------------------------------------------------------------------------------


def test_concurrent_plan_and_commit_keep_state_consistent() -> None:
    planner = CraftPlanner(PlannerConfig(policy="tree", window=50, max_tree_nodes=40))
    errors: list[BaseException] = []
    per_thread = 300

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for i in range(per_thread):
                names = rng.sample([f"k{j}" for j in range(12)], rng.randint(1, 5))
                conv = f"t{seed}" if i % 3 == 0 else None
                plan = planner.plan(make_chunks(*names), conversation_id=conv)
                planner.commit(plan, reused_chunks=rng.randint(0, plan.matched_chunks))
                if i % 50 == 0:
                    planner.on_blocks_removed([block("k1")])
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert planner.stats.plans == planner.stats.commits == 4 * per_thread
    planner._check_invariants()


# ---- state machine: random plan/commit interleavings ---------------------------------------------

KEYS = ["K1", "K2", "K3", "K4", "K5", "K6"]
CONVS = [None, "a", "b"]
TOKENS = {k: 2 + i for i, k in enumerate(KEYS)}  # one tokenizer: a chunk's length is fixed


class PlannerMachine(RuleBasedStateMachine):
    @initialize(
        policy=st.sampled_from(["retriever", "frequency", "tree"]),
        promotion=st.sampled_from([None, "threshold", "served"]),
        window=st.integers(1, 4),
        threshold=st.integers(1, 3),
        max_nodes=st.integers(1, 8),
        max_conversations=st.integers(1, 2),
        ttl=st.sampled_from([None, 3.0]),
        dedup=st.booleans(),
    )
    def setup(
        self,
        policy: str,
        promotion: str | None,
        window: int,
        threshold: int,
        max_nodes: int,
        max_conversations: int,
        ttl: float | None,
        dedup: bool,
    ) -> None:
        self.clock = FakeClock()
        self.planner = CraftPlanner(
            PlannerConfig(
                policy=policy,
                promotion=promotion,
                window=window,
                threshold=threshold,
                max_tree_nodes=max_nodes,
                max_conversations=max_conversations,
                conversation_ttl_s=ttl,
                dedup=dedup,
            ),
            clock=self.clock,
        )
        self.pending: list[Plan] = []
        self.committed: list[Plan] = []
        self.dead: list[Plan] = []  # aborted, or abandoned after the conversation TTL
        self.made_at: dict[int, float] = {}
        # conversation -> its plan in flight (issue 11 item 11: one at a time)
        self.blocking: dict[str, Plan] = {}
        # every chunk committed in a conversation since its last end_conversation()
        self.ever: dict[str, set[str]] = {c: set() for c in CONVS if c is not None}

    def ready(self) -> bool:
        return hasattr(self, "planner")

    @precondition(ready)
    @rule(names=st.lists(st.sampled_from(KEYS), max_size=7), conv=st.sampled_from(CONVS))
    def plan(self, names: list[str], conv: str | None) -> None:
        chunks = [make_chunk(f"text {n}", id=n, num_tokens=TOKENS[n]) for n in names]
        blocker = self.blocking.get(conv) if conv is not None else None
        if blocker is not None:
            ttl = self.planner.config.conversation_ttl_s
            if ttl is None or self.clock.now - self.made_at[blocker.plan_id] <= ttl:
                before = self.planner.to_json()
                with pytest.raises(RuntimeError, match="has a plan in flight"):
                    self.planner.plan(chunks, conversation_id=conv)
                assert self.planner.to_json() == before
                return
            # Older than the TTL: the next plan of the conversation abandons it.
            self.pending.remove(blocker)
            self.dead.append(blocker)
            assert conv is not None
            del self.blocking[conv]
        expected_match = None
        if conv is None or self.planner.conversations.turn_count(conv) == 0:
            expected_match = self.planner.prefix_tree.match(
                [ChunkKey(n) for n in dict.fromkeys(names)]
            )
        plan = self.planner.plan(chunks, conversation_id=conv)
        # every input chunk is in exactly one of the three lists
        parts = [*plan.ordered, *plan.removed_duplicates, *plan.repeated_in_request]
        assert sorted(map(id, parts)) == sorted(map(id, chunks))
        assert len(set(plan.keys)) == len(plan.keys)
        first_seen = list(dict.fromkeys(names))
        assert sorted([*plan.keys, *(c.key for c in plan.removed_duplicates)]) == sorted(first_seen)
        assert Counter(c.key for c in plan.repeated_in_request) == Counter(names) - Counter(
            first_seen
        )
        removed = {c.key for c in plan.removed_duplicates}
        if conv is None or not self.planner.config.dedup:
            assert removed == set()
        else:
            # dedup never removes a chunk not sent earlier in this conversation
            assert removed <= self.ever[conv]
        if plan.turn == 1:
            assert expected_match is not None
            ordered_match = self.planner.prefix_tree.match(list(plan.keys))
            assert plan.matched_chunks == ordered_match.length
            if self.planner.config.policy == "tree":
                assert plan.matched_chunks >= expected_match.length
        else:
            assert plan.matched_chunks == 0
        self.pending.append(plan)
        self.made_at[plan.plan_id] = self.clock.now
        if conv is not None:
            self.blocking[conv] = plan
            assert self.planner.in_flight(conv)

    def _settled(self, plan: Plan) -> None:
        conv = plan.conversation_id
        if conv is not None and self.blocking.get(conv) is plan:
            del self.blocking[conv]

    @precondition(lambda self: hasattr(self, "planner") and self.pending)
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        plan = self.pending.pop(data.draw(st.integers(0, len(self.pending) - 1)))
        self._settled(plan)
        live = self.planner.prefix_tree.match(list(plan.keys)).length if plan.turn == 1 else 0
        reused = data.draw(st.one_of(st.none(), st.integers(0, len(plan.keys))))
        # One prompt head for the planner's life: the CP-Tree keys paths by chunks only, so a
        # node's token span assumes the same number of tokens before the first chunk.
        kwargs: dict[str, object] = {"prefix_tokens": 7}
        if data.draw(st.booleans()):
            kwargs["block_hashes"] = chained_hashes(plan.keys)
        result = self.planner.commit(plan, reused_chunks=reused, **kwargs)
        expected_reuse = live if reused is None else min(live, reused)
        assert result.reused_chunks == expected_reuse
        if plan.conversation_id is not None:
            self.ever[plan.conversation_id] |= set(plan.keys)
        self.committed.append(plan)

    @precondition(lambda self: hasattr(self, "planner") and self.committed)
    @rule(data=st.data())
    def commit_again_is_misuse(self, data: st.DataObject) -> None:
        plan = data.draw(st.sampled_from(self.committed + self.dead))
        before = self.planner.to_json()
        with pytest.raises(RuntimeError):
            self.planner.commit(plan)
        assert not self.planner.abort(plan)
        assert self.planner.to_json() == before

    @precondition(lambda self: hasattr(self, "planner") and self.pending)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        plan = self.pending.pop(data.draw(st.integers(0, len(self.pending) - 1)))
        self._settled(plan)
        before = self.planner.to_json()
        assert self.planner.abort(plan)
        assert self.planner.to_json() == before
        self.dead.append(plan)

    @precondition(ready)
    @rule(paths=st.lists(st.lists(st.sampled_from(KEYS), min_size=1, max_size=3), max_size=3))
    def blocks_removed(self, paths: list[list[str]]) -> None:
        before = len(self.planner.prefix_tree)
        removed = self.planner.on_blocks_removed([block(*p) for p in paths])
        assert len(self.planner.prefix_tree) == before - removed

    @precondition(ready)
    @rule(path=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3))
    def blocks_moved(self, path: list[str]) -> None:
        moved = self.planner.on_blocks_moved([block(*path)], KVLocation("g1", "cpu"))
        assert moved in (0, 1)

    @precondition(ready)
    @rule()
    def all_cleared(self) -> None:
        self.planner.on_all_blocks_cleared()
        assert len(self.planner.prefix_tree) == 0

    @precondition(ready)
    @rule(conv=st.sampled_from(["a", "b"]))
    def end_conversation(self, conv: str) -> None:
        self.planner.end_conversation(conv)
        self.ever[conv] = set()
        # Its plan in flight stays committable but no longer blocks the conversation.
        self.blocking.pop(conv, None)

    @precondition(ready)
    @rule(by=st.sampled_from([0.0, 1.0, 2.5]))
    def tick(self, by: float) -> None:
        self.clock.tick(by)

    @precondition(ready)
    @rule(names=st.lists(st.sampled_from(KEYS), max_size=5), conv=st.sampled_from(CONVS))
    def save_load_gives_the_same_future(self, names: list[str], conv: str | None) -> None:
        if conv is not None and conv in self.blocking:
            conv = None  # the twin has no plans in flight; this planner would refuse
        data = json.loads(json.dumps(self.planner.to_json()))
        twin = CraftPlanner.from_json(data, clock=self.clock)
        twin._check_invariants()
        assert twin.to_json() == data
        chunks = [make_chunk(f"text {n}", id=n, num_tokens=TOKENS[n]) for n in names]
        mine, theirs = self.planner.plan(chunks, conv), twin.plan(chunks, conv)
        assert _plan_view(mine) == _plan_view(theirs)
        self.planner.commit(mine, prefix_tokens=7, block_hashes=chained_hashes(mine.keys))
        twin.commit(theirs, prefix_tokens=7, block_hashes=chained_hashes(theirs.keys))
        # A conversation with a plan in flight is held (never evicted) by this planner only:
        # the twin has no plans in flight. Everything else agrees.
        assert _without(twin.to_json(), self.blocking) == _without(
            self.planner.to_json(), self.blocking
        )
        if conv is not None:
            self.ever[conv] |= set(mine.keys)
        self.committed.append(mine)

    @precondition(ready)
    @invariant()
    def invariants_hold(self) -> None:
        self.planner._check_invariants()
        stats = self.planner.stats
        assert stats.commits == len(self.committed)
        assert stats.plans == len(self.committed) + len(self.pending) + len(self.dead)


def _without(state: dict[str, Any], held: Iterable[str]) -> dict[str, Any]:
    """Planner JSON without the conversations in ``held``."""
    skip = set(held)
    conversations = dict(state["conversations"])
    conversations["conversations"] = [
        c for c in conversations["conversations"] if c["id"] not in skip
    ]
    return {**state, "conversations": conversations}


PlannerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
TestPlannerMachine = PlannerMachine.TestCase
