"""Typed values crossing the engine boundary: requests in, reports and results out."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from craft_rag.chunk import Chunk
from craft_rag.engine.planners import PlanLike
from craft_rag.types import ChunkKey


@dataclass(frozen=True, slots=True)
class SamplingRequest:
    """Per-request sampling settings. ``read_prefix_cache=False`` is the no-cache baseline on
    the same engine (vLLM's ``skip_reading_prefix_cache``: the prompt is computed in full, its
    blocks are still cached). ``extra`` goes to ``vllm.SamplingParams`` unchanged."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    read_prefix_cache: bool = True
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            msg = f"max_tokens must be an int >= 1, got {self.max_tokens!r}"
            raise ValueError(msg)
        if self.temperature < 0:
            msg = f"temperature must be >= 0, got {self.temperature!r}"
            raise ValueError(msg)


@dataclass(frozen=True, slots=True)
class RagRequest:
    """One request for :meth:`CraftEngine.generate_batch`. ``cache_salt`` isolates its
    prefix-cache entries (and its planner) from other salts; ``plan`` is a plan made earlier by
    ``engine.planner_for(cache_salt).plan(...)``, served and committed instead of planning
    again (see :meth:`CraftEngine.generate`)."""

    chunks: Sequence[Chunk]
    question: str
    conversation_id: str | None = None
    cache_salt: str | None = None
    plan: PlanLike | None = None


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What one engine step produced for one request (a delta). Backends build these."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int | None


@dataclass(frozen=True, slots=True)
class ReuseReport:
    """How much of one request's prompt the engine reused, next to what CRAFT predicted.

    ``cached_tokens`` is vLLM's ``num_cached_tokens`` (whole blocks; the last prompt token is
    always recomputed). ``predicted_tokens`` is the CP-Tree's predicted reusable prefix (tokens
    from the start of the prompt; ``None`` when unknown). ``reused_chunks`` counts this turn's
    leading chunks lying entirely inside the cached tokens. ``ttft_ms`` runs from submission to
    the first generated token; ``dropped_turns`` are old conversation turns left out to fit the
    context (paper §4.3). ``plan_id`` is the committed plan's id (``None`` for a prompt
    without chunks: :meth:`CraftEngine.generate_messages`/``generate_tokens``, which plan and
    commit nothing); ``salted`` says the request ran under a ``cache_salt`` (the salt itself is
    not reported: reports end up in logs and traces).
    """

    request_id: str
    prompt_tokens: int
    cached_tokens: int
    predicted_tokens: int | None
    predicted_chunks: int
    reused_chunks: int
    prefix_tokens: int
    ttft_ms: float
    latency_ms: float
    output_tokens: int
    chunk_order: tuple[ChunkKey, ...]
    removed_duplicates: tuple[ChunkKey, ...]
    repeated_in_request: tuple[ChunkKey, ...]
    dropped_turns: int
    conversation_id: str | None
    turn: int
    read_prefix_cache: bool
    plan_id: int | None = None
    salted: bool = False

    @property
    def cached_fraction(self) -> float:
        """``cached_tokens / prompt_tokens`` (0 for an empty prompt)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def uncached_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


@dataclass(frozen=True, slots=True)
class GenerationResult:
    """A finished request: the reply, its :class:`ReuseReport` and the exact prompt ids sent."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    report: ReuseReport
    prompt_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class StreamChunk:
    """One streamed piece of a reply. The last piece has ``result`` set (``finished``)."""

    text: str
    token_ids: tuple[int, ...]
    elapsed_ms: float
    result: GenerationResult | None = None

    @property
    def finished(self) -> bool:
        return self.result is not None
