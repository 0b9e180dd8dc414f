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

Fairness (wall time on a shared CPU; :mod:`craft_rag_bench.bench.ttft_stats`): garbage is
collected before each system (outside its timing), every request's tokens and TTFT are kept
(``per_request``), ``craft_tree`` is paired with every other system request by request
(``tree_vs``: the TTFT gap its computed tokens explain and the rest), and ``--ttft-passes 2``
serves every system twice in mirrored order (A B .. B A, each pass from an empty cache) so a
load drifting over the run slows every system alike; TTFT statistics then run over both passes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from craft_rag.trace import TraceRequest
from craft_rag_bench.bench.context import BenchContext
from craft_rag_bench.bench.serving import SIDE_BY_SIDE, peer_systems, serve_fresh, served
from craft_rag_bench.bench.ttft_stats import (
    fit_mean,
    fit_rows,
    mirrored_order,
    paired,
    per_request,
    serve_passes,
    summary_row,
)

if TYPE_CHECKING:
    from craft_rag.engine import CraftEngine

WORKLOADS: tuple[str, ...] = ("squad", "mtrag")
MULTI_TURN_BASELINES: tuple[str, ...] = ("no_cache_nodedup", "prefix_cache_nodedup")
TREE = "craft_tree"
"""The system every other is paired with in ``tree_vs`` (issue 16's TTFT target)."""


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
        passes = ctx.sizes.ttft_passes

        def serve_one(name: str, index: int, workload: str = workload, n: int = n) -> Any:
            # The first pass is shared with the kv/quality suites; later ones are served anew.
            if index == 0:
                return served(ctx, workload, n, name, max_tokens=max_tokens)
            return serve_fresh(ctx, workload, n, name, max_tokens=max_tokens)

        runs, pass_info = serve_passes(names, passes, serve_one)
        rows = {name: per_request(rs) for name, rs in runs.items()}
        a, b = fit_rows(rows)
        summaries = {name: summary_row(rs) for name, rs in runs.items()}
        base = summaries["no_cache_nodedup" if multi_turn else "no_cache"]
        systems: dict[str, Any] = {}
        for name, row in summaries.items():
            mean, p50, p99 = row["mean_ttft_ms"], row["p50_ttft_ms"], row["p99_ttft_ms"]
            row["normalised_mean"] = mean / base["mean_ttft_ms"] if base["mean_ttft_ms"] else 0
            row["normalised_p50"] = p50 / base["p50_ttft_ms"] if base["p50_ttft_ms"] else 0
            row["normalised_p99"] = p99 / base["p99_ttft_ms"] if base["p99_ttft_ms"] else 0
            row["speedup_mean"] = base["mean_ttft_ms"] / mean if mean else 0
            row["computed_tokens"] = row["prompt_tokens"] - row["cached_tokens"]
            row["fit_mean_ttft_ms"] = fit_mean(rows[name], (a, b))
            row["residual_mean_ms"] = mean - row["fit_mean_ttft_ms"]
            systems[name] = row
        bound = total_overlap_bound(engine, trace)
        bound_row: dict[str, Any] | None = None
        if bound is not None:
            cached, prompt = bound
            est = (a * len(trace) + b * (prompt - cached)) / len(trace)
            bound_row = {
                "cached_token_fraction": cached / prompt if prompt else 0.0,
                "estimated_mean_ttft_ms": est,
                "estimated_speedup_mean": base["mean_ttft_ms"] / est if est > 0 else None,
            }
        out["workloads"][workload] = {
            "requests": len(trace),
            "systems": systems,
            "total_overlap_bound": bound_row,
            "ttft_fit_ms": {"intercept": a, "per_computed_token": b},
            "baseline": "no_cache_nodedup" if multi_turn else "no_cache",
            "passes": passes,
            "serving_order": mirrored_order(names, passes),
            "pass_info": pass_info,
            "tree_vs": {
                other: paired(rows[TREE], rows[other], (a, b)) for other in rows if other != TREE
            } if TREE in rows else {},
            "per_request": rows,
        }
    return out
