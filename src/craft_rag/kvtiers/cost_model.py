"""Prefill time as a function of prompt length, and the prefix-aware cost of one KV block.

PGDSF (RAGCache §5.1) ranks a cached block by what recomputing it would cost. Attention makes a
token's compute grow with the tokens before it, so the same block costs more late in a prompt:
``block_cost(prefix, n) = T(prefix + n) - T(prefix)`` where ``T`` is the engine's measured
prefill time of a prompt with nothing cached. RAGCache interpolates a 2-D profile
T(cached, new); with a prefix cache, ``T(cached=p, new=n) ~= T(p + n) - T(p)``, which needs only
a 1-D profile an engine can measure in a few prompts.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence

DEFAULT_CPU_PROFILE: tuple[tuple[int, float], ...] = (
    (0, 0.0),
    (128, 0.35),
    (256, 0.72),
    (512, 1.55),
    (1024, 3.4),
    (2048, 7.6),
)
"""An *estimate*, not a measurement of your engine: the embedded SmolLM2-135M in float32 on a
2-core x86 CPU without AVX-512, anchored on docs/engine.md's 604-token prefill of ~1.9 s and
bent upward for attention's quadratic term. Fit real points with a few prompts of growing length
(``PrefillCostModel(points)``) before trusting absolute costs; PGDSF only needs their ratios."""


class PrefillCostModel:
    """Piecewise-linear prefill time ``T(tokens)`` through measured ``(tokens, seconds)`` points.

    Invariants: at least two points, token counts distinct and >= 0, times >= 0 and
    non-decreasing in tokens (so every block cost is >= 0). Outside the measured range the
    first/last segment is extended (extrapolation), clamped at 0 s below the first point.
    """

    __slots__ = ("_seconds", "_tokens")

    def __init__(self, points: Sequence[tuple[int, float]]) -> None:
        ordered = sorted((int(t), float(s)) for t, s in points)
        if len(ordered) < 2:
            msg = f"need >= 2 (tokens, seconds) points, got {len(ordered)}"
            raise ValueError(msg)
        tokens = [t for t, _ in ordered]
        seconds = [s for _, s in ordered]
        if len(set(tokens)) != len(tokens) or tokens[0] < 0:
            msg = f"token counts must be distinct and >= 0, got {tokens}"
            raise ValueError(msg)
        if seconds[0] < 0 or any(b < a for a, b in itertools.pairwise(seconds)):
            msg = f"prefill times must be >= 0 and non-decreasing in tokens, got {seconds}"
            raise ValueError(msg)
        self._tokens = tokens
        self._seconds = seconds

    @property
    def points(self) -> list[tuple[int, float]]:
        """The profile, sorted by tokens."""
        return list(zip(self._tokens, self._seconds, strict=True))

    def prefill_time(self, tokens: int) -> float:
        """Interpolated ``T(tokens)`` in seconds. O(log(points)). ``ValueError`` if tokens < 0."""
        if tokens < 0:
            msg = f"tokens must be >= 0, got {tokens}"
            raise ValueError(msg)
        i = bisect.bisect_right(self._tokens, tokens) - 1
        i = min(max(i, 0), len(self._tokens) - 2)
        t0, t1 = self._tokens[i], self._tokens[i + 1]
        s0, s1 = self._seconds[i], self._seconds[i + 1]
        return max(0.0, s0 + (s1 - s0) * (tokens - t0) / (t1 - t0))

    def block_cost(self, prefix_tokens: int, block_tokens: int) -> float:
        """Seconds to compute ``block_tokens`` after ``prefix_tokens`` cached (>= 0). O(log n)."""
        if prefix_tokens < 0 or block_tokens < 0:
            msg = f"token counts must be >= 0, got prefix {prefix_tokens}, block {block_tokens}"
            raise ValueError(msg)
        end = self.prefill_time(prefix_tokens + block_tokens)
        return max(0.0, end - self.prefill_time(prefix_tokens))


def default_cost_model() -> PrefillCostModel:
    """The model of :data:`DEFAULT_CPU_PROFILE` (an estimate; see there)."""
    return PrefillCostModel(DEFAULT_CPU_PROFILE)
