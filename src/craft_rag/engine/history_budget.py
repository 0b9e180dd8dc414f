"""How much of a conversation's history its prompt keeps: :class:`HistoryBudget` (the policy
:meth:`~craft_rag.engine.conversation_prompts.ConversationPrompts.turns_to_forget` applies
after each turn) and its measured default. Pure values, no state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["DEFAULT_HISTORY_BUDGET", "HistoryBudget"]


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

    def turns_to_drop(self, lengths: Sequence[int], first: int = 0) -> int:
        """How many oldest turns of a history whose turns hold ``lengths`` tokens (oldest
        first, the newest last) to drop, at least ``first`` (already left out): none while
        the rest is within ``max_tokens``; else oldest whole turns until at most
        ``keep_tokens`` remain, the newest always kept. O(turns)."""
        n = first
        left = sum(lengths[n:])
        if left > self.max_tokens:
            while n < len(lengths) - 1 and left > self.keep_tokens:
                left -= lengths[n]
                n += 1
        return n


DEFAULT_HISTORY_BUDGET = HistoryBudget(max_tokens=3072, keep_tokens=2048)
"""Chosen by measurement (docs/benchmarks.md, "Multi-turn chat"): on the embedded model a
cached token costs ~0.05 ms of TTFT per turn (2,048 cached tokens add ~100 ms) while a drop
recomputes the kept history once (~1 ms a token), so dropping pays only after tens of turns; a
1,536/768 budget made 3-turn MTRAG chats recompute ~2,800 tokens. The budget is therefore high
(close to the engine's default 4,096-token context), the hysteresis wide. ``None`` disables it."""
