"""Several worker processes (spawned) sharing one SQLite file or one Redis database.

Served in order, round-robin over 3 workers, the plans, dedup decisions, commit results and
final states equal those of one local planner serving the same requests in the same order.
Served concurrently, every worker ends with the same state, each conversation's turns are
committed once each and never repeat a chunk, and the counts equal the commits.
"""

from __future__ import annotations

import multiprocessing as mp
import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import store_workers
from store_workers import CONFIG, serve, state_of

from craft_rag import CraftPlanner, PlannerConfig

N_WORKERS = 3


@pytest.fixture(params=["sqlite", "redis"])
def shared_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite://{tmp_path / 'state.db'}"
    return str(request.getfixturevalue("redis_url"))


@pytest.fixture
def workers(shared_url: str) -> Iterator[list[Any]]:
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for _ in range(N_WORKERS):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=store_workers.worker, args=(shared_url, child), daemon=True)
        proc.start()
        pipes.append(parent)
        procs.append(proc)
    yield pipes
    for pipe in pipes:
        try:
            pipe.send(("stop",))
            pipe.recv()
        except (EOFError, OSError):
            pass
    for proc in procs:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()


def call(pipe: Any, *command: Any) -> Any:
    pipe.send(command)
    if not pipe.poll(60):
        raise TimeoutError(f"worker did not answer {command[0]!r}")
    return pipe.recv()


def requests(n: int, seed: int) -> list[tuple[list[int], str | None, int | None]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        pool = rng.choice((10, 40))
        ids = rng.sample(range(pool), rng.randint(2, 6))
        conv = rng.choice([None, None, "a", "b", "c", "d"])
        out.append((ids, conv, rng.choice([None, None, 0])))
    return out


def test_workers_in_order_equal_one_process(workers: list[Any]) -> None:
    solo = CraftPlanner(CONFIG)
    for i, (ids, conv, reused) in enumerate(requests(150, seed=11)):
        got = call(workers[i % N_WORKERS], "serve", ids, conv, reused)
        assert tuple(got) == tuple(serve(solo, ids, conv, reused)), f"request {i}"
    want = state_of_local(solo)
    for pipe in workers:
        assert tuple(call(pipe, "state")) == want


def state_of_local(planner: CraftPlanner) -> tuple[Any, ...]:
    # The local planner has no store: sync() is a no-op, the rest is the workers' view.
    state = state_of(planner)
    return tuple(list(x) if isinstance(x, tuple) else x for x in state)


def test_concurrent_workers_agree_and_keep_conversations_whole(workers: list[Any]) -> None:
    rng = random.Random(5)
    per_worker = [
        [(rng.sample(range(30), rng.randint(2, 5)), rng.choice([None, "a", "b", "c"]))
         for _ in range(60)]
        for _ in range(N_WORKERS)
    ]
    for pipe, reqs in zip(workers, per_worker, strict=True):
        pipe.send(("run", reqs))
    results = []
    for pipe in workers:
        assert pipe.poll(120)
        results.append(pipe.recv())
    states = [tuple(call(pipe, "state")) for pipe in workers]
    assert states[1:] == states[:-1], "workers disagree after sync"
    committed = [item for done, _ in results for item in done]
    assert len(committed) == N_WORKERS * 60
    # Each conversation: turns 1..n committed once each; no chunk sent twice (dedup held)
    # while all its turns fit the window of live turns.
    by_conv: dict[str, list[tuple[int, list[str]]]] = {}
    for conv, (keys, _removed, turn, _m, _r) in committed:
        if conv is not None:
            by_conv.setdefault(conv, []).append((turn, keys))
    _counts, _nodes, conversations = states[0]
    for conv, turns in conversations:
        assert sorted(t for t, _ in by_conv[conv]) == list(range(1, len(by_conv[conv]) + 1))
        assert len(turns) == len(by_conv[conv])
        sent = [k for turn in turns for k in turn]
        assert len(sent) == len(set(sent)), f"conversation {conv} re-sent a chunk"


def test_counts_equal_the_commits_with_an_unlimited_window(shared_url: str) -> None:
    config = PlannerConfig(window=None, max_tree_nodes=1000)
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for _ in range(2):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=store_workers.worker, args=(shared_url, child, config))
        proc.start()
        pipes.append(parent)
        procs.append(proc)
    try:
        rng = random.Random(2)
        reqs = [[(rng.sample(range(20), 4), None) for _ in range(40)] for _ in pipes]
        for pipe, mine in zip(pipes, reqs, strict=True):
            pipe.send(("run", mine))
        for pipe in pipes:
            assert pipe.poll(120)
            pipe.recv()
        want = Counter(f"doc-{i}" for mine in reqs for ids, _ in mine for i in ids)
        for pipe in pipes:
            counts, _nodes, _convs = call(pipe, "state")
            assert dict(counts) == dict(want)
    finally:
        for pipe in pipes:
            pipe.send(("stop",))
        for proc in procs:
            proc.join(timeout=10)
