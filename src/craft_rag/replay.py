"""Trace replay: run a trace through the planner and a simulated vLLM prefix cache.

Per request: plan -> render token-exact prompt (append-only across a conversation's turns) ->
simulated cache lookup -> commit with the reuse the cache actually gave. Reports the paper's
overlap metrics on the order fed to the engine plus reuse fractions and planner latency.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass

from craft_rag.chunk import Chunk
from craft_rag.metrics import (
    chunks_inside_cache,
    chunks_with_cached_blocks,
    fraction,
    prefix_overlap,
    total_overlap,
)
from craft_rag.planner import CraftPlanner, PlannerConfig
from craft_rag.prefix_cache_sim import SimulatedPrefixCache
from craft_rag.prompt import AssembledPrompt, PromptAssembler, PromptFormat
from craft_rag.stores import DEFAULT_NAMESPACE, StateStore
from craft_rag.tokenizer import Tokenizer
from craft_rag.trace import TraceRequest
from craft_rag.types import ChunkKey, ConversationId

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


def reused_chunk_count(
    prompt: AssembledPrompt, cached_tokens: int, block_size: int | None = None
) -> int:
    """Leading chunks of this turn lying entirely inside the cached prefix
    (:func:`craft_rag.metrics.chunks_inside_cache`, the engine's definition too); 0 on a cold
    request. ``block_size`` is accepted for compatibility and no longer changes the count.
    O(k)."""
    del block_size
    return chunks_inside_cache(prompt.chunk_spans, cached_tokens)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1))))
    return ordered[rank]


def _render(
    assembler: PromptAssembler,
    turns: Sequence[tuple[int, ...]],
    chunks: Sequence[Chunk],
    query: str,
    max_model_len: int | None,
    max_tokens: int,
    request_id: str,
) -> tuple[AssembledPrompt, int]:
    """The prompt for one turn and how many oldest turns were dropped to fit."""
    dropped = 0
    while True:
        history = [*assembler.head_ids]
        for turn in turns[dropped:]:
            history.extend(turn)
        prompt = assembler.next_turn(history, chunks, query)
        if max_model_len is None or prompt.num_tokens + max_tokens <= max_model_len:
            return prompt, dropped
        if dropped == len(turns):
            msg = (
                f"request {request_id!r} needs {prompt.num_tokens} prompt tokens + max_tokens "
                f"{max_tokens} > max_model_len {max_model_len} even without earlier turns"
            )
            raise ValueError(msg)
        dropped += 1


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
    the trace has none). With ``max_model_len``, whole oldest turns are dropped while
    ``prompt + max_tokens`` would exceed it, as the engine does (paper §4.3); a turn that
    cannot fit alone raises ``ValueError``. With ``store`` (a URL or
    :class:`~craft_rag.stores.StateStore`) the planner's state lives in that store's
    ``namespace`` (shared with other replay workers; it starts with what the store holds),
    while the simulated prefix cache stays this process's own."""
    planner = CraftPlanner(config, store=store, namespace=namespace)
    assembler = PromptAssembler(tokenizer, prompt_format)
    cache = SimulatedPrefixCache(block_size, cache_tokens)
    # Per conversation: the stored turns, each [chunks][question tail][answer close].
    histories: dict[ConversationId, list[tuple[int, ...]]] = {}
    orders: list[tuple[ChunkKey, ...]] = []
    planner_us: list[float] = []
    prompt_tokens = cached_total = rendered = reused_total = 0
    count = 0

    for request in requests:
        t0 = time.perf_counter_ns()
        plan = planner.plan(request.chunks, request.conversation_id)
        t1 = time.perf_counter_ns()
        conv = request.conversation_id
        turns = histories.get(conv, []) if conv is not None and plan.turn > 1 else []
        prompt, dropped = _render(assembler, turns, plan.ordered, request.query,
                                  max_model_len, max_tokens, request.id)
        cached = cache.serve(prompt.token_ids)
        reused = chunks_inside_cache(prompt.chunk_spans, cached)
        t2 = time.perf_counter_ns()
        planner.commit(
            plan,
            prefix_tokens=prompt.prefix_tokens,
            chunk_token_counts=[end - start for start, end in prompt.chunk_spans],
            # Block-granular KV evidence, as the engine passes it (see the function).
            reused_chunks=chunks_with_cached_blocks(prompt.chunk_spans, cached, block_size),
        )
        t3 = time.perf_counter_ns()
        planner_us.append(((t1 - t0) + (t3 - t2)) / 1000)
        if conv is not None:
            segment = prompt.token_ids[prompt.prefix_tokens :]
            answer = assembler.answer_ids(request.answer or "")
            histories[conv] = [*turns[dropped:], segment + answer]
        orders.append(plan.keys)
        prompt_tokens += prompt.num_tokens
        cached_total += cached
        rendered += len(plan.ordered)
        reused_total += reused
        count += 1
        if on_served is not None:
            on_served(
                ServedRequest(request.id, prompt, cached, reused, len(plan.removed_duplicates))
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
        planner_us_p50=percentile(planner_us, 50),
        planner_us_p99=percentile(planner_us, 99),
        tokenizer=tokenizer.name,
        block_size=block_size,
        cache_tokens=cache_tokens,
    )
