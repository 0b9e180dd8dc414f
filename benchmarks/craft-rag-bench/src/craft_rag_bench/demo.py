"""``craft-rag demo``: real questions through retrieval -> CRAFT -> the in-process vLLM engine.

Four systems run the same requests, one after another, on ONE engine, each from an empty prefix
cache and with the same sampling settings:

- ``no_cache``: prefix caching off for reading (vLLM's ``skip_reading_prefix_cache``);
- ``prefix_cache``: vLLM prefix caching with the retriever's chunk order;
- ``craft_frequency``: CRAFT with the paper's frequency order;
- ``craft_tree``: CRAFT with the CP-Tree set-match order (the library default).

Each system is preceded by an unmeasured warm-up request on an unrelated prompt (then the cache
is reset), so no system pays for the engine's first-call costs.

With several ``--server`` URLs (replicas of one model: ``--server URL --server URL`` or
``--server URL,URL``) the systems are routing policies over them instead, each on its own
``CraftEngine(server=[...], routing=...)`` with a fresh cache salt: ``no_cache`` (round-robin,
prefix cache not read) and any of :data:`craft_rag.routing.ROUTING_POLICIES` (default
``round_robin``, ``prefix_fixed_order``, ``craft_joint``).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Unpack

from tqdm import tqdm

from craft_rag.chunk import make_chunk
from craft_rag.cli_args import check_input_file, int_range, non_negative_int, seed_int
from craft_rag.metrics import percentile
from craft_rag.planner import CraftPlanner, PlannerConfig
from craft_rag.redact import redact_url
from craft_rag.trace import TraceRequest, read_trace

if TYPE_CHECKING:
    from craft_rag.engine import CraftEngine, EngineSettings, GenerationResult
    from craft_rag.engine.forms import CallOptions


@dataclass(frozen=True, slots=True)
class DemoSystem:
    """One configuration of the side-by-side run."""

    name: str
    policy: str
    read_prefix_cache: bool


SYSTEMS: tuple[DemoSystem, ...] = (
    DemoSystem("no_cache", "retriever", read_prefix_cache=False),
    DemoSystem("prefix_cache", "retriever", read_prefix_cache=True),
    DemoSystem("craft_frequency", "frequency", read_prefix_cache=True),
    DemoSystem("craft_tree", "tree", read_prefix_cache=True),
)


ROUTED_DEFAULT = ("no_cache", "round_robin", "prefix_fixed_order", "craft_joint")
"""The systems of a run over several servers (``no_cache``: round-robin, cache not read)."""


@dataclass(frozen=True, slots=True)
class SystemResult:
    """Aggregates of one system over the run."""

    requests: int
    mean_ttft_ms: float
    p50_ttft_ms: float
    p99_ttft_ms: float
    cached_token_fraction: float
    prompt_tokens: int
    cached_tokens: int
    dedup_removed_chunks: int
    dropped_turns: int


def request_summary(
    ttfts: Sequence[float], prompt_tokens: int, cached_tokens: int
) -> dict[str, Any]:
    """The aggregates every suite reports for one system's requests (one TTFT per request and
    the token totals): ``requests``, ``prompt_tokens``, ``cached_tokens``,
    ``cached_token_fraction``, ``mean_ttft_ms``, ``p50_ttft_ms``, ``p99_ttft_ms`` (0.0 for no
    requests or no prompt tokens). O(n log n) for the percentiles."""
    return {
        "requests": len(ttfts),
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached_tokens,
        "cached_token_fraction": cached_tokens / prompt_tokens if prompt_tokens else 0.0,
        "mean_ttft_ms": sum(ttfts) / len(ttfts) if ttfts else 0.0,
        "p50_ttft_ms": percentile(ttfts, 50),
        "p99_ttft_ms": percentile(ttfts, 99),
    }


def summarise(results: Sequence[GenerationResult]) -> SystemResult:
    """Aggregate the reports of one system's requests (:func:`request_summary`, plus the
    chunks dedup removed and the turns dropped)."""
    return SystemResult(
        **request_summary(
            [r.report.ttft_ms for r in results],
            sum(r.report.prompt_tokens for r in results),
            sum(r.report.cached_tokens for r in results),
        ),
        dedup_removed_chunks=sum(len(r.report.removed_duplicates) for r in results),
        dropped_turns=sum(r.report.dropped_turns for r in results),
    )


def default_trace(requests: int, top_k: int, seed: int) -> list[TraceRequest]:
    """SQuAD questions (dataset order, with Zipf re-asks and reworded near-duplicates) with
    faiss retrieval over SQuAD's own 2,067 paragraphs (embedded once, cached on disk)."""
    from craft_rag_bench.workloads import TraceConfig, build_trace

    config = TraceConfig(
        dataset="squad", requests=requests, top_k=top_k, seed=seed, corpus="dataset", index="flat"
    )
    return build_trace(config)


def _warm_up(engine: CraftEngine, max_tokens: int, cache_salt: str | None = None) -> None:
    chunk = make_chunk("The warm-up passage is not part of the measured run.", id="warmup:0")
    engine.generate([chunk], "Is this a warm-up?", max_tokens=max_tokens, cache_salt=cache_salt)


def run_system(
    engine: CraftEngine,
    system: DemoSystem,
    trace: Sequence[TraceRequest],
    *,
    max_tokens: int,
    progress: bool,
    cache_salt: str | None = None,
) -> list[GenerationResult]:
    """Serve ``trace`` under ``system`` from an empty prefix cache and a fresh planner.
    ``cache_salt`` (over a server): the system's own fresh salt, a cold cache namespace
    without resetting the server's cache (which needs its dev mode)."""
    engine.set_planner(CraftPlanner(PlannerConfig(policy=system.policy)))
    _warm_up(engine, max_tokens, cache_salt)
    if cache_salt is None and not engine.reset_prefix_cache():
        msg = "could not reset the prefix cache (requests still running)"
        raise RuntimeError(msg)
    return serve_requests(
        engine,
        tqdm(trace, desc=f"{system.name:>15}", disable=not progress, file=sys.stderr),
        max_tokens=max_tokens,
        read_prefix_cache=system.read_prefix_cache,
        cache_salt=cache_salt,
    )


def serve_requests(
    engine: CraftEngine, requests: Iterable[TraceRequest], **options: Unpack[CallOptions]
) -> list[GenerationResult]:
    """The measured loop, one definition for :func:`run_system` and
    :func:`craft_rag_bench.bench.serving.serve`: each request served in turn, one at a time,
    as it comes from ``requests`` (a progress bar may wrap the trace), ``options`` passed to
    every ``engine.generate``. Cost: each request's prefill of its uncached tokens plus
    ``max_tokens`` decode steps."""
    out: list[GenerationResult] = []
    for request in requests:
        out.append(
            engine.generate(
                request.chunks, request.query, conversation_id=request.conversation_id, **options
            )
        )
    return out


def format_table(results: dict[str, SystemResult]) -> str:
    """Side-by-side table, TTFT speed-ups relative to ``no_cache``."""
    base = results.get("no_cache")
    header = ("system", "mean TTFT ms", "p50 ms", "p99 ms", "speed-up", "cached tokens")
    rows = [header]
    for name, r in results.items():
        speedup = base.mean_ttft_ms / r.mean_ttft_ms if base and r.mean_ttft_ms else 0.0
        rows.append(
            (
                name,
                f"{r.mean_ttft_ms:.1f}",
                f"{r.p50_ttft_ms:.1f}",
                f"{r.p99_ttft_ms:.1f}",
                f"{speedup:.2f}x",
                f"{100 * r.cached_token_fraction:.1f}%",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows
    )


def add_demo_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "demo",
        help="side-by-side TTFT and cached tokens: no cache / prefix cache / CRAFT",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--trace", help="replay-format trace to serve (default: built from SQuAD)")
    p.add_argument(
        "--requests", type=int_range(1, 100_000), default=40, help="requests (default 40)"
    )
    p.add_argument("--top-k", type=int_range(1, 1000), default=5)
    p.add_argument("--seed", type=seed_int, default=0)
    p.add_argument(
        "--max-tokens", type=int_range(1, 1 << 20), default=16,
        help="tokens generated per request",
    )
    p.add_argument("--block-size", type=int_range(1, 1 << 16), default=32)
    p.add_argument("--max-model-len", type=int_range(1, 1 << 24), default=4096)
    p.add_argument(
        "--answers", type=non_negative_int, default=3, help="answers to print (default 3)"
    )
    p.add_argument(
        "--systems",
        default=None,
        help="comma-separated subset of " + ",".join(s.name for s in SYSTEMS) + " (default: "
        "all); with several --server: no_cache and routing policies (default "
        + ",".join(ROUTED_DEFAULT) + ")",
    )
    p.add_argument(
        "--server",
        action="append",
        default=None,
        metavar="URL",
        help="serve through a vLLM server at this URL (`craft-rag serve`); each system gets "
        "its own fresh cache_salt, no_cache a fresh salt per request. Repeat it (or give "
        "URL,URL) for several replicas of one model: the systems are then routing policies",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run_demo)


def server_urls(given: Sequence[str] | None) -> list[str]:
    """The ``--server`` URLs: each occurrence, split at commas (``[]``: none given).
    ``ValueError`` for an empty item, naming the form to use."""
    urls: list[str] = []
    for item in given or ():
        parts = [u.strip() for u in item.split(",")]
        if not all(parts):
            msg = (
                f"--server {redact_url(item)!r} has an empty URL; give "
                "--server URL [--server URL ...]"
            )
            raise ValueError(msg)
        urls.extend(parts)
    return urls


def system_names(systems: str | None, several: bool) -> list[str]:
    """The ``--systems`` to run, checked against :data:`SYSTEMS` (one engine) or ``no_cache``
    plus the routing policies (``several`` servers). ``ValueError`` names the valid ones."""
    default: tuple[str, ...]
    if several:
        from craft_rag.routing import ROUTING_POLICIES

        valid = {"no_cache", *ROUTING_POLICIES}
        default = ROUTED_DEFAULT
    else:
        valid = {s.name for s in SYSTEMS}
        default = tuple(s.name for s in SYSTEMS)
    names = [n.strip() for n in (systems or ",".join(default)).split(",") if n.strip()]
    unknown = [n for n in names if n not in valid]
    if unknown or not names:
        what = f"unknown system(s) {unknown}" if unknown else "no system given"
        where = " (with several --server: routing policies)" if several else ""
        msg = f"--systems: {what}; choose from {','.join(sorted(valid))}{where}"
        raise ValueError(msg)
    return names


def run_routed(
    settings: EngineSettings,
    servers: list[str],
    names: Sequence[str],
    trace: Sequence[TraceRequest],
    *,
    max_tokens: int,
    progress: bool,
) -> dict[str, list[GenerationResult]]:
    """Serve ``trace`` once per system over ``servers``: each on its own
    ``CraftEngine(server=servers, routing=...)`` (fresh trees) with a fresh cache salt (a
    cold cache namespace on every replica), after an unmeasured warm-up."""
    from craft_rag.engine import CraftEngine

    out: dict[str, list[GenerationResult]] = {}
    for name in names:
        routing = "round_robin" if name == "no_cache" else name
        salt = f"demo-{name}-{secrets.token_hex(8)}"
        with CraftEngine(settings, server=servers, routing=routing) as engine:
            _warm_up(engine, max_tokens, f"{salt}-warm")
            out[name] = serve_requests(
                engine,
                tqdm(trace, desc=f"{name:>18}", disable=not progress, file=sys.stderr),
                max_tokens=max_tokens,
                read_prefix_cache=name != "no_cache",
                cache_salt=salt,
            )
    return out


def run_demo(args: argparse.Namespace) -> int:
    # vLLM logs every cache reset at INFO on stdout; the demo's table is the output that matters.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    by_name = {s.name: s for s in SYSTEMS}
    servers = server_urls(getattr(args, "server", None))
    names = system_names(args.systems, len(servers) > 1)
    progress = not args.no_progress
    started = time.perf_counter()
    if args.trace is not None:
        trace = read_trace(check_input_file(args.trace, "--trace"), limit=args.requests)
    else:
        trace = default_trace(args.requests, args.top_k, args.seed)
    if not trace:
        msg = f"the trace {args.trace} has no requests; pass a trace with at least one JSON line"
        raise ValueError(msg)
    # Imported only now (vLLM takes seconds): every input above was checked first.
    from craft_rag.engine import CraftEngine, EngineSettings

    settings = EngineSettings(block_size=args.block_size, max_model_len=args.max_model_len)
    results: dict[str, SystemResult] = {}
    answers: list[tuple[str, str]] = []
    server = servers[0] if len(servers) == 1 else None
    if len(servers) > 1:
        served_by = run_routed(
            settings, servers, names, trace, max_tokens=args.max_tokens, progress=progress
        )
        results = {name: summarise(served) for name, served in served_by.items()}
        last = served_by[names[-1]]
        answers = [(t.query, r.text.strip()) for t, r in zip(trace, last, strict=True)]
    else:
        with CraftEngine(settings, server=server) as engine:
            for name in names:
                salt = f"demo-{name}-{secrets.token_hex(8)}" if server else None
                served = run_system(
                    engine,
                    by_name[name],
                    trace,
                    max_tokens=args.max_tokens,
                    progress=progress,
                    cache_salt=salt,
                )
                results[name] = summarise(served)
                if name == names[-1]:
                    answers = [
                        (t.query, r.text.strip()) for t, r in zip(trace, served, strict=True)
                    ]
    payload: dict[str, Any] = {name: asdict(r) for name, r in results.items()}
    payload["requests"] = len(trace)
    payload["trace"] = args.trace or "squad (built)"
    payload["max_tokens"] = args.max_tokens
    payload["block_size"] = args.block_size
    payload["seconds"] = round(time.perf_counter() - started, 1)
    # Results are shared: URLs without credentials; one server as before, several as a list.
    shown = [redact_url(u) for u in servers]
    payload["server"] = shown[0] if len(shown) == 1 else (shown or None)
    if args.json:
        json.dump(payload, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    print(format_table(results))
    print(f"({len(trace)} requests, max_tokens {args.max_tokens}, block {args.block_size}, "
          f"{payload['seconds']} s)")
    for query, answer in answers[: args.answers]:
        print(f"\nQ: {query}\nA: {answer}")
    return 0
