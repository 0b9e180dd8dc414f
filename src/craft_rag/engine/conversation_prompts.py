"""Append-only multi-turn prompts with oldest-turn dropping (paper §4.3).

A conversation's prompt for turn ``t`` is ``[head][turn 1]...[turn t-1][turn-t chunks][Q_t tail]``
where each stored turn is ``[its chunks][Q tail][reply ids][answer close]`` (the close ends the
assistant turn and opens the next user turn, see :mod:`craft_rag.engine.chat_format`). Each
turn's prompt therefore starts with the previous turn's prompt and reply, token for token, and
vLLM's prefix cache reuses all of it. Replies are kept as the token ids the model generated
(trailing stop tokens replaced by the template's close), so even the reply's KV is reusable.

**History budget.** On this engine TTFT grows with the cached length too (attention over the
whole prefix), so an ever-growing history makes later turns slower even when they are mostly
cached. A :class:`HistoryBudget` bounds the stored history (head excluded): when a completed
turn takes it over ``max_tokens``, whole oldest turns are dropped until it is at most
``keep_tokens``. The first turn after a drop recomputes the shorter history once; the low-water
mark then leaves room for several turns that only append (the prefix stays stable and reused)
instead of sliding, and recomputing, every turn. Dropped turns are reported through
``on_drop`` so the planner forgets their chunks: conversation dedup is only correct while the
turn carrying a chunk is still in the prompt.

When ``history + new turn + max_tokens`` would exceed ``max_model_len``, :meth:`fit` drops whole
oldest turns before the turn is planned (never part of a turn, never part of a chunk); the count
is reported. A turn that cannot fit even alone raises ``ValueError``.

**Several workers** (``CraftEngine(store=...)``): this object owns the worker's local copy of
each history; the store owns the shared copy (:mod:`craft_rag.stores.histories`), written by
the worker that served the last turn. :meth:`export` and :meth:`adopt` move a history between
the two; ``version`` (a store seq) says how new the local copy is.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from craft_rag.chunk import Chunk
from craft_rag.prompt import AssembledPrompt, PromptAssembler
from craft_rag.stores.histories import StoredHistory
from craft_rag.types import ChunkKey

DEFAULT_MAX_CONVERSATIONS = 1024

OnForget = Callable[[str, str | None], object]
"""Called with ``(conversation_id, cache_salt)`` when a history is evicted or ended."""

OnDrop = Callable[[str, str | None, int], object]
"""Called with ``(conversation_id, cache_salt, n)`` when the ``n`` oldest turns of a history are
dropped (budget or context length); the history itself lives on."""


@dataclass(frozen=True, slots=True)
class HistoryBudget:
    """Token budget of a conversation's stored history (head excluded), like LlamaIndex's
    ``ChatMemoryBuffer.token_limit``. Over ``max_tokens`` after a turn, the oldest whole turns
    are dropped until at most ``keep_tokens`` remain (the newest turn is always kept).
    ``keep_tokens < max_tokens`` is the hysteresis that keeps the new prefix stable for
    several turns. Defaults (:data:`DEFAULT_HISTORY_BUDGET`) come from ``craft-rag bench chat``."""

    max_tokens: int
    keep_tokens: int

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            msg = f"HistoryBudget.max_tokens must be an int >= 1, got {self.max_tokens!r}"
            raise ValueError(msg)
        if not isinstance(self.keep_tokens, int) or not 0 <= self.keep_tokens <= self.max_tokens:
            msg = (
                f"HistoryBudget.keep_tokens must be an int in [0, max_tokens={self.max_tokens}], "
                f"got {self.keep_tokens!r}"
            )
            raise ValueError(msg)


DEFAULT_HISTORY_BUDGET = HistoryBudget(max_tokens=3072, keep_tokens=2048)
"""Chosen by measurement (docs/benchmarks.md, "Multi-turn chat"): on the embedded model a
cached token costs ~0.05 ms of TTFT per turn (2,048 cached tokens add ~100 ms) while a drop
recomputes the kept history once (~1 ms a token), so dropping pays only after tens of turns; a
1,536/768 budget made 3-turn MTRAG chats recompute ~2,800 tokens. The budget is therefore high
(close to the engine's default 4,096-token context), the hysteresis wide. ``None`` disables it."""


@dataclass(frozen=True, slots=True)
class RenderedTurn:
    """A prompt ready to send. ``dropped_turns`` old turns were left out to fit the context;
    ``kept_turns`` earlier turns are in it. ``turn_ids`` is this turn's own segment (chunks,
    question, tail) — what :meth:`ConversationPrompts.complete` stores with the reply."""

    prompt: AssembledPrompt
    conversation_id: str | None
    dropped_turns: int
    kept_turns: int
    turn_ids: tuple[int, ...]
    earlier_dropped: int = 0
    """Turns dropped since the previous served turn (history budget, :meth:`fit`): also left
    out of this prompt, already forgotten. Reports add it to ``dropped_turns``."""

    @property
    def left_out(self) -> int:
        """Every turn this prompt no longer holds since the previous one."""
        return self.dropped_turns + self.earlier_dropped


@dataclass(slots=True)
class _History:
    """One conversation's stored turns. Owner: :class:`ConversationPrompts` (under its lock)."""

    turns: list[tuple[int, ...]] = field(default_factory=list)
    keys: list[tuple[ChunkKey, ...]] = field(default_factory=list)
    """The chunk keys each stored turn carries (parallel to ``turns``)."""
    tokens: int = 0
    in_flight: bool = False
    dropped_since: int = 0
    """Turns dropped since the last served turn (reported by the next one)."""
    cache_salt: str | None = None
    """The prefix-cache namespace of every turn; fixed for the history's lifetime."""
    version: int = 0
    """The store seq this copy matches (0: never saved to or loaded from a store)."""


class ConversationPrompts:
    """Renders single- and multi-turn prompts; keeps per-conversation token histories.

    Invariants: each history's ``tokens`` is the sum of its turns' lengths; at most
    ``max_conversations`` histories (least recently used dropped first, never one with a turn
    in flight); at most one turn in flight per conversation. Thread-safe (one lock, which also
    guards the assembler's chunk cache). Cost of ``render``: O(prompt tokens) to concatenate
    plus tokenizing uncached segments.

    ``on_forget(conversation_id, cache_salt)`` runs, under the lock, for every history dropped
    by the LRU bound or :meth:`end`. The engine uses it to end the conversation in its salt's
    planner: a planner that still knew the conversation would plan the next turn as a later
    turn (earlier turns' chunks removed as already sent) for a prompt rendered without those
    turns, and the removed chunks would silently vanish. Lock order: this lock, then the
    planners' locks (never the reverse).
    """

    def __init__(
        self,
        assembler: PromptAssembler,
        *,
        max_model_len: int,
        max_conversations: int = DEFAULT_MAX_CONVERSATIONS,
        on_forget: OnForget | None = None,
        history_budget: HistoryBudget | None = None,
        on_drop: OnDrop | None = None,
    ) -> None:
        if max_conversations < 1:
            msg = f"max_conversations must be >= 1, got {max_conversations}"
            raise ValueError(msg)
        if history_budget is not None and not isinstance(history_budget, HistoryBudget):
            msg = f"history_budget must be a HistoryBudget or None, got {history_budget!r}"
            raise ValueError(msg)
        self.assembler = assembler
        self.max_model_len = max_model_len
        self.max_conversations = max_conversations
        self.history_budget = history_budget
        self._lock = threading.Lock()
        self._histories: OrderedDict[str, _History] = OrderedDict()
        self._on_forget = on_forget
        self._on_drop = on_drop
        self._close_ids = assembler.answer_ids("")

    def render(
        self,
        chunks: Sequence[Chunk],
        question: str,
        *,
        max_tokens: int,
        conversation_id: str | None = None,
        fresh: bool = False,
        cache_salt: str | None = None,
    ) -> RenderedTurn:
        """The prompt for one turn; with a ``conversation_id`` it continues that conversation
        (``fresh=True`` starts it over, e.g. when the planner no longer knows it) and marks a
        turn in flight until :meth:`complete` or :meth:`cancel`. A new conversation takes
        ``cache_salt`` for all its turns.

        ``ValueError`` when the turn cannot fit in ``max_model_len`` with ``max_tokens`` even
        without earlier turns, or when a known conversation is sent with another
        ``cache_salt``; ``RuntimeError`` when the conversation already has a turn in flight.
        """
        with self._lock:
            a = self.assembler
            segment: list[int] = []
            spans_rel: list[tuple[int, int]] = []
            for chunk in chunks:
                start = len(segment)
                segment.extend(a.chunk_ids(chunk))
                spans_rel.append((start, len(segment)))
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

            history: _History | None = None
            if conversation_id is not None:
                history = self._histories.get(conversation_id)
                if history is not None:
                    _check_salt(conversation_id, history, cache_salt)
                if history is not None and history.in_flight:
                    msg = (
                        f"conversation {conversation_id!r} already has a turn in flight; "
                        "await it before sending the next turn"
                    )
                    raise RuntimeError(msg)
                if history is None or fresh:
                    history = _History(cache_salt=cache_salt)
                    self._histories[conversation_id] = history
                self._histories.move_to_end(conversation_id)
                history.in_flight = True
                self._evict_over_bound()

            turns = history.turns if history is not None else []
            dropped = 0
            kept_tokens = history.tokens if history is not None else 0
            while len(head) + kept_tokens + len(segment) > budget:
                kept_tokens -= len(turns[dropped])
                dropped += 1
            ids = list(head)
            for turn in turns[dropped:]:
                ids.extend(turn)
            prefix = len(ids)
            ids.extend(segment)
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
                kept_turns=len(turns) - dropped,
                turn_ids=tuple(segment),
                earlier_dropped=history.dropped_since if history is not None else 0,
            )

    def complete(
        self,
        rendered: RenderedTurn,
        reply_ids: Sequence[int],
        stop_token_ids: frozenset[int] = frozenset(),
        *,
        stored_reply: Sequence[int] | None = None,
    ) -> None:
        """Record a served turn: forget the turns it dropped, append its segment, the reply
        (trailing stop tokens removed) and the answer close (or ``stored_reply``, reply and
        close as given: replay stores a trace's answer). No-op without a conversation."""
        if rendered.conversation_id is None:
            return
        if stored_reply is None:
            reply = list(reply_ids)
            while reply and reply[-1] in stop_token_ids:
                reply.pop()
            stored_reply = (*reply, *self._close_ids)
        stored = (*rendered.turn_ids, *stored_reply)
        cid = rendered.conversation_id
        with self._lock:
            history = self._histories.get(cid)
            if history is None:  # ended while in flight: nothing to continue
                return
            self._drop(cid, history, rendered.dropped_turns)
            history.turns.append(stored)
            history.keys.append(rendered.prompt.chunk_keys)
            history.tokens += len(stored)
            budget = self.history_budget
            history.dropped_since = 0
            if budget is not None and history.tokens > budget.max_tokens:
                n, left = 0, history.tokens
                while n < len(history.turns) - 1 and left > budget.keep_tokens:
                    left -= len(history.turns[n])
                    n += 1
                self._drop(cid, history, n)
                history.dropped_since = n
            history.in_flight = False
            self._evict_over_bound()

    def fit(
        self,
        conversation_id: str | None,
        turn_tokens: int,
        max_tokens: int,
        cache_salt: str | None = None,
    ) -> frozenset[ChunkKey]:
        """Drop the oldest whole turns of an idle conversation until a turn of ``turn_tokens``
        (chunks and question, an upper bound) plus ``max_tokens`` fits after the head and the
        history in ``max_model_len``; call before planning the turn, so the plan's dedup only
        counts chunks still in the prompt. Returns the keys no kept turn carries any more
        (empty when nothing was dropped). Unknown, in-flight or other-salt conversations are
        left alone (``render`` reports those). O(turns)."""
        if conversation_id is None:
            return frozenset()
        with self._lock:
            history = self._histories.get(conversation_id)
            if history is None or history.in_flight or history.cache_salt != cache_salt:
                return frozenset()
            budget = self.max_model_len - max_tokens - len(self.assembler.head_ids) - turn_tokens
            n, left = 0, history.tokens
            while n < len(history.turns) and left > budget:
                left -= len(history.turns[n])
                n += 1
            if n == 0:
                return frozenset()
            dropped = {k for keys in history.keys[:n] for k in keys}
            kept = {k for keys in history.keys[n:] for k in keys}
            self._drop(conversation_id, history, n)
            history.dropped_since += n
            return frozenset(dropped - kept)

    def turn_token_count(self, chunks: Sequence[Chunk], question: str) -> int:
        """Tokens of one turn's segment (chunks, question, tail) as :meth:`render` builds it."""
        with self._lock:
            a = self.assembler
            return sum(len(a.chunk_ids(c)) for c in chunks) + len(a.question_ids(question))

    def side_prompt(
        self, conversation_id: str | None, text: str, cache_salt: str | None = None
    ) -> tuple[int, ...]:
        """``[head][stored turns][text as a user question][assistant opener]``: a one-off
        request (e.g. condensing a follow-up) that continues the conversation's cached prefix
        without becoming part of it (nothing is stored). ``text`` is tokenized as plain text.
        An unknown conversation gives ``[head][text]``. ``ValueError`` when a known
        conversation has another ``cache_salt``. O(prompt tokens)."""
        if not isinstance(text, str) or not text.strip():
            msg = "text must be a non-empty string"
            raise ValueError(msg)
        with self._lock:
            ids = list(self.assembler.head_ids)
            history = self._histories.get(conversation_id) if conversation_id else None
            if history is not None:
                assert conversation_id is not None
                _check_salt(conversation_id, history, cache_salt)
                for turn in history.turns:
                    ids.extend(turn)
            ids.extend(self.assembler.question_ids(text))
            return tuple(ids)

    def _drop(self, conversation_id: str, history: _History, n: int) -> None:
        """Drop the ``n`` oldest turns and tell ``on_drop`` (caller holds the lock)."""
        if n <= 0:
            return
        del history.turns[:n]
        del history.keys[:n]
        history.tokens = sum(len(t) for t in history.turns)
        if self._on_drop is not None:
            self._on_drop(conversation_id, history.cache_salt, n)

    def version(self, conversation_id: str) -> int:
        """The store seq the local history matches (0: unknown, or never stored). O(1)."""
        with self._lock:
            history = self._histories.get(conversation_id)
            return history.version if history is not None else 0

    def export(self, conversation_id: str, version: int) -> StoredHistory | None:
        """The idle history's turns, marking the local copy as matching store seq ``version``
        (the caller stores them at that version); None for an unknown or in-flight one.
        O(tokens)."""
        with self._lock:
            history = self._histories.get(conversation_id)
            if history is None or history.in_flight:
                return None
            history.version = max(history.version, version)
            return StoredHistory(
                tuple(history.turns), tuple(history.keys), history.dropped_since
            )

    def adopt(
        self,
        conversation_id: str,
        stored: StoredHistory,
        version: int,
        cache_salt: str | None,
    ) -> bool:
        """Replace the local history by ``stored`` (another worker's newer copy, at store seq
        ``version``). No hook runs: the planner already replayed the turns the other worker
        served and dropped. False (nothing changed) while a turn is in flight here or when the
        local copy is at least as new. O(tokens)."""
        with self._lock:
            history = self._histories.get(conversation_id)
            if history is not None and (history.in_flight or history.version >= version):
                return False
            self._histories[conversation_id] = _History(
                turns=list(stored.turns),
                keys=list(stored.keys),
                tokens=sum(len(t) for t in stored.turns),
                dropped_since=stored.dropped_since,
                cache_salt=cache_salt,
                version=version,
            )
            self._histories.move_to_end(conversation_id)
            self._evict_over_bound()
            return True

    def cancel(self, rendered: RenderedTurn) -> None:
        """The turn was not served (engine failure, abort): keep the history as it was."""
        if rendered.conversation_id is None:
            return
        with self._lock:
            history = self._histories.get(rendered.conversation_id)
            if history is not None:
                history.in_flight = False
                self._evict_over_bound()

    def check_salt(self, conversation_id: str | None, cache_salt: str | None) -> None:
        """``ValueError`` when ``conversation_id`` is known with another ``cache_salt`` (its
        turns live in that salt's cache namespace; a new salt would silently start over).
        O(1)."""
        if conversation_id is None:
            return
        with self._lock:
            history = self._histories.get(conversation_id)
            if history is not None:
                _check_salt(conversation_id, history, cache_salt)

    def cache_salt(self, conversation_id: str) -> str | None:
        """The salt of a known conversation (``None``: unsalted or unknown)."""
        with self._lock:
            history = self._histories.get(conversation_id)
            return history.cache_salt if history is not None else None

    def end(self, conversation_id: str) -> bool:
        """Forget a conversation's history (``on_forget`` runs). True if it was known."""
        with self._lock:
            history = self._histories.pop(conversation_id, None)
            if history is None:
                return False
            self._forgotten(conversation_id, history)
            return True

    def clear(self) -> None:
        with self._lock:
            self._histories.clear()

    def history_tokens(self, conversation_id: str) -> int:
        """Tokens of the stored turns (0 for an unknown conversation); head excluded."""
        with self._lock:
            history = self._histories.get(conversation_id)
            return history.tokens if history is not None else 0

    def turn_count(self, conversation_id: str) -> int:
        with self._lock:
            history = self._histories.get(conversation_id)
            return len(history.turns) if history is not None else 0

    def _evict_over_bound(self) -> None:
        """Drop least recently used idle histories past the bound (caller holds the lock);
        histories with a turn in flight are never dropped, so the bound may be exceeded while
        more than ``max_conversations`` turns are in flight."""
        over = len(self._histories) - self.max_conversations
        if over <= 0:
            return
        for cid in [c for c, h in self._histories.items() if not h.in_flight][:over]:
            self._forgotten(cid, self._histories.pop(cid))

    def _forgotten(self, conversation_id: str, history: _History) -> None:
        if self._on_forget is not None:
            self._on_forget(conversation_id, history.cache_salt)

    def _check_invariants(self) -> None:
        with self._lock:
            assert len(self._histories) <= self.max_conversations or all(
                h.in_flight for h in self._histories.values()
            )
            for history in self._histories.values():
                assert history.tokens == sum(len(t) for t in history.turns)
                assert len(history.keys) == len(history.turns)


def _check_salt(conversation_id: str, history: _History, cache_salt: str | None) -> None:
    if history.cache_salt != cache_salt:
        known = "no cache_salt" if history.cache_salt is None else "another cache_salt"
        msg = (
            f"conversation {conversation_id!r} was started with {known}; send every turn with "
            "the salt of its first turn, or end_conversation() it before changing the salt"
        )
        raise ValueError(msg)
