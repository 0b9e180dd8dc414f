"""Suite ``kv`` (paper Fig. 12; issue 4's simulator agreement and block-size choice).

KV computation = prompt tokens - vLLM's ``num_cached_tokens``, summed over a run, from the
ENGINE. The reduction is relative to vLLM prefix caching with the retriever's order and no
dedup (the deployed baseline), split into

- ``cross_request``: CRAFT's reordering (CRAFT without dedup vs the baseline), and
- ``conversation``: conversation-scoped dedup on top (CRAFT with dedup vs without),

on the single-turn trace (dedup does nothing there) and on MTRAG. Also reported against no
prefix caching at all (every prompt token computed).

Simulator agreement: the same trace replayed by :func:`craft_rag.replay.replay` with the same
planner settings, tokenizer, chat format, block size and KV capacity, and (``cache_model``) the
engine's exact prompt ids fed through :class:`SimulatedPrefixCache`; on MTRAG the replay's
history uses the engine's replies (the trace's reference answers are not what was served).

Block size: the simulator's reuse at 32/64/128 on both traces, and an engine check: the first
``block_check_requests`` single-turn requests served under prefix caching and CRAFT ``tree`` by
a short-lived engine per block size (vLLM fixes the block size at start-up). The bench's own
engine is closed for it and restarted lazily by the next suite (a restart takes seconds); an
engine handed in by the caller is never closed, so then the check is skipped.

Peers (ContextPilot online/offline, LongContextReorder) are served on the same engine; each
workload's ``peers`` holds their reductions and ``cached_token_fraction`` every system's
engine cached-token fraction.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from craft_rag.prefix_cache_sim import SimulatedPrefixCache
from craft_rag.trace import TraceRequest
from craft_rag_bench.bench.context import BenchContext, engine_kv_tokens
from craft_rag_bench.bench.overlap import replay_policy
from craft_rag_bench.bench.serving import SYSTEMS, peer_systems, serve, served
from craft_rag_bench.bench.ttft import WORKLOADS, workload_requests

if TYPE_CHECKING:
    from craft_rag.engine import GenerationResult

BASELINE = "prefix_cache_nodedup"
SINGLE_TURN_SYSTEMS = ("no_cache", "prefix_cache", "craft_frequency", "craft_tree")
MULTI_TURN_SYSTEMS = (
    "no_cache_nodedup", "no_cache", "prefix_cache_nodedup", "craft_frequency_nodedup",
    "craft_frequency", "craft_tree_nodedup", "craft_tree", "prefix_cache",
)
AGREEMENT_SYSTEMS = ("prefix_cache", "craft_frequency", "craft_tree")


def _totals(results: list[GenerationResult]) -> tuple[int, int]:
    prompt = sum(r.report.prompt_tokens for r in results)
    cached = sum(r.report.cached_tokens for r in results)
    return prompt, cached


def _fraction(results: list[GenerationResult]) -> float:
    prompt, cached = _totals(results)
    return cached / prompt if prompt else 0.0


def _reduction(results: dict[str, list[GenerationResult]], multi_turn: bool) -> dict[str, Any]:
    computed = {n: p - c for n, (p, c) in ((n, _totals(rs)) for n, rs in results.items())}
    no_cache_prompt = _totals(results["no_cache_nodedup" if multi_turn else "no_cache"])[0]
    base_name = BASELINE if multi_turn else "prefix_cache"
    base = computed[base_name]
    out: dict[str, Any] = {"baseline": base_name, "computed_tokens": computed,
                           "no_cache_tokens": no_cache_prompt}
    for policy in ("frequency", "tree"):
        full = computed[f"craft_{policy}"]
        reorder_only = computed[f"craft_{policy}_nodedup"] if multi_turn else full
        out[policy] = {
            "cross_request": (base - reorder_only) / base if base else 0.0,
            "conversation": (reorder_only - full) / base if base else 0.0,
            "total_vs_prefix_cache": (base - full) / base if base else 0.0,
            "total_vs_no_cache": (no_cache_prompt - full) / no_cache_prompt
            if no_cache_prompt else 0.0,
        }
    out["peers"] = {
        name: {
            "total_vs_prefix_cache": (base - computed[name]) / base if base else 0.0,
            "total_vs_no_cache": (no_cache_prompt - computed[name]) / no_cache_prompt
            if no_cache_prompt else 0.0,
            "cached_token_fraction": _fraction(results[name]),
        }
        for name in results if SYSTEMS[name].peer is not None
    }
    out["cached_token_fraction"] = {name: _fraction(rs) for name, rs in results.items()}
    if multi_turn:
        with_dedup = computed["prefix_cache"]
        out["prefix_cache_with_dedup_vs_baseline"] = (base - with_dedup) / base if base else 0.0
    return out


def _agreement(
    ctx: BenchContext,
    workload: str,
    trace: list[TraceRequest],
    results: list[GenerationResult],
    system_name: str,
) -> dict[str, Any]:
    engine = ctx.get_engine()
    system = SYSTEMS[system_name]
    if any(r.conversation_id for r in trace):
        trace = [replace(r, answer=g.text) for r, g in zip(trace, results, strict=True)]
    capacity = engine_kv_tokens(engine)
    sim = replay_policy(ctx, trace, system.config, block_size=engine.block_size,
                        cache_tokens=capacity, max_model_len=engine.max_model_len,
                        max_tokens=ctx.sizes.ttft_max_tokens)
    prompt, cached = _totals(results)
    cache = SimulatedPrefixCache(engine.block_size, capacity or (1 << 20))
    model_cached = sum(cache.serve(list(r.prompt_token_ids)) for r in results)
    engine_fraction = cached / prompt if prompt else 0.0
    return {
        "workload": workload,
        "system": system_name,
        "engine_reused_token_fraction": engine_fraction,
        "replay_reused_token_fraction": sim.reused_token_fraction,
        "cache_model_reused_token_fraction": model_cached / prompt if prompt else 0.0,
        "difference_points": 100 * (sim.reused_token_fraction - engine_fraction),
        "engine_prompt_tokens": prompt,
        "replay_prompt_tokens": sim.prompt_tokens,
        "kv_capacity_tokens": capacity,
    }


def run(ctx: BenchContext) -> dict[str, Any]:
    engine = ctx.get_engine()
    max_tokens = ctx.sizes.ttft_max_tokens
    out: dict[str, Any] = {"suite": "kv", "block_size": engine.block_size,
                           "max_tokens": max_tokens, "workloads": {}, "agreement": [],
                           "block_sizes": []}
    for workload in ctx.workloads(WORKLOADS):
        n = workload_requests(ctx, workload)
        trace = ctx.trace(workload, n)
        multi_turn = any(r.conversation_id for r in trace)
        names = MULTI_TURN_SYSTEMS if multi_turn else SINGLE_TURN_SYSTEMS
        names = (*names, *peer_systems())
        results = {name: served(ctx, workload, n, name, max_tokens=max_tokens)
                   for name in names}
        out["workloads"][workload] = {
            "requests": len(trace),
            "multi_turn": multi_turn,
            **_reduction(results, multi_turn),
        }
        for name in AGREEMENT_SYSTEMS:
            out["agreement"].append(_agreement(ctx, workload, trace, results[name], name))
        for block in ctx.sizes.block_sizes:
            for name in ("prefix_cache", "craft_tree"):
                sim = replay_policy(ctx, trace, SYSTEMS[name].config, block_size=block,
                                    cache_tokens=engine_kv_tokens(engine))
                out["block_sizes"].append({
                    "workload": workload, "system": name, "block_size": block,
                    "reused_token_fraction": sim.reused_token_fraction,
                    "computed_tokens": sim.prompt_tokens - sim.cached_tokens,
                })
    out["engine_block_sizes"] = _engine_block_sizes(ctx)
    return out


def _engine_block_sizes(ctx: BenchContext) -> list[dict[str, Any]]:
    """Serve the same single-turn requests at each block size on its own engine."""
    if ctx.engine is not None and not ctx.owns_engine:
        return []
    from craft_rag.engine import CraftEngine, EngineSettings
    from craft_rag_bench.demo import summarise

    workload = ctx.workloads(["squad"])[0]
    n = ctx.sizes.block_check_requests
    trace = [r for r in ctx.trace(workload, n) if r.conversation_id is None]
    if not trace:
        return []
    ctx.close()
    rows: list[dict[str, Any]] = []
    for block in ctx.sizes.block_sizes:
        with CraftEngine(EngineSettings(block_size=block, max_model_len=ctx.max_model_len)) as e:
            for name in ("prefix_cache", "craft_tree"):
                results = serve(e, SYSTEMS[name], trace, max_tokens=ctx.sizes.ttft_max_tokens,
                                desc=f"kv/block{block}/{name}", ctx=ctx)
                s = summarise(results)
                rows.append({
                    "workload": workload, "system": name, "block_size": block,
                    "requests": s.requests, "mean_ttft_ms": s.mean_ttft_ms,
                    "p50_ttft_ms": s.p50_ttft_ms, "cached_token_fraction":
                    s.cached_token_fraction,
                })
    return rows
