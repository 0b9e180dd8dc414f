"""Append-only multi-turn prompts with oldest-turn dropping (paper §4.3).

A conversation's prompt for turn ``t`` is ``[head][turn 1]...[turn t-1][turn-t chunks][Q_t tail]``
where each stored turn is ``[its chunks][Q tail][reply ids][answer close]`` (the close ends the
assistant turn and opens the next user turn, see :mod:`craft_rag.engine.chat_format`). Each
turn's prompt therefore starts with the previous turn's prompt and reply, token for token, and
vLLM's prefix cache reuses all of it. Replies are kept as the token ids the model generated
(trailing stop tokens replaced by the template's close), so even the reply's KV is reusable.

**Two renderings.** Single requests use ``assembler``; conversation turns and their side prompts
``chat_assembler`` (an engine's: :func:`craft_rag.engine.wiring.conversation_format`).

**History budget.** On this engine TTFT grows with the cached length too (attention over the
whole prefix), so an ever-growing history makes later turns slower even when they are mostly
cached. A :class:`~craft_rag.engine.history_budget.HistoryBudget` bounds the stored history
(head excluded): when a completed turn takes it over ``max_tokens``, whole oldest turns are
dropped until it is at most ``keep_tokens``. The first turn after a drop recomputes the shorter
history once; the low-water mark then leaves room for several turns that only append (the prefix
stays stable and reused) instead of sliding, and recomputing, every turn. Dropped turns are
forgotten in the conversation store (through the salt's planner, so a shared store logs them),
which also forgets their chunks: conversation dedup is only correct while the turn carrying a
chunk is still in the prompt.

When ``history + new turn + max_tokens`` would exceed ``max_model_len``, the turn's
:class:`~craft_rag.engine.turn_context.TurnContext` drops whole oldest turns before it is
planned (never part of a turn, never part of a chunk); the count is reported. A turn that
cannot fit even alone raises ``ValueError``.

**State.** This module keeps none: every turn (chunk keys and token ids), the turn in flight
and the bounds live in the one conversation store (:class:`craft_rag.conversation.
ConversationStore`) of each cache salt's planner, found through
:class:`~craft_rag.engine.conversation_stores.ConversationStores` (an engine's
:class:`~craft_rag.engine.planners.PlannerNamespaces`). A turn reads its conversation once,
into a :class:`~craft_rag.engine.turn_context.TurnContext` (fit and layout happen there,
before planning); :meth:`ConversationPrompts.render` renders from that view and
:meth:`ConversationPrompts.turns_to_forget` applies the :class:`HistoryBudget` to it, so the
planner that records the turn also forgets what the prompt left out. With several workers
(``CraftEngine(store=...)``) the token history also has a shared copy
(:mod:`craft_rag.stores.histories`).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

from craft_rag.chunk import Chunk
from craft_rag.conversation import ConversationHistory
from craft_rag.engine.conversation_stores import ConversationStores
from craft_rag.engine.history_budget import DEFAULT_HISTORY_BUDGET, HistoryBudget
from craft_rag.engine.planners import ENGINE_MAX_CONVERSATIONS
from craft_rag.engine.turn_context import TurnContext
from craft_rag.engine.turn_layout import (
    APPEND_ONLY,
    ChunkSpanMemo,
    LayoutChoice,
    TurnLayoutPolicy,
    predict_layout,
    restart_history,
    restarted_here,
)
from craft_rag.prompt import AssembledPrompt, PromptAssembler
from craft_rag.types import ConversationId

__all__ = [
    "DEFAULT_HISTORY_BUDGET",
    "ENGINE_MAX_CONVERSATIONS",
    "ConversationPrompts",
    "ConversationStores",
    "HistoryBudget",
    "RenderedTurn",
]


def __getattr__(name: str) -> object:
    # One name per bound: this module's former DEFAULT_MAX_CONVERSATIONS (1,024) was the
    # engine's bound under the name craft_rag.conversation uses for a planner's (10,000).
    if name == "DEFAULT_MAX_CONVERSATIONS":
        warnings.warn(
            "craft_rag.engine.conversation_prompts.DEFAULT_MAX_CONVERSATIONS is "
            "ENGINE_MAX_CONVERSATIONS (an engine's default planner); a planner's own bound "
            "is craft_rag.conversation.DEFAULT_MAX_CONVERSATIONS",
            DeprecationWarning,
            stacklevel=2,
        )
        return ENGINE_MAX_CONVERSATIONS
    msg = f"module {__name__!r} has no attribute {name!r}"
    raise AttributeError(msg)


@dataclass(frozen=True, slots=True)
class RenderedTurn:
    """A prompt ready to send. ``dropped_turns`` old turns were left out to fit the context;
    ``kept_turns`` earlier turns are in it. ``turn_ids`` is this turn's own segment (chunks,
    question, tail) — what :meth:`ConversationPrompts.stored_turn` stores with the reply."""

    prompt: AssembledPrompt
    conversation_id: str | None
    dropped_turns: int
    kept_turns: int
    turn_ids: tuple[int, ...]
    earlier_dropped: int = 0
    """Turns dropped since the previous served turn (history budget, the turn's fit): also
    left out of this prompt, already forgotten. Reports add it to ``dropped_turns``."""
    cache_salt: str | None = field(default=None, repr=False)  # a tenant's key: never shown
    compacted_turns: int = 0
    """A restart (:mod:`craft_rag.engine.turn_layout`): the earlier live turns are in this
    prompt only compacted (``turn_ids`` starts with them); they are forgotten once the turn
    is recorded (:meth:`ConversationPrompts.turns_to_forget`)."""
    layout: LayoutChoice | None = None
    chunk_span: tuple[int, int] = (0, 0)
    """Where this turn's chunks lie in ``turn_ids`` (what a later compaction cuts out)."""

    @property
    def left_out(self) -> int:
        """Every turn this prompt no longer holds since the previous one."""
        return self.dropped_turns + self.earlier_dropped


class ConversationPrompts:
    """Renders single- and multi-turn prompts from a turn's view of its conversation
    (:class:`~craft_rag.engine.turn_context.TurnContext`); applies the history budget. Holds
    no conversation state (see the module docstring): the salts' planners do.

    A conversation is scoped by its tenant: it lives in its salt's store and is looked up
    there alone, so the same id under another ``cache_salt`` is another conversation (never an
    error that would tell one tenant about another's ids). Thread-safe (one lock guards the
    assemblers' chunk caches; the stores lock themselves). Cost of ``render``: O(prompt
    tokens) to concatenate plus tokenizing uncached segments; it reads no store.
    """

    def __init__(
        self,
        assembler: PromptAssembler,
        *,
        max_model_len: int,
        stores: ConversationStores,
        history_budget: HistoryBudget | None = None,
        turn_layout: TurnLayoutPolicy = APPEND_ONLY,
        chat_assembler: PromptAssembler | None = None,
    ) -> None:
        """``stores``: where conversations live, one per salt (an engine's planners, whose
        config bounds them). ``turn_layout``: append-only (default here; replay) or the
        engine's cost-model restart. ``chat_assembler``: renders conversation turns (default
        ``assembler``; same tokenizer)."""
        if history_budget is not None and not isinstance(history_budget, HistoryBudget):
            msg = f"history_budget must be a HistoryBudget or None, got {history_budget!r}"
            raise ValueError(msg)
        if not isinstance(turn_layout, TurnLayoutPolicy):
            msg = f"turn_layout must be a TurnLayoutPolicy, got {turn_layout!r}"
            raise ValueError(msg)
        self.assembler = assembler
        self.chat_assembler = chat_assembler or assembler  # the stored turns are its tokens
        self.max_model_len = max_model_len
        self.history_budget = history_budget
        self.turn_layout = turn_layout
        self.spans = ChunkSpanMemo()
        self.stores = stores
        self._lock = threading.Lock()
        self._close_ids = self.chat_assembler.answer_ids("")

    def assembler_for(self, conversation_id: str | None) -> PromptAssembler:
        """The assembler of a request of ``conversation_id`` (``None``: a single request)."""
        return self.assembler if conversation_id is None else self.chat_assembler

    # ---- reading the store (queries and side prompts; a RAG turn reads its TurnContext) ----

    def _history(
        self, conversation_id: str | None, cache_salt: str | None
    ) -> ConversationHistory | None:
        """The live history of ``cache_salt``'s conversation ``conversation_id`` (``None``:
        unknown under that salt; other salts are never looked at)."""
        if conversation_id is None:
            return None
        store = self.stores.held_store(cache_salt)
        return store.history(ConversationId(conversation_id)) if store is not None else None

    def history_tokens(self, conversation_id: str, cache_salt: str | None = None) -> int:
        """Tokens of the stored turns (0 for an unknown conversation); head excluded."""
        history = self._history(conversation_id, cache_salt)
        return history.tokens if history is not None else 0

    def turn_count(self, conversation_id: str, cache_salt: str | None = None) -> int:
        """Turns the prompt holds now (dropped ones excluded; 0 when unknown)."""
        history = self._history(conversation_id, cache_salt)
        return len(history.turns) if history is not None else 0

    def version(self, conversation_id: str, cache_salt: str | None = None) -> int:
        """The shared-store seq the token history matches (0: unknown, or never stored)."""
        history = self._history(conversation_id, cache_salt)
        return history.version if history is not None else 0

    # ---- one turn: measure, layout (both from TurnContext.open), render, forget ------------

    def turn_token_count(
        self, chunks: Sequence[Chunk], question: str, conversation_id: str | None = None
    ) -> int:
        """Tokens of one turn's segment (chunks, question, tail) as :meth:`render` builds it
        for ``conversation_id``."""
        with self._lock:
            a = self.assembler_for(conversation_id)
            docs = sum(len(a.chunk_ids(c)) for c in chunks) if chunks else len(a.no_documents_ids)
            return docs + len(a.question_ids(question))

    def choose_layout(
        self,
        view: TurnContext,
        chunks: Sequence[Chunk],
        question: str,
        *,
        block_size: int,
    ) -> LayoutChoice | None:
        """Before planning a turn: append, or restart compacted (:attr:`turn_layout`)? None
        without a conversation with live turns all known here, while another turn is in
        flight (``view.planned``: the one in flight is this turn), or with the layout off.
        Predicts cached tokens from the history (whole ``block_size`` blocks; the previous
        turn's reply close is new) and dedup from the live turns' keys, as the planner would.
        ``chunks``: ALL of the turn's chunks (with a caller's plan: its ordered and removed
        ones). Reads only ``view``. O(history + chunk tokens)."""
        history = view.history
        if not self.turn_layout.enabled or view.conversation_id is None:
            return None
        if history is None or not history.turns or None in history.turns:
            return None
        if history.in_flight and not view.planned:  # another turn is being served
            return None
        with self._lock:
            return predict_layout(
                self.turn_layout, self.chat_assembler, history, chunks, question,
                block_size=block_size, memo=self.spans,
            )

    def render(self, view: TurnContext, chunks: Sequence[Chunk], question: str) -> RenderedTurn:
        """The prompt for one turn after ``view``'s live turns (with a conversation its
        planner holds the turn in flight: its commit or abort ends the hold; a first turn
        starts the conversation in the store here). ``view.layout`` with ``restart``: the
        live turns go in compacted (``compacted_turns``) and ``chunks`` should be ALL of the
        turn's chunks (the store will no longer vouch for earlier ones); a restart that would
        not fit the context is rendered append-only.

        ``ValueError`` when the turn cannot fit in ``max_model_len`` with ``view.max_tokens``
        even without earlier turns; ``RuntimeError`` when a live turn's tokens are not known
        here (another worker's, not loaded).
        """
        conversation_id, max_tokens = view.conversation_id, view.max_tokens
        with self._lock:
            a = self.assembler_for(conversation_id)
            segment: list[int] = []
            spans_rel: list[tuple[int, int]] = []
            for chunk in chunks:
                start = len(segment)
                segment.extend(a.chunk_ids(chunk))
                spans_rel.append((start, len(segment)))
            if not chunks:
                segment.extend(a.no_documents_ids)
            segment.extend(a.question_ids(question))
        head = a.head_ids
        budget = self.max_model_len - max_tokens
        if len(head) + len(segment) > budget:
            chunk_tokens = spans_rel[-1][1] if spans_rel else 0
            msg = (
                f"prompt needs {len(head) + len(segment)} tokens (head {len(head)}, "
                f"{len(chunks)} chunks {chunk_tokens}, question "
                f"{len(segment) - chunk_tokens}) + max_tokens {max_tokens} > max_model_len "
                f"{self.max_model_len} even without earlier turns; pass fewer or shorter "
                "chunks, lower max_tokens, or "
                "start the engine with a larger max_model_len"
            )
            raise ValueError(msg)

        history = view.history
        if conversation_id is not None and view.planner is not None:
            # A later turn is held by its plan already (no-op); a first one starts here.
            view.planner.conversations.hold(ConversationId(conversation_id))
        turns = history.turns if history is not None else ()
        if None in turns:
            msg = (
                f"conversation {conversation_id!r}: a turn served by another worker is not in "
                "this worker's history (its shared copy was not stored); send the turn to that "
                "worker, or end_conversation() and start over"
            )
            raise RuntimeError(msg)
        dropped = 0
        room = budget - len(head) - len(segment)
        lead, layout = restart_history(view.layout, [t or () for t in turns], self.spans, room)
        compacted = len(turns) if layout is not None and layout.restart and turns else 0
        ids = list(head)
        if compacted:
            ids.extend(lead)
        else:
            kept_tokens = history.tokens if history is not None else 0
            while len(head) + kept_tokens + len(segment) > budget:
                kept_tokens -= len(turns[dropped] or ())
                dropped += 1
            for turn in turns[dropped:]:
                ids.extend(turn or ())
        prefix = len(ids)
        ids.extend(segment)
        chunk_end = spans_rel[-1][1] if spans_rel else 0
        earlier = history.dropped_since if history is not None else 0
        if earlier and len(turns) == 1 and restarted_here(turns[0] or (), self.spans):
            earlier = 0  # the turns forgotten since were compacted by that restart, not dropped
        prompt = AssembledPrompt(
            token_ids=tuple(ids),
            chunk_keys=tuple(c.key for c in chunks),
            chunk_spans=tuple((prefix + s, prefix + e) for s, e in spans_rel),
            prefix_tokens=prefix,
        )
        return RenderedTurn(
            prompt=prompt,
            conversation_id=conversation_id,
            dropped_turns=dropped,
            kept_turns=len(turns) - dropped - compacted,
            turn_ids=(*lead, *segment),
            earlier_dropped=earlier,
            cache_salt=view.cache_salt,
            compacted_turns=compacted,
            layout=layout,
            chunk_span=(len(lead), len(lead) + chunk_end),
        )

    def stored_turn(
        self,
        rendered: RenderedTurn,
        reply_ids: Sequence[int],
        stop_token_ids: frozenset[int] = frozenset(),
        *,
        stored_reply: Sequence[int] | None = None,
    ) -> tuple[int, ...]:
        """The token ids a served turn leaves in the conversation: its segment, the reply
        (trailing stop tokens removed) and the answer close (or ``stored_reply``, reply and
        close as given: replay stores a trace's answer). Remembers where its chunks lie
        (:attr:`spans`, for a later compaction); changes nothing else."""
        if stored_reply is None:
            reply = list(reply_ids)
            while reply and reply[-1] in stop_token_ids:
                reply.pop()
            stored_reply = (*reply, *self._close_ids)
        tokens = (*rendered.turn_ids, *stored_reply)
        self.spans.remember(tokens, rendered.chunk_span)
        return tokens

    def turns_to_forget(
        self, view: TurnContext, rendered: RenderedTurn, stored: Sequence[int]
    ) -> int:
        """How many oldest turns to forget once the turn (``stored``, :meth:`stored_turn`) is
        recorded after ``view``'s live turns: the ones its prompt left out (or holds only
        compacted, a restart) and, over the history budget, the oldest whole turns down to
        ``keep_tokens`` (the newest turn is always kept). Reads only ``view``. O(turns)."""
        if rendered.conversation_id is None:
            return 0
        lengths = [*(len(t or ()) for t in view.turns), len(stored)]
        n = min(rendered.dropped_turns + rendered.compacted_turns, len(lengths) - 1)
        if self.history_budget is not None:
            n = self.history_budget.turns_to_drop(lengths, n)
        return n

    def side_prompt(
        self, conversation_id: str | None, text: str, cache_salt: str | None = None
    ) -> tuple[int, ...]:
        """``[head][stored turns][text as a user question][assistant opener]``: a one-off
        request (e.g. condensing a follow-up) that continues the conversation's cached prefix
        without becoming part of it (nothing is stored), rendered as a chunk-free turn of it
        (:meth:`assembler_for`). ``text`` is tokenized as plain text. An unknown conversation
        (under ``cache_salt``; another salt's is never read) gives ``[head][text]``.
        O(prompt tokens)."""
        if not isinstance(text, str) or not text.strip():
            msg = "text must be a non-empty string"
            raise ValueError(msg)
        history = self._history(conversation_id, cache_salt)
        a = self.assembler_for(conversation_id)
        ids = list(a.head_ids)
        for turn in history.turns if history is not None else ():
            ids.extend(turn or ())
        ids.extend(a.no_documents_ids)
        with self._lock:
            ids.extend(a.question_ids(text))
        return tuple(ids)

    def end(self, conversation_id: str, cache_salt: str | None = None) -> bool:
        """Forget ``cache_salt``'s conversation (in its planner too; no other salt's). True if
        it was known."""
        return self.stores.end_conversation(conversation_id, cache_salt)

    def clear(self) -> None:
        """Forget every conversation of the stores held now."""
        for _, store in self.stores.conversation_stores():
            store.clear()

    def _check_invariants(self) -> None:
        for _, store in self.stores.conversation_stores():
            store._check_invariants()
