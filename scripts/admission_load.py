"""Cache-aware admission vs FCFS under Poisson load, one policy per run (one engine per process).

Workload (synthetic, seeded): ``--groups`` document sets of 4 chunks each; every request
retrieves one set, chosen with Zipf(1) popularity, in a shuffled order, with its own question,
so popular sets are cached and rare ones are cold. Requests arrive as a Poisson process at
``--rate`` per second, each served on its own thread (``engine.generate``); the cache starts
empty. Prints one JSON object: mean/p50/p99 TTFT, throughput, cached fraction, mean held time.

    python scripts/admission_load.py --policy fcfs --rate 4 --requests 60
    python scripts/admission_load.py --policy cache_aware --rate 4 --requests 60

Compare runs of the same seed, rate and ``--queue`` on the same machine state only.
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", choices=("fcfs", "cache_aware"), required=True)
    parser.add_argument("--rate", type=float, default=4.0, help="arrivals per second")
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--groups", type=int, default=12)
    parser.add_argument("--words", type=int, default=60, help="words per chunk")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument(
        "--queue", type=int, default=None, help="admission_queue (default: vLLM priority)"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from craft_rag.engine import CraftEngine, EngineSettings
    from craft_rag.metrics import percentile
    from craft_rag.testing import make_chunks

    rng = random.Random(args.seed)
    groups = [make_chunks(4, words=args.words, prefix=f"g{g}", seed=g) for g in range(args.groups)]
    weights = [1.0 / (g + 1) for g in range(args.groups)]
    requests = []
    for i in range(args.requests):
        chunks = list(rng.choices(groups, weights)[0])
        rng.shuffle(chunks)
        requests.append((chunks, f"Question {i}: what do the documents say about w{i % 200}?"))
    arrivals, t = [], 0.0
    for _ in requests:
        arrivals.append(t)
        t += rng.expovariate(args.rate)

    # fcfs without a queue is admission off: vLLM's own order, the baseline.
    settings = EngineSettings(admission=args.policy, admission_queue=args.queue)
    with CraftEngine(settings) as engine:
        engine.generate(make_chunks(1, prefix="warmup"), "Warm up?", max_tokens=1)
        engine.reset_prefix_cache()
        finished: list[float] = []
        lock = threading.Lock()
        start = time.perf_counter() + 0.05

        def one(i: int) -> Any:
            delay = start + arrivals[i] - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            chunks, question = requests[i]
            result = engine.generate(chunks, question, max_tokens=args.max_tokens)
            with lock:
                finished.append(time.perf_counter())
            return result

        with ThreadPoolExecutor(max_workers=len(requests)) as pool:
            results = list(pool.map(one, range(len(requests))))
    ttfts = [r.report.ttft_ms for r in results]
    prompt = sum(r.report.prompt_tokens for r in results)
    held = [r.report.admission_held_ms or 0.0 for r in results]
    print(
        json.dumps(
            {
                "policy": args.policy,
                "queue": args.queue,
                "rate": args.rate,
                "requests": len(results),
                "seed": args.seed,
                "mean_ttft_ms": sum(ttfts) / len(ttfts),
                "p50_ttft_ms": percentile(ttfts, 50),
                "p99_ttft_ms": percentile(ttfts, 99),
                "throughput_rps": len(results) / (max(finished) - start),
                "cached_token_fraction": sum(r.report.cached_tokens for r in results) / prompt,
                "mean_held_ms": sum(held) / len(held),
            }
        )
    )


if __name__ == "__main__":
    main()
