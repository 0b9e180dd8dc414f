"""Issue 16: the planner's own commit takes a fast path (arguments checked once in
``commit``, then the CA-Table's ``_add`` and the CP-Tree's ``insert_trusted`` with no second
pass), while an entry replayed from a shared store goes through the checked ``record`` /
``insert`` (both through the planner's one ``_record(ServedTurn)``).
Both must change state identically: a local planner and a store-backed planner (which applies
its own commits from the log, through the checked path) are fed the same seeded stream, with
evictions, stale reuse, block hashes, KV events and conversations, and must agree on every
plan and on the whole saved state."""

from __future__ import annotations

import random
from typing import Any

import pytest

from craft_rag.chunk import Chunk
from craft_rag.planner import CraftPlanner, PlannerConfig
from craft_rag.prefix_tree import KVLocation
from craft_rag.stores import MemoryStore


class StepClock:
    """Time moves only between requests (a shared planner stamps entries with it)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _state(planner: CraftPlanner) -> dict[str, Any]:
    data = planner.to_json()
    del data["conversations"]  # turn token ids are recorded by the committing worker only
    return data


@pytest.mark.parametrize(
    ("seed", "policy", "k", "window", "max_nodes"),
    [(1, "tree", 5, 40, 48), (2, "tree", 12, 200, 120), (3, "frequency", 6, 30, 40)],
)
def test_local_fast_path_changes_state_like_the_checked_path(
    seed: int, policy: str, k: int, window: int, max_nodes: int
) -> None:
    rng = random.Random(seed)
    clock = StepClock()
    config = PlannerConfig(policy=policy, window=window, max_tree_nodes=max_nodes)
    local = CraftPlanner(config, clock=clock)
    shared = CraftPlanner(config, clock=clock, store=MemoryStore())
    hashes: list[int] = []
    for step in range(700):
        clock.now += rng.choice([0.0, 0.0, 1.0])  # a coarse clock: many equal access times
        ids = [min(59, int(rng.paretovariate(1.1))) if rng.random() < 0.6 else rng.randrange(60)
               for _ in range(rng.randint(1, k))]
        tokens = rng.choice([None, 16, 32])
        request = [Chunk(key=f"c{i}", text="", num_tokens=tokens) for i in ids]
        conv = f"conv{rng.randrange(4)}" if rng.random() < 0.15 else None
        plans = [p.plan(request, conv) for p in (local, shared)]
        assert plans[0].ordered == plans[1].ordered
        assert plans[0].matched_chunks == plans[1].matched_chunks
        assert plans[0].matched_tokens == plans[1].matched_tokens
        kwargs: dict[str, Any] = {"prefix_tokens": rng.choice([None, 0, 40])}
        n = len(plans[0].ordered)
        if rng.random() < 0.3:
            kwargs["chunk_token_counts"] = [rng.choice([5, 32]) for _ in range(n)]
        if rng.random() < 0.3:
            rows = [[rng.getrandbits(40) for _ in range(rng.randint(0, 2))] for _ in range(n)]
            kwargs["block_hashes"] = rows
            hashes.extend(h for row in rows for h in row)
        if rng.random() < 0.1:
            kwargs["reused_chunks"] = rng.randint(0, n)
        if rng.random() < 0.1:
            kwargs["location"] = KVLocation(engine_id=rng.choice(["a", "b"]))
        results = [p.commit(plan, **kwargs) for p, plan in zip((local, shared), plans, strict=True)]
        assert results[0] == results[1]
        if hashes and rng.random() < 0.03:  # the engine evicted some blocks (local events)
            gone = rng.sample(hashes, min(3, len(hashes)))
            assert local.on_blocks_removed(gone) == shared.on_blocks_removed(gone)
        if step % 50 == 49:
            assert _state(local) == _state(shared)
            local._check_invariants()
            shared._check_invariants()
    assert local.prefix_tree.evictions > 0
    assert _state(local) == _state(shared)
