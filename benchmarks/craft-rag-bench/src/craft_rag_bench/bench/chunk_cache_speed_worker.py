"""One system of the ``chunk-cache-speed`` suite on its own engine, in its own process.

``python -m craft_rag_bench.bench.chunk_cache_speed_worker SPEC OUT``: reads a
:class:`SpeedSpec` (JSON), starts ONE in-process engine (with chunk-caches,
``EngineSettings(chunk_cache=ChunkCacheSettings(rule, fraction))``, when the spec asks), serves
the spec's trace under the system's planner (:func:`craft_rag_bench.bench.serving.serve`: fresh
planner, one warm-up request, empty pool) and writes one JSON object to OUT atomically.

Why a process per system: the chunk-cache store and the KV tiers behind it live in the engine's
KV connector, and vLLM keeps process-global state (the KV transfer agent) that a second engine in
the same process would inherit; every system must start from empty caches.

OUT holds ``system``, ``engine_start_s``, ``serve_s`` and ``requests``: per request in trace
order :func:`request_row` (``id``, ``prompt_tokens``, ``cached_tokens``, ``ttft_ms``,
``output_ids``, ``prompt_sha256``, ``approximate``, ``exact``, ``fixed``, ``recomputed``,
``computed``, ``refused``).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from craft_rag_bench.bench.tiers_worker import prompt_digest

if TYPE_CHECKING:
    from craft_rag.engine import CraftEngine, GenerationResult


@dataclass(frozen=True, slots=True)
class SpeedSpec:
    """What one worker process serves: ``planner`` is a planner policy (``tree`` is CRAFT,
    ``retriever`` the retriever's order); ``chunk_cache`` turns the engine's chunk-caches on
    with the recompute ``rule`` and ``fraction``."""

    system: str
    planner: str
    trace_path: str
    block_size: int
    max_model_len: int
    max_tokens: int
    chunk_cache: bool = False
    rule: str = "kv_deviation"
    fraction: float = 0.3
    progress: bool = False

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> SpeedSpec:
        data = json.loads(text)
        if not isinstance(data, dict):
            msg = "a worker spec is a JSON object"
            raise ValueError(msg)
        return cls(**data)


CHUNK_CACHE_BYTES = 1 << 30
"""The bench's chunk-cache store (the default, 256 MiB, holds ~5,800 tokens of SmolLM2-135M in
float32: fewer than a 40-request trace's distinct chunks, so chunks the engine counts as cached
would be evicted and computed in full)."""


def start_engine(spec: SpeedSpec) -> CraftEngine:
    """The engine of ``spec``: the default KV pool, and chunk-caches (over the default KV
    tiers) when ``spec.chunk_cache``, with a chunk-cache store of :data:`CHUNK_CACHE_BYTES`."""
    from craft_rag.engine import ChunkCacheSettings, CraftEngine, EngineSettings

    chunk_cache = (ChunkCacheSettings(rule=spec.rule, fraction=spec.fraction,
                                      cache_bytes=CHUNK_CACHE_BYTES)
                   if spec.chunk_cache else None)
    return CraftEngine(EngineSettings(block_size=spec.block_size,
                                      max_model_len=spec.max_model_len, chunk_cache=chunk_cache))


def _count(report: Any, name: str) -> int | None:
    value = getattr(report, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def request_row(request_id: str, result: GenerationResult) -> dict[str, Any]:
    """One request's JSON row. The prompt's tokens by origin come from the report's chunk-cache
    counts (``exact_reused_tokens``, ``fixed_tokens``, ``recomputed_tokens``,
    ``computed_tokens``) when they are present and sum to the prompt; otherwise (no
    chunk-caches, or counts the engine did not report) from vLLM's ``cached_tokens``: exact =
    cached, computed = the rest, nothing fixed or recomputed. ``counts_from`` says which."""
    report = result.report
    prompt, cached = report.prompt_tokens, report.cached_tokens
    counts = [_count(report, n) for n in ("exact_reused_tokens", "fixed_tokens",
                                          "recomputed_tokens", "computed_tokens")]
    known = [c for c in counts if c is not None]
    if len(known) == 4 and sum(known) == prompt:
        exact, fixed, recomputed, computed = known
        source = "report"
    else:
        exact, fixed, recomputed, computed = cached, 0, 0, prompt - cached
        source = "cached_tokens"
    refused = getattr(report, "chunk_cache_refused", None)
    return {
        "id": request_id, "prompt_tokens": prompt, "cached_tokens": cached,
        "ttft_ms": report.ttft_ms, "output_ids": list(result.token_ids),
        "prompt_sha256": prompt_digest(result.prompt_token_ids),
        "approximate": bool(getattr(report, "approximate", False)),
        "exact": exact, "fixed": fixed, "recomputed": recomputed, "computed": computed,
        "refused": refused if isinstance(refused, str) else None, "counts_from": source,
    }


def run_worker(spec: SpeedSpec) -> dict[str, Any]:
    """Serve ``spec``'s trace on a fresh engine (closed before returning)."""
    from craft_rag.planner import PlannerConfig
    from craft_rag.trace import read_trace
    from craft_rag_bench.bench.context import BenchContext
    from craft_rag_bench.bench.serving import BenchSystem, serve

    trace = read_trace(spec.trace_path)
    started = time.perf_counter()
    engine = start_engine(spec)
    engine_start = time.perf_counter() - started
    try:
        started = time.perf_counter()
        results = serve(engine, BenchSystem(spec.system, PlannerConfig(policy=spec.planner)),
                        trace, max_tokens=spec.max_tokens, desc=spec.system,
                        ctx=BenchContext(progress=spec.progress))
        serve_s = time.perf_counter() - started
    finally:
        engine.close()
    return {
        "system": spec.system,
        "engine_start_s": round(engine_start, 1),
        "serve_s": round(serve_s, 1),
        "requests": [request_row(request.id, r)
                     for request, r in zip(trace, results, strict=True)],
    }


def main(argv: list[str]) -> int:
    from craft_rag.files import write_atomic

    if len(argv) != 2:
        print("usage: python -m craft_rag_bench.bench.chunk_cache_speed_worker SPEC OUT",
              file=sys.stderr)
        return 2
    spec = SpeedSpec.from_json(Path(argv[0]).read_text(encoding="utf-8"))
    result = run_worker(spec)
    write_atomic(Path(argv[1]), json.dumps(result, allow_nan=False) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
