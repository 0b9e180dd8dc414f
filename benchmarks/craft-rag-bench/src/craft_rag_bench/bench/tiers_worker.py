"""One system of the ``tiers`` suite on its own engine, in its own process.

``python -m craft_rag_bench.bench.tiers_worker SPEC OUT``: reads a :class:`WorkerSpec` (JSON),
starts ONE in-process engine with the spec's KV pool (and, for a tier system, the craft-rag KV
connector loaded by module path through ``EngineSettings.engine_kwargs["kv_transfer_config"]``),
serves the spec's trace under the system's planner (:func:`craft_rag_bench.bench.serving.serve`:
fresh planner, warm-up, empty pool) and writes one JSON object to OUT atomically.

Why a process per system: vLLM keeps process-global state (the distributed group, the KV
transfer agent) that a second engine in the same process would inherit or break, and a
connector's engine must not leave state behind for the next system. The parent
(:mod:`craft_rag_bench.bench.tiers`) owns every path in the spec (a private temp folder).

OUT holds, per request in trace order: ``id``, ``prompt_tokens``, ``cached_tokens``,
``ttft_ms``, ``output_ids`` (the greedy reply's token ids), ``prompt_sha256`` (of the exact
prompt ids, so the parent compares prompts across systems without shipping them) and
``ram_tokens``/``disk_tokens`` (tokens the connector loaded from each tier: the counts it hands
back from ``request_finished`` in ``kv_transfer_params["craft_tiers"]``, recorded by wrapping
that method on the scheduler-side connector since the engine does not report them; None without
a connector); plus ``engine_start_s``, ``serve_s`` and ``connector`` (the store's
``TierStats`` at the end, or None).

With ``verify_tier_hits`` (``--verify-tier-hits``), once the whole trace is served (so the
measured run is the same as without it), every request a tier served tokens to is served
again from the exact same prompt ids *from scratch*: ``read_prefix_cache=False`` is vLLM's
``skip_reading_prefix_cache``, under which vLLM 0.32's scheduler skips the pool lookup
(``KVCacheManager.prefix_cache_lookup_enabled``) and zeroes whatever the connector's
``get_num_new_matched_tokens`` offers (the connector also returns 0 for such a request). Its
row gets ``recompute``: ``output_ids``, ``cached_tokens`` and ``ram_tokens``/``disk_tokens``
of the re-run (which must be 0, 0 and 0 for the re-run to count: the parent checks), plus
``verify_s`` on the result. Rows of other requests get ``recompute: None``; without the
option no row has the key.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from craft_rag.engine import CraftEngine

CONNECTOR_NAME = "CraftTierConnector"
CONNECTOR_MODULE = "craft_rag.kvtiers.connector"
STATS_METHODS: tuple[str, ...] = ("tier_stats", "store_stats", "stats")
"""Methods tried, in order, on the scheduler-side connector, then on its ``store``, for the
store statistics."""
TIER_PARAMS_KEY = "craft_tiers"
"""Where the connector puts a request's ``{"ram_tokens", "disk_tokens"}`` in
``kv_transfer_params`` (``craft_rag.kvtiers.connector.TIER_PARAMS_KEY``)."""


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What one worker process serves. ``policy`` is the tier policy (``lru``/``pgdsf``) or
    None for a system without tiers (then ``disk_dir`` is unused)."""

    system: str
    planner: str
    trace_path: str
    blocks: int
    block_size: int
    max_model_len: int
    max_tokens: int
    policy: str | None = None
    ram_bytes: int = 0
    disk_bytes: int = 0
    disk_dir: str | None = None
    progress: bool = False
    verify_tier_hits: bool = False

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        data = json.loads(text)
        if not isinstance(data, dict):
            msg = "a worker spec is a JSON object"
            raise ValueError(msg)
        return cls(**data)


def connector_extra_config(spec: WorkerSpec) -> dict[str, Any]:
    """``kv_connector_extra_config`` of a tier system (``ValueError`` without a policy or a
    disk folder: a caller bug in the parent)."""
    if spec.policy is None or spec.disk_dir is None:
        msg = f"system {spec.system!r} has no tier policy or disk folder"
        raise ValueError(msg)
    return {"ram_bytes": spec.ram_bytes, "disk_bytes": spec.disk_bytes,
            "disk_dir": spec.disk_dir, "policy": spec.policy}


def start_engine(spec: WorkerSpec) -> CraftEngine:
    """The engine of ``spec``: exactly ``spec.blocks`` KV blocks, the connector when tiered."""
    from craft_rag.engine import CraftEngine, EngineSettings

    kwargs: dict[str, Any] = {}
    if spec.policy is not None:
        from vllm.config import KVTransferConfig

        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector=CONNECTOR_NAME, kv_connector_module_path=CONNECTOR_MODULE,
            kv_role="kv_both", kv_connector_extra_config=connector_extra_config(spec),
        )
    return CraftEngine(EngineSettings(
        block_size=spec.block_size, max_model_len=spec.max_model_len,
        num_gpu_blocks_override=spec.blocks, engine_kwargs=kwargs,
    ))


def scheduler_connector(engine: CraftEngine) -> Any:
    """The scheduler-side KV connector of an in-process engine, or None. Reached through
    vLLM's private objects (``LLM.llm_engine.engine_core.engine_core.scheduler.connector``),
    so every step is optional."""
    llm = getattr(getattr(engine, "_backend", None), "llm", None)
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    scheduler = getattr(getattr(core, "engine_core", None), "scheduler", None)
    return getattr(scheduler, "connector", None)


def connector_stats(connector: Any) -> dict[str, Any] | None:
    """The connector's store statistics as a JSON-able dict (the first of
    :data:`STATS_METHODS` it has; a dataclass result is converted), or None."""
    if connector is None:
        return None
    try:
        store = getattr(connector, "store", None)
    except RuntimeError:  # the worker-role connector has no store
        store = None
    for owner, name in [(o, n) for o in (connector, store) for n in STATS_METHODS]:
        method = getattr(owner, name, None)
        if not callable(method):
            continue
        value = method()
        if hasattr(value, "__dataclass_fields__"):
            value = asdict(value)
        if isinstance(value, Mapping):
            plain: dict[str, Any] = json.loads(json.dumps(dict(value), default=str))
            return plain
    return None


TierCounts = dict[str, dict[str, int]]
"""vLLM request id (internal and external) -> the connector's tier counts for it."""


def record_tier_counts(connector: Any) -> TierCounts:
    """Wrap ``connector.request_finished`` (on the instance) so every finished request's tier
    counts land in the returned dict, under vLLM's internal request id and the id it was
    submitted with (the scheduler's ``Request`` only has the internal one, which vLLM makes
    from the submitted one plus ``-`` and 8 random characters). Empty and untouched when
    there is no connector."""
    counts: TierCounts = {}
    original = getattr(connector, "request_finished", None)
    if original is None:
        return counts

    def recording(request: Any, block_ids: Any) -> Any:
        done = original(request, block_ids)
        params = done[1] if isinstance(done, tuple) and len(done) == 2 else None
        found = params.get(TIER_PARAMS_KEY) if isinstance(params, Mapping) else None
        if isinstance(found, Mapping):
            row = {k: int(v) for k, v in found.items() if isinstance(v, int)}
            rid = str(getattr(request, "request_id", ""))
            for key in (rid, rid.rsplit("-", 1)[0], getattr(request, "external_req_id", None)):
                if key:
                    counts[str(key)] = row
        return done

    connector.request_finished = recording
    return counts


def tier_tokens(counts: TierCounts, request_id: str, tiered: bool) -> dict[str, int | None]:
    """``ram_tokens``/``disk_tokens`` of one request; None without tiers or when nothing was
    recorded for it (every request the connector saw is recorded, loads or not, so a missing
    id means the counts could not be matched: unknown, not zero)."""
    row = counts.get(request_id)
    if not tiered or row is None:
        return {"ram_tokens": None, "disk_tokens": None}
    return {"ram_tokens": row.get("ram_tokens", 0), "disk_tokens": row.get("disk_tokens", 0)}


def is_tier_hit(row: Mapping[str, Any]) -> bool:
    """Whether a tier served some of the request's prompt tokens (its ``ram_tokens`` +
    ``disk_tokens`` > 0; unknown counts are not a hit)."""
    ram, disk = row.get("ram_tokens"), row.get("disk_tokens")
    return ram is not None and disk is not None and int(ram) + int(disk) > 0


def recompute_tier_hits(
    engine: CraftEngine,
    rows: list[dict[str, Any]],
    prompts: list[tuple[int, ...]],
    counts: TierCounts,
    max_tokens: int,
) -> None:
    """Serve every tier-hit row's prompt (``prompts[i]`` for ``rows[i]``) again from scratch
    (no pool, no tier: ``read_prefix_cache=False``) and store the re-run under the row's
    ``recompute`` (None for a row that is not a tier hit). One request at a time, after the
    measured run. Cost: the full prefill of each tier-hit prompt plus ``max_tokens`` decode
    steps. Prints one line per re-run to stderr (a run cut short still shows its count)."""
    from craft_rag.engine import SamplingRequest, TokensRequest

    sampling = SamplingRequest(max_tokens=max_tokens, read_prefix_cache=False)
    done = same = 0
    for row, ids in zip(rows, prompts, strict=True):
        if not is_tier_hit(row):
            row["recompute"] = None
            continue
        again = engine.submit(TokensRequest(ids, sampling=sampling)).result()
        tiers = tier_tokens(counts, again.report.request_id, tiered=True)
        row["recompute"] = {"output_ids": list(again.token_ids),
                            "cached_tokens": again.report.cached_tokens, **tiers}
        done += 1
        same += list(again.token_ids) == list(row["output_ids"])
        print(f"[verify] {row['id']}: cached {again.report.cached_tokens}, tiers "
              f"{tiers['ram_tokens']}/{tiers['disk_tokens']}, identical "
              f"{list(again.token_ids) == list(row['output_ids'])} ({same}/{done})",
              file=sys.stderr, flush=True)


def run_worker(spec: WorkerSpec) -> dict[str, Any]:
    """Serve ``spec``'s trace on a fresh engine (closed before returning)."""
    from craft_rag.planner import PlannerConfig
    from craft_rag.trace import read_trace
    from craft_rag_bench.bench.context import BenchContext
    from craft_rag_bench.bench.serving import BenchSystem, serve

    trace = read_trace(spec.trace_path)
    started = time.perf_counter()
    engine = start_engine(spec)
    engine_start = time.perf_counter() - started
    tiered = spec.policy is not None
    counts = record_tier_counts(scheduler_connector(engine)) if tiered else {}
    try:
        started = time.perf_counter()
        results = serve(engine, BenchSystem(spec.system, PlannerConfig(policy=spec.planner)),
                        trace, max_tokens=spec.max_tokens, desc=spec.system,
                        ctx=BenchContext(progress=spec.progress))
        serve_s = time.perf_counter() - started
        # Before any re-run: the store's statistics describe the measured run alone.
        stats = connector_stats(scheduler_connector(engine)) if spec.policy else None
        rows = [
            {"id": request.id, "prompt_tokens": r.report.prompt_tokens,
             "cached_tokens": r.report.cached_tokens, "ttft_ms": r.report.ttft_ms,
             "output_ids": list(r.token_ids),
             "prompt_sha256": prompt_digest(r.prompt_token_ids),
             **tier_tokens(counts, r.report.request_id, tiered)}
            for request, r in zip(trace, results, strict=True)
        ]
        extra: dict[str, Any] = {}
        if spec.verify_tier_hits:
            started = time.perf_counter()
            recompute_tier_hits(engine, rows, [tuple(r.prompt_token_ids) for r in results],
                                counts, spec.max_tokens)
            extra["verify_s"] = round(time.perf_counter() - started, 1)
    finally:
        engine.close()
    return {
        "system": spec.system,
        "engine_start_s": round(engine_start, 1),
        "serve_s": round(serve_s, 1),
        **extra,
        "connector": stats,
        "tier_counts_recorded": len(counts),
        "requests": rows,
    }


def prompt_digest(ids: tuple[int, ...] | list[int]) -> str:
    """SHA-256 of a prompt's token ids (comma-separated decimal)."""
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()


def main(argv: list[str]) -> int:
    from craft_rag.files import write_atomic

    if len(argv) != 2:
        print("usage: python -m craft_rag_bench.bench.tiers_worker SPEC OUT", file=sys.stderr)
        return 2
    spec = WorkerSpec.from_json(Path(argv[0]).read_text(encoding="utf-8"))
    result = run_worker(spec)
    write_atomic(Path(argv[1]), json.dumps(result, allow_nan=False) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
