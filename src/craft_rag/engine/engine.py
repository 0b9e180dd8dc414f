"""``CraftEngine``: CRAFT planning in front of one in-process vLLM engine with prefix caching.

Per request: ``plan`` (order, dedup; CP-Tree prediction) -> ``render`` (token-exact, chat
template, append-only across turns) -> ``generate`` (token ids to vLLM, deltas back through one
stepping thread) -> ``commit`` (what vLLM actually reused: leading chunks inside
``num_cached_tokens``, token spans, expected block hashes). A request that fails is not
committed and leaves the conversation as it was. KV cache events keep the CP-Tree in step with
evictions (:mod:`craft_rag.engine.kv_events`).

Sync ``generate``/``generate_batch``, the sync ``stream`` iterator and async ``astream`` share
``_start`` and ``_finish``; they differ only in how they wait (see
:mod:`craft_rag.engine.driver`).
"""

from __future__ import annotations

import asyncio
import itertools
import queue
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from craft_rag.chunk import Chunk
from craft_rag.engine.chat_format import derive_chat_format
from craft_rag.engine.conversation_prompts import (
    DEFAULT_MAX_CONVERSATIONS,
    ConversationPrompts,
    RenderedTurn,
)
from craft_rag.engine.driver import (
    EngineBackend,
    EngineDriver,
    EngineFailure,
    RequestCancelled,
    RequestState,
)
from craft_rag.engine.kv_events import BlockHasher, KVEventSync
from craft_rag.engine.model import resolve_model
from craft_rag.engine.results import (
    GenerationResult,
    RagRequest,
    ReuseReport,
    SamplingRequest,
    StepOutput,
    StreamChunk,
)
from craft_rag.engine.vllm_backend import EngineSettings, EngineStartError, VLLMBackend
from craft_rag.prompt import DEFAULT_INSTRUCTIONS, PromptAssembler, PromptFormat
from craft_rag.tokenizer import HFTokenizer, Tokenizer
from craft_rag.types import BlockHash

__all__ = [
    "CraftEngine",
    "EngineFailure",
    "EngineSettings",
    "EngineStartError",
    "PlannerLike",
    "RequestCancelled",
]


class PlanLike(Protocol):
    """The parts of :class:`craft_rag.planner.Plan` the engine reads."""

    @property
    def ordered(self) -> tuple[Chunk, ...]: ...
    @property
    def removed_duplicates(self) -> tuple[Chunk, ...]: ...
    @property
    def repeated_in_request(self) -> tuple[Chunk, ...]: ...
    @property
    def matched_chunks(self) -> int: ...
    @property
    def matched_tokens(self) -> int | None: ...
    @property
    def turn(self) -> int: ...


class PlannerLike(Protocol):
    """What the engine needs from a planner (:class:`craft_rag.planner.CraftPlanner`)."""

    def plan(self, chunks: Sequence[Chunk], conversation_id: str | None = None) -> Any: ...

    def commit(
        self,
        plan: Any,
        *,
        prefix_tokens: int | None = None,
        chunk_token_counts: Sequence[int] | None = None,
        reused_chunks: int | None = None,
        block_hashes: Sequence[Sequence[BlockHash]] | None = None,
    ) -> Any: ...

    def on_blocks_removed(self, hashes: Iterable[BlockHash]) -> int: ...

    def on_all_blocks_cleared(self) -> None: ...

    def end_conversation(self, conversation_id: str) -> bool: ...


class ManagedBackend(EngineBackend, Protocol):
    """A backend the engine can also query and shut down (``VLLMBackend`` or a test fake)."""

    max_model_len: int
    block_size: int
    prefix_caching: bool
    eos_token_ids: frozenset[int]

    def reset_prefix_cache(self) -> bool: ...

    def published_batches(self) -> int | None: ...

    def shutdown(self) -> None: ...


@dataclass(slots=True)
class _InFlight:
    """One request between ``_start`` and ``_finish``. Owner: the calling method."""

    plan: PlanLike
    rendered: RenderedTurn
    sampling: SamplingRequest
    state: RequestState
    planner: PlannerLike


def _default_planner() -> PlannerLike:
    from craft_rag.planner import CraftPlanner, PlannerConfig

    return CraftPlanner(PlannerConfig(policy="tree"))


class CraftEngine:
    """One in-process vLLM engine with prefix caching, fed CRAFT-planned prompts.

    Invariants: exactly one backend engine per instance; every call into it goes through the
    driver's lock; the planner is committed only for requests that finished; a conversation
    has at most one turn in flight. Start-up: seconds (plus ~30 s the very first time the
    embedded model is converted). Close with :meth:`close` (or use as a context manager).
    """

    def __init__(
        self,
        settings: EngineSettings | None = None,
        planner: PlannerLike | None = None,
        *,
        prompt_format: PromptFormat | None = None,
        system_prompt: str | None = None,
        instructions: str = DEFAULT_INSTRUCTIONS,
        max_conversations: int = DEFAULT_MAX_CONVERSATIONS,
        backend: ManagedBackend | None = None,
        tokenizer: Tokenizer | None = None,
        block_hasher: BlockHasher | None = None,
    ) -> None:
        """Start the engine. ``backend``/``tokenizer``/``block_hasher`` replace the vLLM
        pieces (tests use fakes); by default the model is resolved (``settings.model``, or the
        embedded default prepared on first use), vLLM is started and KV events subscribed.

        ``ImportError`` (vLLM or converter missing) and :class:`EngineStartError` name the fix.
        """
        self.settings = settings or EngineSettings()
        self._planner: PlannerLike = planner if planner is not None else _default_planner()
        self._ids = itertools.count(1)
        self.kv_events: KVEventSync | None = None
        model_path = resolve_model(self.settings.model) if backend is None else None

        # Prompt pieces first: they are cheap and fail fast, before vLLM takes seconds and RAM.
        if prompt_format is None:
            if model_path is None:
                msg = "pass prompt_format= when passing a custom backend"
                raise ValueError(msg)
            prompt_format = derive_chat_format(
                model_path, system_prompt=system_prompt, instructions=instructions
            )
        if tokenizer is None:
            if model_path is None:
                msg = "pass tokenizer= when passing a custom backend"
                raise ValueError(msg)
            tokenizer = _model_tokenizer(model_path)
        self.prompt_format = prompt_format
        self.assembler = PromptAssembler(tokenizer, prompt_format)

        if backend is None:
            assert model_path is not None
            vllm_backend = VLLMBackend(self.settings, model_path)
            if vllm_backend.kv_events_endpoint is not None:
                # Subscribe before the engine binds the endpoint (ZMQ connects lazily).
                self.kv_events = KVEventSync(vllm_backend.kv_events_endpoint, self._planner)
            try:
                vllm_backend.start()
            except BaseException:
                if self.kv_events is not None:
                    self.kv_events.close()
                raise
            backend = vllm_backend
            if block_hasher is None and vllm_backend.prefix_caching:
                block_hasher = BlockHasher.from_engine(vllm_backend.vllm_config)
        self._backend: ManagedBackend = backend
        self.block_hasher = block_hasher
        self.conversations = ConversationPrompts(
            self.assembler,
            max_model_len=backend.max_model_len,
            max_conversations=max_conversations,
        )
        self._driver = EngineDriver(backend)

    # ---- configuration -----------------------------------------------------------------------

    @property
    def planner(self) -> PlannerLike:
        return self._planner

    def set_planner(self, planner: PlannerLike) -> None:
        """Serve later requests with ``planner`` (e.g. another policy for a side-by-side run):
        KV events go to it, and conversation histories are forgotten (the new planner knows
        none of them). Call :meth:`reset_prefix_cache` too for a cold start."""
        self._planner = planner
        if self.kv_events is not None:
            self.kv_events.set_listener(planner)
        self.conversations.clear()

    @property
    def max_model_len(self) -> int:
        return self._backend.max_model_len

    @property
    def block_size(self) -> int:
        return self._backend.block_size

    def reset_prefix_cache(self) -> bool:
        """Drop vLLM's whole prefix cache and empty the CP-Tree. False (nothing changed) if
        running requests hold blocks."""
        done = self._driver.exclusive(self._backend.reset_prefix_cache)
        if done:
            # vLLM publishes AllBlocksCleared only at its next step; clear now so the next
            # plan sees the empty cache. The event, applied before the next commit (event
            # barrier), clears an already-empty tree.
            self._planner.on_all_blocks_cleared()
        return done

    def end_conversation(self, conversation_id: str) -> bool:
        """Forget a conversation in the planner and the prompt history."""
        known = self._planner.end_conversation(conversation_id)
        return self.conversations.end(conversation_id) or known

    # ---- the request path ----------------------------------------------------------------------

    def _start(
        self,
        chunks: Sequence[Chunk],
        question: str,
        conversation_id: str | None,
        sampling: SamplingRequest,
        on_delta: Callable[[StepOutput, float], object] | None = None,
        on_done: Callable[[], object] | None = None,
    ) -> _InFlight:
        if not isinstance(question, str) or not question.strip():
            msg = "question must be a non-empty string"
            raise ValueError(msg)
        planner = self._planner
        self._event_barrier()
        plan: PlanLike = planner.plan(list(chunks), conversation_id)
        rendered = self.conversations.render(
            plan.ordered,
            question,
            max_tokens=sampling.max_tokens,
            conversation_id=conversation_id,
            fresh=plan.turn == 1,
        )
        state = RequestState(f"craft-{next(self._ids)}", on_delta=on_delta, on_done=on_done)
        try:
            self._driver.submit(rendered.prompt.token_ids, sampling, state)
        except BaseException:
            self.conversations.cancel(rendered)
            raise
        return _InFlight(plan, rendered, sampling, state, planner)

    def _finish(self, flight: _InFlight) -> GenerationResult:
        """Commit a finished request and build its result; on failure, undo and raise."""
        state, rendered, plan = flight.state, flight.rendered, flight.plan
        if state.error is not None:
            self.conversations.cancel(rendered)
            raise state.error
        prompt = rendered.prompt
        cached = state.num_cached_tokens or 0
        reused = reused_chunk_count(prompt.chunk_spans, cached, self._backend.block_size)
        block_hashes = None
        if self.block_hasher is not None:
            hashes = self.block_hasher.block_hashes(prompt.token_ids)
            block_hashes = self.block_hasher.per_chunk(hashes, prompt.chunk_spans)
        # Evictions published up to now reach the CP-Tree before this commit, not after it.
        self._event_barrier()
        try:
            flight.planner.commit(
                plan,
                prefix_tokens=prompt.prefix_tokens,
                chunk_token_counts=[end - start for start, end in prompt.chunk_spans],
                # Without reading the cache, cached=0 says nothing about what the cache holds.
                reused_chunks=reused if flight.sampling.read_prefix_cache else None,
                block_hashes=block_hashes,
            )
        except BaseException:
            self.conversations.cancel(rendered)
            raise
        self.conversations.complete(rendered, state.token_ids, self._backend.eos_token_ids)
        first = state.first_token_at if state.first_token_at is not None else state.finished_at
        end = state.finished_at if state.finished_at is not None else state.submitted_at
        report = ReuseReport(
            request_id=state.request_id,
            prompt_tokens=prompt.num_tokens,
            cached_tokens=cached,
            predicted_tokens=plan.matched_tokens,
            predicted_chunks=plan.matched_chunks,
            reused_chunks=reused,
            prefix_tokens=prompt.prefix_tokens,
            ttft_ms=((first or state.submitted_at) - state.submitted_at) * 1000.0,
            latency_ms=(end - state.submitted_at) * 1000.0,
            output_tokens=len(state.token_ids),
            chunk_order=tuple(c.key for c in plan.ordered),
            removed_duplicates=tuple(c.key for c in plan.removed_duplicates),
            repeated_in_request=tuple(c.key for c in plan.repeated_in_request),
            dropped_turns=rendered.dropped_turns,
            conversation_id=rendered.conversation_id,
            turn=plan.turn,
            read_prefix_cache=flight.sampling.read_prefix_cache,
        )
        return GenerationResult(
            text=state.text,
            token_ids=tuple(state.token_ids),
            finish_reason=state.finish_reason,
            report=report,
            prompt_token_ids=prompt.token_ids,
        )

    def _event_barrier(self) -> None:
        """Wait until every KV event batch the engine has published so far was applied to the
        planner (usually already true: microseconds; at most 2 s if a batch was lost)."""
        if self.kv_events is None:
            return
        published = self._backend.published_batches()
        if published is not None:
            self.kv_events.wait_through(published - 1)

    def _abandon(self, flight: _InFlight) -> None:
        """The caller stopped waiting: abort the request; nothing is committed."""
        self._driver.abort(flight.state.request_id)
        self.conversations.cancel(flight.rendered)

    # ---- public API ----------------------------------------------------------------------------

    def generate(
        self,
        chunks: Sequence[Chunk],
        question: str,
        *,
        conversation_id: str | None = None,
        sampling: SamplingRequest | None = None,
        max_tokens: int | None = None,
        read_prefix_cache: bool | None = None,
    ) -> GenerationResult:
        """Answer ``question`` over ``chunks`` (any order; empty is fine). Blocks until done.

        ``max_tokens``/``read_prefix_cache`` override the same fields of ``sampling``.
        ``ValueError`` for an empty question or a prompt that cannot fit; :class:`EngineFailure`
        if the engine fails (nothing is committed). Cost: one prefill of the uncached tokens
        plus ``max_tokens`` decode steps.
        """
        return self.generate_batch(
            [RagRequest(chunks, question, conversation_id)],
            sampling=sampling,
            max_tokens=max_tokens,
            read_prefix_cache=read_prefix_cache,
        )[0]

    def generate_batch(
        self,
        requests: Sequence[RagRequest],
        *,
        sampling: SamplingRequest | None = None,
        max_tokens: int | None = None,
        read_prefix_cache: bool | None = None,
    ) -> list[GenerationResult]:
        """Serve several requests concurrently (vLLM batches them); results in input order.

        Requests are planned in order before any runs, so one request's commit cannot help a
        later one in the same batch. A conversation may appear at most once per batch
        (``ValueError``). If any request fails, the others still finish and are committed, and
        the first error is raised.
        """
        params = _sampling(sampling, max_tokens, read_prefix_cache)
        conversation_ids = [r.conversation_id for r in requests if r.conversation_id]
        if len(conversation_ids) != len(set(conversation_ids)):
            msg = "a conversation may appear at most once per batch (its turns are sequential)"
            raise ValueError(msg)
        flights: list[_InFlight] = []
        try:
            for request in requests:
                flights.append(
                    self._start(request.chunks, request.question, request.conversation_id, params)
                )
            for flight in flights:
                flight.state.done.wait()
        except BaseException:
            for flight in flights:
                if not flight.state.done.is_set():
                    self._abandon(flight)
            raise
        results: list[GenerationResult] = []
        error: BaseException | None = None
        for flight in flights:
            try:
                results.append(self._finish(flight))
            except BaseException as exc:
                error = error or exc
        if error is not None:
            raise error
        return results

    def stream(
        self,
        chunks: Sequence[Chunk],
        question: str,
        *,
        conversation_id: str | None = None,
        sampling: SamplingRequest | None = None,
        max_tokens: int | None = None,
        read_prefix_cache: bool | None = None,
    ) -> Iterator[StreamChunk]:
        """Yield the reply as it is generated; the last chunk carries the full result.
        Closing the iterator early aborts the request (nothing committed)."""
        params = _sampling(sampling, max_tokens, read_prefix_cache)
        inbox: queue.SimpleQueue[tuple[StepOutput, float] | None] = queue.SimpleQueue()
        flight = self._start(
            chunks,
            question,
            conversation_id,
            params,
            lambda out, now: inbox.put((out, now)),
            lambda: inbox.put(None),
        )
        finished = False
        try:
            while (item := inbox.get()) is not None:
                piece = self._piece(flight, *item)
                if piece is not None:
                    yield piece
            finished = True
            yield self._final(flight)
        finally:
            if not finished:
                self._abandon(flight)

    async def astream(
        self,
        chunks: Sequence[Chunk],
        question: str,
        *,
        conversation_id: str | None = None,
        sampling: SamplingRequest | None = None,
        max_tokens: int | None = None,
        read_prefix_cache: bool | None = None,
    ) -> AsyncIterator[StreamChunk]:
        """Async :meth:`stream`: the engine steps on its own thread, deltas arrive through an
        asyncio queue, so the event loop never blocks on a forward pass. Cancelling the
        consumer aborts the request (nothing committed)."""
        params = _sampling(sampling, max_tokens, read_prefix_cache)
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[tuple[StepOutput, float] | None] = asyncio.Queue()
        flight = self._start(
            chunks,
            question,
            conversation_id,
            params,
            lambda out, now: loop.call_soon_threadsafe(inbox.put_nowait, (out, now)),
            lambda: loop.call_soon_threadsafe(inbox.put_nowait, None),
        )
        finished = False
        try:
            while (item := await inbox.get()) is not None:
                piece = self._piece(flight, *item)
                if piece is not None:
                    yield piece
            finished = True
            yield self._final(flight)
        finally:
            if not finished:
                self._abandon(flight)

    @staticmethod
    def _piece(flight: _InFlight, out: StepOutput, now: float) -> StreamChunk | None:
        if not out.new_token_ids and not out.new_text:
            return None
        return StreamChunk(
            text=out.new_text,
            token_ids=out.new_token_ids,
            elapsed_ms=(now - flight.state.submitted_at) * 1000.0,
        )

    def _final(self, flight: _InFlight) -> StreamChunk:
        result = self._finish(flight)
        return StreamChunk(
            text="", token_ids=(), elapsed_ms=result.report.latency_ms, result=result
        )

    # ---- lifecycle -----------------------------------------------------------------------------

    def close(self) -> None:
        """Cancel in-flight requests, stop the driver and KV-event threads, free the engine."""
        self._driver.close()
        if self.kv_events is not None:
            self.kv_events.close()
        self._backend.shutdown()

    def __enter__(self) -> CraftEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def reused_chunk_count(
    chunk_spans: Sequence[tuple[int, int]], cached_tokens: int, block_size: int
) -> int:
    """Leading chunks whose full KV blocks were all cache hits (block-granular, as the planner
    expects): chunk ``[start, end)`` counts when ``end // block_size * block_size <=
    cached_tokens``. The partial block at a chunk's end is shared with whatever follows, so it
    can only hit when the next chunk matches too; counting it would call every last chunk of
    a cached prefix a miss. O(chunks)."""
    n = 0
    for _, end in chunk_spans:
        if end // block_size * block_size > cached_tokens:
            break
        n += 1
    return n


def _sampling(
    sampling: SamplingRequest | None, max_tokens: int | None, read_prefix_cache: bool | None
) -> SamplingRequest:
    params = sampling or SamplingRequest()
    if max_tokens is not None or read_prefix_cache is not None:
        params = SamplingRequest(
            max_tokens=max_tokens if max_tokens is not None else params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            seed=params.seed,
            stop=params.stop,
            read_prefix_cache=(
                read_prefix_cache if read_prefix_cache is not None else params.read_prefix_cache
            ),
            extra=params.extra,
        )
    return params


def _model_tokenizer(model_path: str) -> Tokenizer:
    """The served model's ``tokenizer.json`` (the same ids vLLM would produce)."""
    from pathlib import Path

    path = Path(model_path) / "tokenizer.json"
    if not path.is_file():
        msg = (
            f"{model_path} has no tokenizer.json; pass a local model folder (hub ids need a "
            "local copy for token-exact prompts) or tokenizer=..."
        )
        raise FileNotFoundError(msg)
    return HFTokenizer(path)
