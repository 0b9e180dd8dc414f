"""Typed values crossing the engine boundary: requests in, reports and results out.

The three request kinds :meth:`CraftEngine.submit` serves are :class:`RagRequest` (chunks and a
question: planned, rendered, committed), :class:`MessagesRequest` (a plain chat) and
:class:`TokensRequest` (a ready prompt); each is checked when it is made (``ValueError`` naming
the field), so a request that exists is well-formed. Each carries its :class:`SamplingRequest`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, TypeAlias

from craft_rag.chunk import Chunk
from craft_rag.engine.turn_layout import LayoutChoice
from craft_rag.kvtiers.approx_params import ReuseCounts
from craft_rag.types import ChunkKey
from craft_rag.validation import (
    MAX_INT,
    check_int,
    check_number,
    materialise,
    validate_cache_salt,
    validate_conversation_id,
)

if TYPE_CHECKING:
    from craft_rag.planner import Plan


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
        if _not_int(self.max_tokens) or not 1 <= self.max_tokens <= MAX_INT:
            msg = f"max_tokens must be an int >= 1 (<= {MAX_INT}), got {self.max_tokens!r}"
            raise ValueError(msg)
        if self.seed is not None:  # int64, what vLLM and torch take
            check_int(self.seed, "seed", minimum=-(2**63), maximum=MAX_INT)
        check_number(self.temperature, "temperature", minimum=0.0)
        check_number(self.top_p, "top_p", positive=True, maximum=1.0)

    def with_overrides(self, **overrides: object) -> SamplingRequest:
        """A copy with the named fields replaced: the one mapping from call keyword arguments
        (``generate(max_tokens=...)``, an integration's ``invoke(..., temperature=...)``) to
        sampling. ``None`` leaves a field as it is; ``stop`` may be one string. ``ValueError``
        naming an unknown keyword (and the known ones), a bool given for a number, or a
        non-bool ``read_prefix_cache``. O(fields)."""
        unknown = sorted(set(overrides) - SAMPLING_KEYWORDS)
        if unknown:
            msg = (
                f"unsupported call arguments {unknown} (unknown keyword for sampling); "
                f"supported: {sorted(SAMPLING_KEYWORDS)}"
            )
            raise ValueError(msg)
        changes: dict[str, Any] = {k: _checked(k, v) for k, v in overrides.items() if v is not None}
        return replace(self, **changes) if changes else self


def _not_int(value: object) -> bool:
    return isinstance(value, bool) or not isinstance(value, int)


def _checked(name: str, value: object) -> object:
    """One override, type-checked (bools and numbers are never taken for each other)."""
    if name in ("max_tokens", "seed"):
        bad = _not_int(value)
    elif name in ("temperature", "top_p"):
        bad = isinstance(value, bool) or not isinstance(value, int | float)
    elif name == "read_prefix_cache":
        bad = not isinstance(value, bool)
    elif name == "stop":
        value = (value,) if isinstance(value, str) else value
        bad = not isinstance(value, Sequence) or not all(isinstance(s, str) for s in value)
        value = value if bad else tuple(value)  # type: ignore[arg-type]
    else:  # extra
        bad = not isinstance(value, Mapping)
    if bad:
        kind = {"read_prefix_cache": "a bool", "stop": "a string or a list of strings"}
        msg = f"{name} must be {kind.get(name, 'a number (not a bool)')}, got {value!r}"
        raise ValueError(msg)
    return value


SAMPLING_KEYWORDS = frozenset(f.name for f in fields(SamplingRequest))
"""The keyword arguments :meth:`SamplingRequest.with_overrides` takes."""


@dataclass(frozen=True, slots=True)
class RagRequest:
    """A RAG turn: answer ``question`` over ``chunks`` (planned, rendered, committed; see
    :meth:`CraftEngine.generate`). ``cache_salt`` isolates its prefix-cache entries (and its
    planner) from other salts; ``plan`` is a plan made earlier by
    ``engine.planner_for(cache_salt).plan(...)`` (or its ``plan.ref``: an adapter hands plans
    over by name), claimed from that planner, served and committed instead of planning
    again. ``chunks`` is read once into a tuple. ``ValueError`` for an empty question, a bad
    conversation id or salt."""

    chunks: Sequence[Chunk]
    question: str
    conversation_id: str | None = None
    cache_salt: str | None = field(default=None, repr=False)  # a tenant's key: never shown
    plan: Plan | str | None = None
    sampling: SamplingRequest = field(default_factory=SamplingRequest)

    def __post_init__(self) -> None:
        if not isinstance(self.question, str) or not self.question.strip():
            msg = "question must be a non-empty string"
            raise ValueError(msg)
        object.__setattr__(self, "chunks", materialise(self.chunks, "chunks"))
        validate_conversation_id(self.conversation_id)
        _check_common(self.cache_salt, self.sampling)


@dataclass(frozen=True, slots=True)
class MessagesRequest:
    """A plain chat: ``(role, text)`` pairs rendered with the model's chat template (see
    :meth:`CraftEngine.generate_messages`); stateless, nothing planned or committed.
    ``messages`` is read once into a tuple of pairs. ``ValueError`` for an empty list or an
    item that is not a pair of strings (the template checks roles and text later)."""

    messages: Sequence[tuple[str, str]]
    cache_salt: str | None = field(default=None, repr=False)  # a tenant's key: never shown
    sampling: SamplingRequest = field(default_factory=SamplingRequest)

    def __post_init__(self) -> None:
        pairs = materialise(self.messages, "messages")
        if not pairs:
            msg = (
                "messages must be a non-empty sequence of (role, text) pairs, e.g. [('user', 'Hi')]"
            )
            raise ValueError(msg)
        for i, pair in enumerate(pairs):
            if not isinstance(pair, tuple | list) or len(pair) != 2:
                msg = f"messages[{i}] must be a (role, text) pair of strings, got {pair!r}"
                raise ValueError(msg)
        object.__setattr__(self, "messages", tuple(tuple(p) for p in pairs))
        _check_common(self.cache_salt, self.sampling)


@dataclass(frozen=True, slots=True)
class TokensRequest:
    """A ready prompt of token ids (no template, no planning, no commit; see
    :meth:`CraftEngine.generate_tokens`). ``ValueError`` for an empty prompt or an id that is
    not an int >= 0."""

    token_ids: Sequence[int]
    cache_salt: str | None = field(default=None, repr=False)  # a tenant's key: never shown
    sampling: SamplingRequest = field(default_factory=SamplingRequest)

    def __post_init__(self) -> None:
        ids = materialise(self.token_ids, "token_ids")
        if not ids or not all(not _not_int(t) and t >= 0 for t in ids):
            msg = "token_ids must be a non-empty sequence of token ids (ints >= 0)"
            raise ValueError(msg)
        object.__setattr__(self, "token_ids", ids)
        _check_common(self.cache_salt, self.sampling)


EngineRequest: TypeAlias = RagRequest | MessagesRequest | TokensRequest
"""What :meth:`CraftEngine.submit` serves."""


def _check_common(cache_salt: object, sampling: object) -> None:
    validate_cache_salt(cache_salt)
    if not isinstance(sampling, SamplingRequest):
        msg = f"sampling must be a SamplingRequest, got {type(sampling).__name__}"
        raise ValueError(msg)


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What one engine step produced for one request (a delta). Backends build these."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int | None
    tier_ram_tokens: int = 0
    """Of ``num_cached_tokens``, those the KV tier connector loaded from its RAM tier (set on
    the finishing delta; 0 without tiers)."""
    tier_disk_tokens: int = 0
    """Of ``num_cached_tokens``, those loaded from the disk tier (as ``tier_ram_tokens``)."""
    reuse_counts: ReuseCounts | None = None
    """The approximate connector's per-origin counts (``craft_reuse``), on the finishing delta
    of a request that sent ``craft_approx`` spans; ``None`` otherwise."""


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

    With KV tiers on (``EngineSettings.kv_tiers``, ``craft-rag serve --kv-tier-*``),
    ``cached_tokens`` splits by source: ``tier_ram_tokens`` and ``tier_disk_tokens`` were loaded
    from the tiers, :attr:`pool_tokens` (the rest) were already in vLLM's KV pool. The tier
    counts are 0 without tiers, and under a vLLM server (``CraftEngine(server=...)``), whose
    streaming replies do not carry the connector's ``kv_transfer_params``.
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
    # LayoutChoice is imported at runtime, not only for type checking: pydantic models that
    # hold a ReuseReport (a user's event handler, say) resolve this annotation when built.
    layout: LayoutChoice | None = None
    """A conversation turn's layout decision (append or compacted restart, with the predicted
    costs: :mod:`craft_rag.engine.turn_layout`); ``None`` when none was made."""
    tier_ram_tokens: int = 0
    """Of ``cached_tokens``, those loaded from the KV tiers' RAM tier (0 without tiers)."""
    tier_disk_tokens: int = 0
    """Of ``cached_tokens``, those loaded from the KV tiers' disk tier (0 without tiers)."""
    admission_held_ms: float | None = None
    """With cache-aware admission on (``EngineSettings.admission``/``admission_queue``): how
    long craft-rag's admission queue held the request before it entered vLLM (part of
    ``ttft_ms``); 0 when vLLM's priority scheduler ordered it (that wait shows only in
    ``ttft_ms``). ``None`` with admission off."""
    replica: str | None = None
    """With several servers (``CraftEngine(server=[url, ...])``): the replica that served the
    request (its URL without credentials); ``None`` with one engine."""
    rehomed: bool = False
    """With several servers: this conversation turn is the first on a new home replica (its
    old home went down). The conversation's history moved with it, so ``turn`` goes on and
    the earlier turns are in the prompt, computed there from scratch (no cached KV)."""
    retries: int = 0
    """With several servers: how often the request was sent again to another replica because
    its replica was unreachable before the first token."""
    approximate: bool = False
    """With chunk-caches on (``EngineSettings.chunk_cache``): some prompt tokens' KV came from
    a chunk-cache (re-rotated, partly recomputed), so the answer may differ from a full
    prefill's. ``False`` whenever the request was served exactly."""
    exact_reused_tokens: int | None = None
    """With chunk spans sent: prompt tokens whose KV was reused exactly (pool, tiers, a cached
    head); ``None`` when the request sent none (then ``cached_tokens`` says it)."""
    fixed_tokens: int = 0
    """With chunk spans sent: chunk-cache tokens reused as cached (not recomputed)."""
    recomputed_tokens: int = 0
    """With chunk spans sent: tokens the connector computed (selected tokens of reused
    chunks, chunks without a chunk-cache, an uncached head)."""
    computed_tokens: int | None = None
    """With chunk spans sent: tokens vLLM computed; ``exact_reused_tokens + fixed_tokens +
    recomputed_tokens + computed_tokens == prompt_tokens``. ``None`` when none were sent."""
    chunk_cache_refused: str | None = None
    """With chunk spans sent: why the connector refused them (the request was then computed
    exactly); ``None`` when they were used or not sent."""

    @property
    def cached_fraction(self) -> float:
        """``cached_tokens / prompt_tokens`` (0 for an empty prompt)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def uncached_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def pool_tokens(self) -> int:
        """Cached tokens found in vLLM's own KV pool: ``cached_tokens`` less the tier tokens
        (never negative: a server's counts are not trusted to add up)."""
        return max(0, self.cached_tokens - self.tier_ram_tokens - self.tier_disk_tokens)


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
