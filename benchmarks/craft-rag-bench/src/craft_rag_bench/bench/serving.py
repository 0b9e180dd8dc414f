"""Serving a trace on the engine under one system: the engine suites' common loop.

The four systems of the side-by-side run are :data:`craft_rag_bench.demo.SYSTEMS` (served with
:func:`craft_rag_bench.demo.run_system`: fresh planner, warm-up, empty cache). The KV and quality
suites also need variants the demo does not have (conversation dedup off); :func:`serve` is the
same loop with an explicit :class:`PlannerConfig`.

Peer systems (:mod:`craft_rag_bench.bench.peers`: ContextPilot online/offline, LongContextReorder)
are served by the same loop on the same engine: the peer orders the trace's chunks (online
peers see only earlier requests), then the ``retriever`` planner keeps that order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from craft_rag.chunk import make_chunk
from craft_rag.planner import CraftPlanner, PlannerConfig
from craft_rag.trace import TraceRequest
from craft_rag_bench.bench.context import BenchContext
from craft_rag_bench.bench.peers import PEER_ORDERS, available_peers, peer_trace
from craft_rag_bench.demo import SYSTEMS as DEMO_SYSTEMS
from craft_rag_bench.demo import run_system, serve_requests

if TYPE_CHECKING:
    from craft_rag.engine import CraftEngine, GenerationResult


@dataclass(frozen=True, slots=True)
class BenchSystem:
    """A system: planner settings plus whether vLLM may read its prefix cache."""

    name: str
    config: PlannerConfig
    read_prefix_cache: bool = True
    peer: str | None = None
    """A peer order (:data:`craft_rag_bench.bench.peers.PEER_ORDERS`) applied before planning."""


SYSTEMS: dict[str, BenchSystem] = {
    s.name: s
    for s in (
        BenchSystem("no_cache", PlannerConfig(policy="retriever"), read_prefix_cache=False),
        BenchSystem("prefix_cache", PlannerConfig(policy="retriever")),
        BenchSystem("craft_frequency", PlannerConfig(policy="frequency")),
        BenchSystem("craft_tree", PlannerConfig(policy="tree")),
        # Variants without conversation-scoped dedup (they differ only on multi-turn traces).
        BenchSystem("no_cache_nodedup", PlannerConfig(policy="retriever", dedup=False),
                    read_prefix_cache=False),
        BenchSystem("prefix_cache_nodedup", PlannerConfig(policy="retriever", dedup=False)),
        BenchSystem("craft_frequency_nodedup", PlannerConfig(policy="frequency", dedup=False)),
        BenchSystem("craft_tree_nodedup", PlannerConfig(policy="tree", dedup=False)),
        # Peers: their order, kept by the retriever planner; no conversation dedup (not theirs).
        *(BenchSystem(p, PlannerConfig(policy="retriever", dedup=False), peer=p)
          for p in PEER_ORDERS),
    )
}
"""Name -> system. The first four are the demo's side-by-side systems."""

SIDE_BY_SIDE: tuple[str, ...] = ("no_cache", "prefix_cache", "craft_frequency", "craft_tree")
_DEMO_SYSTEMS = {s.name: s for s in DEMO_SYSTEMS}


def peer_systems() -> tuple[str, ...]:
    """The peer systems that can run here (ContextPilot is an optional dependency)."""
    return available_peers()


def warm_up(engine: CraftEngine) -> None:
    """One unmeasured request on an unrelated prompt (first-call costs are not measured)."""
    chunk = make_chunk("The warm-up passage is not part of the measured run.", id="warmup:0")
    engine.generate([chunk], "Is this a warm-up?", max_tokens=1)


def serve(
    engine: CraftEngine,
    system: BenchSystem,
    trace: Sequence[TraceRequest],
    *,
    max_tokens: int,
    desc: str,
    ctx: BenchContext,
) -> list[GenerationResult]:
    """Serve ``trace`` one request at a time under ``system``, from an empty prefix cache and
    a fresh planner, after one unmeasured warm-up request. Cost: the prefill of every uncached
    prompt token plus ``max_tokens`` decode steps per request."""
    if system.peer is not None:
        trace = peer_trace(system.peer, trace)
    engine.set_planner(CraftPlanner(system.config))
    warm_up(engine)
    if not engine.reset_prefix_cache():
        msg = "could not reset the prefix cache (requests still running)"
        raise RuntimeError(msg)
    return serve_requests(
        engine,
        ctx.bar(trace, desc),
        max_tokens=max_tokens,
        read_prefix_cache=system.read_prefix_cache,
    )


def served(
    ctx: BenchContext,
    workload: str,
    requests: int,
    system_name: str,
    *,
    max_tokens: int,
    top_k: int | None = None,
) -> list[GenerationResult]:
    """The results of ``system_name`` on the first ``requests`` requests of ``workload``,
    served once per process (the ttft, kv and quality suites share runs)."""
    key = (workload, str(requests), str(top_k), system_name, str(max_tokens))

    def run() -> list[GenerationResult]:
        return serve_fresh(ctx, workload, requests, system_name, max_tokens=max_tokens,
                           top_k=top_k)

    return ctx.cached_run(key, run)


def serve_fresh(
    ctx: BenchContext,
    workload: str,
    requests: int,
    system_name: str,
    *,
    max_tokens: int,
    top_k: int | None = None,
) -> list[GenerationResult]:
    """Serve ``system_name`` on the first ``requests`` requests of ``workload`` now (from an
    empty cache, after a warm-up), not cached in ``ctx``: :func:`served` without the sharing
    (the ``ttft`` suite's later passes)."""
    system = SYSTEMS[system_name]
    trace = ctx.trace(workload, requests, top_k)
    demo_system = _DEMO_SYSTEMS.get(system_name)
    if demo_system is not None:
        # The side-by-side systems go through the demo's own loop (one definition).
        return run_system(
            ctx.get_engine(), demo_system, trace, max_tokens=max_tokens, progress=ctx.progress,
        )
    return serve(
        ctx.get_engine(), system, trace, max_tokens=max_tokens,
        desc=f"{workload}/{system_name}", ctx=ctx,
    )
