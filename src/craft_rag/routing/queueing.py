"""The prefill-time model behind routing costs and the cluster simulator's queues.

On the CPU engine TTFT is almost linear in the prompt tokens vLLM must compute
(``ENGINE_NOTES.md``): ``ttft = a + b * uncached + c * cached`` seconds, where ``cached`` tokens
are read from the prefix cache (``c`` is small but not zero: attention still reads them).
:func:`fit_ttft_model` fits it by least squares on measured points; the bench suite
``routing`` measures ~20 points on the real in-process engine and refits on every full run.

A simulated replica is one FIFO prefill server: a request starts when the replica is free
and holds it for ``model.predict(uncached, cached)`` seconds (decode is not modelled: TTFT is
prefill-bound on this engine, and vLLM's CPU prefill of a batch costs about the sum of its
requests' prefills).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from craft_rag.validation import check_number


@dataclass(frozen=True, slots=True)
class TTFTModel:
    """``ttft_s = a + b * uncached + c * cached``; every coefficient >= 0, ``b > 0``."""

    a: float
    b: float
    c: float = 0.0

    def __post_init__(self) -> None:
        for name in ("a", "b", "c"):
            check_number(getattr(self, name), f"TTFTModel.{name}", minimum=0.0)
        if self.b <= 0:
            msg = f"TTFTModel.b (seconds per uncached token) must be > 0, got {self.b!r}"
            raise ValueError(msg)

    def predict(self, uncached: int, cached: int = 0) -> float:
        """Predicted TTFT in seconds. O(1)."""
        return self.a + self.b * uncached + self.c * cached

    def to_json(self) -> dict[str, float]:
        return {"a": self.a, "b": self.b, "c": self.c}


DEFAULT_TTFT_MODEL = TTFTModel(a=0.03, b=0.000925, c=0.000007)
"""Fit to the ENGINE_NOTES.md measurements (cold ~800 tokens 0.77 s; 448 of ~800 cached
0.36 s; 768 cached 0.065 s); the full ``bench routing`` run refits it on the engine."""


@dataclass(frozen=True, slots=True)
class TTFTPoint:
    """One measured request: tokens computed, tokens read from cache, TTFT in seconds."""

    uncached: int
    cached: int
    ttft_s: float


def fit_ttft_model(points: Sequence[TTFTPoint], *, with_cached: bool = True) -> TTFTModel:
    """Least-squares fit of :class:`TTFTModel` to ``points``; negative coefficients are
    clamped to 0 and the rest refitted (the model must stay monotone). ``ValueError`` for fewer
    than 3 points or points that cannot determine ``b``. O(n). Needs numpy (the ``routing``
    extra, also brought by the engine extras); ``ImportError`` naming it otherwise."""
    try:
        import numpy as np
    except ImportError as exc:
        msg = "fit_ttft_model needs numpy: pip install 'craft-rag[routing]'"
        raise ImportError(msg) from exc

    if len(points) < 3:
        msg = f"need at least 3 points to fit a TTFT model, got {len(points)}"
        raise ValueError(msg)
    columns = ["a", "b", "c"] if with_cached else ["a", "b"]
    y = np.array([p.ttft_s for p in points], dtype=float)
    data = {
        "a": np.ones(len(points)),
        "b": np.array([p.uncached for p in points], dtype=float),
        "c": np.array([p.cached for p in points], dtype=float),
    }
    coef: dict[str, float] = {}
    active = list(columns)
    while active:
        x = np.stack([data[n] for n in active], axis=1)
        if np.linalg.matrix_rank(x) < len(active):
            msg = (
                "the points cannot separate the coefficients: vary the uncached (and cached) "
                "token counts independently"
            )
            raise ValueError(msg)
        solution, *_ = np.linalg.lstsq(x, y, rcond=None)
        values = dict(zip(active, (float(v) for v in solution), strict=True))
        negative = [n for n, v in values.items() if v < 0 and n != "b"]
        if not negative:
            coef = values
            break
        active.remove(negative[0])
    if coef.get("b", 0.0) <= 0:
        msg = "the points do not determine a positive seconds-per-uncached-token (vary uncached)"
        raise ValueError(msg)
    return TTFTModel(a=coef.get("a", 0.0), b=coef["b"], c=coef.get("c", 0.0))
