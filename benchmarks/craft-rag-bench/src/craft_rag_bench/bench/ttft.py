"""Suite ``ttft`` (paper Fig. 11; issue 4's side-by-side): the four systems on one engine.

No prefix caching, prefix caching with the retriever's order, CRAFT ``frequency`` and CRAFT
``tree`` serve the same requests one after another (each from an empty cache, after a warm-up,
through :func:`craft_rag_bench.demo.run_system`), on a single-turn trace with repeated chunks (SQuAD
with Zipf re-asks and reworded near-duplicates, top-5 from the union IVF index) and on MTRAG
multi-turn conversations. TTFT mean/p50/p99 are normalised to no prefix caching. The demo's
systems all apply conversation-scoped dedup, so on conversations the plain baselines without
it (``no_cache_nodedup``, ``prefix_cache_nodedup``) are served too, and the normalisation is
to ``no_cache_nodedup`` (the paper's "w/o prefix caching": everything recomputed, no CRAFT).

The fifth column of issue 7, the Total-overlap bound, cannot be served: it is the cached
fraction if every chunk seen in any earlier request (and the constant head) were reused, with
an estimated TTFT from a least-squares line TTFT = a + b * computed tokens fitted to every
request of the run (prefill dominates TTFT on this CPU).

Peers (ContextPilot online/offline, LongContextReorder; :mod:`craft_rag_bench.bench.peers`) are
served on the same engine after CRAFT and appear as more entries of ``systems``.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from craft_rag.trace import TraceRequest
from craft_rag_bench.bench.context import BenchContext
from craft_rag_bench.bench.serving import SIDE_BY_SIDE, peer_systems, served
from craft_rag_bench.demo import summarise

if TYPE_CHECKING:
    from craft_rag.engine import CraftEngine, GenerationResult

WORKLOADS: tuple[str, ...] = ("squad", "mtrag")
MULTI_TURN_BASELINES: tuple[str, ...] = ("no_cache_nodedup", "prefix_cache_nodedup")


def workload_requests(ctx: BenchContext, workload: str) -> int:
    return ctx.sizes.mtrag_turns if workload == "mtrag" else ctx.sizes.ttft_requests


def total_overlap_bound(engine: CraftEngine, trace: list[TraceRequest]) -> tuple[int, int] | None:
    """(bound cached tokens, prompt tokens) of single-turn requests served in retriever order
    when every chunk seen before and the head are reused; None for multi-turn traces (their
    history is reused by any prefix cache, so the bound is not chunk-level)."""
    if any(r.conversation_id is not None for r in trace):
        return None
    assembler = engine.assembler
    head = len(assembler.head_ids)
    seen: set[str] = set()
    cached = prompt = 0
    for i, request in enumerate(trace):
        ids = [len(assembler.chunk_ids(c)) for c in request.chunks]
        total = head + sum(ids) + len(assembler.question_ids(request.query))
        hit = (head if i else 0) + sum(
            n for c, n in zip(request.chunks, ids, strict=True) if c.key in seen
        )
        cached += min(hit, total - 1)
        prompt += total
        seen.update(c.key for c in request.chunks)
    return cached, prompt


def fit_ttft(results: list[GenerationResult]) -> tuple[float, float]:
    """Least-squares ``ttft_ms = a + b * computed_tokens`` over ``results``."""
    xs = [float(r.report.uncached_tokens) for r in results]
    ys = [r.report.ttft_ms for r in results]
    n = len(xs)
    if n < 2:
        return (ys[0] if ys else 0.0), 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
    return my - b * mx, b


def run(ctx: BenchContext) -> dict[str, Any]:
    engine = ctx.get_engine()
    max_tokens = ctx.sizes.ttft_max_tokens
    out: dict[str, Any] = {
        "suite": "ttft",
        "max_tokens": max_tokens,
        "block_size": engine.block_size,
        "workloads": {},
    }
    for workload in ctx.workloads(WORKLOADS):
        n = workload_requests(ctx, workload)
        trace = ctx.trace(workload, n)
        multi_turn = any(r.conversation_id for r in trace)
        # On conversations the demo's systems all dedup; the plain baselines do not.
        names = (*MULTI_TURN_BASELINES, *SIDE_BY_SIDE) if multi_turn else SIDE_BY_SIDE
        names = (*names, *peer_systems())  # peers on the same engine (issue 16)
        runs = {name: served(ctx, workload, n, name, max_tokens=max_tokens) for name in names}
        summaries = {name: summarise(rs) for name, rs in runs.items()}
        base = summaries["no_cache_nodedup" if multi_turn else "no_cache"]
        systems: dict[str, Any] = {}
        for name, s in summaries.items():
            row = asdict(s)
            row["normalised_mean"] = s.mean_ttft_ms / base.mean_ttft_ms if base.mean_ttft_ms else 0
            row["normalised_p50"] = s.p50_ttft_ms / base.p50_ttft_ms if base.p50_ttft_ms else 0
            row["normalised_p99"] = s.p99_ttft_ms / base.p99_ttft_ms if base.p99_ttft_ms else 0
            row["speedup_mean"] = base.mean_ttft_ms / s.mean_ttft_ms if s.mean_ttft_ms else 0
            row["computed_tokens"] = s.prompt_tokens - s.cached_tokens
            systems[name] = row
        everything = [r for rs in runs.values() for r in rs]
        a, b = fit_ttft(everything)
        bound = total_overlap_bound(engine, trace)
        bound_row: dict[str, Any] | None = None
        if bound is not None:
            cached, prompt = bound
            est = (a * len(trace) + b * (prompt - cached)) / len(trace)
            bound_row = {
                "cached_token_fraction": cached / prompt if prompt else 0.0,
                "estimated_mean_ttft_ms": est,
                "estimated_speedup_mean": base.mean_ttft_ms / est if est > 0 else None,
            }
        out["workloads"][workload] = {
            "requests": len(trace),
            "systems": systems,
            "total_overlap_bound": bound_row,
            "ttft_fit_ms": {"intercept": a, "per_computed_token": b},
            "baseline": "no_cache_nodedup" if multi_turn else "no_cache",
        }
    return out
