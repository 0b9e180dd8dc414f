"""Suite ``chunk-cache-speed``: chunk-caches fixed by selective recomputation, side by side with
CRAFT alone (issue 28's speed targets).

Three systems serve the same single-turn requests, one after the other in one bench run, each
on its own engine in its own process (:mod:`craft_rag_bench.bench.chunk_cache_speed_worker`),
so each starts from empty caches:

- ``craft``: CRAFT's CP-Tree order (``tree``), vLLM's exact prefix caching only;
- ``craft_chunk_cache``: ``craft`` plus chunk-caches (``EngineSettings(chunk_cache=
  ChunkCacheSettings(rule, fraction))``: a chunk's KV cached once, re-rotated to its new
  position and fixed by recomputing ``fraction`` of its tokens, chosen by ``rule``);
- ``retriever_chunk_cache``: chunk-caches with the retriever's chunk order (``retriever``).

Per system (:func:`summarise`): mean/p50/p99 TTFT (submission to first token), the prompt's
tokens by origin (``exact`` prefix hits, ``fixed`` chunk-cache tokens used as they were,
``recomputed`` by the connector's own model copy, ``computed`` by vLLM) from each request's
``ReuseReport``, ``computed_fraction`` = (recomputed + computed) / prompt tokens, approximate
requests and refusals (with their reasons), and ``time_split`` (:func:`time_split`: where the
TTFT goes, from a non-negative least-squares fit of each request's TTFT on its token counts;
the connector reports counts, not times). ``agreement``: greedy outputs equal to ``craft``'s
on the same request and prompt. ``per_request``: the rows behind it all (no reply tokens).

Per workload, ``bound`` (:func:`trace_bound`, no engine, seconds): the paper's Prefix and Total
overlap of the trace (chunk ids, the retriever's order), ``computed_ceiling`` = 1 - Total
overlap (the target: chunk-caches must compute less than that, i.e. reuse past what any prefix
order reaches), the exact-prefix ceilings of CRAFT's and the retriever's order without eviction
(:func:`craft_rag_bench.bench.tiers_bound.simulate_cached`) and ``seen_token_fraction``: the
prompt tokens in chunks some earlier request held, plus the system prompt (what chunk-caches
could reuse at best).

Verdicts (:func:`verdicts`) against :data:`TARGETS`: ``craft`` / ``craft_chunk_cache`` mean
TTFT >= 1.5x, ``retriever_chunk_cache`` / ``craft_chunk_cache`` >= 1.2x, and
``craft_chunk_cache``'s computed fraction below the ceiling.

Not part of ``bench all`` (three engine starts per workload). ``--quick``: 4 requests of each
workload, 2 generated tokens. ``--trace FILE --requests N`` serves that trace instead.

JSON layout (``results`` of the suite): ``{"suite": "chunk-cache-speed", "rule", "fraction",
"max_tokens", "systems": [names], "targets": {...}, "workloads": {name: {"requests",
"bound": {"prefix_overlap", "total_overlap", "computed_ceiling", "unbounded_craft",
"unbounded_prefix", "seen_token_fraction", "prompt_tokens"}, "systems": {name: {"requests",
"prompt_tokens", "cached_tokens", "cached_token_fraction", "mean_ttft_ms", "p50_ttft_ms",
"p99_ttft_ms", "tokens": {"exact", "fixed", "recomputed", "computed"}, "computed_fraction",
"approximate_requests", "refused_requests", "refusals": {reason: count}, "counts_from":
{source: count}, "time_split": {"ms_per_request", "ms_per_token": {origin: ms | null},
"share": {"base", origin: share}, "unexplained_share", "r2", "requests"} | null,
"agreement": {...} | null, "engine_start_s", "serve_s", "per_request": [{"id", "ttft_ms",
"prompt_tokens", "exact", "fixed", "recomputed", "computed", "approximate", "refused"}]} |
{"error"}}, "verdicts": {...}, "seconds"}}}``.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from craft_rag.files import write_atomic
from craft_rag.metrics import prefix_overlap, total_overlap
from craft_rag.prompt import PromptAssembler
from craft_rag.trace import TraceRequest
from craft_rag_bench.bench.chunk_cache_speed_worker import SpeedSpec
from craft_rag_bench.bench.context import BenchContext
from craft_rag_bench.bench.tiers_bound import simulate_cached
from craft_rag_bench.demo import request_summary

WORKLOADS: tuple[str, ...] = ("squad", "hotpotqa")
REQUESTS = 300
QUICK_REQUESTS = 4
MAX_TOKENS = 4
QUICK_MAX_TOKENS = 2
RULE = "kv_deviation"
FRACTION = 0.3
"""The recompute setting served (the quality suite's best: ``kv_deviation`` at 30%)."""
REFERENCE = "craft"
BLENDED = "craft_chunk_cache"


@dataclass(frozen=True, slots=True)
class SpeedSystem:
    """One system: the planner policy and whether the engine has chunk-caches."""

    name: str
    planner: str
    chunk_cache: bool


SYSTEMS: dict[str, SpeedSystem] = {
    s.name: s
    for s in (
        SpeedSystem("craft", "tree", False),
        SpeedSystem("craft_chunk_cache", "tree", True),
        SpeedSystem("retriever_chunk_cache", "retriever", True),
    )
}
"""Name -> system, in the order they are served."""


@dataclass(frozen=True, slots=True)
class Targets:
    """Issue 28's speed targets."""

    craft_over_chunk_cache: float = 1.5
    """``craft``'s mean TTFT over ``craft_chunk_cache``'s, at least."""
    retriever_over_craft_chunk_cache: float = 1.2
    """``retriever_chunk_cache``'s mean TTFT over ``craft_chunk_cache``'s, at least."""


TARGETS = Targets()

Runner = Callable[[SpeedSpec], dict[str, Any]]
"""A worker spec -> the worker's JSON result (:func:`run_worker_process`; fakes in tests)."""


# --------------------------------------------------------------------------- bound


def trace_bound(
    trace: Sequence[TraceRequest], assembler: PromptAssembler, block_size: int
) -> dict[str, Any]:
    """The load-free figures of one trace (see the module). ``ValueError`` for a multi-turn
    trace (from :func:`simulate_cached`). Cost: O(prompt tokens) tokenizing and hashing, two
    planner runs: seconds for 300 requests."""
    orders = [tuple(c.key for c in r.chunks) for r in trace]
    total = total_overlap(orders)
    craft = simulate_cached(trace, assembler, "tree", block_size)
    retriever = simulate_cached(trace, assembler, "retriever", block_size)
    seen: set[object] = set()
    reusable = prompt_tokens = 0
    for i, request in enumerate(trace):
        prompt = assembler.single_turn(list(request.chunks), request.query)
        prompt_tokens += prompt.num_tokens
        if i > 0:
            reusable += prompt.prefix_tokens
        for chunk, (start, end) in zip(request.chunks, prompt.chunk_spans, strict=True):
            if chunk.key in seen:
                reusable += end - start
        seen.update(c.key for c in request.chunks)
    return {
        "prefix_overlap": prefix_overlap(orders),
        "total_overlap": total,
        "computed_ceiling": 1.0 - total,
        "unbounded_craft": craft.fraction,
        "unbounded_prefix": retriever.fraction,
        "seen_token_fraction": reusable / prompt_tokens if prompt_tokens else 0.0,
        "prompt_tokens": prompt_tokens,
    }


# --------------------------------------------------------------------------- per system


def summarise(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One system's aggregates over its request rows (see the module). O(n log n)."""
    out = request_summary([float(r["ttft_ms"]) for r in rows],
                          sum(int(r["prompt_tokens"]) for r in rows),
                          sum(int(r["cached_tokens"]) for r in rows))
    tokens = {k: sum(int(r[k]) for r in rows) for k in ("exact", "fixed", "recomputed",
                                                         "computed")}
    prompt = out["prompt_tokens"]
    refusals = Counter(str(r["refused"]) for r in rows if r.get("refused"))
    out.update({
        "tokens": tokens,
        "computed_fraction": ((tokens["recomputed"] + tokens["computed"]) / prompt
                              if prompt else 0.0),
        "approximate_requests": sum(1 for r in rows if r.get("approximate")),
        "refused_requests": sum(refusals.values()),
        "refusals": dict(refusals.most_common()),
        "counts_from": dict(Counter(str(r.get("counts_from", "?")) for r in rows)),
        "time_split": time_split(rows),
    })
    return out


SPLIT_COLUMNS: tuple[str, ...] = ("fixed", "recomputed", "computed")
MIN_SPLIT_REQUESTS = 8


def time_split(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """Where one system's TTFT goes: the non-negative least-squares fit ``ttft_ms ~ base + a *
    fixed + b * recomputed + c * computed`` over its requests (ms per token of each origin:
    ``fixed`` is loading and re-rotating, ``recomputed`` the connector's model copy,
    ``computed`` vLLM; an origin no request has is left out, its cost None) and each term's
    share of the summed TTFT. Costs are kept >= 0 (an unconstrained fit on a few dozen noisy
    requests gives negative per-token costs). An estimate (few requests, a shared machine), not
    a timer. None below :data:`MIN_SPLIT_REQUESTS` requests or with no token counts at all.
    O(n)."""
    used = [c for c in SPLIT_COLUMNS if any(int(r[c]) for r in rows)]
    if len(rows) < MIN_SPLIT_REQUESTS or not used:
        return None
    import numpy as np
    from scipy.optimize import nnls

    x = np.array([[1.0] + [float(r[c]) for c in used] for r in rows])
    y = np.array([float(r["ttft_ms"]) for r in rows])
    coef, _ = nnls(x, y)
    total = float(y.sum())
    terms = {"base": float(coef[0]) * len(rows)}
    terms.update({c: float(coef[i + 1]) * float(x[:, i + 1].sum()) for i, c in enumerate(used)})
    cost = dict.fromkeys(SPLIT_COLUMNS)
    cost.update({c: float(coef[i + 1]) for i, c in enumerate(used)})
    return {
        "ms_per_request": float(coef[0]),
        "ms_per_token": cost,
        "share": {k: v / total if total else None for k, v in terms.items()},
        "unexplained_share": 1.0 - sum(terms.values()) / total if total else None,
        "r2": _r2(x, y, coef),
        "requests": len(rows),
    }


def _r2(x: Any, y: Any, coef: Any) -> float | None:
    residual = float(((y - x @ coef) ** 2).sum())
    spread = float(((y - y.mean()) ** 2).sum())
    return 1.0 - residual / spread if spread else None


COMPACT_FIELDS: tuple[str, ...] = ("id", "ttft_ms", "prompt_tokens", "exact", "fixed",
                                   "recomputed", "computed", "approximate", "refused")


def compact_rows(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The per-request rows kept in the JSON (no reply tokens, no prompt digest): for fits
    and plots after the run."""
    return [{k: r.get(k) for k in COMPACT_FIELDS} for r in rows]


def agreement(
    reference: Sequence[Mapping[str, Any]], rows: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """Greedy outputs of ``rows`` against the reference's, on the requests with the same id and
    the same prompt (``prompt_sha256``): how many, and how many identical (approximate KV may
    change a reply; an exact one must not)."""
    same_prompt = identical = approximate = approximate_identical = 0
    for ref, row in zip(reference, rows, strict=False):
        if ref["id"] != row["id"] or ref["prompt_sha256"] != row["prompt_sha256"]:
            continue
        same_prompt += 1
        same = list(ref["output_ids"]) == list(row["output_ids"])
        identical += same
        if row.get("approximate"):
            approximate += 1
            approximate_identical += same
    return {"same_prompt": same_prompt, "identical": identical,
            "approximate": approximate, "approximate_identical": approximate_identical}


def verdicts(
    systems: Mapping[str, Mapping[str, Any]], bound: Mapping[str, Any] | None,
    targets: Targets = TARGETS,
) -> dict[str, Any]:
    """The ratios of the targets and whether each is met (None where a system is missing or
    failed, or a denominator is zero)."""
    ok = {n: s for n, s in systems.items() if "error" not in s}
    blended = ok.get(BLENDED)
    out: dict[str, Any] = {}
    if blended is None:
        return out
    for name, key, target in (
            (REFERENCE, "craft_over_chunk_cache", targets.craft_over_chunk_cache),
            ("retriever_chunk_cache", "retriever_over_craft_chunk_cache",
             targets.retriever_over_craft_chunk_cache)):
        other = ok.get(name)
        ratio = (None if other is None or not blended["mean_ttft_ms"]
                 else other["mean_ttft_ms"] / blended["mean_ttft_ms"])
        p50 = (None if other is None or not blended["p50_ttft_ms"]
               else other["p50_ttft_ms"] / blended["p50_ttft_ms"])
        out[key] = {"mean_ttft_ratio": ratio, "p50_ttft_ratio": p50, "target": target,
                    "met": None if ratio is None else ratio >= target}
    if bound is not None:
        ceiling = bound["computed_ceiling"]
        out["computed_below_ceiling"] = {
            "computed_fraction": blended["computed_fraction"], "ceiling": ceiling,
            "met": blended["computed_fraction"] < ceiling}
    return out


# --------------------------------------------------------------------------- running


def side_by_side(base: SpeedSpec, systems: Sequence[str], runner: Runner) -> dict[str, Any]:
    """Run every system of ``systems`` (in :data:`SYSTEMS` order) through ``runner``, ``base``
    giving the trace and sizes. Returns name -> :func:`summarise` row (or ``{"error"}``), each
    chunk-cache system's ``agreement`` with ``craft`` when it ran. ``ValueError`` for an
    unknown system."""
    unknown = [n for n in systems if n not in SYSTEMS]
    if unknown:
        msg = f"unknown chunk-cache-speed systems {unknown}; valid: {list(SYSTEMS)}"
        raise ValueError(msg)
    workers: dict[str, dict[str, Any]] = {}
    for name in (n for n in SYSTEMS if n in systems):
        system = SYSTEMS[name]
        spec = SpeedSpec(**{**asdict(base), "system": name, "planner": system.planner,
                            "chunk_cache": system.chunk_cache})
        started = time.perf_counter()
        workers[name] = runner(spec)
        print(f"[bench] chunk-cache-speed {name}: {time.perf_counter() - started:.0f} s"
              + (f" (failed: {workers[name]['error'][:200]})" if "error" in workers[name]
                 else ""), file=sys.stderr)
    ref = workers.get(REFERENCE)
    reference = ref["requests"] if ref is not None and "error" not in ref else None
    out: dict[str, Any] = {}
    for name, worker in workers.items():
        if "error" in worker:
            out[name] = {"error": worker["error"]}
            continue
        row = summarise(worker["requests"])
        row["agreement"] = (agreement(reference, worker["requests"])
                            if reference is not None and SYSTEMS[name].chunk_cache else None)
        row["engine_start_s"] = worker.get("engine_start_s")
        row["serve_s"] = worker.get("serve_s")
        row["per_request"] = compact_rows(worker["requests"])
        out[name] = row
    return out


def run_worker_process(spec: SpeedSpec, *, workdir: Path) -> dict[str, Any]:
    """Run ``spec`` in a fresh ``python -m craft_rag_bench.bench.chunk_cache_speed_worker``
    process (its output forwarded to stderr, so ``--json`` stdout stays clean) and return its
    JSON result, or ``{"error": ...}`` with the exit status and the output's last lines."""
    import json

    spec_path = workdir / f"{spec.system}.spec.json"
    out_path = workdir / f"{spec.system}.out.json"
    write_atomic(spec_path, spec.to_json())
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env.setdefault("HF_HUB_OFFLINE", "1")
    tail: deque[str] = deque(maxlen=30)
    with subprocess.Popen(
        [sys.executable, "-m", "craft_rag_bench.bench.chunk_cache_speed_worker",
         str(spec_path), str(out_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stderr.write(line)
            tail.append(line)
    if proc.returncode != 0 or not out_path.is_file():
        return {"error": f"worker exited {proc.returncode}: " + "".join(tail)[-3000:]}
    result: dict[str, Any] = json.loads(out_path.read_text(encoding="utf-8"))
    return result


def run(ctx: BenchContext, runner: Runner | None = None) -> dict[str, Any]:
    """The suite (see the module). ``runner`` replaces the worker processes (tests)."""
    from craft_rag.trace import write_trace

    requests = QUICK_REQUESTS if ctx.quick else REQUESTS
    max_tokens = QUICK_MAX_TOKENS if ctx.quick else MAX_TOKENS
    out: dict[str, Any] = {
        "suite": "chunk-cache-speed", "rule": RULE, "fraction": FRACTION,
        "max_tokens": max_tokens, "block_size": ctx.block_size, "systems": list(SYSTEMS),
        "targets": asdict(TARGETS), "workloads": {},
    }
    if runner is None and ctx.engine is not None and not ctx.owns_engine:
        out["skipped"] = ("an engine handed in by the caller cannot switch chunk-caches on; run "
                          "`craft-rag bench chunk-cache-speed` on its own")
        return out
    if runner is None:
        ctx.close()  # one engine at a time: every system starts its own, in its own process
    assembler = PromptAssembler(ctx.tokenizer(), ctx.prompt_format())
    for workload in ctx.workloads(WORKLOADS):
        trace = ctx.trace(workload, requests)
        started = time.perf_counter()
        bound = trace_bound(trace, assembler, ctx.block_size)
        print(f"[bench] chunk-cache-speed {workload}: {len(trace)} requests, Total overlap "
              f"{bound['total_overlap']:.3f}", file=sys.stderr)
        workdir = Path(tempfile.mkdtemp(prefix="craft-chunk-speed-"))
        try:
            trace_path = workdir / "trace.jsonl"
            write_trace(trace, trace_path)
            base = SpeedSpec(system="", planner="", trace_path=str(trace_path),
                             block_size=ctx.block_size, max_model_len=ctx.max_model_len,
                             max_tokens=max_tokens, rule=RULE, fraction=FRACTION,
                             progress=ctx.progress)
            systems = side_by_side(
                base, list(SYSTEMS),
                runner or functools.partial(run_worker_process, workdir=workdir))
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        out["workloads"][workload] = {
            "requests": len(trace), "bound": bound, "systems": systems,
            "verdicts": verdicts(systems, bound),
            "seconds": round(time.perf_counter() - started, 1),
        }
    return out


# --------------------------------------------------------------------------- report


def report_lines(result: Mapping[str, Any]) -> list[str]:
    """Markdown for the generated report: per workload a table of the systems, the bound, where
    the time goes and the verdicts."""
    if result.get("skipped"):
        return [f"Skipped: {result['skipped']}."]
    out: list[str] = []
    for workload, w in result["workloads"].items():
        b = w["bound"]
        out += [f"{workload}: {w['requests']} requests; chunk-caches `{result['rule']}` at "
                f"{100 * result['fraction']:.0f}% recomputed; Total overlap "
                f"{b['total_overlap']:.3f} (computed ceiling {b['computed_ceiling']:.3f}), "
                f"Prefix overlap {b['prefix_overlap']:.3f}; exact-prefix ceiling CRAFT "
                f"{100 * b['unbounded_craft']:.1f}% / retriever {100 * b['unbounded_prefix']:.1f}%,"
                f" tokens in chunks seen before (+ system prompt) "
                f"{100 * b['seen_token_fraction']:.1f}%.", "",
                "| system | mean TTFT ms | p50 | p99 | computed | exact / fixed / recomputed / "
                "computed tokens | approximate | refused | same reply as craft |",
                "|---|---|---|---|---|---|---|---|---|"]
        for name, s in w["systems"].items():
            if "error" in s:
                out.append(f"| {name} | failed: {s['error'][:80]!r} | | | | | | | |")
                continue
            t, a = s["tokens"], s.get("agreement")
            out.append(
                f"| {name} | {s['mean_ttft_ms']:.0f} | {s['p50_ttft_ms']:.0f} | "
                f"{s['p99_ttft_ms']:.0f} | {100 * s['computed_fraction']:.1f}% | "
                f"{t['exact']:,} / {t['fixed']:,} / {t['recomputed']:,} / {t['computed']:,} | "
                f"{s['approximate_requests']} | {s['refused_requests']} | "
                + ("-" if not a else f"{a['identical']}/{a['same_prompt']}") + " |")
        out.append("")
        for name, s in w["systems"].items():
            split = s.get("time_split")
            if split:
                share = split["share"]
                out.append(f"- {name} time split (least squares, R² {_fmt(split['r2'], '.2f')}):"
                           + ", ".join(f" {k} {_fmt(None if v is None else 100 * v, '.0f')}%"
                                       for k, v in share.items())
                           + "; ms/token " + ", ".join(
                               f"{k} {_fmt(v, '.2f')}" for k, v in split["ms_per_token"].items())
                           + f", {split['ms_per_request']:.0f} ms/request")
            if s.get("refusals"):
                out.append(f"- {name} refusals: {s['refusals']}")
        for key, v in w["verdicts"].items():
            if key == "computed_below_ceiling":
                out.append(f"- craft_chunk_cache computes {100 * v['computed_fraction']:.1f}% of "
                           f"prompt tokens vs ceiling {100 * v['ceiling']:.1f}% (met: {v['met']})")
            else:
                out.append(f"- {key}: mean TTFT {_fmt(v['mean_ttft_ratio'], '.2f')}x, p50 "
                           f"{_fmt(v['p50_ttft_ratio'], '.2f')}x (target {v['target']}x, met: "
                           f"{v['met']})")
        out.append("")
    return out


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)
