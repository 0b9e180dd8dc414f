"""Suite ``topk`` (paper Fig. 13c): TTFT vs the number of retrieved chunks k in {3, 5, 10}.

For each k, the single-turn trace is rebuilt with top-k retrieval (with ``--trace``, each
request's chunk list is cut to its first k) and served sequentially under no prefix caching,
prefix caching with the retriever's order and CRAFT (``frequency`` and ``tree``) on the one
engine, each from an empty cache; then the peers (ContextPilot online/offline,
LongContextReorder) on the same engine.
"""

from __future__ import annotations

from typing import Any

from craft_rag_bench.bench.context import BenchContext
from craft_rag_bench.bench.serving import SIDE_BY_SIDE, peer_systems, served
from craft_rag_bench.demo import summarise


def run(ctx: BenchContext) -> dict[str, Any]:
    sizes = ctx.sizes
    workload = ctx.workloads(["squad"])[0]
    rows: list[dict[str, Any]] = []
    for k in sizes.topks:
        base_ms: float | None = None
        for name in (*SIDE_BY_SIDE, *peer_systems()):
            results = served(ctx, workload, sizes.topk_requests, name,
                             max_tokens=sizes.ttft_max_tokens, top_k=k)
            s = summarise(results)
            if name == "no_cache":
                base_ms = s.mean_ttft_ms
            rows.append({
                "k": k,
                "system": name,
                "requests": s.requests,
                "mean_ttft_ms": s.mean_ttft_ms,
                "p50_ttft_ms": s.p50_ttft_ms,
                "p99_ttft_ms": s.p99_ttft_ms,
                "normalised_mean": s.mean_ttft_ms / base_ms if base_ms else None,
                "cached_token_fraction": s.cached_token_fraction,
                "prompt_tokens_per_request": s.prompt_tokens / max(1, s.requests),
            })
    return {"suite": "topk", "workload": workload, "topks": list(sizes.topks),
            "max_tokens": sizes.ttft_max_tokens, "rows": rows}
