"""Seeded fuzz over every store backend with turns in flight across workers.

Three planners share one store (memory://, a SQLite file, a real redis-server); plans are made,
committed (some refused: another worker moved the conversation on), aborted, conversations
ended and their turns forgotten, interleaved across the workers, with few conversations
allowed (evictions all the time) and frequent snapshots (the log is trimmed, a late reader
starts from a snapshot). At checkpoints, with plans still in flight, every worker and a fresh
late reader must hold the same state, and plan the same turn of an idle conversation the same
way: every decision that changes shared state is a function of the log alone.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest

from craft_rag import Chunk, CraftPlanner, PlannerConfig, make_chunk
from craft_rag.planner import Plan
from craft_rag.stores import StateStore

CONFIG = PlannerConfig(policy="tree", window=12, max_tree_nodes=14, max_conversations=3)
CONVERSATIONS = [f"chat-{i}" for i in range(6)]
CHUNKS = [make_chunk(f"passage {i}", id=f"doc-{i}", num_tokens=4 + i % 5) for i in range(12)]
SEEDS = range(4)
STEPS = 70
StoreFactory = Callable[..., StateStore]


def state_of(planner: CraftPlanner) -> Any:
    """Everything shared: the table, the tree (paths, spans, hits, stamps order) and the
    conversations (LRU order, turns, times, drops); token ids are each worker's own."""
    planner._check_invariants()
    data = planner.to_json()
    for conv in data["conversations"]["conversations"]:
        conv.pop("tokens", None)
        conv.pop("version", None)
        live = conv["live_from"]  # a snapshot keeps only the live turns' keys
        conv["turns"] = [[] if i < live else t for i, t in enumerate(conv["turns"])]
    return data


def _request(rng: random.Random) -> list[Chunk]:
    return rng.sample(CHUNKS[: rng.choice((6, 12))], rng.randint(1, 4))


def _check_agreement(
    workers: list[CraftPlanner], make: StoreFactory, in_flight: list[tuple[int, Plan]],
    rng: random.Random, where: str,
) -> None:
    for worker in workers:
        worker.sync()
    late = CraftPlanner(CONFIG, store=make(snapshot_every=5))
    want = state_of(late)
    for i, worker in enumerate(workers):
        assert state_of(worker) == want, f"{where}: worker {i} differs from a late reader"
    # The same turn of an idle conversation is planned the same way by every worker.
    busy = {plan.conversation_id for _, plan in in_flight}
    idle = [c for c in CONVERSATIONS if c not in busy]
    if idle:
        conv, request = rng.choice(idle), _request(rng)
        plans = [w.plan(request, conv) for w in (*workers, late)]
        got = {
            (p.keys, tuple(c.key for c in p.removed_duplicates), p.turn, p.matched_chunks)
            for p in plans
        }
        assert len(got) == 1, f"{where}: workers plan {conv} differently: {got}"
        for w, p in zip((*workers, late), plans, strict=True):
            w.abort(p)


@pytest.mark.parametrize("seed", SEEDS)
def test_workers_with_turns_in_flight_hold_one_state(make_store: StoreFactory, seed: int) -> None:
    rng = random.Random(seed)
    workers = [CraftPlanner(CONFIG, store=make_store(snapshot_every=5)) for _ in range(3)]
    in_flight: list[tuple[int, Plan]] = []
    outcomes = {"committed": 0, "refused": 0, "aborted": 0, "busy": 0}
    for step in range(STEPS):
        action = rng.random()
        if action < 0.45 or not in_flight:
            w = rng.randrange(3)
            conv = rng.choice([None, *CONVERSATIONS])
            try:
                in_flight.append((w, workers[w].plan(_request(rng), conv)))
            except RuntimeError:  # this worker has a turn of it in flight
                outcomes["busy"] += 1
        elif action < 0.8:
            w, plan = in_flight.pop(rng.randrange(len(in_flight)))
            tokens = [rng.randrange(1000) for _ in range(5)] if plan.conversation_id else None
            try:
                workers[w].commit(
                    plan, prefix_tokens=2, turn_tokens=tokens,
                    reused_chunks=rng.choice([None, 0, len(plan.ordered)]),
                )
                outcomes["committed"] += 1
            except RuntimeError as e:  # another worker committed a turn of it first
                assert "moved on" in str(e)
                outcomes["refused"] += 1
        elif action < 0.9:
            w, plan = in_flight.pop(rng.randrange(len(in_flight)))
            workers[w].abort(plan)
            outcomes["aborted"] += 1
        elif action < 0.95:
            workers[rng.randrange(3)].forget_turns(rng.choice(CONVERSATIONS), 1)
        else:
            workers[rng.randrange(3)].end_conversation(rng.choice(CONVERSATIONS))
        if step % 10 == 9:
            _check_agreement(workers, make_store, in_flight, rng, f"seed {seed} step {step}")
    for w, plan in in_flight:
        workers[w].abort(plan)
    _check_agreement(workers, make_store, [], rng, f"seed {seed} end")
    # The fuzzer reached what it is about: turns in flight, commits refused, evictions.
    assert outcomes["committed"] > 10 and outcomes["aborted"] > 0, outcomes


def test_a_conversation_evicted_by_the_log_while_its_turn_is_in_flight(
    make_store: StoreFactory,
) -> None:
    """Worker 1 holds turn 2 of chat-0 in flight; worker 2's commits evict chat-0 (bound 3):
    the hold protects nothing (it is not in the log), and the turn's commit starts chat-0 anew
    on every worker alike."""
    one, two = (CraftPlanner(CONFIG, store=make_store()) for _ in range(2))
    one.commit(one.plan(CHUNKS[:2], "chat-0"), turn_tokens=[1])
    plan = one.plan(CHUNKS[1:3], "chat-0")
    assert plan.turn == 2 and one.in_flight("chat-0")
    for i in range(1, 4):
        two.commit(two.plan(CHUNKS[i : i + 2], f"chat-{i}"))
    one.sync()
    assert one.committed_turns("chat-0") == 0  # evicted here too, in flight or not
    one.commit(plan, turn_tokens=[2])
    two.sync()
    for planner in (one, two):
        assert planner.conversations.turns("chat-0") == [(CHUNKS[2].key,)]  # type: ignore[arg-type]
    assert state_of(one) == state_of(two)
