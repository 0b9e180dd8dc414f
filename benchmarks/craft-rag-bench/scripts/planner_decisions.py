"""Hash every planner decision on seeded streams, to show a planner change keeps them (issue 16).

Run it once per source tree and compare the lines, e.g. against the last commit::

    git archive HEAD src | tar -x -C /tmp/before
    PYTHONPATH=/tmp/before/src python planner_decisions.py > before.txt
    python planner_decisions.py > after.txt && diff before.txt after.txt

One sha256 (16 hex digits) per configuration. Hashed: each plan's ordered / removed / repeated
keys and matched chunks and tokens; each commit result (or abort); KV-event results;
``match`` / ``match_subset`` answers on random probes; every 200 requests and at the end the
whole saved state (``to_json``: tree nodes with their stamps, ``next_stamp``, the table's
window, conversations) after an invariant check; the eviction counter; then the state reloaded
and run 300 more requests. Clocks are deterministic: a tick clock, a coarse one (many equal
access times) and ones that step back (``time.time`` under NTP); node bounds of 1-1,000, so
eviction, stale reuse, block hashes, KV-event removals, full clears and conversations all
occur; plus the ``overhead`` suite's stream at k=5 and k=20 with a 20,000-node bound and a
microsecond tick clock (clock reads counted). ~40 s.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from craft_rag.chunk import Chunk
from craft_rag.planner import CraftPlanner, PlannerConfig
from craft_rag.prefix_tree import KVLocation


class Tick:
    """Deterministic clock: +``step`` per read, or (``coarse``) only when the stream moves it."""

    def __init__(self, step: float, coarse: bool) -> None:
        self.now, self.step, self.coarse, self.reads = 1000.0, step, coarse, 0

    def __call__(self) -> float:
        self.reads += 1
        if not self.coarse:
            self.now += self.step
        return self.now


@dataclass(frozen=True)
class Stream:
    name: str
    config: PlannerConfig
    seed: int
    k: int
    universe: int
    coarse: bool  # many equal access times
    events: bool  # token counts, block hashes, stale reuse, locations, KV events
    conversations: bool
    backwards: bool  # the clock steps back now and then


def _ids(seed: int, k: int, universe: int, n: int) -> Iterator[tuple[random.Random, list[int]]]:
    rng = random.Random(seed)
    for _ in range(n):
        yield rng, [
            min(universe - 1, int(rng.paretovariate(1.1)))
            if rng.random() < 0.6
            else rng.randrange(universe)
            for _ in range(rng.randint(1, k))
        ]


def _state(planner: CraftPlanner) -> bytes:
    return json.dumps(planner.to_json(), sort_keys=True).encode()


def run(s: Stream, n: int = 8000) -> str:
    """The hash of one stream's decisions (see the module)."""
    h = hashlib.sha256()
    clock = Tick(0.5, s.coarse)
    planner = CraftPlanner(s.config, clock=clock)
    hashes: list[int] = []
    for step, (rng, ids) in enumerate(_ids(s.seed, s.k, s.universe, n)):
        if s.coarse and rng.random() < 0.3:
            clock.now += 1.0
        if s.backwards and rng.random() < 0.05:
            clock.now -= 3.0
        tokens = rng.choice([None, 16, 32])
        request = [Chunk(key=f"c{i}", text="", num_tokens=tokens) for i in ids]
        conv = f"conv{rng.randrange(5)}" if s.conversations and rng.random() < 0.2 else None
        plan = planner.plan(request, conv)
        h.update(repr((
            plan.keys, [c.key for c in plan.removed_duplicates],
            [c.key for c in plan.repeated_in_request], plan.matched_chunks,
            plan.matched_tokens, plan.turn,
        )).encode())
        kwargs: dict[str, Any] = {"prefix_tokens": rng.choice([None, 0, 40])}
        m = len(plan.ordered)
        if s.events and rng.random() < 0.3:
            kwargs["chunk_token_counts"] = [rng.choice([5, 32]) for _ in range(m)]
        if s.events and rng.random() < 0.3:
            rows = [[rng.getrandbits(40) for _ in range(rng.randint(0, 2))] for _ in range(m)]
            kwargs["block_hashes"] = rows
            hashes.extend(x for row in rows for x in row)
        if s.events and rng.random() < 0.1:
            kwargs["reused_chunks"] = rng.randint(0, m)
        if s.events and rng.random() < 0.05:
            kwargs["location"] = KVLocation(engine_id=rng.choice(["a", "b"]))
        if rng.random() < 0.02:
            planner.abort(plan)
            h.update(b"abort")
        else:
            h.update(repr(planner.commit(plan, **kwargs)).encode())
        if s.events and hashes and rng.random() < 0.03:
            gone = rng.sample(hashes, min(3, len(hashes)))
            h.update(repr(planner.on_blocks_removed(gone)).encode())
        if s.events and rng.random() < 0.002:
            planner.on_all_blocks_cleared()
        if rng.random() < 0.05:
            probe = [f"c{rng.randrange(s.universe)}" for _ in range(rng.randint(1, s.k + 2))]
            tree = planner.prefix_tree
            h.update(repr((
                tree.match(probe).keys, tree.match_subset(probe).keys,
                tree.match_subset(set(probe)).keys,
            )).encode())
        if step % 200 == 199:
            planner._check_invariants()
            h.update(_state(planner))
    h.update(_state(planner))
    tree = planner.prefix_tree
    h.update(repr((tree.evictions, len(tree), planner.stats)).encode())
    reloaded = CraftPlanner.from_json(planner.to_json(), clock=clock)
    for _, ids in _ids(s.seed + 100, s.k, s.universe, 300):
        clock.now += 1.0
        plan = reloaded.plan([Chunk(key=f"c{i}", text="", num_tokens=16) for i in ids])
        result = reloaded.commit(plan, prefix_tokens=8)
        h.update(repr((plan.keys, plan.matched_chunks, result)).encode())
    h.update(_state(reloaded))
    return h.hexdigest()[:16]


def run_overhead_stream(k: int, window: int, max_nodes: int, n: int) -> str:
    """The hash of the ``overhead`` suite's stream (first ``n`` requests), tick clock."""
    from craft_rag_bench.bench.overhead import _requests

    clock = Tick(1e-6, False)
    config = PlannerConfig(policy="tree", window=window, max_tree_nodes=max_nodes)
    planner = CraftPlanner(config, clock=clock)
    h = hashlib.sha256()
    for i, request in enumerate(_requests(n * k // 2, k, 0)[:n]):
        plan = planner.plan(request)
        result = planner.commit(plan, prefix_tokens=40)
        h.update(repr((plan.keys, plan.matched_chunks, plan.matched_tokens, result)).encode())
        if i % 5000 == 4999:
            h.update(_state(planner))
    h.update(_state(planner))
    h.update(repr((planner.prefix_tree.evictions, clock.reads)).encode())
    return h.hexdigest()[:16]


def _config(policy: str, window: int | None, nodes: int, **kw: Any) -> PlannerConfig:
    return PlannerConfig(policy=policy, window=window, max_tree_nodes=nodes, **kw)


STREAMS = [
    Stream("tree k5 W40 n48 tick", _config("tree", 40, 48), 1, 5, 60, False, True, True, False),
    Stream(
        "tree k12 W200 n120 coarse", _config("tree", 200, 120), 2, 12, 80, True, True, True, False
    ),
    Stream("freq k6 W30 n40 coarse", _config("frequency", 30, 40), 3, 6, 60, True, True, True,
           False),
    Stream("retr k8 Wnone n1000", _config("retriever", None, 1000), 4, 8, 300, False, True, True,
           False),
    Stream("tree k20 W100 n300 coarse", _config("tree", 100, 300), 5, 20, 400, True, True, False,
           False),
    Stream("tree threshold k5 n30", _config("tree", 50, 30, promotion="threshold"), 6, 5, 40,
           True, True, True, False),
    Stream("tree k5 n1 tick", _config("tree", 10, 1), 7, 5, 30, False, True, False, False),
    Stream("tree k6 n200 backwards clock", _config("tree", 100, 200), 8, 6, 120, True, True,
           True, True),
    Stream("tree k4 n64 backwards tick", _config("tree", 100, 64), 9, 4, 50, False, False, False,
           True),
]


def main() -> None:
    for stream in STREAMS:
        print(f"{stream.name:32s}", run(stream), flush=True)
    for k in (5, 20):
        print(f"{f'overhead k{k} W1000 n20000':32s}", run_overhead_stream(k, 1000, 20000, 40000),
              flush=True)


if __name__ == "__main__":
    main()
