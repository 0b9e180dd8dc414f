"""Hash every routing decision on seeded request streams (a refactor's gate for the router).

Runs fixed, seeded streams through :class:`craft_rag.routing.Router` (every routing policy; 4
replicas; commits with partial reuse and block hashes, KV evictions, a replica going down and
up, conversations, two salts) and prints one sha256 per policy and one over all. A change that
keeps the router's behaviour prints the same hashes; each decision's replica, order, predicted
cached tokens, cost and work (as float hex) go into the hash.

    .venv/bin/python scripts/router_decisions.py

Cost: a few seconds on 2 cores. No engine, no files written.
"""

from __future__ import annotations

import hashlib
import json
import random

from craft_rag import Chunk, ChunkKey
from craft_rag.routing import ROUTING_POLICIES, Router, RouterConfig
from craft_rag.types import BlockHash


def _stream(policy: str, seed: int, steps: int = 1500) -> str:
    rng = random.Random(seed)
    pool = [
        Chunk(key=ChunkKey(f"doc-{i}:0"), text="", num_tokens=32 + (i * 7) % 96)
        for i in range(60)
    ]
    router = Router([f"r{i}" for i in range(4)], policy, RouterConfig(block_size=16))
    digest = hashlib.sha256()
    inflight = []
    for step in range(steps):
        k = rng.randint(1, 6)
        picked = [pool[min(59, int(rng.paretovariate(1.2)) - 1)] for _ in range(k // 2)]
        picked += [pool[rng.randrange(60)] for _ in range(k - len(picked))]
        picked = list({c.key: c for c in picked}.values())
        rng.shuffle(picked)
        salt = "t1" if rng.random() < 0.2 else None
        conv = f"c{rng.randrange(20)}" if rng.random() < 0.1 else None
        tokens = 40 + sum(c.num_tokens or 0 for c in picked) + rng.randrange(100)
        d = router.route(picked, prompt_tokens=tokens, conversation_id=conv, salt=salt)
        digest.update(json.dumps([
            d.replica, list(d.plan.keys), d.predicted_cached_tokens,
            d.predicted_cost_s.hex(), d.predicted_work_s.hex(), d.sticky, d.rehomed,
        ]).encode())
        reused = rng.randint(0, len(d.plan.ordered))
        hashes = [[BlockHash(f"{d.replica}/{c.key}/{i}".encode())] for i, c in
                  enumerate(d.plan.ordered)]
        router.planner(d.replica, salt).commit(
            d.plan, prefix_tokens=40, block_hashes=hashes, reused_chunks=reused)
        inflight.append(d)
        if len(inflight) > 6 or rng.random() < 0.5:
            router.finish(inflight.pop(rng.randrange(len(inflight))))
        if rng.random() < 0.05 and d.plan.ordered:
            victim = rng.choice(d.plan.ordered)
            router.on_blocks_removed(d.replica, [BlockHash(f"{d.replica}/{victim.key}/0".encode())],
                                     salt)
        if step % 400 == 399:
            router.mark_down(f"r{rng.randrange(4)}")
        if step % 400 == 99:
            for name in router.replica_ids:
                router.mark_up(name)
        if conv is not None and rng.random() < 0.2:
            router.end_conversation(conv, salt=salt)
    return digest.hexdigest()


def main() -> None:
    total = hashlib.sha256()
    for policy in sorted(ROUTING_POLICIES):
        h = _stream(policy, seed=7)
        total.update(h.encode())
        print(f"{policy:20s} {h}")
    print(f"{'all':20s} {total.hexdigest()}")


if __name__ == "__main__":
    main()
