"""Answer-quality metrics: SQuAD exact match and token F1, and a paired t-test.

``normalize_answer`` is the official SQuAD v1.1 evaluation's normalisation (lower-case, strip
punctuation, articles a/an/the and extra whitespace); EM and F1 take the best score over all
gold answers. :func:`paired_t_test` uses ``scipy.stats.ttest_rel`` when scipy is installed and
the same statistic with a Student-t tail computed here otherwise.
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match(prediction: str, golds: Sequence[str]) -> float:
    """1.0 if the normalised prediction equals any normalised gold answer."""
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in golds))


def token_f1(prediction: str, golds: Sequence[str]) -> float:
    """Best SQuAD token F1 of ``prediction`` against ``golds``."""
    pred = normalize_answer(prediction).split()
    best = 0.0
    for gold in golds:
        ref = normalize_answer(gold).split()
        common = Counter(pred) & Counter(ref)
        same = sum(common.values())
        if not pred or not ref:
            best = max(best, float(pred == ref))
            continue
        if same == 0:
            continue
        precision, recall = same / len(pred), same / len(ref)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


@dataclass(frozen=True, slots=True)
class TTestResult:
    """Paired t-test of ``a - b``: mean difference, t statistic, two-sided p, pairs."""

    mean_difference: float
    t: float | None
    p: float | None
    n: int
    implementation: str


def paired_t_test(a: Sequence[float], b: Sequence[float]) -> TTestResult:
    """Two-sided paired t-test (``ValueError`` if the lengths differ). With all differences
    equal, t is undefined: ``t=None`` and ``p=1.0`` when they are all zero."""
    if len(a) != len(b):
        msg = f"paired samples must have equal length, got {len(a)} and {len(b)}"
        raise ValueError(msg)
    diffs = [x - y for x, y in zip(a, b, strict=True)]
    n = len(diffs)
    mean = sum(diffs) / n if n else 0.0
    if n < 2:
        return TTestResult(mean, None, None, n, "none")
    var = sum((d - mean) ** 2 for d in diffs) / (n - 1)
    if var == 0.0:
        return TTestResult(mean, None, 1.0 if mean == 0.0 else 0.0, n, "degenerate")
    try:
        from scipy.stats import ttest_rel

        res = ttest_rel(list(a), list(b))
        return TTestResult(mean, float(res.statistic), float(res.pvalue), n, "scipy")
    except ImportError:
        t = mean / math.sqrt(var / n)
        return TTestResult(mean, t, _student_two_sided(t, n - 1), n, "builtin")


def _student_two_sided(t: float, df: int) -> float:
    """Two-sided p of Student's t via the regularised incomplete beta (continued fraction)."""
    x = df / (df + t * t)
    return _betainc(df / 2.0, 0.5, x)


def _betainc(a: float, b: float, x: float) -> float:
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    ln = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
    front = math.exp(ln + a * math.log(x) + b * math.log(1 - x))
    if x > (a + 1) / (a + b + 2):
        return 1.0 - _betainc(b, a, 1 - x)
    # Lentz's continued fraction.
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    f = d
    for m in range(1, 300):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            f *= c * d
        if abs(c * d - 1.0) < 1e-12:
            break
    return front * f / a
