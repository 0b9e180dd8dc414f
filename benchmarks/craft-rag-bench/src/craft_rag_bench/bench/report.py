"""The generated markdown report: one section per suite, tables from the JSON results.

``render_report(results, meta)`` is pure (results in, markdown out); ``craft-rag bench`` writes
it to ``<out>/report.md`` from every ``<suite>.json`` in the results folder, so a partial rerun
(one suite) refreshes its section and keeps the others.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

Section = Callable[[Mapping[str, Any]], list[str]]


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _f(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return out


def _overhead(r: Mapping[str, Any]) -> list[str]:
    rows = [
        [x["policy"], str(x["k"]), f"{x['window']:,}", _f(x["plan_commit_us_p50"]),
         _f(x["plan_commit_us_p99"]), _f(x.get("cpu_us_p50")), _f(x.get("cpu_us_p99")),
         _f(x.get("replay_us_p50")), _f(x.get("replay_us_p99")), f"{x['table_chunks']:,}",
         f"{x['tree_nodes']:,}", _f(x["state_mib"])]
        for x in r["rows"]
    ]
    return [f"After {r['distinct_chunks']:,} distinct chunks (targets: p99 <= 50 µs at k=5, "
            "<= 64 MB):", "",
            *_table(["policy", "k", "W", "p50 µs", "p99 µs", "CPU p50 µs", "CPU p99 µs",
                     "replay p50 µs", "replay p99 µs", "table chunks", "tree nodes",
                     "state MiB"], rows)]


def _overlap(r: Mapping[str, Any]) -> list[str]:
    rows = [
        [x["workload"], x["policy"], str(x["requests"]), _pct(x["total_overlap"]),
         _pct(x["prefix_overlap"]), _pct(x.get("reused_token_fraction_no_dedup")),
         _pct(x["reused_token_fraction"]), _pct(x["dedup_removed_fraction"]),
         _f(x["planner_us_p50"]), _f(x["planner_us_p99"])]
        for x in r["rows"]
    ]
    mean = r["mean_over_workloads"]
    return [*_table(["workload", "policy", "requests", "Total overlap", "Prefix overlap",
                     "reused tokens (sim, no dedup)", "reused tokens (sim, dedup)",
                     "dedup removed", "plan p50 µs", "plan p99 µs"], rows), "",
            "Mean over workloads: Total " + _pct(mean["retriever"]["total_overlap"])
            + ", Prefix retriever " + _pct(mean["retriever"]["prefix_overlap"])
            + ", frequency " + _pct(mean["frequency"]["prefix_overlap"])
            + ", tree " + _pct(mean["tree"]["prefix_overlap"])
            + " (paper: Total 43%, Prefix 11%).", *_tree_vs_peers(r)]


def _tree_vs_peers(r: Mapping[str, Any]) -> list[str]:
    ratios = r.get("tree_vs_peers") or []
    if not ratios:
        return []
    rows = [[x["workload"], x["peer"] + (" (sees the future)" if x["sees_future"] else ""),
             _f(x["prefix_overlap_ratio"], 3), _f(x["reused_token_ratio"], 3)] for x in ratios]
    return ["", "CRAFT `tree` over each peer (targets: >= 1.05x ContextPilot online, >= 0.95x "
            "offline):", "", *_table(["workload", "peer", "Prefix overlap ratio",
                                      "reused tokens ratio (no dedup)"], rows)]


def _ttft(r: Mapping[str, Any]) -> list[str]:
    out: list[str] = []
    for workload, w in r["workloads"].items():
        rows = [
            [name, _f(s["mean_ttft_ms"]), _f(s["p50_ttft_ms"]), _f(s["p99_ttft_ms"]),
             _f(s["normalised_mean"], 2), _f(s["normalised_p50"], 2), _f(s["normalised_p99"], 2),
             f"{_f(s['speedup_mean'], 2)}x", _pct(s["cached_token_fraction"]),
             str(s["dedup_removed_chunks"])]
            for name, s in w["systems"].items()
        ]
        bound = w.get("total_overlap_bound")
        if bound:
            rows.append(["Total-overlap bound (est.)", _f(bound["estimated_mean_ttft_ms"]),
                         "-", "-", "-", "-", "-",
                         f"{_f(bound['estimated_speedup_mean'], 2)}x",
                         _pct(bound["cached_token_fraction"]), "-"])
        passes = w.get("passes", 1)
        out += [f"**{workload}** ({w['requests']} requests, max_tokens {r['max_tokens']}, "
                f"block {r['block_size']}"
                + (f", {passes} passes in mirrored order" if passes > 1 else "") + "):", "",
                *_table(["system", "mean ms", "p50 ms", "p99 ms", "norm. mean", "norm. p50",
                         "norm. p99", "speed-up (mean)", "cached tokens", "dedup removed"],
                        rows), "", *_ttft_pairs(w)]
    return out


def _ttft_pairs(w: Mapping[str, Any]) -> list[str]:
    """``craft_tree`` against every other system, request by request (absent in old JSON)."""
    pairs = w.get("tree_vs") or {}
    if not pairs:
        return []
    rows = [
        [f"craft_tree vs {other}",
         _f(p["mean_ttft_diff_ms"]) + (f" ± {_f(p['mean_ttft_diff_se_ms'])}"
                                      if "mean_ttft_diff_se_ms" in p else ""),
         " / ".join(_f(x) for x in p.get("mean_ttft_diff_ms_per_pass", [])) or "-",
         _f(p["fit_ttft_diff_ms"]),
         _f(p["unexplained_ms"]), str(p["requests_fewer_computed"]),
         str(p["requests_more_computed"]),
         ", ".join(f"#{g['request']} {_f(g['ttft_diff_ms'])} ms / {g['computed_tokens_diff']:+.0f}"
                   for g in p["largest_gaps"])]
        for other, p in pairs.items()
    ]
    return ["Paired by request (TTFT differences in ms per request, tree minus the other; "
            "'by tokens' is what the fit TTFT = a + b x computed tokens predicts from the "
            "computed-token difference; ± one standard error over requests):", "",
            *_table(["pair", "mean diff", "per pass", "by tokens", "unexplained",
                     "tree computes fewer", "tree computes more",
                     "largest gaps (ms / computed tokens)"], rows), ""]


def _kv(r: Mapping[str, Any]) -> list[str]:
    out: list[str] = []
    rows = []
    for workload, w in r["workloads"].items():
        for policy in ("frequency", "tree"):
            p = w[policy]
            rows.append([workload, policy, w["baseline"], _pct(p["cross_request"]),
                         _pct(p["conversation"]), _pct(p["total_vs_prefix_cache"]),
                         _pct(p["total_vs_no_cache"])])
    out += _table(["workload", "CRAFT policy", "baseline", "cross-request", "conversation dedup",
                   "total vs baseline", "total vs no cache"], rows)
    out += ["", "Simulator vs engine (reused-token fraction):", ""]
    rows = [
        [a["workload"], a["system"], _pct(a["engine_reused_token_fraction"]),
         _pct(a["replay_reused_token_fraction"]), _pct(a["cache_model_reused_token_fraction"]),
         f"{a['difference_points']:+.1f}"]
        for a in r["agreement"]
    ]
    out += _table(["workload", "system", "engine", "replay", "cache model on engine prompts",
                   "replay - engine (points)"], rows)
    out += ["", "Block size (simulator, same KV capacity in tokens):", ""]
    rows = [
        [b["workload"], b["system"], str(b["block_size"]), _pct(b["reused_token_fraction"]),
         f"{b['computed_tokens']:,}"]
        for b in r["block_sizes"]
    ]
    out += _table(["workload", "system", "block", "reused tokens", "computed tokens"], rows)
    engine_rows = r.get("engine_block_sizes") or []
    if engine_rows:
        out += ["", "Block size on the engine (one engine per block size, same requests):", ""]
        out += _table(
            ["workload", "system", "block", "requests", "mean TTFT ms", "p50 ms",
             "cached tokens"],
            [[b["workload"], b["system"], str(b["block_size"]), str(b["requests"]),
              _f(b["mean_ttft_ms"]), _f(b["p50_ttft_ms"]), _pct(b["cached_token_fraction"])]
             for b in engine_rows],
        )
    return out


def _load(r: Mapping[str, Any]) -> list[str]:
    rows = [
        [p["system"], _f(p["rate"], 2), _f(p["mean_ttft_ms"]), _f(p["p50_ttft_ms"]),
         _f(p["p99_ttft_ms"]), _f(p["throughput_rps"], 2), _pct(p["cached_token_fraction"])]
        for p in r["points"]
    ]
    slo = [
        [name, _f(v["max_rate_within_slo"], 2), _f(v["throughput_rps"], 2)]
        for name, v in r["at_slo"].items()
    ]
    return [*_table(["system", "rate req/s", "mean ms", "p50 ms", "p99 ms", "throughput req/s",
                     "cached tokens"], rows), "",
            f"SLO = 5x low-load TTFT = {_f(r['slo_ms'])} ms:", "",
            *_table(["system", "max rate within SLO", "throughput there (req/s)"], slo),
            *_load_admission(r.get("admission"))]


def _load_admission(adm: Mapping[str, Any] | None) -> list[str]:
    if not adm:  # results written before the comparison existed
        return []
    from craft_rag_bench.bench.load_admission import report_lines

    return ["", *report_lines(adm)]


def _topk(r: Mapping[str, Any]) -> list[str]:
    rows = [
        [str(x["k"]), x["system"], _f(x["mean_ttft_ms"]), _f(x["p99_ttft_ms"]),
         _f(x["normalised_mean"], 2), _pct(x["cached_token_fraction"]),
         _f(x["prompt_tokens_per_request"], 0)]
        for x in r["rows"]
    ]
    return _table(["k", "system", "mean ms", "p99 ms", "norm. mean", "cached tokens",
                   "prompt tokens/request"], rows)


def _sensitivity(r: Mapping[str, Any]) -> list[str]:
    rows = [
        [x["workload"], x["sweep"], x["policy"], x["promotion"],
         "unlimited" if x["window"] is None else str(x["window"]), str(x["threshold"]),
         _pct(x["reused_token_fraction"]), _pct(x["prefix_overlap"]),
         _f(x["computed_tokens_per_request"], 0), _f(x["table_size"], 0)]
        for x in r["rows"]
    ]
    return _table(["workload", "sweep", "policy", "promotion", "window", "T", "reused tokens",
                   "Prefix overlap", "computed tokens/req", "CA-Table size"], rows)


def _quality(r: Mapping[str, Any]) -> list[str]:
    perm = r["permutations"]
    rows = [
        [m, _f(s["retriever_mean"], 3), _f(s["craft_mean"], 3), _f(s["permutation_mean"], 3),
         _f(s["mean_permutation_std"], 3), _f(s["craft_vs_retriever_p"], 2)]
        for m, s in perm["summary"].items()
    ]
    out = [f"{perm['requests']} {perm['workload']} questions, {perm['permutations']} random "
           f"permutations each, greedy, max_tokens {perm['max_tokens']}; similarity = "
           f"{r['similarity_metric']}.", "",
           *_table(["metric", "retriever order", "CRAFT order", "permutations (mean)",
                    "mean std over permutations", "paired t p (CRAFT vs retriever)"], rows)]
    dedup = r.get("dedup")
    if dedup:
        rows = [
            [m, _f(t["dedup_mean"], 3), _f(t["no_dedup_mean"], 3), _f(t["mean_difference"], 3),
             _f(t["t"], 2), _f(t["p"], 2)]
            for m, t in dedup["tests"].items()
        ]
        out += ["", f"MTRAG dedup vs no dedup: {dedup['turns']} turns, {dedup['removed_chunks']} "
                f"chunks removed in {dedup['turns_with_removed_chunks']} turns, max_tokens "
                f"{dedup['max_tokens']}:", "",
                *_table(["metric", "dedup", "no dedup", "mean diff", "t", "p"], rows)]
    return out


def _routing(r: Mapping[str, Any]) -> list[str]:
    from craft_rag_bench.bench.routing import section

    return section(dict(r))


def _cache_sizes(r: Mapping[str, Any]) -> list[str]:
    from craft_rag_bench.bench.cache_sizes import report_lines

    return report_lines(dict(r))


def _tiers(r: Mapping[str, Any]) -> list[str]:
    from craft_rag_bench.bench.tiers import report_lines

    return report_lines(r)


def _chunk_cache_speed(r: Mapping[str, Any]) -> list[str]:
    from craft_rag_bench.bench.chunk_cache_speed import report_lines

    return report_lines(r)


def _pipeline(r: Mapping[str, Any]) -> list[str]:
    from craft_rag_bench.bench.pipeline import report_lines

    return report_lines(dict(r))


SECTIONS: dict[str, tuple[str, Section]] = {
    "overhead": ("Planner overhead", _overhead),
    "overlap": ("Overlap: Prefix vs Total (Fig. 3) and replay under the three policies",
                _overlap),
    "ttft": ("TTFT side by side on one engine (Fig. 11)", _ttft),
    "kv": ("KV computation reduction from the engine (Fig. 12), simulator agreement, "
           "block size", _kv),
    "load": ("TTFT vs request rate, throughput at SLO (Fig. 13a)", _load),
    "topk": ("TTFT vs top-k (Fig. 13c)", _topk),
    "sensitivity": ("CA-Table window and promotion threshold (Figs. 14, 15)", _sensitivity),
    "quality": ("Answer quality: chunk order (Fig. 5) and dedup (Fig. 7)", _quality),
    "routing": ("KV-aware routing across replicas (simulated cluster)", _routing),
    "cache-sizes": ("KV cache sizes: every system from a whole-working-set cache down to "
                    "~10 requests (issue 16)", _cache_sizes),
    "tiers": ("KV tiers: prefix caching, CRAFT, and CRAFT with RAM/disk KV tiers (LRU, PGDSF) "
              "on a small pool", _tiers),
    "pipeline": ("Speculative retrieval pipelining vs search-then-prefill (RAGCache 5.3)",
                 _pipeline),
    "chunk-cache-speed": ("Chunk-caches: TTFT of CRAFT alone, CRAFT + chunk-caches and the "
                          "retriever's order + chunk-caches (issue 28)", _chunk_cache_speed),
}


def render_report(results: Mapping[str, Mapping[str, Any]], meta: Mapping[str, Any]) -> str:
    """Markdown for ``results`` (suite -> JSON result), in :data:`SECTIONS` order."""
    lines = ["# craft-rag benchmark report (generated)", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items()]
    for suite, (title, section) in SECTIONS.items():
        result = results.get(suite)
        if result is None:
            continue
        lines += ["", f"## {title}", "",
                  f"`{suite}`: {result.get('seconds', '?')} s, {result.get('date', '')}"
                  + (" (quick)" if result.get("quick") else ""), ""]
        lines += section(result)
        if result.get("png"):
            lines += ["", f"![{suite}]({result['png']})"]
    return "\n".join(lines) + "\n"
