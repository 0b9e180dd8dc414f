"""How fast could any prompt layout make chat turns? An upper bound from prefix caching alone.

``python -m craft_rag_bench.bench.chat_bound [chat.json]`` (no engine; needs the embedded
model's tokenizer and the datasets). Issue 15 item 3 asks for CRAFT chat's mean TTFT over turns
>= 2 to be 1.3x lower than the best framework chat engine's. This module answers whether ANY
layout can reach that on a workload, given only vLLM's prefix cache:

* a TTFT model ``o + a*new + b*new*(cached + new/2)`` is fitted (least squares) on the
  single-request rows of a ``bench chat`` result (:func:`fit_ttft`): a fixed cost per request,
  the model's layers per new token, attention of each new token over what precedes it;
* per turn, the token counts every layout would send are computed from the dataset with the
  engine's own :class:`~craft_rag.prompt.PromptAssembler` (:func:`simulate`):

  - ``lc_history``: the framework layout ``[head][this turn's chunks][history][question]``,
    cached only as far as the leading chunks equal an earlier turn's (retriever order);
  - ``append``: CRAFT append-only (earlier turns cached, only chunks no live turn holds new);
  - ``restart``: CRAFT's compacted restart ``[head][history without chunks][chunks][question]``;
  - ``craft``: the engine's rule today (the cost model picks append or restart per turn);
  - ``chunks_first``: ``[head][chunks, those leading an earlier such prompt first][history]
    [question]`` (the best chunk order for prefix reuse, chosen online);
  - ``craft3``: per turn the cheapest of append, restart and chunks-first by the fit itself
    (a perfect cost model choosing among implementable layouts; its own sends are cached);
  - ``oracle``: the floor for any layout holding this turn's chunks, the question/answer
    history and the question: only chunks never sent before, the question and the previous
    reply's close are computed, and they attend to nothing but the minimal prompt
    (``cost(L_min - new_min, new_min)``; not reachable in general).

Replies are counted at ``reply_tokens`` (the bench's ``max_tokens``). Each conversation starts
from an empty cache, as in ``bench chat``. Pure arithmetic besides tokenizing: O(tokens).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from craft_rag_bench.bench.chat import ChatConversation, ChatTurn

if TYPE_CHECKING:
    from craft_rag.engine.turn_layout import TurnLayoutPolicy

SYSTEMS: tuple[str, ...] = (
    "lc_history", "append", "restart", "craft", "chunks_first", "craft3", "oracle"
)
"""``craft3``: per turn the cheapest (by the fit itself) of append, restart and chunks-first,
with the cache holding only the prompts actually sent (a perfect cost model's choice)."""


@dataclass(frozen=True, slots=True)
class TtftFit:
    """``ttft_ms = o + a*new + b*new*(cached + new/2)``."""

    o: float
    a: float
    b: float

    def ms(self, cached: int, new: int) -> float:
        """Predicted TTFT of computing ``new`` tokens behind ``cached`` ones (``o`` if none)."""
        if new <= 0:
            return self.o
        return self.o + self.a * new + self.b * new * (cached + new / 2)


def fit_ttft(rows: Sequence[dict[str, Any]]) -> TtftFit:
    """Least-squares fit on rows with ``ttft_ms``, ``prompt_tokens``, ``computed_tokens`` and
    one engine request each (``requests == 1``). ``ValueError`` with fewer than 3 rows."""
    import numpy as np

    use = [r for r in rows if r.get("requests", 1) == 1]
    if len(use) < 3:
        msg = f"fit_ttft needs at least 3 single-request rows, got {len(use)}"
        raise ValueError(msg)
    x = np.array([
        [1.0, r["computed_tokens"],
         r["computed_tokens"] * (r["prompt_tokens"] - r["computed_tokens"]
                                 + r["computed_tokens"] / 2)]
        for r in use
    ])
    y = np.array([float(r["ttft_ms"]) for r in use])
    o, a, b = np.linalg.lstsq(x, y, rcond=None)[0]
    return TtftFit(float(o), float(a), float(b))


@dataclass(frozen=True, slots=True)
class TurnTokens:
    """One turn's token counts: ``chunks`` as ``(key, tokens)`` in the retriever's order."""

    chunks: tuple[tuple[str, int], ...]
    question: int


@dataclass(slots=True)
class BoundResult:
    """Per layout, the predicted TTFT of every turn >= 2 (ms), and the token shares."""

    ttft: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in SYSTEMS})
    chunk_tokens: int = 0
    new_chunk_tokens: int = 0
    turns: int = 0
    wins: dict[str, int] = field(default_factory=lambda: {
        "append": 0, "restart": 0, "chunks_first": 0})
    """Which layout ``craft3`` took, per turn."""

    def mean(self, layout: str) -> float:
        xs = self.ttft[layout]
        return sum(xs) / len(xs) if xs else 0.0

    def speedup(self, layout: str, baseline: str = "lc_history") -> float:
        return self.mean(baseline) / self.mean(layout) if self.mean(layout) else 0.0


def _floor(n: int, block: int) -> int:
    return max(n, 0) // block * block


def _lead(order: Sequence[str], earlier: Sequence[str], lens: dict[str, int]) -> int:
    """Tokens of ``order``'s leading chunks that equal ``earlier``'s, in order."""
    got = 0
    for k_now, k_prev in zip(order, earlier, strict=False):
        if k_now != k_prev:
            break
        got += lens[k_now]
    return got


def _best_lead(earlier: Sequence[Sequence[str]], lens: dict[str, int]) -> tuple[int, list[str]]:
    """The longest chunk prefix of an earlier prompt made only of this turn's chunks."""
    best, best_keys = 0, []
    for prompt in earlier:
        got, keys = 0, []
        for k in prompt:
            if k not in lens:
                break
            got += lens[k]
            keys.append(k)
        if got > best:
            best, best_keys = got, keys
    return best, best_keys


def simulate(
    conversations: Sequence[Sequence[TurnTokens]],
    fit: TtftFit,
    *,
    head: int,
    close: int,
    reply_tokens: int,
    block: int = 32,
    policy: TurnLayoutPolicy | None = None,
) -> BoundResult:
    """Predicted TTFT per system for every turn >= 2 (see the module docstring); each system
    runs the conversation with its own state (what it sent is what is cached). ``policy``:
    the :class:`~craft_rag.engine.turn_layout.TurnLayoutPolicy` whose choice ``craft`` follows
    (default: the engine's). History budget ignored (these conversations stay below it)."""
    if policy is None:
        from craft_rag.engine.turn_layout import DEFAULT_TURN_LAYOUT

        policy = DEFAULT_TURN_LAYOUT
    out = BoundResult()
    reply = reply_tokens + close
    for system in SYSTEMS:
        for conv in conversations:
            live_keys: set[str] = set()
            seen: set[str] = set()
            live = 0  # the conversation's live prompt after the head
            compact = 0  # questions and replies only
            sent: list[list[str]] = []  # chunk orders leading a sent prompt (after the head)
            for t, turn in enumerate(conv, start=1):
                lens = dict(turn.chunks)
                order = list(lens)
                all_c = sum(lens.values())
                q = turn.question
                pick = "append"
                if t >= 2:
                    if system == "lc_history":
                        out.turns += 1
                        out.chunk_tokens += all_c
                        out.new_chunk_tokens += sum(n for k, n in lens.items() if k not in seen)
                    a_cached = _floor(head + live - close - 1, block)
                    a_new = head + live + sum(
                        n for k, n in lens.items() if k not in live_keys) + q - a_cached
                    r_cached = _floor(head, block)
                    r_new = head + compact + all_c + q - r_cached
                    lead, keys = _best_lead(sent, lens)
                    c_cached = _floor(head + lead, block)
                    c_new = head + all_c + compact + q - c_cached
                    lc_lead = max((_lead(order, p, lens) for p in sent), default=0)
                    lc_cached = _floor(head + lc_lead, block)
                    new_min = sum(n for k, n in lens.items() if k not in seen) + q + close
                    options = {
                        "append": fit.ms(a_cached, a_new),
                        "restart": fit.ms(r_cached, r_new),
                        "chunks_first": fit.ms(c_cached, c_new),
                    }
                    if system in ("append", "restart", "chunks_first"):
                        pick = system
                    elif system == "craft":
                        choice = policy.choose((a_cached, a_new), (r_cached, r_new), t - 1)
                        pick = "restart" if choice.restart else "append"
                    elif system == "craft3":
                        pick = min(options, key=lambda k: options[k])
                        out.wins[pick] += 1
                    if system == "lc_history":
                        ms = fit.ms(lc_cached, head + all_c + compact + q - lc_cached)
                    elif system == "oracle":
                        ms = fit.ms(head + all_c + compact + q - new_min, new_min)
                    else:
                        ms = options[pick]
                    out.ttft[system].append(ms)
                    if pick == "chunks_first":
                        order = keys + [k for k in order if k not in keys]
                if system == "lc_history" or t == 1 or pick == "chunks_first":
                    sent.append(order)
                if pick == "append":
                    live += sum(n for k, n in lens.items() if k not in live_keys) + q + reply
                    live_keys |= set(lens)
                else:  # restart or chunks-first: one turn holding the compacted history
                    live, live_keys = compact + all_c + q + reply, set(lens)
                compact += q + reply
                seen |= set(lens)
    return out


def turn_tokens(conversations: Sequence[ChatConversation]) -> tuple[list[list[TurnTokens]],
                                                                   int, int]:
    """Token counts of ``conversations`` with the embedded model's prompt format:
    ``(turns per conversation, head tokens, answer-close tokens)``."""
    from craft_rag.chunk import Chunk
    from craft_rag.engine.model import resolve_model
    from craft_rag.engine.wiring import prompt_pieces
    from craft_rag.prompt import DEFAULT_INSTRUCTIONS, PromptAssembler
    from craft_rag.types import ChunkKey

    fmt, tok = prompt_pieces(resolve_model(None), None, None, system_prompt=None,
                             instructions=DEFAULT_INSTRUCTIONS)
    asm = PromptAssembler(tok, fmt)

    def tokens(turn: ChatTurn) -> TurnTokens:
        return TurnTokens(
            tuple((p, len(asm.chunk_ids(Chunk(ChunkKey(p), text)))) for p, text in turn.chunks),
            len(asm.question_ids(turn.question)),
        )

    out = [[tokens(t) for t in conv.turns] for conv in conversations]
    return out, len(asm.head_ids), len(asm.answer_ids(""))


def main(argv: Sequence[str] = ()) -> None:
    from craft_rag_bench.bench.chat import hotpot_conversations, mtrag_conversations

    path = Path(argv[0] if argv else "benchmarks/results/chat/chat.json")
    result = json.loads(path.read_text())
    rows = [r for w in result["workloads"].values() for name, rs in w["rows"].items()
            if name != "li_context" for r in rs]  # LlamaIndex's reader spins: not the engine
    fit = fit_ttft(rows)
    print(f"fit on {path}: o={fit.o:.1f} ms, a={fit.a:.3f} ms/token, b={fit.b:.6f} ms/token^2")
    cases = {
        "mtrag (bench: 4 conv x 3 turns)": mtrag_conversations(4, 3, 5),
        "mtrag (110 conv x 3 turns)": mtrag_conversations(10_000, 3, 5),
        "mtrag (110 conv x all turns)": mtrag_conversations(10_000, 99, 5),
        "hotpotqa (bench: 2 conv x 3 turns)": hotpot_conversations(2, 3, 5, 0),
        "hotpotqa (50 conv x 3 turns)": hotpot_conversations(50, 3, 5, 0),
    }
    print("| workload | turns>=2 | new-chunk share | " + " | ".join(SYSTEMS) + " | craft3 picks |")
    print("|---|---:|---:|" + "---:|" * len(SYSTEMS) + "---|")
    for name, convs in cases.items():
        tokens, head, close = turn_tokens(convs)
        res = simulate(tokens, fit, head=head, close=close,
                       reply_tokens=int(result.get("max_tokens", 16)))
        share = res.new_chunk_tokens / max(res.chunk_tokens, 1)
        cells = " | ".join(f"{res.mean(k):.0f} ({res.speedup(k):.2f}x)" for k in SYSTEMS)
        print(f"| {name} | {res.turns} | {share:.2f} | {cells} | {res.wins} |")


if __name__ == "__main__":
    main(sys.argv[1:])
