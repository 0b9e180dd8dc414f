"""One contract suite over every store backend (memory://, sqlite://, redis://).

The raw interface (log, conversation check, TTL, namespaces, snapshots) and the planner on top
of it: planners sharing a store hold exactly the state of one local planner serving the same
requests in the same order, and every invariant holds after every step.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import pytest

from craft_rag import Chunk, CraftPlanner, PlannerConfig, make_chunk
from craft_rag.stores import (
    STORE_SCHEMES,
    ConversationConflict,
    StateStore,
    StoreCorrupted,
    namespace_for_salt,
)
from craft_rag.stores.shared import CommitEntry, config_fingerprint, decode_entry

FP = config_fingerprint(PlannerConfig())
StoreFactory = Callable[..., StateStore]


def make_chunks(n: int) -> list[Chunk]:
    return [make_chunk(f"text {i}", id=f"doc-{i}", num_tokens=10 + i) for i in range(n)]


def state_of(planner: CraftPlanner) -> tuple[object, ...]:
    """What must agree between workers: counts, cached orders (with spans), conversations."""
    tree = planner.prefix_tree
    paths = sorted(
        (n.path(), n.token_start, n.token_end)
        for n in _nodes(tree)
    )
    convs = planner.conversations.to_json()["conversations"]
    return (
        dict(planner.access_table._counts),
        planner.access_table.requests_in_window,
        paths,
        [(c["id"], c["turns"]) for c in convs],
    )


def _nodes(tree: object) -> list:  # type: ignore[type-arg]
    out = []
    stack = list(tree.root.children.values())  # type: ignore[attr-defined]
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out


def test_every_scheme_is_registered() -> None:
    assert set(STORE_SCHEMES) == {"memory", "sqlite", "redis", "rediss"}


# ---- the raw interface ---------------------------------------------------------------------------


def test_log_is_contiguous_and_read_returns_the_tail(make_store: StoreFactory) -> None:
    store = make_store()
    store.attach("ns", FP)
    for i in range(5):
        read = store.append("ns", f'"e{i}"', since=i)
        assert read.head == i + 1
        assert [e.seq for e in read.entries] == [i + 1]
    other = make_store()
    read = other.read("ns", 2)
    assert read.head == 5 and read.snapshot is None
    assert [(e.seq, e.data) for e in read.entries] == [(3, '"e2"'), (4, '"e3"'), (5, '"e4"')]
    assert other.read("ns", 5).entries == ()


def test_append_returns_what_the_caller_missed(make_store: StoreFactory) -> None:
    a, b = make_store(), make_store()
    a.attach("ns", FP)
    a.append("ns", "1", since=0)
    a.append("ns", "2", since=1)
    read = b.append("ns", "3", since=0)
    assert [e.data for e in read.entries] == ["1", "2", "3"] and read.head == 3


def test_conversation_check_refuses_a_stale_turn_and_adds_nothing(
    make_store: StoreFactory,
) -> None:
    store = make_store()
    store.attach("ns", FP)
    store.append("ns", "1", since=0, conversation="chat", not_after=0)
    store.append("ns", "2", since=1)  # another conversation's entry does not matter
    store.append("ns", "3", since=2, conversation="chat", not_after=2)
    with pytest.raises(ConversationConflict, match=r"'chat' moved on.*seq 3"):
        store.append("ns", "4", since=3, conversation="chat", not_after=2)
    assert store.read("ns", 0).head == 3
    # Unchecked appends (end of a conversation) always go through.
    assert store.append("ns", "5", since=3, conversation="chat", not_after=None).head == 4


def test_conversation_record_expires_after_its_ttl(make_store: StoreFactory) -> None:
    store = make_store()
    store.attach("ns", FP)
    # The conflicting append must land inside the TTL: 1 s, not 0.2 s, so one scheduler stall
    # on a loaded 2-core CI machine cannot expire the record before it (a flaky pass/fail).
    ttl = 1.0
    store.append("ns", "1", since=0, conversation="chat", not_after=0, ttl_s=ttl)
    written = time.monotonic()  # the record expires at most ttl after this
    with pytest.raises(ConversationConflict):
        store.append("ns", "2", since=1, conversation="chat", not_after=0, ttl_s=ttl)
    time.sleep(max(0.0, written + ttl + 0.15 - time.monotonic()))
    assert store.append("ns", "2", since=1, conversation="chat", not_after=0).head == 2


def test_namespaces_are_isolated(make_store: StoreFactory) -> None:
    store = make_store()
    a, b = namespace_for_salt("tenant-a"), namespace_for_salt("tenant-b")
    store.attach(a, FP)
    store.attach(b, FP)
    store.append(a, "secret-of-a", since=0, conversation="chat", not_after=0)
    assert store.read(b, 0).head == 0 and store.read(b, 0).entries == ()
    # Same conversation id in another tenant: no conflict, separate records.
    store.append(b, "b1", since=0, conversation="chat", not_after=0)
    store.clear(a)
    assert store.read(a, 0).head == 0
    assert [e.data for e in store.read(b, 0).entries] == ["b1"]


def test_another_config_on_a_namespace_is_refused(make_store: StoreFactory) -> None:
    store = make_store()
    CraftPlanner(PlannerConfig(window=100), store=store, namespace="ns")
    with pytest.raises(StoreCorrupted, match=r"another planner config.*same PlannerConfig"):
        CraftPlanner(PlannerConfig(window=200), store=make_store(), namespace="ns")
    CraftPlanner(PlannerConfig(window=200), store=make_store(), namespace="other")


def test_snapshot_trims_the_log_and_late_readers_resume_from_it(make_store: StoreFactory) -> None:
    chunks = make_chunks(12)
    rng = random.Random(3)
    early = CraftPlanner(store=make_store(snapshot_every=4), namespace="ns")
    worker = CraftPlanner(store=make_store(snapshot_every=4), namespace="ns")
    solo = CraftPlanner()
    for i in range(21):
        request = rng.sample(chunks, 5)
        conv = "chat" if i % 3 == 0 else None
        plan, ref = worker.plan(request, conv), solo.plan(request, conv)
        assert plan.keys == ref.keys
        worker.commit(plan, prefix_tokens=7)
        solo.commit(ref, prefix_tokens=7)
    store = make_store(snapshot_every=4)
    # Bounded log: snapshots at 4, 8, ..., 20; entries before 17 are gone.
    read = store.read("ns", 20)
    assert read.head == 21 and [e.seq for e in read.entries] == [21]
    assert store._snapshot("ns").seq == 20  # type: ignore[union-attr]
    assert store._range("ns", 0)[1][0].seq == 17
    # A planner that saw nothing since seq 0 loads the snapshot, then the tail.
    early.sync()
    late = CraftPlanner(store=make_store(snapshot_every=4), namespace="ns")
    for planner in (worker, early, late):
        planner._check_invariants()
        assert state_of(planner) == state_of(solo)


def test_a_flushed_store_is_an_error_not_a_silent_reset(make_store: StoreFactory) -> None:
    planner = CraftPlanner(store=make_store(), namespace="ns")
    planner.commit(planner.plan(make_chunks(3)))
    make_store().clear("ns")
    with pytest.raises(StoreCorrupted, match=r"went back from seq 1 to 0.*restart every worker"):
        planner.plan(make_chunks(3))


def test_a_foreign_entry_is_an_error_naming_the_seq(make_store: StoreFactory) -> None:
    planner = CraftPlanner(store=make_store(), namespace="ns")
    make_store().append("ns", '{"v": "c", "k": "not a list"}', since=0)
    with pytest.raises(StoreCorrupted, match=r"namespace 'ns'.*log entry 1 is not a craft-rag"):
        planner.sync()


def test_entry_codec_round_trips() -> None:
    from craft_rag.prefix_tree import KVLocation, NodeMetadata
    from craft_rag.stores import LogEntry
    from craft_rag.types import BlockHash, ChunkKey, ConversationId

    entry = CommitEntry(
        (ChunkKey("a"), ChunkKey("b")), (ChunkKey("c"),), 2, ConversationId("x"), 1,
        (NodeMetadata((0, 5), (BlockHash(b"\x01\x02"),)), NodeMetadata(None, None)),
        KVLocation("r1", "cpu"), 12.5,
    )
    assert decode_entry(LogEntry(1, entry.to_json()), "here") == entry


# ---- planners sharing a store ---------------------------------------------------------------


@pytest.mark.parametrize("policy", ["tree", "frequency"])
def test_workers_hold_the_state_of_one_planner(make_store: StoreFactory, policy: str) -> None:
    """Three planners share a store, requests go round-robin; after every step each plan equals
    the one local planner's and every invariant holds; at the end all states are equal."""
    config = PlannerConfig(policy=policy, window=25, max_tree_nodes=40, max_conversations=4)
    workers = [CraftPlanner(config, store=make_store(), namespace="ns") for _ in range(3)]
    solo = CraftPlanner(config)
    chunks = make_chunks(30)
    rng = random.Random(7)
    for i in range(120):
        request = rng.sample(chunks[: rng.choice((8, 30))], rng.randint(1, 6))
        conv = rng.choice([None, None, "c1", "c2", "c3", "c4", "c5"])
        worker = workers[i % 3]
        plan, ref = worker.plan(request, conv), solo.plan(request, conv)
        got_plan = (plan.keys, plan.turn, plan.matched_chunks)
        assert got_plan == (ref.keys, ref.turn, ref.matched_chunks)
        assert [c.key for c in plan.removed_duplicates] == [c.key for c in ref.removed_duplicates]
        reused = rng.choice([None, 0, len(plan.ordered)])
        got = worker.commit(plan, prefix_tokens=3, reused_chunks=reused)
        want = solo.commit(ref, prefix_tokens=3, reused_chunks=reused)
        assert got == want
        worker._check_invariants()
        if rng.random() < 0.05 and conv is not None:
            assert worker.end_conversation(conv) == solo.end_conversation(conv)
    for worker in workers:
        worker.sync()
        worker._check_invariants()
        assert state_of(worker) == state_of(solo)


def test_a_turn_planned_on_two_workers_is_committed_once(make_store: StoreFactory) -> None:
    a = CraftPlanner(store=make_store(), namespace="ns")
    b = CraftPlanner(store=make_store(), namespace="ns")
    chunks = make_chunks(6)
    a.commit(a.plan(chunks[:3], "chat"))
    plan_a, plan_b = a.plan(chunks[1:5], "chat"), b.plan(chunks[1:5], "chat")
    assert plan_b.turn == 2 and [c.key for c in plan_b.removed_duplicates] == ["doc-1", "doc-2"]
    a.commit(plan_a)
    with pytest.raises(RuntimeError, match=r"moved on.*plan the turn again"):
        b.commit(plan_b)
    with pytest.raises(RuntimeError, match="already committed"):
        b.commit(plan_b)
    again = b.plan(chunks[1:6], "chat")
    assert again.turn == 3 and [c.key for c in again.ordered] == ["doc-5"]
    b.commit(again)
    a.sync()
    assert a.conversations.turns("chat") == b.conversations.turns("chat")  # type: ignore[arg-type]
    assert len(b.conversations.turns("chat")) == 3  # type: ignore[arg-type]


def test_ending_a_conversation_reaches_every_worker(make_store: StoreFactory) -> None:
    a = CraftPlanner(store=make_store(), namespace="ns")
    b = CraftPlanner(store=make_store(), namespace="ns")
    chunks = make_chunks(3)
    a.commit(a.plan(chunks, "chat"))
    assert b.plan(chunks, "chat").turn == 2
    assert b.end_conversation("chat") is True
    assert b.end_conversation("chat") is False
    plan = a.plan(chunks, "chat")
    assert plan.turn == 1 and len(plan.ordered) == 3


def test_a_plan_never_committed_writes_nothing(make_store: StoreFactory) -> None:
    planner = CraftPlanner(store=make_store(), namespace="ns")
    for i in range(3):
        planner.plan(make_chunks(4), f"chat-{i}")
        planner.plan(make_chunks(4))
    assert make_store().read("ns", 0).head == 0


def test_tenants_share_no_state(make_store: StoreFactory) -> None:
    """Planners of two salts on one store: nothing committed by one is seen by the other."""
    a = CraftPlanner(store=make_store(), namespace=namespace_for_salt("a"))
    b = CraftPlanner(store=make_store(), namespace=namespace_for_salt("b"))
    chunks = make_chunks(4)
    a.commit(a.plan(chunks, "chat"), prefix_tokens=2)
    plan = b.plan(chunks, "chat")
    assert plan.turn == 1 and plan.matched_chunks == 0 and len(plan.removed_duplicates) == 0
    assert len(b.access_table) == 0 and len(b.prefix_tree) == 0
