"""``CraftEngine``: CRAFT planning in front of one in-process vLLM engine with prefix caching.

Per request: ``plan`` (order, dedup; CP-Tree prediction) -> ``render`` (token-exact, chat
template, append-only across turns) -> ``generate`` (token ids to vLLM, deltas back through one
stepping thread) -> ``commit`` (what vLLM actually reused: leading chunks inside
``num_cached_tokens``, token spans, expected block hashes). A request that fails is not
committed and leaves the conversation as it was. KV cache events keep the CP-Tree in step with
evictions (:mod:`craft_rag.engine.kv_events`).

A request may carry a ``cache_salt`` (vLLM isolates its prefix-cache entries from other salts)
and is then planned and committed by that salt's own planner
(:class:`craft_rag.engine.planners.PlannerNamespaces`); it may carry a ``plan`` made earlier,
which is served and committed instead of planning again. Chat message lists and raw token ids
without chunks (``generate_messages``/``generate_tokens``) use the same driver, streaming and
prefix cache, and plan and commit nothing.

Sync ``generate``/``generate_batch``, the sync ``stream`` iterator and async ``astream`` (and
their ``_messages``/``_tokens`` forms) share ``_start_*`` and ``_finish``; they differ only in
how they wait (see :mod:`craft_rag.engine.driver`).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import itertools
import queue
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Protocol

from craft_rag.chunk import Chunk
from craft_rag.engine.chat_format import RenderFn, derive_chat_format, model_renderer
from craft_rag.engine.conversation_prompts import (
    DEFAULT_HISTORY_BUDGET,
    DEFAULT_MAX_CONVERSATIONS,
    ConversationPrompts,
    HistoryBudget,
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
from craft_rag.engine.logs import align_vllm_logging, start_progress
from craft_rag.engine.messages import ChatTurn, MessageRenderer
from craft_rag.engine.model import resolve_model
from craft_rag.engine.planners import (
    DEFAULT_MAX_SALT_NAMESPACES,
    CacheSalt,
    PlanLike,
    PlannerLike,
    PlannerNamespaces,
    check_plan,
    validate_cache_salt,
)
from craft_rag.engine.results import (
    GenerationResult,
    RagRequest,
    ReuseReport,
    SamplingRequest,
    StepOutput,
    StreamChunk,
)
from craft_rag.engine.server_backend import ServerBackend, ServerSettings, connect_server
from craft_rag.engine.server_driver import ServerDriver
from craft_rag.engine.vllm_backend import EngineSettings, EngineStartError, VLLMBackend
from craft_rag.metrics import chunks_inside_cache, chunks_with_cached_blocks
from craft_rag.prompt import DEFAULT_INSTRUCTIONS, PromptAssembler, PromptFormat
from craft_rag.stores.base import StateStore
from craft_rag.stores.histories import load_history, save_history
from craft_rag.tokenizer import HFTokenizer, Tokenizer
from craft_rag.types import ChunkKey

__all__ = [
    "CraftEngine",
    "EngineFailure",
    "EngineSettings",
    "EngineStartError",
    "PlanLike",
    "PlannerLike",
    "RequestCancelled",
]

OnDelta = Callable[[StepOutput, float], object]
OnDone = Callable[[], object]


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
class _RagTurn:
    """The planning side of a chunk request in flight. ``caller_plan``: the plan came in
    through ``plan=`` and is held in the engine's in-flight plan set until the request ends."""

    plan: PlanLike
    rendered: RenderedTurn
    planner: PlannerLike
    caller_plan: bool


@dataclass(slots=True)
class _InFlight:
    """One request between ``_start_*`` and ``_finish``. Owner: the calling method.
    ``rag`` is ``None`` for a prompt without chunks (nothing to commit)."""

    state: RequestState
    sampling: SamplingRequest
    token_ids: tuple[int, ...]
    cache_salt: CacheSalt | None
    rag: _RagTurn | None


def _default_planner() -> PlannerLike:
    from craft_rag.planner import CraftPlanner, PlannerConfig

    return CraftPlanner(PlannerConfig(policy="tree"))


def _store_planners(
    store: StateStore | str,
    planner: PlannerLike | None,
    salt_planner_factory: Callable[[], PlannerLike] | None,
) -> tuple[PlannerLike, Callable[[CacheSalt], PlannerLike]]:
    """The default planner and the per-salt factory of an engine with ``store=``: one store
    namespace per salt, every planner configured like the default one."""
    from craft_rag.planner import CraftPlanner, PlannerConfig
    from craft_rag.stores import DEFAULT_NAMESPACE, as_store, namespace_for_salt

    if planner is not None or salt_planner_factory is not None:
        msg = (
            "store: pass either store= (the engine makes its planners) or planner=/"
            "salt_planner_factory= with CraftPlanner(config, store=..., namespace=...)"
        )
        raise ValueError(msg)
    shared = as_store(store)
    config = PlannerConfig(policy="tree")
    default = CraftPlanner(config, store=shared, namespace=DEFAULT_NAMESPACE)

    def for_salt(salt: CacheSalt) -> PlannerLike:
        return CraftPlanner(config, store=shared, namespace=namespace_for_salt(salt))

    return default, for_salt


class CraftEngine:
    """One in-process vLLM engine with prefix caching, fed CRAFT-planned prompts.

    Invariants: exactly one backend engine per instance; every call into it goes through the
    driver's lock; a planner is committed only for requests that finished, and only by the
    planner of the request's cache salt; a conversation has at most one turn in flight and one
    cache salt; a caller-made plan is in flight at most once. Start-up: seconds (plus ~30 s
    the very first time the embedded model is converted). Close with :meth:`close` (or use as
    a context manager).
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
        salt_planner_factory: Callable[[], PlannerLike] | None = None,
        max_salt_namespaces: int = DEFAULT_MAX_SALT_NAMESPACES,
        backend: ManagedBackend | None = None,
        tokenizer: Tokenizer | None = None,
        block_hasher: BlockHasher | None = None,
        chat_renderer: RenderFn | None = None,
        history_budget: HistoryBudget | None = DEFAULT_HISTORY_BUDGET,
        server: str | ServerSettings | None = None,
        store: StateStore | str | None = None,
    ) -> None:
        """Start the engine. ``backend``/``tokenizer``/``block_hasher``/``chat_renderer``
        replace the vLLM and model pieces (tests use fakes); by default the model is resolved
        (``settings.model``, or the embedded default prepared on first use), vLLM is started
        and KV events subscribed.

        ``planner`` serves unsalted requests; each cache salt gets its own planner from
        ``salt_planner_factory`` (default: a ``CraftPlanner`` with ``planner``'s config), at
        most ``max_salt_namespaces`` of them (least recently used dropped).

        ``history_budget`` bounds each conversation's stored prompt history (oldest whole turns
        dropped, with hysteresis; see :class:`HistoryBudget`); ``None``: only ``max_model_len``
        bounds it.

        ``server``: a vLLM OpenAI-compatible server's URL (or :class:`ServerSettings`) to serve
        through instead of an in-process engine; ``settings.model`` then names the local folder
        of the served model's tokenizer and chat template (see
        :mod:`craft_rag.engine.server_backend`; ``ServerUnavailable``/``ValueError`` name the fix).

        ``store``: planner state shared with other workers (``memory://``,
        ``sqlite:///path/state.db``, ``redis://host:6379/0``; see :mod:`craft_rag.stores`): the
        default planner uses the store's ``default`` namespace and each cache salt its own
        namespace (:func:`craft_rag.stores.namespace_for_salt`), so tenants share no state.
        Not combined with ``planner``/``salt_planner_factory`` (give your planner ``store=``).

        ``ImportError`` (vLLM or converter missing) and :class:`EngineStartError` name the fix.
        """
        self.settings = settings or EngineSettings()
        salted_factory = None
        if store is not None:
            planner, salted_factory = _store_planners(store, planner, salt_planner_factory)
        self._namespaces = PlannerNamespaces(
            planner if planner is not None else _default_planner(),
            salt_planner_factory,
            max_salted=max_salt_namespaces,
            salted_factory=salted_factory,
        )
        self._ids = itertools.count(1)
        self._plans_lock = threading.Lock()
        self._plans_in_flight: set[tuple[int, int]] = set()  # owner: _plans_lock
        self.kv_events: KVEventSync | None = None
        model_path = resolve_model(self.settings.model) if backend is None else None
        self._model_path = model_path
        self._chat_renderer = chat_renderer
        self._message_renderer: MessageRenderer | None = None

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

        server_backend: ServerBackend | None = None
        if server is not None:
            if backend is not None:
                msg = "pass server= (a vLLM server URL) or backend=, not both"
                raise ValueError(msg)
            server_backend, self.kv_events, hasher = connect_server(
                server, model_path, tokenizer, self._namespaces
            )
            block_hasher = block_hasher or hasher
        elif backend is None:
            assert model_path is not None
            vllm_backend = VLLMBackend(self.settings, model_path)
            if vllm_backend.kv_events_endpoint is not None:
                # Subscribe before the engine binds the endpoint (ZMQ connects lazily).
                self.kv_events = KVEventSync(vllm_backend.kv_events_endpoint, self._namespaces)
            align_vllm_logging()  # before vLLM is imported: its level follows craft-rag's
            ready = start_progress(f"the vLLM engine ({model_path})")
            try:
                vllm_backend.start()
            except BaseException:
                if self.kv_events is not None:
                    self.kv_events.close()
                raise
            ready()
            backend = vllm_backend
            if block_hasher is None and vllm_backend.prefix_caching:
                block_hasher = BlockHasher.from_engine(vllm_backend.vllm_config)
        self._backend: ManagedBackend | ServerBackend
        if server_backend is not None:
            self._backend, self._backend_takes_salt = server_backend, True
        else:
            assert backend is not None
            self._backend = backend
            self._backend_takes_salt = _takes_keyword(backend.add_request, "cache_salt")
        self.block_hasher = block_hasher
        self.conversations = ConversationPrompts(
            self.assembler,
            max_model_len=self._backend.max_model_len,
            max_conversations=max_conversations,
            on_forget=self._forget_planned,
            history_budget=history_budget,
            on_drop=self._forget_dropped_turns,
        )
        self._driver: EngineDriver | ServerDriver
        if server_backend is not None:
            lost = self._namespaces.on_all_blocks_cleared  # a restarted server's cache is empty
            self._driver = ServerDriver(server_backend, on_server_lost=lost)
        else:
            self._driver = EngineDriver(self._backend)  # type: ignore[arg-type]

    # ---- configuration -----------------------------------------------------------------------

    @property
    def planner(self) -> PlannerLike:
        """The planner of unsalted requests (see :meth:`planner_for`)."""
        return self._namespaces.default

    def planner_for(self, cache_salt: str | None = None) -> PlannerLike:
        """The planner that plans and commits requests with ``cache_salt`` (the default planner
        for ``None``), created on first use. Make ``plan=`` plans with it. ``ValueError`` for
        an invalid salt. O(1)."""
        return self._namespaces.get(self._salt(cache_salt))

    def set_planner(self, planner: PlannerLike) -> None:
        """Serve later requests with ``planner`` (e.g. another policy for a side-by-side run):
        KV events go to it, the salted planners are dropped (new ones are made like it), and
        conversation histories are forgotten (the new planner knows none of them). Call
        :meth:`reset_prefix_cache` too for a cold start."""
        self._namespaces.reset(planner)
        self.conversations.clear()

    @property
    def max_model_len(self) -> int:
        return self._backend.max_model_len

    @property
    def block_size(self) -> int:
        return self._backend.block_size

    @property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer prompts are built with (text -> ids exactly as the engine sends them)."""
        return self.assembler.tokenizer

    def turn_count(self, conversation_id: str) -> int:
        """Turns the engine holds for ``conversation_id`` (0: unknown, ended or forgotten)."""
        return self.conversations.turn_count(conversation_id)

    def reset_prefix_cache(self) -> bool:
        """Drop vLLM's whole prefix cache (every salt) and empty every CP-Tree. False (nothing
        changed) if running requests hold blocks."""
        done = self._driver.exclusive(self._backend.reset_prefix_cache)
        if done:
            # vLLM publishes AllBlocksCleared only at its next step; clear now so the next
            # plan sees the empty cache. The event, applied before the next commit (event
            # barrier), clears an already-empty tree.
            self._namespaces.on_all_blocks_cleared()
        return done

    def end_conversation(self, conversation_id: str) -> bool:
        """Forget a conversation in the planners and the prompt history (its salt too)."""
        known = self._namespaces.end_conversation(conversation_id)
        return self.conversations.end(conversation_id) or known

    def _forget_planned(self, conversation_id: str, cache_salt: str | None) -> None:
        """The prompt history of a conversation was dropped (LRU bound or ended): its salt's
        planner must forget it too, so its next turn is planned as a fresh first turn with
        nothing removed as "already sent" (the chunks sent earlier are no longer in the
        prompt). A salt whose planner was dropped has nothing to forget."""
        planner = self._namespaces.peek(CacheSalt(cache_salt) if cache_salt is not None else None)
        if planner is not None:
            planner.end_conversation(conversation_id)

    def _forget_dropped_turns(self, conversation_id: str, cache_salt: str | None, n: int) -> None:
        """The prompt history dropped its ``n`` oldest turns: the salt's planner forgets their
        chunks, so one retrieved again is sent again (a planner that cannot forget single turns
        forgets the conversation; its next turn then starts a fresh prompt)."""
        planner = self._namespaces.peek(CacheSalt(cache_salt) if cache_salt is not None else None)
        if planner is None:
            return
        forget = getattr(planner, "forget_turns", None)
        if callable(forget):
            forget(conversation_id, n)
        else:
            planner.end_conversation(conversation_id)

    def fit_turn(
        self,
        chunks: Sequence[Chunk],
        question: str,
        *,
        conversation_id: str | None,
        max_tokens: int,
        cache_salt: str | None = None,
    ) -> frozenset[ChunkKey]:
        """Make room for a turn before planning it yourself (``plan=``): drop the conversation's
        oldest whole turns until ``chunks`` (all retrieved, before dedup) and ``question`` fit
        with ``max_tokens``; the planner forgets the dropped turns' chunks. Engine-made plans
        do this themselves. Returns the chunk keys no longer in the prompt. O(turns)."""
        need = self.conversations.turn_token_count(chunks, question)
        salt = self._salt(cache_salt)
        load_history(self.conversations, self._namespaces.get(salt), conversation_id, salt)
        return self.conversations.fit(conversation_id, need, max_tokens, salt)

    def side_prompt_ids(
        self, conversation_id: str | None, text: str, *, cache_salt: str | None = None
    ) -> tuple[int, ...]:
        """Token ids of a one-off question asked after the conversation's stored prompt (its
        cached prefix) without joining it, e.g. a condense step; serve them with
        :meth:`generate_tokens` (same ``cache_salt``) for a report of their own. ``text`` is
        tokenized as plain text. ``ValueError`` for empty text or another salt."""
        salt = self._salt(cache_salt)
        load_history(self.conversations, self._namespaces.get(salt), conversation_id, salt)
        return self.conversations.side_prompt(conversation_id, text, salt)

    def message_token_ids(self, messages: Sequence[ChatTurn]) -> tuple[int, ...]:
        """The token ids :meth:`generate_messages` sends for ``messages``: the chat template's
        rendering with the generation prompt, one tokenized segment per message (see
        :mod:`craft_rag.engine.messages`). ``ValueError`` for malformed messages."""
        return self._messages().token_ids(messages)

    def _messages(self) -> MessageRenderer:
        with self._plans_lock:
            if self._message_renderer is None:
                render = self._chat_renderer
                if render is None:
                    if self._model_path is None:
                        msg = "pass chat_renderer= when passing a custom backend"
                        raise RuntimeError(msg)
                    render = model_renderer(self._model_path)
                self._message_renderer = MessageRenderer(render, self.assembler.tokenizer)
            return self._message_renderer

    def _salt(self, cache_salt: str | None) -> CacheSalt | None:
        salt = validate_cache_salt(cache_salt)
        if salt is not None and not self._backend_takes_salt:
            msg = (
                f"this engine's backend ({type(self._backend).__name__}) takes no cache_salt: "
                "its add_request needs a cache_salt keyword put into vLLM's prompt dict; "
                "send the request without cache_salt or use the vLLM backend"
            )
            raise NotImplementedError(msg)
        return salt

    # ---- the request path ----------------------------------------------------------------------

    def _start_rag(
        self,
        request: RagRequest,
        sampling: SamplingRequest,
        on_delta: OnDelta | None = None,
        on_done: OnDone | None = None,
    ) -> _InFlight:
        question = request.question
        if not isinstance(question, str) or not question.strip():
            msg = "question must be a non-empty string"
            raise ValueError(msg)
        salt = self._salt(request.cache_salt)
        conversation_id = request.conversation_id
        self.conversations.check_salt(conversation_id, salt)
        planner = self._namespaces.get(salt)
        self._event_barrier()
        caller_plan = request.plan is not None
        fit_id = conversation_id or getattr(request.plan, "conversation_id", None)
        # Shared store: another worker may have served the last turn; render after it.
        load_history(self.conversations, planner, fit_id, salt)
        need = self.conversations.turn_token_count(request.chunks, question)
        # Before planning: dedup may only count chunks of turns that stay in the prompt.
        lost = self.conversations.fit(fit_id, need, sampling.max_tokens, salt)
        if request.plan is None:
            plan: PlanLike = planner.plan(list(request.chunks), conversation_id)
        else:
            plan = check_plan(request.plan, planner, request.chunks, conversation_id, salt=salt)
            conversation_id = plan.conversation_id
            self.conversations.check_salt(conversation_id, salt)
            gone = sorted(lost & {c.key for c in plan.removed_duplicates})
            if gone:
                msg = (
                    f"plan {plan.plan_id} removed chunks {gone[:3]} as already sent, but the "
                    "turns carrying them were dropped to fit the context; call "
                    "engine.fit_turn(...) before planning, or plan the turn again"
                )
                raise RuntimeError(msg)
            self._hold_plan(planner, plan)
        try:
            rendered = self._render(plan, question, sampling, conversation_id, salt)
            if plan.turn > 1 and rendered.kept_turns + rendered.dropped_turns == 0:
                # The history was dropped (LRU, end_conversation) after the plan was made, and
                # with it the planner's record: the plan's removed duplicates are in no prompt.
                self.conversations.cancel(rendered)
                if caller_plan:
                    msg = (
                        f"conversation {conversation_id!r} was forgotten while plan "
                        f"{plan.plan_id} waited to be served; plan the turn again"
                    )
                    raise RuntimeError(msg)
                assert conversation_id is not None  # turn > 1
                self._give_up_plan(planner, plan, caller_plan)
                planner.end_conversation(conversation_id)
                plan = planner.plan(list(request.chunks), conversation_id)
                rendered = self._render(plan, question, sampling, conversation_id, salt)
            state = RequestState(f"craft-{next(self._ids)}", on_delta=on_delta, on_done=on_done)
            try:
                self._driver.submit(rendered.prompt.token_ids, sampling, state, cache_salt=salt)
            except BaseException:
                self.conversations.cancel(rendered)
                raise
        except BaseException:
            self._give_up_plan(planner, plan, caller_plan)
            raise
        rag = _RagTurn(plan, rendered, planner, caller_plan)
        return _InFlight(state, sampling, rendered.prompt.token_ids, salt, rag)

    def _render(
        self,
        plan: PlanLike,
        question: str,
        sampling: SamplingRequest,
        conversation_id: str | None,
        salt: CacheSalt | None,
    ) -> RenderedTurn:
        """Render ``plan``'s turn; a first turn starts the conversation's history over."""
        return self.conversations.render(
            plan.ordered,
            question,
            max_tokens=sampling.max_tokens,
            conversation_id=conversation_id,
            fresh=plan.turn == 1,
            cache_salt=salt,
        )

    def _start_tokens(
        self,
        token_ids: Sequence[int],
        sampling: SamplingRequest,
        cache_salt: str | None,
        on_delta: OnDelta | None = None,
        on_done: OnDone | None = None,
    ) -> _InFlight:
        salt = self._salt(cache_salt)
        ids = tuple(token_ids)
        if not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
            msg = "token_ids must be a non-empty sequence of token ids (ints >= 0)"
            raise ValueError(msg)
        if len(ids) + sampling.max_tokens > self.max_model_len:
            msg = (
                f"prompt needs {len(ids)} tokens + max_tokens {sampling.max_tokens} > "
                f"max_model_len {self.max_model_len}; shorten the prompt (drop old messages), "
                "lower max_tokens, or start the engine with a larger max_model_len"
            )
            raise ValueError(msg)
        state = RequestState(f"craft-{next(self._ids)}", on_delta=on_delta, on_done=on_done)
        self._driver.submit(ids, sampling, state, cache_salt=salt)
        return _InFlight(state, sampling, ids, salt, None)

    def _hold_plan(self, planner: PlannerLike, plan: PlanLike) -> None:
        key = (id(planner), plan.plan_id)
        with self._plans_lock:
            if key in self._plans_in_flight:
                msg = f"plan {plan.plan_id} is already being served; a plan is served once"
                raise RuntimeError(msg)
            self._plans_in_flight.add(key)

    def _release_plan(self, planner: PlannerLike, plan: PlanLike) -> None:
        with self._plans_lock:
            self._plans_in_flight.discard((id(planner), plan.plan_id))

    def _give_up_plan(self, planner: PlannerLike, plan: PlanLike, caller_plan: bool) -> None:
        """A request that will not be committed: a caller's plan is released (the caller holds
        it and may serve it again); a plan the engine made is aborted in its planner, so its
        conversation is not left with a plan in flight (issue 11 item 11)."""
        if caller_plan:
            self._release_plan(planner, plan)
            return
        abort = getattr(planner, "abort", None)
        if callable(abort):
            abort(plan)

    def _finish(self, flight: _InFlight) -> GenerationResult:
        """Commit a finished request and build its result; on failure, undo and raise."""
        rag = flight.rag
        try:
            if flight.state.error is not None:
                raise flight.state.error
            if rag is None:
                return self._result(flight, self._report(flight))
            return self._commit(flight, rag)
        except BaseException:
            if rag is not None:
                self.conversations.cancel(rag.rendered)
                if not rag.caller_plan:
                    self._give_up_plan(rag.planner, rag.plan, False)
            raise
        finally:
            if rag is not None and rag.caller_plan:
                self._release_plan(rag.planner, rag.plan)

    def _commit(self, flight: _InFlight, rag: _RagTurn) -> GenerationResult:
        state, prompt, plan = flight.state, rag.rendered.prompt, rag.plan
        cached = state.num_cached_tokens or 0
        reused = reused_chunk_count(prompt.chunk_spans, cached)
        # The planner prunes CP-Tree nodes past this: block-granular evidence, not `reused`.
        kv_chunks = chunks_with_cached_blocks(prompt.chunk_spans, cached, self._backend.block_size)
        block_hashes = None
        if self.block_hasher is not None:
            hashes = self.block_hasher.block_hashes(prompt.token_ids, flight.cache_salt)
            block_hashes = self.block_hasher.per_chunk(hashes, prompt.chunk_spans)
        # Evictions published up to now reach the CP-Tree before this commit, not after it.
        self._event_barrier()
        rag.planner.commit(
            plan,
            prefix_tokens=prompt.prefix_tokens,
            chunk_token_counts=[end - start for start, end in prompt.chunk_spans],
            # Without reading the cache, cached=0 says nothing about what the cache holds.
            reused_chunks=kv_chunks if flight.sampling.read_prefix_cache else None,
            block_hashes=block_hashes,
        )
        self.conversations.complete(rag.rendered, state.token_ids, self._backend.eos_token_ids)
        save_history(self.conversations, rag.planner, rag.rendered.conversation_id)
        plan_id = getattr(plan, "plan_id", None)
        report = replace(
            self._report(flight),
            predicted_tokens=plan.matched_tokens,
            predicted_chunks=plan.matched_chunks,
            reused_chunks=reused,
            prefix_tokens=prompt.prefix_tokens,
            chunk_order=tuple(c.key for c in plan.ordered),
            removed_duplicates=tuple(c.key for c in plan.removed_duplicates),
            repeated_in_request=tuple(c.key for c in plan.repeated_in_request),
            dropped_turns=rag.rendered.left_out,
            conversation_id=rag.rendered.conversation_id,
            turn=plan.turn,
            plan_id=plan_id if isinstance(plan_id, int) else None,
        )
        return self._result(flight, report)

    @staticmethod
    def _report(flight: _InFlight) -> ReuseReport:
        """The report of a prompt without chunks (a chunk request's replaces the plan fields)."""
        state = flight.state
        first = state.first_token_at if state.first_token_at is not None else state.finished_at
        end = state.finished_at if state.finished_at is not None else state.submitted_at
        return ReuseReport(
            request_id=state.request_id,
            prompt_tokens=len(flight.token_ids),
            cached_tokens=state.num_cached_tokens or 0,
            predicted_tokens=None,
            predicted_chunks=0,
            reused_chunks=0,
            prefix_tokens=0,
            ttft_ms=((first or state.submitted_at) - state.submitted_at) * 1000.0,
            latency_ms=(end - state.submitted_at) * 1000.0,
            output_tokens=len(state.token_ids),
            chunk_order=(),
            removed_duplicates=(),
            repeated_in_request=(),
            dropped_turns=0,
            conversation_id=None,
            turn=1,
            read_prefix_cache=flight.sampling.read_prefix_cache,
            salted=flight.cache_salt is not None,
        )

    @staticmethod
    def _result(flight: _InFlight, report: ReuseReport) -> GenerationResult:
        state = flight.state
        return GenerationResult(
            text=state.text,
            token_ids=tuple(state.token_ids),
            finish_reason=state.finish_reason,
            report=report,
            prompt_token_ids=flight.token_ids,
        )

    def _event_barrier(self) -> None:
        """Wait until every KV event batch the engine has published so far was applied to the
        planners (usually already true: microseconds; at most 2 s if a batch was lost)."""
        if self.kv_events is None:
            return
        published = self._backend.published_batches()
        if published is not None:
            self.kv_events.wait_through(published - 1)

    def _abandon(self, flight: _InFlight) -> None:
        """The caller stopped waiting: abort the request; nothing is committed."""
        self._driver.abort(flight.state.request_id)
        if flight.rag is not None:
            self.conversations.cancel(flight.rag.rendered)
            self._give_up_plan(flight.rag.planner, flight.rag.plan, flight.rag.caller_plan)

    def _wait(self, flights: Sequence[_InFlight]) -> list[GenerationResult]:
        """Wait for started requests; finish (commit) each. The first error is raised after
        every request was finished; waiting interrupted aborts the unfinished ones."""
        try:
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

    def _iterate(self, start: Callable[[OnDelta, OnDone], _InFlight]) -> Iterator[StreamChunk]:
        inbox: queue.SimpleQueue[tuple[StepOutput, float] | None] = queue.SimpleQueue()
        flight = start(lambda out, now: inbox.put((out, now)), lambda: inbox.put(None))
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

    async def _aiterate(
        self, start: Callable[[OnDelta, OnDone], _InFlight]
    ) -> AsyncGenerator[StreamChunk, None]:
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[tuple[StepOutput, float] | None] = asyncio.Queue()
        flight = start(
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

    # ---- public API: RAG requests --------------------------------------------------------------

    def generate(
        self,
        chunks: Sequence[Chunk],
        question: str,
        *,
        conversation_id: str | None = None,
        sampling: SamplingRequest | None = None,
        max_tokens: int | None = None,
        read_prefix_cache: bool | None = None,
        cache_salt: str | None = None,
        plan: PlanLike | None = None,
    ) -> GenerationResult:
        """Answer ``question`` over ``chunks`` (any order; empty is fine). Blocks until done.

        ``max_tokens``/``read_prefix_cache`` override the same fields of ``sampling``.
        ``cache_salt`` puts the request in its own prefix-cache namespace (vLLM reuses KV only
        between requests with the same salt) with its own planner; every turn of a conversation
        must use the salt of its first turn. ``plan`` is a plan made earlier by
        ``planner_for(cache_salt).plan(chunks, conversation_id)``: its order is served and that
        plan is committed (no second planning); pass ``plan.ordered`` as ``chunks``.

        ``ValueError`` for an empty question, a prompt that cannot fit, a bad salt, a salt
        other than the conversation's, or a plan that does not fit the request;
        ``RuntimeError`` for a plan that cannot be committed (already committed, made by
        another planner or salt, stale, or being served); :class:`EngineFailure` if the engine
        fails (nothing is committed; a ``plan`` can be served again). Cost: one prefill of the
        uncached tokens plus ``max_tokens`` decode steps.
        """
        return self.generate_batch(
            [RagRequest(chunks, question, conversation_id, cache_salt, plan)],
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
        the first error is raised. Each request may carry its own ``cache_salt`` and ``plan``.
        """
        params = _sampling(sampling, max_tokens, read_prefix_cache)
        conversation_ids = [
            r.conversation_id or getattr(r.plan, "conversation_id", None) for r in requests
        ]
        named = [c for c in conversation_ids if c]
        if len(named) != len(set(named)):
            msg = "a conversation may appear at most once per batch (its turns are sequential)"
            raise ValueError(msg)
        flights: list[_InFlight] = []
        try:
            for request in requests:
                flights.append(self._start_rag(request, params))
        except BaseException:
            for flight in flights:
                self._abandon(flight)
            raise
        return self._wait(flights)

    def stream(
        self,
        chunks: Sequence[Chunk],
        question: str,
        *,
        conversation_id: str | None = None,
        sampling: SamplingRequest | None = None,
        max_tokens: int | None = None,
        read_prefix_cache: bool | None = None,
        cache_salt: str | None = None,
        plan: PlanLike | None = None,
    ) -> Iterator[StreamChunk]:
        """Yield the reply as it is generated; the last chunk carries the full result. The
        request starts when the iterator is first advanced; closing it early aborts the
        request (nothing committed). Arguments as for :meth:`generate`."""
        params = _sampling(sampling, max_tokens, read_prefix_cache)
        request = RagRequest(chunks, question, conversation_id, cache_salt, plan)
        yield from self._iterate(functools.partial(self._start_rag, request, params))

    async def astream(
        self,
        chunks: Sequence[Chunk],
        question: str,
        *,
        conversation_id: str | None = None,
        sampling: SamplingRequest | None = None,
        max_tokens: int | None = None,
        read_prefix_cache: bool | None = None,
        cache_salt: str | None = None,
        plan: PlanLike | None = None,
    ) -> AsyncIterator[StreamChunk]:
        """Async :meth:`stream`: the engine steps on its own thread, deltas arrive through an
        asyncio queue, so the event loop never blocks on a forward pass. Cancelling the
        consumer aborts the request (nothing committed)."""
        params = _sampling(sampling, max_tokens, read_prefix_cache)
        request = RagRequest(chunks, question, conversation_id, cache_salt, plan)
        start = functools.partial(self._start_rag, request, params)
        # aclosing: closing this generator must close the inner one (and abort) at once, not
        # when the inner generator is garbage-collected.
        async with aclosing(self._aiterate(start)) as pieces:
            async for piece in pieces:
                yield piece

    # ---- public API: prompts without chunks ----------------------------------------------------

    def generate_tokens(
        self,
        token_ids: Sequence[int],
        *,
        sampling: SamplingRequest | None = None,
        max_tokens: int | None = None,
        read_prefix_cache: bool | None = None,
        cache_salt: str | None = None,
    ) -> GenerationResult:
        """Generate from a ready prompt of token ids (no template, no planning, no commit);
        vLLM's prefix cache applies as usual (per ``cache_salt``). The report has no chunks.
        ``ValueError`` for an empty prompt or one that cannot fit; :class:`EngineFailure` if
        the engine fails. Cost: as :meth:`generate`."""
        params = _sampling(sampling, max_tokens, read_prefix_cache)
        return self._wait([self._start_tokens(token_ids, params, cache_salt)])[0]

    def stream_tokens(
        self,
        token_ids: Sequence[int],
        *,
        sampling: SamplingRequest | None = None,
        max_tokens: int | None = None,
        read_prefix_cache: bool | None = None,
        cache_salt: str | None = None,
    ) -> Iterator[StreamChunk]:
        """Streaming :meth:`generate_tokens` (closing early aborts the request)."""
        params = _sampling(sampling, max_tokens, read_prefix_cache)
        start = functools.partial(self._start_tokens, token_ids, params, cache_salt)
        yield from self._iterate(start)

    async def astream_tokens(
        self,
        token_ids: Sequence[int],
        *,
        sampling: SamplingRequest | None = None,
        max_tokens: int | None = None,
        read_prefix_cache: bool | None = None,
        cache_salt: str | None = None,
    ) -> AsyncIterator[StreamChunk]:
        """Async :meth:`stream_tokens`."""
        params = _sampling(sampling, max_tokens, read_prefix_cache)
        start = functools.partial(self._start_tokens, token_ids, params, cache_salt)
        async with aclosing(self._aiterate(start)) as pieces:
            async for piece in pieces:
                yield piece

    def generate_messages(
        self,
        messages: Sequence[ChatTurn],
        *,
        sampling: SamplingRequest | None = None,
        max_tokens: int | None = None,
        read_prefix_cache: bool | None = None,
        cache_salt: str | None = None,
    ) -> GenerationResult:
        """Answer a plain chat: ``messages`` are ``(role, text)`` pairs rendered with the
        model's chat template and the generation prompt, one tokenized segment per message
        (:meth:`message_token_ids`), so a chat re-sent with more messages reuses the earlier
        messages' KV. Stateless (no conversation, no planning, no commit). Errors as for
        :meth:`generate_tokens`, plus ``ValueError`` for malformed messages."""
        return self.generate_tokens(
            self.message_token_ids(messages),
            sampling=sampling,
            max_tokens=max_tokens,
            read_prefix_cache=read_prefix_cache,
            cache_salt=cache_salt,
        )

    def stream_messages(
        self,
        messages: Sequence[ChatTurn],
        *,
        sampling: SamplingRequest | None = None,
        max_tokens: int | None = None,
        read_prefix_cache: bool | None = None,
        cache_salt: str | None = None,
    ) -> Iterator[StreamChunk]:
        """Streaming :meth:`generate_messages`."""
        ids = self.message_token_ids(messages)
        yield from self.stream_tokens(
            ids,
            sampling=sampling,
            max_tokens=max_tokens,
            read_prefix_cache=read_prefix_cache,
            cache_salt=cache_salt,
        )

    async def astream_messages(
        self,
        messages: Sequence[ChatTurn],
        *,
        sampling: SamplingRequest | None = None,
        max_tokens: int | None = None,
        read_prefix_cache: bool | None = None,
        cache_salt: str | None = None,
    ) -> AsyncIterator[StreamChunk]:
        """Async :meth:`stream_messages`."""
        params = _sampling(sampling, max_tokens, read_prefix_cache)
        ids = self.message_token_ids(messages)
        start = functools.partial(self._start_tokens, ids, params, cache_salt)
        async with aclosing(self._aiterate(start)) as pieces:
            async for piece in pieces:
                yield piece

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


def _takes_keyword(fn: Callable[..., object], name: str) -> bool:
    """Whether ``fn`` accepts the keyword argument ``name`` (or any keyword)."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in parameters or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()
    )


def reused_chunk_count(
    chunk_spans: Sequence[tuple[int, int]], cached_tokens: int, block_size: int | None = None
) -> int:
    """Leading chunks lying entirely inside the cached prefix (``ReuseReport.reused_chunks``):
    :func:`craft_rag.metrics.chunks_inside_cache`, the definition replay uses too; 0 on a cold
    request. ``block_size`` is accepted for compatibility and no longer changes the count (the
    planner's block-granular evidence is :func:`craft_rag.metrics.chunks_with_cached_blocks`).
    O(chunks)."""
    del block_size
    return chunks_inside_cache(chunk_spans, cached_tokens)


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
