"""Trace replay: run a trace through the engine's RAG-turn code around a simulated prefix cache.

Per request, :class:`craft_rag.engine.rag_turn.RagTurns` runs exactly what ``CraftEngine`` runs
(make room for the turn, plan, render the token-exact append-only prompt, commit with the
reuse the cache actually gave, record the turn, drop oldest turns to fit ``max_model_len``);
only the cache differs: :class:`~craft_rag.prefix_cache_sim.SimulatedPrefixCache` instead of
vLLM, and the trace's ``answer`` instead of a generated reply. This module only aggregates:
the paper's overlap metrics on the order fed to the engine plus reuse fractions and turn
latency.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

from craft_rag.engine.conversation_prompts import ConversationPrompts
from craft_rag.engine.driver import RequestState
from craft_rag.engine.planners import PlannerNamespaces
from craft_rag.engine.rag_turn import RagTurn, RagTurns, reused_chunk_count
from craft_rag.engine.results import RagRequest, SamplingRequest
from craft_rag.metrics import fraction, percentile, prefix_overlap, total_overlap
from craft_rag.planner import CraftPlanner, PlannerConfig
from craft_rag.prefix_cache_sim import SimulatedPrefixCache
from craft_rag.prompt import AssembledPrompt, PromptAssembler, PromptFormat
from craft_rag.stores import DEFAULT_NAMESPACE, StateStore
from craft_rag.tokenizer import Tokenizer
from craft_rag.trace import TraceRequest
from craft_rag.types import CacheSalt, ChunkKey
from craft_rag.validation import MAX_INT, validate_cache_salt

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_CACHE_TOKENS",
    "ReplayResult",
    "ServedRequest",
    "percentile",
    "replay",
    "reused_chunk_count",
]

DEFAULT_BLOCK_SIZE = 32
DEFAULT_CACHE_TOKENS = 1 << 18


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """Aggregates of one replay. Fractions are in [0, 1].

    ``reused_chunk_fraction``: chunks rendered into prompts that lay entirely inside the
    cached prefix (:func:`craft_rag.metrics.chunks_inside_cache`), over chunks rendered;
    ``reused_token_fraction``: cached prompt tokens over prompt tokens;
    ``dedup_removed_fraction``: chunks removed by conversation dedup over chunks
    retrieved.
    """

    policy: str
    requests: int
    prefix_overlap: float
    total_overlap: float
    reused_chunk_fraction: float
    reused_token_fraction: float
    dedup_removed_fraction: float
    prompt_tokens: int
    cached_tokens: int
    chunks_retrieved: int
    chunks_rendered: int
    chunks_reused: int
    chunks_removed_by_dedup: int
    planner_us_p50: float
    planner_us_p99: float
    tokenizer: str
    block_size: int
    cache_tokens: int

    def to_json(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class ServedRequest:
    """One replayed request: the prompt sent and what the cache reused."""

    request_id: str
    prompt: AssembledPrompt
    cached_tokens: int
    reused_chunks: int
    removed_by_dedup: int


@dataclass(slots=True)
class _SimulatedCache:
    """A simulated prefix cache as the RAG-turn code sees an engine: ``submit`` looks the
    prompt up (and inserts it), the reply is the trace's answer (stored by the caller)."""

    cache: SimulatedPrefixCache
    block_size: int
    eos_token_ids: frozenset[int] = frozenset()
    serve_ns: int = 0
    """Time the last lookup took (excluded from the turn's latency)."""

    def submit(
        self,
        token_ids: tuple[int, ...],
        sampling: SamplingRequest,
        state: RequestState,
        *,
        cache_salt: CacheSalt | None,
    ) -> None:
        del sampling, cache_salt
        t0 = time.perf_counter_ns()
        state.num_cached_tokens = self.cache.serve(token_ids)
        self.serve_ns = time.perf_counter_ns() - t0
        state.finished_at = state.submitted_at
        state.finish_reason = "stop"
        state.done.set()


def replay(
    requests: Iterable[TraceRequest],
    config: PlannerConfig,
    tokenizer: Tokenizer,
    *,
    prompt_format: PromptFormat | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    cache_tokens: int = DEFAULT_CACHE_TOKENS,
    max_model_len: int | None = None,
    max_tokens: int = 0,
    on_served: Callable[[ServedRequest], None] | None = None,
    store: StateStore | str | None = None,
    namespace: str = DEFAULT_NAMESPACE,
) -> ReplayResult:
    """Replay ``requests`` in order under ``config``; all state starts empty. Conversations
    render append-only; a turn's history is the previous prompt plus its ``answer`` (empty if
    the trace has none). With ``max_model_len``, whole oldest turns are dropped (before
    planning, their chunks forgotten by dedup) while ``prompt + max_tokens`` would exceed it:
    the engine's own RAG-turn code (paper §4.3); a turn that cannot fit alone raises
    ``ValueError`` naming the request. ``planner_us_*`` time each whole turn (plan, render,
    commit), the simulated cache lookup excluded. With ``store`` (a URL or
    :class:`~craft_rag.stores.StateStore`) the planner's state lives in that store's
    ``namespace`` (shared with other replay workers; it starts with what the store holds),
    while the simulated prefix cache stays this process's own."""
    planner = CraftPlanner(config, store=store, namespace=namespace)
    assembler = PromptAssembler(tokenizer, prompt_format)
    sim = _SimulatedCache(SimulatedPrefixCache(block_size, cache_tokens), block_size)
    # The engine's sampling needs max_tokens >= 1; the context budget stays max_model_len -
    # max_tokens (max_model_len grows by what max_tokens was raised).
    sampling = SamplingRequest(max_tokens=max(1, max_tokens))
    limit = MAX_INT if max_model_len is None else max_model_len + sampling.max_tokens - max_tokens
    namespaces = PlannerNamespaces(planner)
    conversations = ConversationPrompts(
        assembler, max_model_len=limit, history_budget=None, stores=namespaces
    )
    turns = RagTurns(
        namespaces,
        conversations,
        sim.submit,
        sim,
        check_salt=validate_cache_salt,
    )
    orders: list[tuple[ChunkKey, ...]] = []
    turn_us: list[float] = []
    prompt_tokens = cached_total = rendered = reused_total = 0
    count = 0

    for request in requests:
        rag_request = RagRequest(
            request.chunks, request.query, request.conversation_id, sampling=sampling
        )
        t0 = time.perf_counter_ns()
        try:
            flight = turns.start(rag_request, sampling)
        except ValueError as exc:
            raise ValueError(f"request {request.id!r}: {exc}") from None
        turn = flight.turn
        assert isinstance(turn, RagTurn)
        answer = assembler.answer_ids(request.answer or "")
        result = turns.commit(flight, turn, stored_reply=answer)
        turn_us.append((time.perf_counter_ns() - t0 - sim.serve_ns) / 1000)
        report = result.report
        prompt = turn.rendered.prompt
        orders.append(report.chunk_order)
        prompt_tokens += prompt.num_tokens
        cached_total += report.cached_tokens
        rendered += len(report.chunk_order)
        reused_total += report.reused_chunks
        count += 1
        if on_served is not None:
            on_served(
                ServedRequest(
                    request.id,
                    prompt,
                    report.cached_tokens,
                    report.reused_chunks,
                    len(report.removed_duplicates),
                )
            )

    stats = planner.stats
    return ReplayResult(
        policy=config.policy,
        requests=count,
        prefix_overlap=prefix_overlap(orders),
        total_overlap=total_overlap(orders),
        reused_chunk_fraction=fraction(reused_total, rendered),
        reused_token_fraction=fraction(cached_total, prompt_tokens),
        dedup_removed_fraction=fraction(stats.chunks_removed_by_dedup, stats.chunks_retrieved),
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_total,
        chunks_retrieved=stats.chunks_retrieved,
        chunks_rendered=rendered,
        chunks_reused=reused_total,
        chunks_removed_by_dedup=stats.chunks_removed_by_dedup,
        planner_us_p50=percentile(turn_us, 50),
        planner_us_p99=percentile(turn_us, 99),
        tokenizer=tokenizer.name,
        block_size=block_size,
        cache_tokens=cache_tokens,
    )
