"""One RAG turn: fit -> layout -> plan -> render -> (serve) -> commit, the code the engine AND
replay run.

:class:`RagTurns` owns the turn logic: it validates the request, reads the conversation once
into a :class:`~craft_rag.engine.turn_context.TurnContext` (which makes room in the prompt
before planning, since dedup may only count chunks still in the prompt, and chooses the
layout), plans
(or claims a caller's plan by its lease, :meth:`craft_rag.planner.CraftPlanner.claim`), renders
the token-exact append-only prompt, hands it to a ``submit`` function (the engine's driver, or
replay's simulated prefix cache), and on completion commits what the cache actually reused
(:func:`reused_chunk_count`) and records the turn. A turn that is not served is given up: the
conversation is left as it was, an engine-made plan aborted, a caller's plan released (its
holder may serve it again).

Conversations have one owner, each salt's planner's conversation store (a conversation is
scoped by its tenant: the same id under two salts is two conversations): the planner records a
turn's keys and tokens in its commit, and holds a conversation while a turn of it is planned
(never evicted in between); dropped turns (history budget, context length) are forgotten
through that planner (logged with a shared store). Nothing is reconciled afterwards.

The walk of a turn through the modules: :mod:`~craft_rag.engine.planners` (the salt's
planner) -> :mod:`~craft_rag.engine.turn_context` (read, fit, layout) -> the planner (plan)
-> :mod:`~craft_rag.engine.conversation_prompts` (render; after serving: the stored turn and
the turns the history budget forgets) -> the planner (commit, forget) ->
:mod:`craft_rag.stores.histories` (the shared copy, with ``store=``). No store is scanned and
the conversation is read once (twice only when it moved while the turn was planned).

Cost per turn: the plan and commit (O(k) plus the tree policy's match), one O(turns) read of
the conversation and the render (O(prompt tokens), tokenizing uncached chunks); nothing
else.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

from craft_rag.chunk import Chunk
from craft_rag.engine.chunk_cache_plan import ChunkCachePlan, ChunkCachePlanner
from craft_rag.engine.conversation_prompts import ConversationPrompts, RenderedTurn
from craft_rag.engine.driver import RequestState
from craft_rag.engine.planners import (
    CacheSalt,
    PlannerNamespaces,
    check_plan,
    validate_cache_salt,
)
from craft_rag.engine.requests import InFlight, OnDelta, OnDone, plain_report, result_of
from craft_rag.engine.results import GenerationResult, RagRequest, SamplingRequest
from craft_rag.engine.turn_context import TurnContext
from craft_rag.kvtiers.approx_params import request_scoped_salt
from craft_rag.metrics import chunks_inside_cache, chunks_with_cached_blocks
from craft_rag.planner import CraftPlanner, Plan
from craft_rag.prompt import AssembledPrompt
from craft_rag.stores.histories import load_history, save_history
from craft_rag.types import ChunkKey

if TYPE_CHECKING:
    from craft_rag.engine.kv_events import BlockHasher

__all__ = ["RagTurn", "RagTurns", "predicted_cached_tokens", "reused_chunk_count"]


class Submit(Protocol):
    """Starts serving a rendered prompt; fills the :class:`RequestState` (cached tokens, reply).
    (:meth:`craft_rag.engine.driver.EngineDriver.submit` is one.)"""

    def __call__(
        self,
        token_ids: tuple[int, ...],
        sampling: SamplingRequest,
        state: RequestState,
        *,
        cache_salt: CacheSalt | None,
    ) -> None: ...


class CacheFacts(Protocol):
    """What a RAG turn needs to know of the cache it is served from."""

    @property
    def block_size(self) -> int: ...

    @property
    def eos_token_ids(self) -> frozenset[int]: ...


def reused_chunk_count(
    chunks: AssembledPrompt | Sequence[tuple[int, int]],
    cached_tokens: int,
    block_size: int | None = None,
) -> int:
    """Leading chunks lying entirely inside the cached prefix (``ReuseReport.reused_chunks``):
    :func:`craft_rag.metrics.chunks_inside_cache` over the prompt's (or the given) chunk spans;
    0 on a cold request. The one definition the engine and replay report. ``block_size`` is
    accepted for compatibility and no longer changes the count (the planner's block-granular
    evidence is :func:`craft_rag.metrics.chunks_with_cached_blocks`). O(chunks)."""
    del block_size
    spans = chunks.chunk_spans if isinstance(chunks, AssembledPrompt) else chunks
    return chunks_inside_cache(spans, cached_tokens)


def predicted_cached_tokens(
    plan: Plan, rendered: RenderedTurn, close_tokens: int, block_size: int
) -> int:
    """The tokens of ``rendered``'s prompt predicted to be in the prefix cache, which
    cache-aware admission ranks the request by (:mod:`craft_rag.scheduling.admission`).

    - A single request or a conversation's first turn: the CP-Tree's match
      (``plan.matched_tokens``; 0 when unknown).
    - A later turn appended after the same live turns as its previous prompt: the head and
      history in whole ``block_size`` blocks, less the previous reply's ``close_tokens`` (never
      in a prompt) and its last token (sampled, never fed), as
      :func:`~craft_rag.engine.turn_layout.predict_layout` predicts. The append-only prompt
      starts with the previous prompt and reply, so the history counts as cached: nothing
      tells the engine it was evicted (the CP-Tree holds chunks, not histories), nor, with a
      shared store, that another worker served the previous turn.
    - A restart (compacted history): the layout's ``restart_cached`` (the part of the old
      prompt the new one still starts with).
    - A turn whose prompt left out turns since the previous one (dropped to fit, or by the
      history budget): 0, its history differs from the previous prompt's right after the
      head.

    O(1)."""
    if rendered.conversation_id is None or plan.turn == 1:
        return plan.matched_tokens or 0
    if rendered.left_out:
        return 0
    if rendered.compacted_turns:
        return rendered.layout.restart_cached if rendered.layout is not None else 0
    block = max(block_size, 1)
    return max(0, (rendered.prompt.prefix_tokens - close_tokens - 1) // block * block)


@dataclass(slots=True)
class RagTurn:
    """A RAG turn in flight (the lifecycle's :class:`~craft_rag.engine.requests.TurnHooks`):
    exactly one of :meth:`commit` / :meth:`give_up` ends it. ``caller_plan``: the plan came in
    through ``plan=`` (claimed from its planner; released, not aborted, if not served).
    ``view``: the conversation as this turn read it (what the commit's budget applies to)."""

    owner: RagTurns
    plan: Plan
    rendered: RenderedTurn
    planner: CraftPlanner
    caller_plan: bool
    view: TurnContext
    chunk_plan: ChunkCachePlan | None = None  # with chunk-caches on: the per-chunk plan

    def commit(self, flight: InFlight) -> GenerationResult:
        return self.owner.commit(flight, self)

    def give_up(self) -> None:
        self.owner.give_up_plan(self.planner, self.plan, self.caller_plan)


class RagTurns:
    """The RAG-turn half of an engine (see the module docstring). Holds no state of its own:
    the planners (per salt) own plans and conversations; ``renderer`` renders from them."""

    def __init__(
        self,
        namespaces: PlannerNamespaces,
        renderer: ConversationPrompts,
        submit: Submit,
        cache: CacheFacts,
        *,
        check_salt: Callable[[str | None], CacheSalt | None],
        block_hasher: BlockHasher | None = None,
        barrier: Callable[[], None] = lambda: None,
        request_ids: Callable[[], str] | None = None,
        chunk_cache: ChunkCachePlanner | None = None,
    ) -> None:
        self.namespaces = namespaces
        # With chunk-caches on (EngineSettings.chunk_cache, in-process vLLM only): the
        # per-chunk plan of each single request (chunk_cache_plan; owns its chunk record).
        self.chunk_cache = chunk_cache
        self.renderer = renderer
        self.block_hasher = block_hasher
        self._submit = submit
        self._cache = cache
        self._check_salt = check_salt
        self._barrier = barrier
        counter = itertools.count(1)
        self._request_ids = request_ids or (lambda: f"craft-{next(counter)}")
        # The answer close ends each stored reply but was never in a prompt (not cached).
        self._close_tokens = len(renderer.chat_assembler.answer_ids(""))

    # ---- start: fit -> plan (or claim) -> render -> submit ------------------------------------

    def start(
        self,
        request: RagRequest,
        sampling: SamplingRequest,
        on_delta: OnDelta | None = None,
        on_done: OnDone | None = None,
    ) -> InFlight:
        """Plan and render ``request`` and submit it; raises (nothing changed, no plan left in
        flight) on bad input or a plan that cannot be served."""
        question = request.question
        if not isinstance(question, str) or not question.strip():
            msg = "question must be a non-empty string"
            raise ValueError(msg)
        salt = self._check_salt(request.cache_salt)
        conversation_id = request.conversation_id
        planner = self.namespaces.get(salt)
        self._barrier()
        given = None
        if request.plan is not None:
            given = check_plan(request.plan, planner, request.chunks, conversation_id, salt=salt)
        fit_id = conversation_id or (given.conversation_id if given is not None else None)
        # The one read of the conversation (after another worker's last turn, with a shared
        # store); fit (before planning: dedup may only count chunks
        # of turns that stay in the prompt) and layout (append, or restart compacted: a
        # caller's plan already holds the conversation; a restart re-sends what it removed).
        view = TurnContext.open(
            self.renderer,
            planner,
            fit_id,
            salt,
            request.chunks,
            question,
            max_tokens=sampling.max_tokens,
            planned=given is not None,
            layout_chunks=(
                request.chunks if given is None else (*given.ordered, *given.removed_duplicates)
            ),
            block_size=self._cache.block_size,
        )
        next_turn = view.next_turn  # read with the view: the steps below do not come back to it
        if given is None:
            chunks = list(request.chunks)
            if self.chunk_cache is not None and conversation_id is None:
                # Fixable chunks ahead of new ones among the planner's ties (see
                # chunk_cache_plan: the plan is never reordered after planning).
                chunks = self.chunk_cache.fixable_first(chunks, lambda c: c.key, salt)
            plan = planner.claim(planner.plan(chunks, conversation_id))
        else:
            conversation_id = given.conversation_id
            gone = sorted(view.lost_keys & {c.key for c in given.removed_duplicates})
            if gone:
                msg = (
                    f"plan {given.plan_id} removed chunks {gone[:3]} as already sent, but the "
                    "turns carrying them were dropped to fit the context; call "
                    "engine.fit_turn(...) before planning, or plan the turn again"
                )
                raise RuntimeError(msg)
            plan = planner.claim(given)
        caller_plan = given is not None
        try:
            conv = plan.conversation_id
            if conv is not None and plan.turn != next_turn:
                # The conversation moved since the view was read (the plan pulled another
                # worker's turn, or it was ended before planning): read it again.
                view = view.read_again()
            if conv is not None and plan.turn != planner.committed_turns(conv) + 1:
                # Ended (end_conversation) after it was planned: its removed duplicates are in
                # no prompt any more. (An LRU or TTL eviction cannot happen: the planner holds
                # a conversation while a turn of it is planned.)
                msg = (
                    f"conversation {conversation_id!r} was ended while plan {plan.plan_id} "
                    "waited to be served; send the turn again"
                )
                raise RuntimeError(msg)
            rendered = self.render(plan, question, view)
            # What cache-aware admission ranks by (the CP-Tree's match, or the history); read
            # from the rendered turn before the driver is reached (the turn's walk never
            # returns to a module it left: tests/engine/test_turn_walk.py).
            predicted = predicted_cached_tokens(
                plan, rendered, self._close_tokens, self._cache.block_size
            )
            state = RequestState(
                self._request_ids(),
                on_delta=on_delta,
                on_done=on_done,
                predicted_cached_tokens=predicted,
            )
            sent_sampling, sent_salt, chunk_plan = self._chunk_cache_request(
                plan, rendered, sampling, salt
            )
            self._submit(rendered.prompt.token_ids, sent_sampling, state, cache_salt=sent_salt)
            if chunk_plan is not None and self.chunk_cache is not None:
                self.chunk_cache.sent(salt, rendered.prompt.chunk_keys, chunk_plan)
        except BaseException:
            self.give_up_plan(planner, plan, caller_plan)
            raise
        turn = RagTurn(self, plan, rendered, planner, caller_plan, view, chunk_plan)
        return InFlight(state, sampling, rendered.prompt.token_ids, salt, turn)

    def _chunk_cache_request(
        self, plan: Plan, rendered: RenderedTurn, sampling: SamplingRequest,
        salt: CacheSalt | None,
    ) -> tuple[SamplingRequest, CacheSalt | None, ChunkCachePlan | None]:
        """What to submit with chunk-caches on: the sampling, with the per-chunk plan's
        ``kv_transfer_params`` added (``craft_approx`` chunk spans for a span request, under a
        request-scoped salt: :func:`~craft_rag.kvtiers.approx_params.request_scoped_salt` of
        the tenant's; ``craft_chunks`` for an exact request with harvest on, under the tenant's
        own salt, so that the connector keeps its exactly computed chunks), the salt and the
        plan; unchanged (and no plan) when off or not applicable: a conversation turn (its
        history must stay an exact prefix for the next turn) or a request that does not read
        the prefix cache (the no-cache baseline)."""
        if (self.chunk_cache is None or rendered.conversation_id is not None
                or not sampling.read_prefix_cache):
            return sampling, salt, None
        prompt = rendered.prompt
        chunk_plan = self.chunk_cache.plan(
            prompt.chunk_keys, prompt.chunk_spans, plan.matched_tokens, len(prompt.token_ids),
            salt, block_size=self._cache.block_size,
        )
        params = chunk_plan.params(self.chunk_cache.settings)
        if not params:
            return sampling, salt, chunk_plan
        extra = dict(sampling.extra)
        args = dict(extra.get("extra_args") or {})
        args["kv_transfer_params"] = {**(args.get("kv_transfer_params") or {}), **params}
        extra["extra_args"] = args
        sent_salt = CacheSalt(request_scoped_salt(salt)) if chunk_plan.send else salt
        return replace(sampling, extra=extra), sent_salt, chunk_plan

    def render(self, plan: Plan, question: str, view: TurnContext) -> RenderedTurn:
        """Render ``plan``'s turn after ``view``'s live turns (its planner holds the turn in
        flight). A restart (``view.layout``) renders the plan's chunks and then the ones dedup
        removed (in the retriever's order): every chunk of the turn is in the prompt, and
        :meth:`commit` records all of their keys with the turn (``removed_in_prompt``)."""
        chunks = plan.ordered
        if view.layout is not None and view.layout.restart:
            chunks = (*plan.ordered, *plan.removed_duplicates)
        return self.renderer.render(view, chunks, question)

    def give_up_plan(self, planner: CraftPlanner, plan: Plan, caller_plan: bool) -> None:
        """A turn that will not be committed: a caller's plan is released (its holder may
        serve it again); a plan the engine made is aborted, so its conversation is not left
        with a plan in flight (which would block its next turn)."""
        if caller_plan:
            planner.release(plan)
        else:
            planner.abort(plan)

    # ---- commit ---------------------------------------------------------------------------

    def commit(
        self,
        flight: InFlight,
        turn: RagTurn,
        *,
        stored_reply: Sequence[int] | None = None,
    ) -> GenerationResult:
        """Commit a finished turn with what the cache reused and record it in the history.
        ``stored_reply``: the reply and close to store instead of the generated ids (replay
        stores the trace's answer)."""
        state, prompt, plan, rendered = flight.state, turn.rendered.prompt, turn.plan, turn.rendered
        tokens = self.renderer.stored_turn(
            rendered, state.token_ids, self._cache.eos_token_ids, stored_reply=stored_reply
        )
        # Left-out and over-budget turns, from the view the turn was rendered after.
        forget = self.renderer.turns_to_forget(turn.view, rendered, tokens)
        left_out = rendered.left_out
        cached = state.num_cached_tokens or 0
        if state.reuse_counts is not None:
            # Chunk spans were sent: vLLM counts the connector's approximate tokens as cached,
            # but only the exact ones are reuse the CP-Tree (and reused_chunks) may count.
            cached = min(cached, state.reuse_counts.exact)
        reused = reused_chunk_count(prompt, cached)
        # The planner prunes CP-Tree nodes past this: block-granular evidence, not `reused`.
        # The plan's chunks lead the prompt's (a restart re-sends dedup's after them).
        spans = prompt.chunk_spans[: len(plan.ordered)]
        kv_chunks = chunks_with_cached_blocks(spans, cached, self._cache.block_size)
        block_hashes = None
        if self.block_hasher is not None:
            hashes = self.block_hasher.block_hashes(prompt.token_ids, flight.cache_salt)
            block_hashes = self.block_hasher.per_chunk(hashes, spans)
        resent = len(prompt.chunk_keys) > len(plan.ordered)  # dedup's chunks re-sent
        # Evictions published up to now reach the CP-Tree before this commit, not after it.
        self._barrier()
        turn.planner.commit(
            plan,
            prefix_tokens=prompt.prefix_tokens,
            chunk_token_counts=[end - start for start, end in spans],
            # Without reading the cache, cached=0 says nothing about what the cache holds.
            reused_chunks=kv_chunks if flight.sampling.read_prefix_cache else None,
            block_hashes=block_hashes,
            # Recorded only in a conversation: a single request's ids would be checked, O(prompt
            # tokens) in Python (~65 µs for 1,600 ids), then dropped.
            turn_tokens=tokens if plan.conversation_id is not None else None,
            # A restart re-sent dedup's chunks: the turn records every key in its prompt.
            removed_in_prompt=resent,
        )
        if turn.chunk_plan is not None and self.chunk_cache is not None:
            self.chunk_cache.finished(flight.cache_salt, prompt.chunk_keys, turn.chunk_plan)
        cid = rendered.conversation_id
        # Unless it was ended while in flight (its commit then started it anew).
        if forget and cid is not None and turn.planner.committed_turns(cid) == plan.turn:
            turn.planner.forget_turns(cid, forget)
        save_history(turn.planner, cid)
        report = replace(
            plain_report(flight),
            predicted_tokens=plan.matched_tokens,
            predicted_chunks=plan.matched_chunks,
            reused_chunks=reused,
            prefix_tokens=prompt.prefix_tokens,
            chunk_order=prompt.chunk_keys,
            removed_duplicates=() if resent else tuple(c.key for c in plan.removed_duplicates),
            repeated_in_request=tuple(c.key for c in plan.repeated_in_request),
            dropped_turns=left_out,
            conversation_id=turn.rendered.conversation_id,
            turn=plan.turn,
            plan_id=plan.plan_id,
            layout=turn.rendered.layout,
        )
        return result_of(flight, report)

    # ---- conversations --------------------------------------------------------------------

    def end_conversation(self, conversation_id: str, cache_salt: str | None = None) -> bool:
        """Forget ``cache_salt``'s conversation in that salt's planner and store (turns,
        tokens, the turn in flight); no other tenant's. ``ValueError`` for a bad salt."""
        salt = validate_cache_salt(cache_salt)
        return self.namespaces.end_conversation(conversation_id, salt)

    def fit_turn(
        self, chunks: Sequence[Chunk], question: str, where: tuple[str | None, int, str | None]
    ) -> frozenset[ChunkKey]:
        """See :meth:`craft_rag.engine.CraftEngine.fit_turn`; ``where``: ``(conversation_id,
        max_tokens, cache_salt)``."""
        conversation_id, max_tokens, cache_salt = where
        salt = self._check_salt(cache_salt)
        view = TurnContext.open(
            self.renderer,
            self.namespaces.get(salt),
            conversation_id,
            salt,
            chunks,
            question,
            max_tokens=max_tokens,
        )
        return view.lost_keys

    def side_prompt_ids(
        self, conversation_id: str | None, text: str, *, cache_salt: str | None = None
    ) -> tuple[int, ...]:
        """See :meth:`craft_rag.engine.CraftEngine.side_prompt_ids`."""
        salt = self._check_salt(cache_salt)
        load_history(self.namespaces.get(salt), conversation_id)
        return self.renderer.side_prompt(conversation_id, text, salt)
