"""Hash every decision the planner makes on seeded request streams (a refactor's gate).

Runs fixed, seeded streams through :class:`craft_rag.CraftPlanner` using public names only
(plan, commit with partial reuse and block hashes, abort, KV-eviction events, a save/load
round-trip mid-stream, a small tree bound that evicts, every ordering policy, conversations
with dedup) and prints one sha256 per stream and one over all of them. A change to the core
that keeps behaviour prints the same hashes; anything else names the stream that moved.

    .venv/bin/python scripts/planner_decisions.py            # hashes
    .venv/bin/python scripts/planner_decisions.py --dump D   # also one JSON line per decision

Cost: ~2-5 s on 2 cores. No engine, no files written unless --dump.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from craft_rag import (
    ORDERING_POLICIES,
    Chunk,
    ChunkKey,
    CommitResult,
    CraftPlanner,
    Plan,
    PlannerConfig,
)
from craft_rag.files import write_atomic

Decision = dict[str, Any]


def _chunks(n: int) -> list[Chunk]:
    return [
        Chunk(key=ChunkKey(f"doc-{i}:0"), text="", num_tokens=32 + (i * 7) % 96) for i in range(n)
    ]


def _request(rng: random.Random, pool: list[Chunk], k: int) -> list[Chunk]:
    """``k`` chunks, skewed towards a hot head, with an occasional repeated key."""
    picked = [pool[min(len(pool) - 1, int(rng.paretovariate(1.1)) - 1)] for _ in range(k // 2)]
    picked += [pool[rng.randrange(len(pool))] for _ in range(k - len(picked))]
    rng.shuffle(picked)
    return picked


def _plan_record(plan: Plan) -> Decision:
    return {
        "ordered": [c.key for c in plan.ordered],
        "removed": [c.key for c in plan.removed_duplicates],
        "repeated": [c.key for c in plan.repeated_in_request],
        "matched_chunks": plan.matched_chunks,
        "matched_tokens": plan.matched_tokens,
        "conversation": plan.conversation_id,
        "turn": plan.turn,
        "policy": plan.policy,
    }


def _commit_record(result: CommitResult) -> Decision:
    return {
        "reused": result.reused_chunks,
        "inserted": result.inserted_path,
        "stale_removed": result.stale_nodes_removed,
        "turn": result.turn,
    }


def _hashes_for(plan: Plan, salt: int) -> list[list[int]]:
    """Deterministic fake block hashes: one per 32 tokens of each chunk, tied to the path."""
    out: list[list[int]] = []
    path = salt
    for chunk in plan.ordered:
        blocks = []
        for b in range(max(1, chunk.num_tokens // 32)):
            path = (path * 1_000_003 + sum(map(ord, chunk.key)) + b) % (2**61 - 1)
            blocks.append(path)
        out.append(blocks)
    return out


def _serve(
    planner: CraftPlanner,
    rng: random.Random,
    plan: Plan,
    with_hashes: bool,
) -> Iterator[Decision]:
    """Commit ``plan`` as an engine would: reuse at most the predicted match, sometimes less."""
    yield {"plan": _plan_record(plan)}
    if rng.random() < 0.05:
        yield {"abort": planner.abort(plan)}
        return
    reused = plan.matched_chunks if rng.random() < 0.8 else rng.randint(0, plan.matched_chunks)
    result = planner.commit(
        plan,
        prefix_tokens=40,
        reused_chunks=reused,
        block_hashes=_hashes_for(plan, 17) if with_hashes else None,
    )
    yield {"commit": _commit_record(result)}


def _stateless(policy: str, seed: int, *, max_nodes: int | None = None) -> Iterator[Decision]:
    rng = random.Random(seed)
    pool = _chunks(400)
    config = PlannerConfig(policy=policy, window=200)
    if max_nodes is not None:
        config = PlannerConfig(policy=policy, window=200, max_tree_nodes=max_nodes)
    planner = CraftPlanner(config)
    for i in range(600):
        plan = planner.plan(_request(rng, pool, rng.choice((3, 5, 8))))
        yield from _serve(planner, rng, plan, with_hashes=True)
        if i % 97 == 96:  # the engine evicted some blocks
            victims = [h for hs in _hashes_for(plan, 17) for h in hs][:2]
            yield {"removed_blocks": planner.on_blocks_removed(victims)}
        if i == 300:  # a restart: the saved state is loaded and planning goes on
            planner = CraftPlanner.from_json(json.loads(json.dumps(planner.to_json())))
            yield {"reloaded": True}
    yield {"tree_nodes": len(planner.prefix_tree), "table": len(planner.access_table)}


def _conversations(seed: int) -> Iterator[Decision]:
    rng = random.Random(seed)
    pool = _chunks(150)
    planner = CraftPlanner(PlannerConfig(window=100))
    ids = [f"conv-{i}" for i in range(12)]
    for _ in range(400):
        conversation = rng.choice(ids) if rng.random() < 0.85 else None
        plan = planner.plan(_request(rng, pool, 5), conversation)
        yield from _serve(planner, rng, plan, with_hashes=False)
        if conversation is not None and rng.random() < 0.03:
            yield {"ended": planner.end_conversation(conversation)}
    yield {"turns": [planner.committed_turns(c) for c in ids]}


STREAMS: dict[str, Callable[[], Iterator[Decision]]] = {
    **{f"stateless-{p}": (lambda p=p: _stateless(p, 1)) for p in sorted(ORDERING_POLICIES)},  # type: ignore[misc]
    "stateless-evicting": lambda: _stateless("tree", 2, max_nodes=64),
    "conversations": lambda: _conversations(3),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dump", type=Path, help="folder for one JSON-lines file per stream")
    args = parser.parse_args(argv)
    overall = hashlib.sha256()
    for name, stream in STREAMS.items():
        digest = hashlib.sha256()
        lines = []
        for decision in stream():
            line = json.dumps(decision, sort_keys=True)
            digest.update(line.encode())
            lines.append(line)
        if args.dump is not None:
            args.dump.mkdir(parents=True, exist_ok=True)
            write_atomic(args.dump / f"{name}.jsonl", "\n".join(lines) + "\n")
        print(f"{name:24s} {len(lines):6d} decisions  {digest.hexdigest()}")
        overall.update(digest.digest())
    print(f"{'all':24s} {'':6s}            {overall.hexdigest()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
