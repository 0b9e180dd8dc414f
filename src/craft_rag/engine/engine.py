"""``CraftEngine``: CRAFT planning in front of one vLLM engine with prefix caching, in-process or
a vLLM server (``server=``).

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

This module is the facade. Every request goes through :meth:`CraftEngine.submit` (the public
``generate``/``stream``/``astream`` forms are one statement each over it,
:mod:`craft_rag.engine.forms`): a RAG turn starts in :mod:`craft_rag.engine.rag_turn`, a prompt
without chunks here; the returned :class:`~craft_rag.engine.requests.RequestHandle` (the request
lifecycle, :mod:`craft_rag.engine.requests`) is read by waiting, iterating or async iterating,
and ends the turn exactly once (commit or give up). The backend and its driver are set up by
:mod:`craft_rag.engine.wiring`.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from typing import ClassVar, Unpack

from craft_rag.chunk import Chunk
from craft_rag.conversation import ConversationHistory
from craft_rag.engine.admission import admission_of
from craft_rag.engine.backends.server.backend import ServerSettings
from craft_rag.engine.backends.vllm.backend import EngineSettings, EngineStartError
from craft_rag.engine.chat_format import model_renderer
from craft_rag.engine.chunk_cache_plan import ChunkCachePlanner
from craft_rag.engine.conversation_prompts import (
    ENGINE_MAX_CONVERSATIONS,
    ConversationPrompts,
)
from craft_rag.engine.driver import (
    EngineFailure,
    RequestCancelled,
    RequestIds,
    RequestState,
    SubmitTo,
)
from craft_rag.engine.engine_settings import (
    BackendParts,
    ConversationSettings,
    FlatKeywords,
    PlannerSettings,
    RenderingSettings,
    group_keywords,
)
from craft_rag.engine.event_barrier import EventBarrier
from craft_rag.engine.forms import RequestForms
from craft_rag.engine.messages import ChatTurn, MessageRenderer
from craft_rag.engine.model import local_model_folder
from craft_rag.engine.planners import (
    PlannerNamespaces,
    SaltCheck,
    bound_conversations,
    default_planner,
    store_planners,
    validate_cache_salt,
)
from craft_rag.engine.rag_turn import RagTurns, reused_chunk_count
from craft_rag.engine.requests import (
    InFlight,
    OnDelta,
    OnDone,
    RequestHandle,
    finish_request,
)
from craft_rag.engine.results import (
    EngineRequest,
    GenerationResult,
    MessagesRequest,
    RagRequest,
    SamplingRequest,
    TokensRequest,
)
from craft_rag.engine.wiring import (
    ChatRendering,
    conversation_format,
    prompt_pieces,
    wire_backend,
)
from craft_rag.planner import CraftPlanner
from craft_rag.prompt import PromptAssembler, PromptFormat
from craft_rag.tokenizer import Tokenizer
from craft_rag.types import ChunkKey
from craft_rag.validation import validate_conversation_id

__all__ = [
    "CraftEngine",
    "EngineFailure",
    "EngineSettings",
    "EngineStartError",
    "RequestCancelled",
    "reused_chunk_count",
]


_InFlight = InFlight


class CraftEngine(RequestForms):
    """One vLLM engine with prefix caching (in-process, or a server), fed CRAFT-planned prompts.

    Invariants: exactly one backend engine per instance; every call into it goes through the
    driver's lock; a planner is committed only for requests that finished, and only by the
    planner of the request's cache salt; a conversation belongs to one cache salt (the same id
    under another salt is another conversation) and has at most one turn in flight; a
    caller-made plan is in flight at most once. Start-up: seconds (plus ~30 s
    the very first time the embedded model is converted). Close with :meth:`close` (or use as
    a context manager).
    """

    several_servers: ClassVar[type[CraftEngine] | None] = None
    """The class ``CraftEngine(server=[url, url, ...])`` makes: set once, when
    :mod:`craft_rag.engine.routed_engine` is imported (by this package's ``__init__``), so
    this module does not import it back."""

    def __new__(cls, *args: object, **kwargs: object) -> CraftEngine:
        # server=[url, url, ...]: one engine over several replicas (the same request forms).
        if cls is CraftEngine and isinstance(kwargs.get("server"), list | tuple):
            routed = CraftEngine.several_servers
            if routed is None:  # pragma: no cover - the package __init__ imports it
                msg = "import craft_rag.engine (it registers the several-server engine)"
                raise RuntimeError(msg)
            return super().__new__(routed)
        return super().__new__(cls)

    def __init__(
        self,
        settings: EngineSettings | None = None,
        planner: CraftPlanner | None = None,
        *,
        server: str | ServerSettings | Sequence[str | ServerSettings] | None = None,
        routing: str | None = None,
        planners: PlannerSettings | None = None,
        rendering: RenderingSettings | None = None,
        conversation: ConversationSettings | None = None,
        parts: BackendParts | None = None,
        **flat: Unpack[FlatKeywords],
    ) -> None:
        """Start the engine. The options come in groups (:mod:`craft_rag.engine.engine_settings`:
        ``planners``, ``rendering``, ``conversation``, ``parts``); each group's fields are also
        accepted as flat keywords (``store=``, ``turn_layout=``...), not both for one group.
        ``backend``/``tokenizer``/``block_hasher``/``chat_renderer`` (:class:`BackendParts`)
        replace the vLLM and model pieces (tests use fakes); by default the model is resolved
        (``settings.model``, or the embedded default prepared on first use), vLLM is started
        and KV events subscribed.

        ``planner`` serves unsalted requests; each cache salt gets its own planner from
        ``salt_planner_factory`` (default: a ``CraftPlanner`` with ``planner``'s config), at
        most ``max_salt_namespaces`` of them (least recently used dropped).

        ``max_conversations`` bounds the conversations the planners keep (one LRU + TTL bound
        on each planner's conversation store: chunk keys and prompt tokens together); ``None``
        keeps a given planner's own bound, and gives the default planner
        :data:`~craft_rag.engine.conversation_prompts.ENGINE_MAX_CONVERSATIONS` (1,024; with
        ``store=``: ``PlannerConfig``'s default, 10,000, which the store's other workers share).

        ``history_budget`` bounds each conversation's stored prompt history (oldest whole turns
        dropped, with hysteresis; see :class:`HistoryBudget`); ``None``: only ``max_model_len``
        bounds it. ``turn_layout``: per conversation turn, append to the prompt or restart it
        with a compacted (chunk-free) history when a cost model predicts that faster
        (:mod:`craft_rag.engine.turn_layout`; ``APPEND_ONLY`` turns it off).

        ``server``: a vLLM OpenAI-compatible server's URL (or :class:`ServerSettings`) to serve
        through instead of an in-process engine; ``settings.model`` then names the local folder
        of the served model's tokenizer and chat template (see
        :mod:`craft_rag.engine.backends.server.backend`; ``ServerUnavailable``/``ValueError``
        name the fix). A list of them (``server=[url, url, ...]``) makes one engine over
        several replicas: every request is routed with ``routing`` (default
        ``"craft_joint"``: placement and chunk order chosen together) and committed to the
        chosen replica's CP-Tree (:class:`~craft_rag.engine.routed_engine.RoutedEngine`;
        docs/routing.md). ``routing`` with one server is a ``ValueError``.

        ``store``: planner state shared with other workers (``memory://``,
        ``sqlite:///path/state.db``, ``redis://host:6379/0``; see :mod:`craft_rag.stores`): the
        default planner uses the store's ``default`` namespace and each cache salt its own
        namespace (:func:`craft_rag.stores.namespace_for_salt`), so tenants share no state.
        Not combined with ``planner``/``salt_planner_factory`` (give your planner ``store=``).

        ``prompt_format`` renders requests without a conversation (default: derived from the
        model's chat template, the question closing the documents' user message);
        ``chat_prompt_format`` renders conversation turns (default: ``prompt_format`` when
        that is given, else derived with the question as its own user message where the
        template accepts two user messages in a row: better multi-turn answers, worse
        single-turn ones, docs/benchmarks.md). :attr:`chat_rendering` says which was chosen.
        ``ValueError`` for either when it is not a ``PromptFormat``.

        ``ImportError`` (vLLM or converter missing) and :class:`EngineStartError` name the fix.
        """
        if routing is not None or not (server is None or isinstance(server, str | ServerSettings)):
            msg = (
                "routing= spreads requests over several servers: pass server=[url, url, ...] "
                "to CraftEngine itself (one server needs no routing)"
            )
            raise ValueError(msg)
        groups = group_keywords(planners, rendering, conversation, parts, flat)
        self.settings = settings or EngineSettings()
        rendering, parts = groups.rendering, groups.parts
        prompt_format, system_prompt = rendering.prompt_format, rendering.system_prompt
        instructions, backend, tokenizer = rendering.instructions, parts.backend, parts.tokenizer
        store, salt_planner_factory = groups.planners.store, groups.planners.salt_planner_factory
        self.system_prompt = system_prompt  # fixed at the head of every prompt (read-only)
        self.instructions = instructions  # before each request's first document
        salted_factory = None
        bound = groups.planners.max_conversations
        if store is not None:
            planner, salted_factory = store_planners(store, planner, salt_planner_factory, bound)
        elif planner is None:
            planner = default_planner(bound or ENGINE_MAX_CONVERSATIONS)
        elif bound is not None:
            planner = bound_conversations(planner, bound)
        self._namespaces = PlannerNamespaces(
            planner,
            salt_planner_factory,
            max_salted=groups.planners.max_salt_namespaces,
            salted_factory=salted_factory,
        )
        self._ids = RequestIds()
        self._renderer_lock = threading.Lock()
        # A hub id becomes its local snapshot: the prompt is built from its tokenizer and
        # chat template, so the engine needs the files, as vLLM does.
        model_path = local_model_folder(self.settings.model) if backend is None else None
        self._model_path = model_path
        self._chat_renderer = parts.chat_renderer
        self._message_renderer: MessageRenderer | None = None

        # Prompt pieces first: they are cheap and fail fast, before vLLM takes seconds and RAM.
        self.prompt_format, tokenizer = prompt_pieces(
            model_path,
            prompt_format,
            tokenizer,
            system_prompt=system_prompt,
            instructions=instructions,
        )
        self.assembler = PromptAssembler(tokenizer, self.prompt_format)
        chat = conversation_format(
            model_path,
            self.prompt_format,
            prompt_format=prompt_format,
            chat_prompt_format=rendering.chat_prompt_format,
            system_prompt=system_prompt,
            instructions=instructions,
        )
        self._chat_rendering = chat.rendering
        chat_assembler = (
            self.assembler
            if chat.format is self.prompt_format
            else PromptAssembler(tokenizer, chat.format)
        )
        wiring = wire_backend(
            self.settings,
            model_path,
            tokenizer,
            self._namespaces,
            server=server,
            backend=backend,
            block_hasher=parts.block_hasher,
        )
        self._backend = wiring.backend
        self.kv_events = wiring.kv_events
        block_hasher = wiring.block_hasher
        self.block_hasher = block_hasher
        self.prompt_renderer = ConversationPrompts(
            self.assembler,
            max_model_len=self._backend.max_model_len,
            history_budget=groups.conversation.history_budget,
            stores=self._namespaces,  # each salt's planner's one conversation store
            turn_layout=groups.conversation.turn_layout,
            chat_assembler=chat_assembler,
        )
        self._driver = wiring.driver(
            on_server_lost=self._namespaces.on_all_blocks_cleared,
            admission=admission_of(self.settings),
        )
        # The turn's steps call these objects of the modules that own them (no call back into
        # this facade mid-turn): the salt check, the event barrier, ids and the driver's submit.
        self._salt = SaltCheck(wiring.takes_salt, type(self._backend).__name__)
        self._rag = RagTurns(
            self._namespaces,
            self.prompt_renderer,
            SubmitTo(self._driver),
            self._backend,
            check_salt=self._salt,
            block_hasher=block_hasher,
            barrier=EventBarrier(self.kv_events, self._backend.published_batches),
            request_ids=self._ids,
            # Chunk-caches (EngineSettings.chunk_cache): in-process, the engine loads the
            # connector; over a server, the server must run it (`craft-rag serve --chunk-cache`)
            # and this planner's record mirrors that server's store (one per replica engine).
            chunk_cache=(
                ChunkCachePlanner(self.settings.chunk_cache)
                if self.settings.chunk_cache is not None
                else None
            ),
        )

    # ---- configuration -----------------------------------------------------------------------

    @property
    def planner(self) -> CraftPlanner:
        """The planner of unsalted requests (see :meth:`planner_for`)."""
        return self._namespaces.default

    def planner_for(self, cache_salt: str | None = None) -> CraftPlanner:
        """The planner that plans and commits requests with ``cache_salt`` (the default planner
        for ``None``), created on first use. Make ``plan=`` plans with it. ``ValueError`` for
        an invalid salt. O(1)."""
        return self._namespaces.get(self._salt(cache_salt))

    def set_planner(self, planner: CraftPlanner) -> None:
        """Serve later requests with ``planner`` (e.g. another policy for a side-by-side run):
        KV events go to it, the salted planners are dropped (new ones are made like it), and
        with them their conversations (each planner's store holds its conversations: the new
        planner's are served from now on). Call :meth:`reset_prefix_cache` too for a cold
        start."""
        self._namespaces.reset(planner)

    @property
    def conversations(self) -> ConversationPrompts:
        """The former name of :attr:`prompt_renderer` (a renderer, not conversation state:
        that is each salt's planner's ``conversations`` store)."""
        return self.prompt_renderer

    @property
    def chat_prompt_format(self) -> PromptFormat:
        """The format of conversation turns (:attr:`prompt_format` renders single requests;
        see :attr:`chat_rendering`). Read-only."""
        return self.prompt_renderer.chat_assembler.format

    @property
    def chat_rendering(self) -> ChatRendering:
        """Why conversations render with :attr:`chat_prompt_format`: ``"question_message"``
        (derived, the question as its own user message), ``"single_turn"`` (derived; the chat
        template refuses two user messages in a row, so the single-turn rendering),
        ``"prompt_format"`` or ``"chat_prompt_format"`` (the caller's). Read-only."""
        return self._chat_rendering

    @property
    def max_model_len(self) -> int:
        return self._backend.max_model_len

    @property
    def block_size(self) -> int:
        return self._backend.block_size

    @property
    def requests_in_flight(self) -> int:
        """Requests the engine serves or holds now (waiting, prefilling or decoding), every
        salt and kind together: a load signal (speculative pipelining's queue gate). O(1)."""
        return self._driver.in_flight()

    @property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer prompts are built with (text -> ids exactly as the engine sends them)."""
        return self.assembler.tokenizer

    def turn_count(self, conversation_id: str, *, cache_salt: str | None = None) -> int:
        """Turns the engine holds for ``cache_salt``'s ``conversation_id`` (0: unknown under
        that salt, ended or forgotten)."""
        return self.prompt_renderer.turn_count(conversation_id, validate_cache_salt(cache_salt))

    def reset_prefix_cache(self) -> bool:
        """Drop vLLM's whole prefix cache (every salt) and empty every CP-Tree. False (nothing
        changed) if running requests hold blocks."""
        # vLLM publishes AllBlocksCleared only with its next step's batch, which can reach the
        # sync after that step's request committed (no event barrier over a server): announce
        # it first so it is not applied then, and clear now so the next plan sees the empty
        # cache (kv_events module doc, "Our own resets").
        if self.kv_events is not None:
            self.kv_events.expect_clear()
        done = False
        try:
            done = self._driver.exclusive(self._backend.reset_prefix_cache)
        finally:
            if not done and self.kv_events is not None:
                self.kv_events.cancel_clear()
        if done:
            self._namespaces.on_all_blocks_cleared()
        return done

    def end_conversation(self, conversation_id: str, *, cache_salt: str | None = None) -> bool:
        """Forget ``cache_salt``'s conversation (default: the unsalted tenant's) in its planner
        and prompt history; a conversation with the same id under another salt is another
        tenant's and stays. True if it was known. ``ValueError`` for a bad salt."""
        return self._rag.end_conversation(conversation_id, cache_salt)

    def export_conversation(
        self, conversation_id: str, *, cache_salt: str | None = None
    ) -> ConversationHistory | None:
        """``cache_salt``'s conversation as :meth:`import_conversation` takes it on another
        engine of the same model and prompt format: its live turns (chunk keys and token ids),
        its turn count and dropped turns. Conversation history is client-side state, so it can
        move (a routed engine moves it off a lost replica). A turn in flight is not part of it.
        None when unknown under that salt, without a recorded turn, or a live turn's tokens are
        not known here (another worker's, not loaded). Read-only. ``ValueError`` for a bad id
        or salt. O(turns)."""
        cid = validate_conversation_id(conversation_id)
        store = self._namespaces.held_store(validate_cache_salt(cache_salt))
        history = store.history(cid) if store is not None and cid is not None else None
        if history is None or not history.turn_count or None in history.turns:
            return None
        return history

    def import_conversation(
        self,
        conversation_id: str,
        history: ConversationHistory,
        *,
        cache_salt: str | None = None,
    ) -> bool:
        """Take in a conversation :meth:`export_conversation` gave (from another engine): its
        next turn here continues it (turn numbers go on, its earlier turns are in the prompt,
        computed here from scratch, and their chunks are deduplicated). False (nothing
        changed) when the conversation is already live here with turns or a turn in flight.
        ``ValueError`` for a bad id, salt or history; ``RuntimeError`` with a shared store
        (``store=``: its log decides the conversations). O(tokens)."""
        cid = validate_conversation_id(conversation_id)
        if cid is None:
            msg = "conversation_id: must be a non-empty string, got None"
            raise ValueError(msg)
        planner = self._namespaces.get(self._salt(cache_salt))
        return planner.conversations.import_history(cid, history)

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
        where = (conversation_id, max_tokens, cache_salt)
        return self._rag.fit_turn(chunks, question, where)

    def side_prompt_ids(
        self, conversation_id: str | None, text: str, *, cache_salt: str | None = None
    ) -> tuple[int, ...]:
        """Token ids of a one-off question asked after the conversation's stored prompt (its
        cached prefix) without joining it, e.g. a condense step; serve them with
        :meth:`generate_tokens` (same ``cache_salt``) for a report of their own. ``text`` is
        tokenized as plain text. ``ValueError`` for empty text or another salt."""
        return self._rag.side_prompt_ids(conversation_id, text, cache_salt=cache_salt)

    def message_token_ids(self, messages: Sequence[ChatTurn]) -> tuple[int, ...]:
        """The token ids :meth:`generate_messages` sends for ``messages``: the chat template's
        rendering with the generation prompt, one tokenized segment per message (see
        :mod:`craft_rag.engine.messages`). ``ValueError`` for malformed messages."""
        return self._messages().token_ids(messages)

    def _messages(self) -> MessageRenderer:
        with self._renderer_lock:
            if self._message_renderer is None:
                render = self._chat_renderer
                if render is None:
                    if self._model_path is None:
                        msg = "pass chat_renderer= when passing a custom backend"
                        raise RuntimeError(msg)
                    render = model_renderer(self._model_path)
                self._message_renderer = MessageRenderer(render, self.assembler.tokenizer)
            return self._message_renderer

    # ---- the request path: submit -> _start (RAG turn or prompt) -> handle -> _finish -----------

    def _start_tokens(
        self,
        ids: tuple[int, ...],
        sampling: SamplingRequest,
        cache_salt: str | None,
        on_delta: OnDelta | None = None,
        on_done: OnDone | None = None,
    ) -> InFlight:
        """Start a prompt without chunks (``ids`` checked by :class:`TokensRequest`)."""
        salt = self._salt(cache_salt)
        if len(ids) + sampling.max_tokens > self.max_model_len:
            msg = (
                f"prompt needs {len(ids)} tokens + max_tokens {sampling.max_tokens} > "
                f"max_model_len {self.max_model_len}; shorten the prompt (drop old messages), "
                "lower max_tokens, or start the engine with a larger max_model_len"
            )
            raise ValueError(msg)
        state = RequestState(self._ids(), on_delta=on_delta, on_done=on_done)
        self._driver.submit(ids, sampling, state, cache_salt=salt)
        return InFlight(state, sampling, ids, salt)

    def _finish(self, flight: InFlight) -> GenerationResult:
        """Where every request ends (commit or give up); the bench harness wraps it."""
        return finish_request(flight)

    # ---- the one entry point -------------------------------------------------------------------

    def submit(self, request: EngineRequest) -> RequestHandle:
        """Start ``request`` (a :class:`RagRequest`, :class:`MessagesRequest` or
        :class:`TokensRequest`) now; returns its :class:`RequestHandle` (``result()``,
        iteration, ``async for``, ``abort()``). Errors from planning and rendering (see
        :meth:`generate`) are raised here and change nothing. Cost: the plan and render of a
        RAG turn (or the chat template's render) here; the prefill and decode on the driver."""
        return RequestHandle(
            functools.partial(self._start, request), self._driver.abort, self._finish
        )

    def _start(self, request: EngineRequest, on_delta: OnDelta, on_done: OnDone) -> InFlight:
        if isinstance(request, RagRequest):
            return self._rag.start(request, request.sampling, on_delta, on_done)
        if isinstance(request, MessagesRequest):
            ids = self.message_token_ids(request.messages)
        elif isinstance(request, TokensRequest):
            ids = tuple(request.token_ids)
        else:
            msg = (
                f"submit takes a RagRequest, MessagesRequest or TokensRequest, got "
                f"{type(request).__name__}"
            )
            raise ValueError(msg)
        return self._start_tokens(ids, request.sampling, request.cache_salt, on_delta, on_done)

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
