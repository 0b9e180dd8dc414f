"""Suite ``tiers``: KV beyond the engine's pool, side by side (craft-rag's RAM/disk KV tiers).

Four systems serve the same single-turn requests, each on its own engine in its own process
(:mod:`craft_rag_bench.bench.tiers_worker`; vLLM's process-global state and the connector's
store must not carry over from one system to the next):

- ``prefix``: vLLM prefix caching, the retriever's chunk order;
- ``craft``: CRAFT's CP-Tree order (``tree``), prefix caching;
- ``craft_tier_lru`` / ``craft_tier_pgdsf``: ``craft`` plus the craft-rag KV connector
  (``craft_rag.kvtiers.connector.CraftTierConnector``, loaded by module path) with a RAM tier
  and a disk tier (default 1 GiB / 4 GiB, a fresh private folder per system, removed after)
  under the LRU or PGDSF replacement policy.

The engine's pool is small on purpose: :func:`pool_blocks` holds about ``pool_requests``
(default 4) mean-sized prompts of the trace (its working set in retriever order, as the
``cache-sizes`` suite computes it), so reuse beyond the last few prompts must come from a tier.

Measured per system (:func:`summarise_requests`): cached-token fraction (vLLM's
``num_cached_tokens``, which counts tier-loaded tokens too), mean/p50/p99 TTFT (wall clock,
submission to first token: tier load time included), the connector's store statistics and
tier hit ratio (:func:`tier_tokens`: of the prompt tokens the pool lacked, the fraction a tier
served, from the connector's per-request counts), and exactness
(:func:`exactness`): each tier system's greedy outputs against ``craft``'s on the same
requests. With ``--verify-tier-hits`` each tier system also serves every tier-hit prompt again
from scratch, compared in :mod:`craft_rag_bench.bench.tiers_recompute` (no second system
needed). Verdicts (:func:`verdicts`) against the targets in :data:`TARGETS`.
``--systems`` serves a subset (default: all four).

Per workload, ``bound`` (:mod:`craft_rag_bench.bench.tiers_bound`, no engine, seconds): the
cached-token fractions a simulated prefix cache gives CRAFT's order without eviction, on the
pool alone and on pool + tiers, and the largest cached ratio over ``craft`` any tier could
reach. ``bound_only`` (``--bound-only``) computes only that and starts no engine.

Not part of ``bench all`` (four engine starts per workload: minutes). The bench's own engine is
closed first; an engine handed in by the caller cannot run here (``skipped`` says why; the
bound alone still runs).
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from craft_rag.files import write_atomic
from craft_rag_bench.bench.cache_sizes import WorkingSet, trace_prompts, working_set
from craft_rag_bench.bench.context import BenchContext
from craft_rag_bench.bench.tiers_bound import bound, model_block_bytes
from craft_rag_bench.bench.tiers_recompute import recompute_check
from craft_rag_bench.bench.tiers_worker import WorkerSpec
from craft_rag_bench.demo import request_summary

WORKLOADS: tuple[str, ...] = ("squad", "hotpotqa")
REFERENCE = "craft"
"""The system every tier system is compared with (same planner, no tiers)."""


@dataclass(frozen=True, slots=True)
class TierSystem:
    """One system of the suite: the planner policy and the tier policy (None: no tiers)."""

    name: str
    planner: str
    tier_policy: str | None = None


SYSTEMS: dict[str, TierSystem] = {
    s.name: s
    for s in (
        TierSystem("prefix", "retriever"),
        TierSystem("craft", "tree"),
        TierSystem("craft_tier_lru", "tree", "lru"),
        TierSystem("craft_tier_pgdsf", "tree", "pgdsf"),
    )
}
"""Name -> system, in the order they are served."""

TIERED: tuple[str, ...] = tuple(n for n, s in SYSTEMS.items() if s.tier_policy is not None)


@dataclass(frozen=True, slots=True)
class Targets:
    """What the suite checks (the KV-tier targets)."""

    cached_ratio: float = 1.5
    """A tier system's cached-token fraction over ``craft``'s, at least."""
    ttft_speedup: float = 1.3
    """``craft``'s mean TTFT over a tier system's, at least."""
    pgdsf_over_lru_hit_ratio: float = 1.0
    """PGDSF's tier hit ratio over LRU's, at least."""
    exact_requests: int = 50
    """Requests served from tier hits whose greedy outputs equal ``craft``'s (and, with
    ``--verify-tier-hits``, a from-scratch recompute's), at least."""


TARGETS = Targets()

Runner = Callable[[WorkerSpec], dict[str, Any]]
"""A worker spec -> the worker's JSON result (:func:`run_worker_process`; fakes in tests)."""


def pool_blocks(ws: WorkingSet, pool_requests: int) -> int:
    """KV blocks of the engine's pool: ``pool_requests`` mean-sized requests (rounded up), at
    least the largest request plus one block (vLLM must fit a running request) and at most
    every request's blocks plus the largest (the ``whole`` cache: nothing evicted).
    ``ValueError`` for ``pool_requests`` < 1. O(1)."""
    if pool_requests < 1:
        msg = f"pool_requests must be >= 1, got {pool_requests}; pass e.g. --pool-requests 4"
        raise ValueError(msg)
    whole = ws.request_blocks + ws.max_request_blocks
    wanted = math.ceil(pool_requests * ws.mean_request_blocks)
    return min(whole, max(ws.max_request_blocks + 1, wanted))


def engine_max_len(max_model_len: int, blocks: int, ws: WorkingSet) -> int:
    """``max_model_len`` for a pool of ``blocks``: vLLM refuses a length its blocks cannot
    hold whole (it keeps one spare). ``ValueError`` if the longest request does not fit."""
    max_len = min(max_model_len, (blocks - 1) * ws.block_size)
    if max_len < ws.max_request_blocks * ws.block_size:
        msg = (f"--max-model-len {max_model_len} is below the longest request "
               f"({ws.max_request_blocks} blocks of {ws.block_size}); raise it")
        raise ValueError(msg)
    return max_len


def summarise_requests(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Aggregates of one system's per-request rows (``prompt_tokens``, ``cached_tokens``,
    ``ttft_ms``): :func:`craft_rag_bench.demo.request_summary`."""
    return request_summary(
        [float(r["ttft_ms"]) for r in rows],
        sum(int(r["prompt_tokens"]) for r in rows),
        sum(int(r["cached_tokens"]) for r in rows),
    )


def exactness(
    reference: Sequence[Mapping[str, Any]], rows: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """A tier system's greedy outputs against the reference's, request by request (same index
    and id). Only requests whose prompts are identical (``prompt_sha256``) are comparable (the
    planner may order differently once its pool differs). A request is a *tier hit* when a
    tier served some of its tokens (``ram_tokens + disk_tokens > 0``; where those are unknown:
    when it cached more tokens than the reference did on the same prompt).
    ``mismatched`` lists up to 10 ids of comparable requests whose outputs differ."""
    compared = same_prompt = identical = tier_hits = tier_identical = extra = 0
    mismatched: list[str] = []
    for ref, row in zip(reference, rows, strict=False):
        if ref["id"] != row["id"]:
            continue
        compared += 1
        if ref["prompt_sha256"] != row["prompt_sha256"]:
            continue
        same_prompt += 1
        same = list(ref["output_ids"]) == list(row["output_ids"])
        identical += same
        gained = int(row["cached_tokens"]) - int(ref["cached_tokens"])
        ram, disk = row.get("ram_tokens"), row.get("disk_tokens")
        hit = gained > 0 if ram is None or disk is None else int(ram) + int(disk) > 0
        if hit:
            tier_hits += 1
            tier_identical += same
            extra += max(gained, 0)
        if not same and len(mismatched) < 10:
            mismatched.append(str(row["id"]))
    return {
        "compared": compared,
        "same_prompt": same_prompt,
        "identical": identical,
        "tier_hit_requests": tier_hits,
        "tier_hit_identical": tier_identical,
        "tier_extra_cached_tokens": extra,
        "mismatched": mismatched,
    }


def tier_tokens(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Tokens the tiers served over one system's rows and its *tier hit ratio*: of the prompt
    tokens the engine's pool did not hold (prompt - (cached - tier)), the fraction a tier
    served. Every field None when any row's tier counts are unknown (``ram_tokens`` None)."""
    if not rows or any(r.get("ram_tokens") is None or r.get("disk_tokens") is None
                       for r in rows):
        return {"ram_tokens": None, "disk_tokens": None, "tier_tokens": None,
                "tier_hit_ratio": None}
    ram = sum(int(r["ram_tokens"]) for r in rows)
    disk = sum(int(r["disk_tokens"]) for r in rows)
    missed = sum(int(r["prompt_tokens"]) - int(r["cached_tokens"]) for r in rows) + ram + disk
    return {"ram_tokens": ram, "disk_tokens": disk, "tier_tokens": ram + disk,
            "tier_hit_ratio": (ram + disk) / missed if missed > 0 else None}


def verdicts(
    systems: Mapping[str, Mapping[str, Any]], targets: Targets = TARGETS
) -> dict[str, Any]:
    """Each tier system against ``craft`` (cached-token ratio, mean-TTFT speedup, exactness)
    and PGDSF against LRU (tier hit ratio), with whether each target is met. Systems that
    failed (``error``) or are missing give no verdict; a ratio whose denominator is zero or
    unknown is None, and so is its ``*_met``."""
    out: dict[str, Any] = {}
    for name in TIERED:  # against a recompute: needs no reference system
        check = systems.get(name, {}).get("tier_hit_verification")
        if check:
            out[name] = {
                "recompute_identical": check["identical_to_recompute"],
                "recompute_met": (check["all_identical"]
                                  and check["identical_to_recompute"] >= targets.exact_requests),
            }
    ref = systems.get(REFERENCE)
    ok = {n: s for n, s in systems.items() if "error" not in s}
    if ref is not None and "error" not in ref:
        for name in TIERED:
            s = ok.get(name)
            if s is None:
                continue
            cached = _ratio(s["cached_token_fraction"], ref["cached_token_fraction"])
            speedup = _ratio(ref["mean_ttft_ms"], s["mean_ttft_ms"])
            exact = s.get("exactness") or {}
            hits, same = exact.get("tier_hit_requests", 0), exact.get("tier_hit_identical", 0)
            out[name] = {
                **out.get(name, {}),
                "cached_ratio": cached,
                "cached_met": None if cached is None else cached >= targets.cached_ratio,
                "ttft_speedup": speedup,
                "ttft_met": None if speedup is None else speedup >= targets.ttft_speedup,
                "exact_tier_hits": same,
                "exact_all_identical": hits == same,
                "exact_met": hits == same and same >= targets.exact_requests,
            }
    lru, pgdsf = ok.get("craft_tier_lru"), ok.get("craft_tier_pgdsf")
    if lru is not None and pgdsf is not None:
        ratio = _ratio(pgdsf.get("tier_hit_ratio"), lru.get("tier_hit_ratio"))
        out["pgdsf_vs_lru"] = {
            "hit_ratio_ratio": ratio,
            "hit_ratio_met": None if ratio is None else ratio >= targets.pgdsf_over_lru_hit_ratio,
            "cached_ratio": _ratio(pgdsf["cached_token_fraction"], lru["cached_token_fraction"]),
        }
    return out


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or not den:
        return None
    return num / den


def system_row(
    system: TierSystem, worker: Mapping[str, Any], reference: Sequence[Mapping[str, Any]] | None
) -> dict[str, Any]:
    """One system's JSON row from its worker result (``error`` kept as is)."""
    if "error" in worker:
        return {"error": worker["error"]}
    rows = worker["requests"]
    out = summarise_requests(rows)
    out["engine_start_s"] = worker.get("engine_start_s")
    out["serve_s"] = worker.get("serve_s")
    if system.tier_policy is not None:
        out["tier_policy"] = system.tier_policy
        out.update(tier_tokens(rows))
        out["tier_stats"] = worker.get("connector")
        out["exactness"] = None if reference is None else exactness(reference, rows)
        check = recompute_check(rows)
        if check is not None:
            out["tier_hit_verification"] = check
            out["verify_s"] = worker.get("verify_s")
    return out


def side_by_side(
    base: WorkerSpec, systems: Sequence[str], runner: Runner, workdir: Path
) -> dict[str, dict[str, Any]]:
    """Run every system of ``systems`` through ``runner`` (one process each), ``base`` giving
    the trace, pool and tier sizes; a tier system gets a fresh private disk folder under
    ``workdir``, removed after it ran. Systems run in :data:`SYSTEMS` order. Returns name ->
    :func:`system_row` (tier systems compared with ``craft`` when it ran)."""
    unknown = [n for n in systems if n not in SYSTEMS]
    if unknown:
        msg = f"unknown tiers systems {unknown}; valid: {list(SYSTEMS)}"
        raise ValueError(msg)
    workers: dict[str, dict[str, Any]] = {}
    for name in (n for n in SYSTEMS if n in systems):
        system = SYSTEMS[name]
        disk_dir = (tempfile.mkdtemp(prefix=f"{name}-", dir=workdir)
                    if system.tier_policy is not None else None)
        spec = WorkerSpec(**{**asdict(base), "system": name, "planner": system.planner,
                             "policy": system.tier_policy, "disk_dir": disk_dir})
        started = time.perf_counter()
        try:
            workers[name] = runner(spec)
            if disk_dir is not None:
                workers[name]["disk_dir_bytes"] = _folder_bytes(Path(disk_dir))
        finally:
            if disk_dir is not None:
                shutil.rmtree(disk_dir, ignore_errors=True)
        print(f"[bench] tiers {name}: {time.perf_counter() - started:.0f} s"
              + (f" (failed: {workers[name]['error'][:200]})" if "error" in workers[name] else ""),
              file=sys.stderr)
    ref = workers.get(REFERENCE)
    reference = ref["requests"] if ref is not None and "error" not in ref else None
    out = {}
    for name in (n for n in SYSTEMS if n in workers):
        out[name] = system_row(SYSTEMS[name], workers[name], reference)
        if "disk_dir_bytes" in workers[name] and "error" not in out[name]:
            out[name]["disk_dir_bytes"] = workers[name]["disk_dir_bytes"]
    return out


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def run_worker_process(spec: WorkerSpec, *, workdir: Path) -> dict[str, Any]:
    """Run ``spec`` in a fresh ``python -m craft_rag_bench.bench.tiers_worker`` process (its
    output forwarded to stderr, so ``--json`` stdout stays clean) and return its JSON result,
    or ``{"error": ...}`` with the exit status and the output's last lines."""
    import json

    spec_path = workdir / f"{spec.system}.spec.json"
    out_path = workdir / f"{spec.system}.out.json"
    write_atomic(spec_path, spec.to_json())
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env.setdefault("HF_HUB_OFFLINE", "1")
    tail: deque[str] = deque(maxlen=30)
    with subprocess.Popen(
        [sys.executable, "-m", "craft_rag_bench.bench.tiers_worker", str(spec_path),
         str(out_path)],
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


def run(ctx: BenchContext) -> dict[str, Any]:
    from craft_rag.prompt import PromptAssembler
    from craft_rag.trace import write_trace

    sizes = ctx.sizes
    max_tokens = sizes.tiers_max_tokens
    bound_only = sizes.tiers_bound_only
    out: dict[str, Any] = {
        "suite": "tiers", "block_size": ctx.block_size, "max_tokens": max_tokens,
        "pool_requests": sizes.tiers_pool_requests, "tier_ram_bytes": sizes.tiers_ram_bytes,
        "tier_disk_bytes": sizes.tiers_disk_bytes, "systems": selected_systems(sizes.tiers_systems),
        "targets": asdict(TARGETS), "workloads": {}, "bound_only": bound_only,
    }
    if ctx.engine is not None and not ctx.owns_engine and not bound_only:
        out["skipped"] = ("an engine handed in by the caller cannot change its KV pool or load a "
                          "connector; run `craft-rag bench tiers` on its own (or pass "
                          "--bound-only for the load-free bound alone)")
        return out
    if not bound_only:
        ctx.close()  # one engine at a time: every system starts its own, in its own process
    assembler = PromptAssembler(ctx.tokenizer(), ctx.prompt_format())
    block_bytes = model_block_bytes(ctx.block_size)
    for workload in ctx.workloads(WORKLOADS):
        trace = ctx.trace(workload, sizes.tiers_requests)
        ws = working_set(trace_prompts(assembler, trace), ctx.block_size, max_tokens)
        blocks = pool_blocks(ws, sizes.tiers_pool_requests)
        max_len = engine_max_len(ctx.max_model_len, blocks, ws)
        print(f"[bench] tiers {workload}: {len(trace)} requests, working set "
              f"{ws.distinct_blocks} distinct / {ws.request_blocks} request blocks; pool "
              f"{blocks} blocks", file=sys.stderr)
        started = time.perf_counter()
        bound_args = {"block_size": ctx.block_size, "pool_blocks": blocks,
                      "ram_bytes": sizes.tiers_ram_bytes, "disk_bytes": sizes.tiers_disk_bytes,
                      "block_bytes": block_bytes}
        if bound_only:
            out["workloads"][workload] = {
                "requests": len(trace), "working_set": asdict(ws), "pool_blocks": blocks,
                "pool_tokens": blocks * ctx.block_size, "max_model_len": max_len,
                "systems": {}, "verdicts": {}, "bound": bound(trace, assembler, **bound_args),
                "seconds": round(time.perf_counter() - started, 1),
            }
            continue
        workdir = Path(tempfile.mkdtemp(prefix="craft-tiers-"))
        try:
            trace_path = workdir / "trace.jsonl"
            write_trace(trace, trace_path)
            base = WorkerSpec(
                system="", planner="", trace_path=str(trace_path), blocks=blocks,
                block_size=ctx.block_size, max_model_len=max_len, max_tokens=max_tokens,
                ram_bytes=sizes.tiers_ram_bytes, disk_bytes=sizes.tiers_disk_bytes,
                progress=ctx.progress, verify_tier_hits=sizes.tiers_verify_tier_hits,
            )
            runner = functools.partial(run_worker_process, workdir=workdir)
            systems = side_by_side(base, out["systems"], runner, workdir)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        craft = systems.get(REFERENCE, {})
        out["workloads"][workload] = {
            "requests": len(trace),
            "working_set": asdict(ws),
            "pool_blocks": blocks,
            "pool_tokens": blocks * ctx.block_size,
            "max_model_len": max_len,
            "systems": systems,
            "verdicts": verdicts(systems),
            "bound": bound(trace, assembler, craft_measured=craft.get("cached_token_fraction"),
                           **bound_args),
            "seconds": round(time.perf_counter() - started, 1),
        }
    return out


def selected_systems(names: Sequence[str]) -> list[str]:
    """The systems to serve, in :data:`SYSTEMS` order: all of them when ``names`` is empty.
    ``ValueError`` naming the valid systems for an unknown name."""
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown:
        msg = (f"unknown tiers systems {unknown}; valid: {', '.join(SYSTEMS)} "
               "(e.g. --systems craft,craft_tier_pgdsf)")
        raise ValueError(msg)
    return [n for n in SYSTEMS if not names or n in names]


def report_lines(result: Mapping[str, Any]) -> list[str]:
    """Markdown for the generated report: a table per workload (cached fraction, mean/p50/p99
    TTFT, tokens loaded from each tier, tier hit ratio, exact tier hits; none with
    ``bound_only``), the load-free bound, then the verdicts."""
    if result.get("skipped"):
        return [f"Skipped: {result['skipped']}."]
    out: list[str] = []
    for workload, w in result["workloads"].items():
        out += [f"{workload}: {w['requests']} requests, pool {w['pool_blocks']:,} blocks "
                f"({w['pool_tokens']:,} tokens, ~{result['pool_requests']} prompts); tiers "
                f"{result['tier_ram_bytes'] / 2**30:g} GiB RAM, "
                f"{result['tier_disk_bytes'] / 2**30:g} GiB disk.", ""]
        if w["systems"]:  # none with --bound-only
            out += ["| system | cached | mean TTFT ms | p50 | p99 | tier tokens RAM / disk | "
                    "tier hit ratio | exact tier hits |", "|---|---|---|---|---|---|---|---|"]
        for name, s in w["systems"].items():
            if "error" in s:
                out.append(f"| {name} | failed: {s['error'][:80]!r} | | | | | | |")
                continue
            exact = s.get("exactness")
            out.append(
                f"| {name} | {100 * s['cached_token_fraction']:.1f}% | {s['mean_ttft_ms']:.0f} | "
                f"{s['p50_ttft_ms']:.0f} | {s['p99_ttft_ms']:.0f} | "
                + ("-" if s.get("ram_tokens") is None else
                   f"{s['ram_tokens']:,} / {s['disk_tokens']:,}") + " | "
                f"{_fmt(s.get('tier_hit_ratio'), '.3f')} | "
                + ("-" if not exact else
                   f"{exact['tier_hit_identical']}/{exact['tier_hit_requests']}") + " |")
        out.append("")
        for name, s in w["systems"].items():
            check = s.get("tier_hit_verification")
            if check:
                out.append(f"- {name}: {check['identical_to_recompute']} of "
                           f"{check['verified_requests']} tier hits recomputed from scratch "
                           f"identical ({check['tier_hit_requests']} tier hits; mismatched "
                           f"{check['mismatched_ids'] or 'none'})")
        out += bound_lines(w.get("bound"))
        for name, v in w["verdicts"].items():
            if name == "pgdsf_vs_lru":
                out.append(f"- PGDSF vs LRU: hit ratio {_fmt(v['hit_ratio_ratio'], '.2f')}x "
                           f"(met: {v['hit_ratio_met']}), cached {_fmt(v['cached_ratio'], '.2f')}x")
            elif "cached_ratio" in v:
                out.append(f"- {name} vs craft: cached {_fmt(v['cached_ratio'], '.2f')}x "
                           f"(met: {v['cached_met']}), mean TTFT "
                           f"{_fmt(v['ttft_speedup'], '.2f')}x faster (met: {v['ttft_met']}), "
                           f"{v['exact_tier_hits']} exact tier hits (met: {v['exact_met']})")
            if "recompute_met" in v:
                out.append(f"- {name} vs a recompute from scratch: {v['recompute_identical']} "
                           f"identical tier hits (met: {v['recompute_met']})")
        out.append("")
    return out


def bound_lines(b: Mapping[str, Any] | None) -> list[str]:
    """The load-free bound of one workload as report lines (none without a bound)."""
    if not b:
        return []
    tiers = b["tier_blocks"]
    return [f"- Bound (no engine, simulated LRU prefix cache): CRAFT caches "
            f"{100 * b['unbounded_craft']:.1f}% with nothing evicted (retriever order "
            f"{100 * b['unbounded_prefix']:.1f}%), {100 * b['pool_only_craft']:.1f}% on the pool "
            f"alone, {100 * b['pool_plus_tiers_craft']:.1f}% on pool + tiers "
            f"({tiers['ram']:,} + {tiers['disk']:,} blocks; "
            f"{100 * b['pool_plus_tiers_craft_blind']:.1f}% when the planner hears only the "
            f"pool's evictions); at most "
            f"{_fmt(b['max_cached_ratio_over_craft'], '.2f')}x the tokens of CRAFT alone "
            f"({b['ratio_reference']}; target {TARGETS.cached_ratio}x).", ""]


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)
