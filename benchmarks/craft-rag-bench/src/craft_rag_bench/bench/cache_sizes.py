"""Suite ``cache-sizes`` (issue 16 item 4, "Small caches"): every system at several KV sizes.

Real KV caches evict. The suite serves the same single-turn requests under every system side by
side (no cache, prefix cache, CRAFT ``frequency``/``tree``, and the peers ContextPilot
online/offline and LongContextReorder when they can run) on one short-lived engine per KV cache
size (vLLM fixes the block count at start-up: ``EngineSettings.num_gpu_blocks_override``).

Sizes are computed from the trace's working set in blocks (:func:`working_set`, token-exact
prompts from the model's tokenizer and chat format in retriever order): ``whole`` holds every
request's blocks (no eviction possible, whatever the order), ``small`` about
:data:`SMALL_REQUESTS` requests, ``medium`` their geometric mean; plain integers are block counts.

The CP-Tree is kept true by KV events: the engine subscribes every planner it serves with to
vLLM's ``BlockRemoved``/``AllBlocksCleared`` (``engine.kv_events``); each row records the
blocks removed and CP-Tree nodes pruned while the system ran. Predicted vs actual per system
(:func:`reuse_accuracy`): predicted = the planner's matched tokens/chunks for each plan
(``ReuseReport.predicted_tokens``/``predicted_chunks``), actual = the engine's cached tokens and
reused chunks (``cached_tokens``/``reused_chunks``).

Not part of ``bench all`` (it starts one engine per size: minutes). The bench's own engine is
closed first (the next suite restarts it lazily); an engine handed in by the caller is never
closed, so then the sweep is skipped (``skipped`` says why).
"""

from __future__ import annotations

import functools
import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from craft_rag.trace import TraceRequest
from craft_rag_bench.bench.context import BenchContext
from craft_rag_bench.bench.serving import SIDE_BY_SIDE, SYSTEMS, peer_systems, serve
from craft_rag_bench.demo import summarise

if TYPE_CHECKING:
    from craft_rag.engine import CraftEngine, GenerationResult
    from craft_rag.prompt import PromptAssembler

SIZE_NAMES: tuple[str, ...] = ("whole", "medium", "small")
DEFAULT_CACHE_SIZES: tuple[str, ...] = SIZE_NAMES
SMALL_REQUESTS = 10
"""``small`` holds about this many (mean-sized) requests."""
WORKLOADS: tuple[str, ...] = ("squad",)
RIVALS: tuple[str, ...] = ("prefix_cache", "contextpilot_online", "contextpilot_offline")
"""The systems CRAFT ``tree`` must stay ahead of at every size (issue 16 targets)."""

EngineFactory = Callable[[int], "CraftEngine"]
"""KV blocks -> a started engine of that many blocks (the caller closes it)."""


@dataclass(frozen=True, slots=True)
class WorkingSet:
    """A trace's KV footprint in blocks of ``block_size`` tokens (retriever order).

    ``request_blocks``: sum over requests of ceil((prompt + max_tokens) / block), what a cache
    needs to never evict; ``distinct_blocks``: distinct full prompt blocks (shared prefixes
    counted once); ``mean_request_blocks``/``max_request_blocks`` per request."""

    requests: int
    block_size: int
    request_blocks: int
    distinct_blocks: int
    mean_request_blocks: float
    max_request_blocks: int


def working_set(
    prompts: Sequence[Sequence[int]], block_size: int, max_tokens: int
) -> WorkingSet:
    """The :class:`WorkingSet` of ``prompts`` (token ids). Full blocks are identified by their
    whole prefix (chained, as vLLM hashes them). ``ValueError`` for no prompts or a block size
    below 1. O(total prompt tokens)."""
    if block_size < 1:
        msg = f"block_size must be >= 1, got {block_size}"
        raise ValueError(msg)
    if not prompts:
        msg = "the working set needs at least one prompt; pass a non-empty trace"
        raise ValueError(msg)
    chains: dict[tuple[int, tuple[int, ...]], int] = {}
    per_request: list[int] = []
    for ids in prompts:
        per_request.append(math.ceil((len(ids) + max(max_tokens, 0)) / block_size))
        parent = -1
        for start in range(0, len(ids) - block_size + 1, block_size):
            key = (parent, tuple(ids[start:start + block_size]))
            parent = chains.setdefault(key, len(chains))
    return WorkingSet(
        requests=len(prompts), block_size=block_size, request_blocks=sum(per_request),
        distinct_blocks=len(chains), mean_request_blocks=sum(per_request) / len(per_request),
        max_request_blocks=max(per_request),
    )


def parse_cache_sizes(text: str) -> tuple[str, ...]:
    """``--cache-sizes`` value: comma-separated ``whole``/``medium``/``small`` or block counts
    (integers >= 1). ``ValueError`` naming the option and the valid forms."""
    parts = tuple(p.strip().lower() for p in text.split(",") if p.strip())
    if not parts:
        msg = "--cache-sizes is empty; pass e.g. whole,medium,small or 64,256,4096"
        raise ValueError(msg)
    for part in parts:
        if part not in SIZE_NAMES and not (part.isdigit() and int(part) >= 1):
            msg = (f"--cache-sizes: {part!r} is neither one of {list(SIZE_NAMES)} nor a block "
                   "count >= 1; pass e.g. whole,medium,small or 64,256,4096")
            raise ValueError(msg)
    return parts


def cache_blocks(sizes: Sequence[str], ws: WorkingSet) -> list[tuple[str, int]]:
    """``(label, KV blocks)`` for each size, largest first, duplicates dropped.

    ``whole`` = every request's blocks + one request more (the warm-up), so nothing is ever
    evicted; ``small`` = :data:`SMALL_REQUESTS` mean requests; ``medium`` = their geometric
    mean. Every size must hold the largest request plus one block (vLLM must fit a running
    request): ``ValueError`` names the minimum."""
    minimum = ws.max_request_blocks + 1
    whole = ws.request_blocks + ws.max_request_blocks
    small = min(whole, max(minimum, math.ceil(SMALL_REQUESTS * ws.mean_request_blocks)))
    named = {"whole": whole, "small": small,
             "medium": max(small, min(whole, round(math.sqrt(whole * small))))}
    out: dict[int, str] = {}
    for size in sizes:
        blocks = named[size] if size in named else int(size)
        if blocks < minimum:
            msg = (f"--cache-sizes: {size} ({blocks} blocks) cannot hold the largest request; "
                   f"use at least {minimum} blocks")
            raise ValueError(msg)
        out.setdefault(blocks, size)
    return [(label, blocks) for blocks, label in sorted(out.items(), reverse=True)]


def reuse_accuracy(results: Sequence[GenerationResult], block_size: int) -> dict[str, Any]:
    """Predicted (the planner's matched prefix) vs actual (the engine's cache) over ``results``.

    Tokens: ``predicted_tokens`` sums the plans' matched tokens (requests with an unknown
    prediction are left out of every predicted/error figure and counted in ``unpredicted``);
    ``over``/``under`` sum per-request excess/shortfall (a prediction ends mid-block, the cache
    holds whole blocks only, so up to ``block_size - 1`` over per request is granularity);
    ``within_block`` is the fraction of predicted requests within one block of the actual and
    ``stale_requests`` counts those predicting at least one whole block the cache did not have
    (a CP-Tree node whose blocks were evicted). Chunks: matched chunks vs chunks lying entirely
    inside the cached tokens."""
    reports = [r.report for r in results]
    known = [r for r in reports if r.predicted_tokens is not None]
    prompt = sum(r.prompt_tokens for r in reports)
    cached = sum(r.cached_tokens for r in reports)
    predicted = sum(r.predicted_tokens or 0 for r in known)
    over = sum(max(0, (r.predicted_tokens or 0) - r.cached_tokens) for r in known)
    under = sum(max(0, r.cached_tokens - (r.predicted_tokens or 0)) for r in known)
    within = sum(1 for r in known if abs((r.predicted_tokens or 0) - r.cached_tokens) < block_size)
    stale = sum(1 for r in known if (r.predicted_tokens or 0) - r.cached_tokens >= block_size)
    return {
        "requests": len(reports),
        "unpredicted": len(reports) - len(known),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "predicted_tokens": predicted,
        "cached_fraction": cached / prompt if prompt else 0.0,
        "predicted_fraction": predicted / prompt if prompt else 0.0,
        "over_predicted_tokens": over,
        "under_predicted_tokens": under,
        "within_block": within / len(known) if known else 0.0,
        "stale_requests": stale,
        "predicted_chunks": sum(r.predicted_chunks for r in reports),
        "reused_chunks": sum(r.reused_chunks for r in reports),
        "over_predicted_chunks": sum(max(0, r.predicted_chunks - r.reused_chunks)
                                     for r in reports),
    }


def verdicts(systems: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per rival present: ``tree`` cached fraction and mean TTFT over the rival's, and whether
    ``tree`` is ahead on each (more cached tokens; lower mean TTFT)."""
    tree = systems.get("craft_tree")
    out: dict[str, Any] = {}
    if tree is None:
        return out
    for rival in RIVALS:
        other = systems.get(rival)
        if other is None:
            continue
        cf, ocf = tree["cached_token_fraction"], other["cached_token_fraction"]
        tt, ott = tree["mean_ttft_ms"], other["mean_ttft_ms"]
        out[rival] = {
            "cached_ratio": cf / ocf if ocf else None,
            "ttft_ratio": tt / ott if ott else None,
            "ahead_cached": cf > ocf,
            "ahead_ttft": tt < ott,
        }
    return out


@contextmanager
def _kv_event_delta(engine: CraftEngine) -> Iterator[dict[str, int]]:
    """Blocks removed / CP-Tree nodes pruned / clears heard while the body ran (zeros when
    the engine hears no KV events)."""
    sync = engine.kv_events
    before = (0, 0, 0) if sync is None else (
        sync.stats.blocks_removed, sync.stats.nodes_removed, sync.stats.clears)
    delta: dict[str, int] = {}
    yield delta
    after = before if sync is None else (
        sync.stats.blocks_removed, sync.stats.nodes_removed, sync.stats.clears)
    delta.update(kv_events=int(sync is not None), blocks_removed=after[0] - before[0],
                 nodes_removed=after[1] - before[1], clears=after[2] - before[2])


def sweep(
    ctx: BenchContext,
    trace: Sequence[TraceRequest],
    sizes: Sequence[tuple[str, int]],
    make_engine: EngineFactory,
    *,
    systems: Sequence[str],
    max_tokens: int,
) -> list[dict[str, Any]]:
    """Serve ``trace`` under every system on one engine per size (closed after it). One row
    per size: each system's TTFT summary, ``normalised_mean`` TTFT (to ``no_cache`` at the
    same size), :func:`reuse_accuracy` and KV-event counts, plus :func:`verdicts`."""
    rows: list[dict[str, Any]] = []
    for label, blocks in sizes:
        started = time.perf_counter()
        engine = make_engine(blocks)
        try:
            per_system: dict[str, dict[str, Any]] = {}
            for name in systems:
                with _kv_event_delta(engine) as events:
                    results = serve(engine, SYSTEMS[name], trace, max_tokens=max_tokens,
                                    desc=f"cache/{label}/{name}", ctx=ctx)
                row = asdict(summarise(results))
                row["accuracy"] = reuse_accuracy(results, engine.block_size)
                row["events"] = events
                per_system[name] = row
            block_size = engine.block_size
        finally:
            engine.close()
        base = per_system.get("no_cache", {}).get("mean_ttft_ms") or 0.0
        for row in per_system.values():
            row["normalised_mean"] = row["mean_ttft_ms"] / base if base else None
        rows.append({
            "size": label, "blocks": blocks, "kv_tokens": blocks * block_size,
            "systems": per_system, "tree_vs": verdicts(per_system),
            "seconds": round(time.perf_counter() - started, 1),
        })
    return rows


def trace_prompts(assembler: PromptAssembler, trace: Sequence[TraceRequest]) -> list[list[int]]:
    """Token-exact prompts of ``trace`` in retriever order (head, chunks, question and tail;
    conversation history is not included)."""
    out = []
    for request in trace:
        ids = list(assembler.head_ids)
        for chunk in request.chunks:
            ids += assembler.chunk_ids(chunk)
        ids += assembler.question_ids(request.query)
        out.append(ids)
    return out


def run(ctx: BenchContext) -> dict[str, Any]:
    from craft_rag.prompt import PromptAssembler

    max_tokens = ctx.sizes.ttft_max_tokens
    out: dict[str, Any] = {"suite": "cache-sizes", "block_size": ctx.block_size,
                           "max_tokens": max_tokens, "small_requests": SMALL_REQUESTS,
                           "workloads": {}}
    if ctx.engine is not None and not ctx.owns_engine:
        out["skipped"] = ("an engine handed in by the caller cannot change its KV size and is "
                          "never closed here; run `craft-rag bench cache-sizes` on its own")
        return out
    ctx.close()  # one engine at a time: the next suite restarts the bench's engine lazily
    assembler = PromptAssembler(ctx.tokenizer(), ctx.prompt_format())
    names = (*SIDE_BY_SIDE, *peer_systems())
    for workload in ctx.workloads(WORKLOADS):
        trace = ctx.trace(workload, ctx.sizes.ttft_requests)
        ws = working_set(trace_prompts(assembler, trace), ctx.block_size, max_tokens)
        sizes = cache_blocks(ctx.sizes.cache_sizes, ws)
        print(f"[bench] cache-sizes {workload}: working set {ws.distinct_blocks} distinct / "
              f"{ws.request_blocks} request blocks; sizes {sizes}", file=sys.stderr)
        rows = sweep(ctx, trace, sizes, functools.partial(_engine, ctx, ws=ws),
                     systems=names, max_tokens=max_tokens)
        out["workloads"][workload] = {
            "requests": len(trace),
            "multi_turn": any(r.conversation_id for r in trace),
            "working_set": asdict(ws),
            "sizes": rows,
        }
    return out


def _engine(ctx: BenchContext, blocks: int, *, ws: WorkingSet) -> CraftEngine:
    """An in-process engine with exactly ``blocks`` KV blocks (and enough memory for them)."""
    from craft_rag.engine import CraftEngine, EngineSettings

    # vLLM refuses a max_model_len its KV blocks cannot hold whole (it keeps one block spare).
    max_len = min(ctx.max_model_len, (blocks - 1) * ctx.block_size)
    if max_len < ws.max_request_blocks * ctx.block_size:
        msg = (f"--max-model-len {ctx.max_model_len} is below the longest request "
               f"({ws.max_request_blocks} blocks); raise it")
        raise ValueError(msg)
    return CraftEngine(EngineSettings(
        block_size=ctx.block_size, max_model_len=max_len, num_gpu_blocks_override=blocks,
    ))


def report_lines(result: dict[str, Any]) -> list[str]:
    """Markdown for the generated report: one table per workload (a row per size and system:
    cached fraction, predicted fraction, over-predicted tokens, mean TTFT and its ratio to
    no cache at that size, KV blocks removed), then ``tree``'s verdict per size."""
    if result.get("skipped"):
        return [f"Skipped: {result['skipped']}."]
    out: list[str] = []
    for workload, w in result["workloads"].items():
        ws = w["working_set"]
        out += [f"{workload}: {w['requests']} requests, working set {ws['distinct_blocks']:,} "
                f"distinct blocks ({ws['request_blocks']:,} request blocks) of "
                f"{ws['block_size']} tokens.", "",
                "| size | blocks | system | cached | predicted | over-predicted tokens | "
                "stale predictions | mean TTFT ms | vs no cache | KV blocks removed |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        verdict_lines = []
        for row in w["sizes"]:
            for name, s in row["systems"].items():
                a = s["accuracy"]
                norm = s.get("normalised_mean")
                out.append(
                    f"| {row['size']} | {row['blocks']:,} | {name} | "
                    f"{100 * a['cached_fraction']:.1f}% | {100 * a['predicted_fraction']:.1f}% | "
                    f"{a['over_predicted_tokens']:,} | {a['stale_requests']} | "
                    f"{s['mean_ttft_ms']:.0f} | "
                    f"{'-' if norm is None else f'{norm:.2f}'} | "
                    f"{s['events'].get('blocks_removed', 0):,} |")
            parts = [
                f"{rival} {'ahead' if v['ahead_cached'] else 'NOT ahead'} on cached tokens"
                f" ({_ratio(v['cached_ratio'])}), "
                f"{'ahead' if v['ahead_ttft'] else 'NOT ahead'} on mean TTFT"
                f" ({_ratio(v['ttft_ratio'])})"
                for rival, v in row["tree_vs"].items()
            ]
            verdict_lines.append(f"- {row['size']}: tree vs " + "; ".join(parts))
        out += ["", *verdict_lines, ""]
    return out


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"
