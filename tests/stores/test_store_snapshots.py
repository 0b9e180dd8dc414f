"""Snapshots on every backend: bounded (no token ids), written outside the planner lock, and a
worker loading one keeps its own conversations' token ids."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from craft_rag import Chunk, CraftPlanner, PlannerConfig, make_chunk
from craft_rag.stores import MemoryStore, Snapshot, StateStore
from craft_rag.stores.histories import load_history, save_history

CONFIG = PlannerConfig(policy="tree", window=30, max_tree_nodes=60, max_conversations=60)
StoreFactory = Callable[..., StateStore]
TURN_TOKENS = 2000


def chunks(*ids: int) -> list[Chunk]:
    return [make_chunk(f"passage {i}", id=f"doc-{i}", num_tokens=5 + i) for i in ids]


def test_loading_a_snapshot_keeps_the_workers_own_token_ids(make_store: StoreFactory) -> None:
    mine = CraftPlanner(CONFIG, store=make_store(snapshot_every=4))
    other = CraftPlanner(CONFIG, store=make_store(snapshot_every=4))
    ids = list(range(10, 40))
    mine.commit(mine.plan(chunks(1, 2), "chat"), turn_tokens=ids)
    for i in range(9):  # snapshots at 4 and 8; the log before 5 is trimmed
        other.commit(other.plan(chunks(i % 5, 5 + i % 3)), prefix_tokens=1)
    assert make_store(snapshot_every=4).read("default", 1).snapshot is not None
    mine.sync()  # behind the trim point: loads the snapshot, which holds no token ids
    history = mine.conversations.history("chat")  # type: ignore[arg-type]
    assert history is not None and history.turns == (tuple(ids),)
    plan = mine.plan(chunks(2, 3), "chat")  # its next turn renders from them
    assert plan.turn == 2 and [c.key for c in plan.removed_duplicates] == ["doc-2"]
    mine.commit(plan, turn_tokens=[1, 2, 3])
    other.sync()
    assert other.committed_turns("chat") == 2


def test_snapshots_hold_no_token_ids_and_late_readers_get_them_from_histories(
    make_store: StoreFactory,
) -> None:
    """40 conversations of two 2,000-token turns: the snapshot holds their chunk keys only
    (a few KB, not the ~160,000 token ids); a late reader fills a conversation's ids from its
    stored history record."""
    worker = CraftPlanner(CONFIG, store=make_store(snapshot_every=80))
    for turn in range(2):
        for c in range(40):
            conv = f"chat-{c}"
            load_history(worker, conv)
            plan = worker.plan(chunks(c % 9, 9 + turn), conv)
            worker.commit(plan, turn_tokens=[c * 7 + turn] * TURN_TOKENS, prefix_tokens=3)
            save_history(worker, conv)
    snapshot = make_store(snapshot_every=80)._snapshot("default")
    assert snapshot is not None and snapshot.seq == 80
    state = json.loads(snapshot.state)
    assert all("tokens" not in c for c in state["conversations"]["conversations"])
    assert len(snapshot.state) < 20_000, len(snapshot.state)  # 160,000 ids would be ~800 KB
    late = CraftPlanner(CONFIG, store=make_store(snapshot_every=80))
    late._check_invariants()
    assert late.committed_turns("chat-7") == 2
    assert load_history(late, "chat-7")
    history = late.conversations.history("chat-7")  # type: ignore[arg-type]
    assert history is not None and history.turns == (
        (7 * 7,) * TURN_TOKENS, (7 * 7 + 1,) * TURN_TOKENS,
    )


class _WatchedStore(MemoryStore):
    """A memory store that notes whether the planner's lock was held while it wrote a
    snapshot."""

    planner: CraftPlanner | None = None
    locked: list[bool]

    def put_snapshot(self, namespace: str, snapshot: Snapshot, keep_from: int) -> None:
        assert self.planner is not None
        self.locked.append(self.planner._lock.locked())
        super().put_snapshot(namespace, snapshot, keep_from)


def test_snapshots_are_written_outside_the_planner_lock() -> None:
    store = _WatchedStore(snapshot_every=3)
    store.locked = []
    planner = CraftPlanner(CONFIG, store=store)
    store.planner = planner
    for i in range(7):
        planner.commit(planner.plan(chunks(i, i + 1), f"chat-{i % 2}"), turn_tokens=[i])
    planner.end_conversation("chat-0")
    planner.forget_turns("chat-1", 1)  # seq 9: a snapshot from a forget entry
    assert store.locked == [False, False, False]
    assert store._snapshot("default").seq == 9  # type: ignore[union-attr]


def test_a_snapshot_written_by_the_previous_version_still_loads(make_store: StoreFactory) -> None:
    """Snapshots of today's main carry token ids and history versions: a worker loads them
    (and keeps the ids: they are right for that state)."""
    source = CraftPlanner(CONFIG, clock=time.time)  # a store's planners' clock
    source.commit(source.plan(chunks(1, 2), "chat"), turn_tokens=[5, 6, 7], prefix_tokens=2)
    old = {
        "access_table": source.access_table.to_json(),
        "prefix_tree": source.prefix_tree.to_json(),
        "conversations": source.conversations.to_json(),  # with "tokens"
        "clock": 0.0,
    }
    assert "tokens" in old["conversations"]["conversations"][0]
    store = make_store()
    CraftPlanner(CONFIG, store=store)  # attach the namespace
    for i in range(3):
        store.append("default", f'{{"v":"e","c":"x{i}","ts":0}}', since=i)
    store.put_snapshot("default", Snapshot(2, json.dumps(old)), keep_from=3)
    late = CraftPlanner(CONFIG, store=make_store())
    late._check_invariants()
    history = late.conversations.history("chat")  # type: ignore[arg-type]
    assert history is not None and history.turns == ((5, 6, 7),)
