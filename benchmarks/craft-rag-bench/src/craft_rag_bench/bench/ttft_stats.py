"""Statistics of the ``ttft`` suite beyond the summary: passes, per-request rows, pairing.

TTFT here is wall time on a shared CPU: a system served while the machine is busier (other jobs,
a garbage collection, load drifting over the minutes a suite runs) looks slower for reasons that
have nothing to do with its order. Three things separate the order's effect from that noise:

- **mirrored passes** (:func:`mirrored_order`): with ``--ttft-passes 2`` every system is served
  twice, in the order A B C .. C B A, each pass from an empty cache, and the TTFT statistics run
  over both passes; a load that drifts linearly over the run then slows every system alike.
- **per-request rows** (:func:`per_request`): tokens and TTFT of every request of every pass, so a
  difference can be paired request by request across systems (the order is deterministic: the
  same system caches the same tokens in every pass).
- **the fit** (:func:`fit_rows`, :func:`paired`): ``TTFT = a + b * computed tokens`` fitted to
  every request of the run; a system's ``fit_mean_ttft_ms`` is what its token counts alone
  predict, and the residual is what they do not explain (noise, or a cost the tokens miss).

Besides :func:`serve_passes` (serves, reads the load average) and :func:`gc_pauses`
(collects garbage, hooks ``gc.callbacks``), the functions are pure (lists in, dicts out);
all are O(requests x passes).
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from craft_rag.metrics import percentile
from craft_rag_bench.demo import summarise

if TYPE_CHECKING:
    from craft_rag.engine import GenerationResult

MAX_PASSES = 8
"""Upper bound of ``--ttft-passes`` (each pass serves every system once more)."""


def mirrored_order(names: Sequence[str], passes: int) -> list[str]:
    """The serving order of ``passes`` passes: ``names``, then reversed, then forward ...
    (A B C, C B A, A B C ...). ``ValueError`` for ``passes`` outside 1..MAX_PASSES."""
    if not 1 <= passes <= MAX_PASSES:
        msg = f"ttft passes must be in 1..{MAX_PASSES} (got {passes}); pass --ttft-passes 1 or 2"
        raise ValueError(msg)
    out: list[str] = []
    for i in range(passes):
        out += list(names) if i % 2 == 0 else list(reversed(names))
    return out


@contextmanager
def gc_pauses(*, collect: bool = True) -> Iterator[dict[str, float]]:
    """With ``collect``, collect garbage now (each system starts from the same clean heap,
    outside its timing; ~0.2 s with vLLM loaded), then count the collections (and their
    milliseconds) that run inside the block."""
    if collect:
        gc.collect()
    stats = {"collections": 0.0, "ms": 0.0, "gen2_collections": 0.0}
    started: list[float] = []

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            stats["ms"] += 1000.0 * (time.perf_counter() - started.pop())
            stats["collections"] += 1
            stats["gen2_collections"] += info.get("generation") == 2

    gc.callbacks.append(callback)
    try:
        yield stats
    finally:
        gc.callbacks.remove(callback)


def serve_passes(
    names: Sequence[str],
    passes: int,
    serve: Callable[[str, int], list[GenerationResult]],
) -> tuple[dict[str, list[list[GenerationResult]]], dict[str, list[dict[str, Any]]]]:
    """Serve every system ``passes`` times in mirrored order: ``serve(name, pass_index)``.
    With more than one pass, garbage is collected before each (one pass: as before, so
    ``bench all`` costs what it did). Returns (system -> its passes' results, system -> per
    pass: load averages before/after, garbage collections inside, wall seconds)."""
    runs: dict[str, list[list[GenerationResult]]] = {n: [] for n in names}
    info: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for name in mirrored_order(names, passes):
        load_before = os.getloadavg()[0]
        started = time.perf_counter()
        with gc_pauses(collect=passes > 1) as pauses:
            results = serve(name, len(runs[name]))
        runs[name].append(results)
        info[name].append({
            "load_avg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
            "seconds": round(time.perf_counter() - started, 2),
            "gc_collections": int(pauses["collections"]),
            "gc_gen2_collections": int(pauses["gen2_collections"]),
            "gc_ms": round(pauses["ms"], 2),
        })
    return runs, info


def summary_row(runs: Sequence[Sequence[GenerationResult]]) -> dict[str, Any]:
    """The summary of one system's passes: the tokens of the first pass (the order is
    deterministic, ``cached_tokens_per_pass`` shows it), TTFT mean/p50/p99 over every request of
    every pass, and ``mean_ttft_ms_per_pass``."""
    if not runs or not runs[0]:
        msg = "a system needs at least one pass with at least one request"
        raise ValueError(msg)
    row = asdict(summarise(runs[0]))
    ttfts = [r.report.ttft_ms for rs in runs for r in rs]
    row["mean_ttft_ms"] = sum(ttfts) / len(ttfts)
    row["p50_ttft_ms"] = percentile(ttfts, 50)
    row["p99_ttft_ms"] = percentile(ttfts, 99)
    row["passes"] = len(runs)
    row["mean_ttft_ms_per_pass"] = [sum(r.report.ttft_ms for r in rs) / len(rs) for rs in runs]
    row["cached_tokens_per_pass"] = [sum(r.report.cached_tokens for r in rs) for rs in runs]
    return row


def per_request(runs: Sequence[Sequence[GenerationResult]]) -> dict[str, Any]:
    """Per-request rows of one system: ``prompt_tokens`` (one per request), ``cached_tokens``
    and ``ttft_ms`` (one list per pass, rounded to 0.1 ms)."""
    return {
        "prompt_tokens": [r.report.prompt_tokens for r in runs[0]],
        "cached_tokens": [[r.report.cached_tokens for r in rs] for rs in runs],
        "ttft_ms": [[round(r.report.ttft_ms, 1) for r in rs] for rs in runs],
    }


def fit_rows(rows: Mapping[str, Mapping[str, Any]]) -> tuple[float, float]:
    """Least-squares ``ttft_ms = a + b * computed tokens`` over every request of every pass of
    every system in ``rows`` (:func:`per_request` rows)."""
    xs: list[float] = []
    ys: list[float] = []
    for row in rows.values():
        for cached, ttfts in zip(row["cached_tokens"], row["ttft_ms"], strict=True):
            xs += [float(p - c) for p, c in zip(row["prompt_tokens"], cached, strict=True)]
            ys += ttfts
    n = len(xs)
    if n < 2:
        return (ys[0] if ys else 0.0), 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
    return my - b * mx, b


def _computed(row: Mapping[str, Any]) -> list[float]:
    """Mean computed tokens per request over the passes."""
    passes = len(row["cached_tokens"])
    return [
        p - sum(cached[i] for cached in row["cached_tokens"]) / passes
        for i, p in enumerate(row["prompt_tokens"])
    ]


def _mean_ttft(row: Mapping[str, Any]) -> list[float]:
    """Mean TTFT per request over the passes."""
    passes = row["ttft_ms"]
    return [sum(p[i] for p in passes) / len(passes) for i in range(len(row["prompt_tokens"]))]


def fit_mean(row: Mapping[str, Any], fit: tuple[float, float]) -> float:
    """The mean TTFT the fit predicts from ``row``'s computed tokens alone."""
    computed = _computed(row)
    return fit[0] + fit[1] * sum(computed) / len(computed) if computed else 0.0


def paired(
    a: Mapping[str, Any], b: Mapping[str, Any], fit: tuple[float, float], *, top: int = 3
) -> dict[str, Any]:
    """System ``a`` against ``b`` request by request (same trace): how many requests ``a``
    computes more / fewer tokens for, the total computed-token difference, the mean TTFT
    difference (``a`` - ``b``), the part of it the fit explains by tokens, the rest
    (``unexplained_ms``: noise, or a cost the tokens miss), the standard error of the mean
    difference over requests (``mean_ttft_diff_se_ms``: request-level noise only; a load that
    shifts a whole pass shows in ``mean_ttft_diff_ms_per_pass``, pass i against pass i) and the
    ``top`` requests where ``a`` is slowest against ``b`` (largest ``a - b`` TTFT, the tail
    to explain). ``ValueError`` when the two rows are not the same trace."""
    if a["prompt_tokens"] != b["prompt_tokens"]:
        msg = "paired rows must come from the same trace (prompt_tokens differ)"
        raise ValueError(msg)
    ca, cb = _computed(a), _computed(b)
    ta, tb = _mean_ttft(a), _mean_ttft(b)
    n = len(ca)
    if n == 0:
        msg = "paired rows hold no requests"
        raise ValueError(msg)
    ttft_diff = (sum(ta) - sum(tb)) / n
    fit_diff = fit[1] * (sum(ca) - sum(cb)) / n
    diffs = [x - y for x, y in zip(ta, tb, strict=True)]
    var = sum((d - ttft_diff) ** 2 for d in diffs) / (n - 1) if n > 1 else 0.0
    per_pass = [
        (sum(pa) - sum(pb)) / n for pa, pb in zip(a["ttft_ms"], b["ttft_ms"], strict=False)
    ]
    gaps = sorted(range(n), key=lambda i: tb[i] - ta[i])[:top]
    return {
        "requests_more_computed": sum(x > y for x, y in zip(ca, cb, strict=True)),
        "requests_fewer_computed": sum(x < y for x, y in zip(ca, cb, strict=True)),
        "computed_tokens_diff": sum(ca) - sum(cb),
        "mean_ttft_diff_ms": ttft_diff,
        "fit_ttft_diff_ms": fit_diff,
        "unexplained_ms": ttft_diff - fit_diff,
        "mean_ttft_diff_se_ms": (var / n) ** 0.5,
        "mean_ttft_diff_ms_per_pass": per_pass,
        "largest_gaps": [
            {"request": i, "ttft_diff_ms": round(ta[i] - tb[i], 1),
             "computed_tokens_diff": ca[i] - cb[i]}
            for i in gaps
        ],
    }
