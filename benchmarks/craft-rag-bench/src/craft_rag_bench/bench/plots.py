"""PNG figures in the style of the paper's, one per suite, from the suites' JSON results.

Each ``plot_<suite>(result, path)`` draws one small PNG (Agg backend, ~80 dpi, so the files
stay a few tens of KB); :data:`PLOTTERS` maps suite -> function. matplotlib is imported lazily.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

SYSTEM_LABELS = {
    "no_cache_nodedup": "w/o prefix caching, no dedup",
    "no_cache": "w/o prefix caching",
    "prefix_cache_nodedup": "w/ prefix caching, no dedup",
    "prefix_cache": "w/ prefix caching",
    "craft_frequency": "CRAFT frequency",
    "craft_tree": "CRAFT tree",
}
DPI = 80


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path) -> None:
    """Write the PNG through :func:`craft_rag.files.atomic_writer` (private temp file renamed
    into place: never a half-written figure, never through a symlink)."""
    from craft_rag.files import atomic_writer

    fig.tight_layout()
    try:
        with atomic_writer(path, binary=True) as handle:
            fig.savefig(handle, dpi=DPI, format="png")
    finally:
        _plt().close(fig)


def plot_overlap(result: Mapping[str, Any], path: Path) -> None:
    plt = _plt()
    rows = result["rows"]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    get = {(r["workload"], r["policy"]): r for r in rows}
    series: list[tuple[str, Callable[[str], float]]] = [
        ("Total (any order)", lambda w: get[(w, "retriever")]["retrieved_total_overlap"]),
        ("Prefix, retriever order", lambda w: get[(w, "retriever")]["retrieved_prefix_overlap"]),
        ("Prefix, CRAFT frequency", lambda w: get[(w, "frequency")]["prefix_overlap"]),
        ("Prefix, CRAFT tree", lambda w: get[(w, "tree")]["prefix_overlap"]),
    ]
    fig, ax = plt.subplots(figsize=(8, 3.2))
    width = 0.8 / len(series)
    for i, (label, value) in enumerate(series):
        xs = [j + i * width for j in range(len(workloads))]
        ax.bar(xs, [100 * value(w) for w in workloads], width, label=label)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(workloads))], workloads)
    ax.set_ylabel("chunk overlap (%)")
    ax.set_title("Chunk overlap across requests: prefix vs total (cf. paper Fig. 3)")
    ax.legend(fontsize=7)
    save_figure(fig, path)


def plot_kv(result: Mapping[str, Any], path: Path) -> None:
    plt = _plt()
    labels: list[str] = []
    cross: list[float] = []
    conv: list[float] = []
    for workload, w in result["workloads"].items():
        for policy in ("frequency", "tree"):
            labels.append(f"{workload}\n{policy}")
            cross.append(100 * w[policy]["cross_request"])
            conv.append(100 * w[policy]["conversation"])
    fig, ax = plt.subplots(figsize=(6, 3.2))
    xs = list(range(len(labels)))
    ax.bar(xs, cross, label="cross-request reordering")
    ax.bar(xs, conv, bottom=cross, label="conversation-scoped dedup")
    ax.set_xticks(xs, labels, fontsize=8)
    ax.axhline(0, color="black", linewidth=0.5)
    ax.set_ylabel("KV computation reduction (%)\nvs prefix caching, retriever order")
    ax.set_title("Reduction in prefill KV computation, engine (cf. Fig. 12)", fontsize=9)
    ax.legend(fontsize=7)
    save_figure(fig, path)


def plot_ttft(result: Mapping[str, Any], path: Path) -> None:
    plt = _plt()
    workloads = list(result["workloads"])
    fig, axes = plt.subplots(1, len(workloads), figsize=(4 * len(workloads), 3.2), squeeze=False)
    for ax, workload in zip(axes[0], workloads, strict=True):
        systems = result["workloads"][workload]["systems"]
        names = [n for n in SYSTEM_LABELS if n in systems]
        width = 0.25
        for i, stat in enumerate(("mean", "p50", "p99")):
            xs = [j + i * width for j in range(len(names))]
            ax.bar(xs, [systems[n][f"normalised_{stat}"] for n in names], width, label=stat)
        ax.set_xticks([j + width for j in range(len(names))],
                      [SYSTEM_LABELS[n].replace(" ", "\n").replace(",", "") for n in names],
                      fontsize=6)
        ax.set_ylabel("TTFT / w/o prefix caching")
        ax.set_title(f"{workload}: normalised TTFT (cf. Fig. 11)", fontsize=9)
        ax.legend(fontsize=7)
    save_figure(fig, path)


def plot_load(result: Mapping[str, Any], path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for name in dict.fromkeys(p["system"] for p in result["points"]):
        pts = sorted((p for p in result["points"] if p["system"] == name), key=lambda p: p["rate"])
        ax.plot([p["rate"] for p in pts], [p["mean_ttft_ms"] / 1000 for p in pts], marker="o",
                label=SYSTEM_LABELS.get(name, name))
    ax.axhline(result["slo_ms"] / 1000, color="grey", linestyle="--", label="SLO (5x low load)")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("mean TTFT (s)")
    ax.set_title("TTFT vs request rate (cf. Fig. 13a)", fontsize=9)
    ax.legend(fontsize=7)
    save_figure(fig, path)


def plot_topk(result: Mapping[str, Any], path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for name in dict.fromkeys(r["system"] for r in result["rows"]):
        pts = [r for r in result["rows"] if r["system"] == name]
        ax.plot([r["k"] for r in pts], [r["mean_ttft_ms"] / 1000 for r in pts], marker="o",
                label=SYSTEM_LABELS.get(name, name))
    ax.set_xlabel("retrieved chunks k")
    ax.set_ylabel("mean TTFT (s)")
    ax.set_xticks(result["topks"])
    ax.set_title("TTFT vs number of chunks (cf. Fig. 13c)", fontsize=9)
    ax.legend(fontsize=7)
    save_figure(fig, path)


def plot_sensitivity(result: Mapping[str, Any], path: Path) -> None:
    plt = _plt()
    rows = result["rows"]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    for workload in workloads:
        for policy in ("frequency", "tree"):
            pts = [r for r in rows if r["workload"] == workload and r["policy"] == policy
                   and r["sweep"] == "window"]
            labels = [str(r["window"]) if r["window"] is not None else "unl." for r in pts]
            axes[0].plot(labels, [100 * r["reused_token_fraction"] for r in pts], marker="o",
                         label=f"{workload} {policy}")
            pts = [r for r in rows if r["workload"] == workload and r["policy"] == policy
                   and r["sweep"] == "threshold"]
            axes[1].plot([str(r["threshold"]) for r in pts],
                         [100 * r["reused_token_fraction"] for r in pts], marker="o",
                         label=f"{workload} {policy}")
    axes[0].set_xlabel("CA-Table window (requests)")
    axes[0].set_title("Window (cf. Fig. 14)", fontsize=9)
    axes[1].set_xlabel("promotion threshold T")
    axes[1].set_title("Threshold, threshold promotion (cf. Fig. 15)", fontsize=9)
    for ax in axes:
        ax.set_ylabel("reused prompt tokens (%)")
        ax.legend(fontsize=6)
    save_figure(fig, path)


def plot_quality(result: Mapping[str, Any], path: Path) -> None:
    plt = _plt()
    perm = result["permutations"]
    rows = perm["per_request"]
    dedup = result.get("dedup")
    ncols = 3 if dedup else 2
    fig, axes = plt.subplots(1, ncols, figsize=(4.5 * ncols, 3.2))
    xs = list(range(1, len(rows) + 1))
    for ax, metric, label in ((axes[0], "f1", "token F1"),
                              (axes[1], "minilm_cosine", "MiniLM cosine (not BERTScore)")):
        ax.plot(xs, [r[f"retriever_{metric}"] for r in rows], "o-", label="retriever order")
        ax.plot(xs, [r[f"craft_{metric}"] for r in rows], "s--", label="CRAFT order")
        ax.errorbar(xs, [r[f"permutation_{metric}_mean"] or 0 for r in rows],
                    yerr=[r[f"permutation_{metric}_std"] or 0 for r in rows], fmt="^:",
                    capsize=2, label=f"random perms (mean ± std, n={perm['permutations']})")
        ax.set_xlabel("request")
        ax.set_ylabel(label)
        ax.set_title(f"{label} by chunk order (cf. Fig. 5)", fontsize=9)
        ax.legend(fontsize=6)
    if dedup:
        turns = dedup["per_turn"]
        ts = list(range(1, len(turns) + 1))
        axes[2].plot(ts, [t["no_dedup_f1"] for t in turns], "o-", label="no dedup")
        axes[2].plot(ts, [t["dedup_f1"] for t in turns], "s--", label="dedup")
        p = dedup["tests"]["f1"]["p"]
        axes[2].set_title(f"MTRAG F1, dedup vs not (paired t p={p if p is None else round(p, 2)})",
                          fontsize=9)
        axes[2].set_xlabel("turn")
        axes[2].set_ylabel("token F1")
        axes[2].legend(fontsize=6)
    save_figure(fig, path)


def plot_overhead(result: Mapping[str, Any], path: Path) -> None:
    plt = _plt()
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    labels = [f"{r['policy']}\nk={r['k']} W={r['window']}" for r in rows]
    xs = list(range(len(rows)))
    ax.bar([x - 0.2 for x in xs], [r["plan_commit_us_p50"] for r in rows], 0.4, label="p50")
    ax.bar([x + 0.2 for x in xs], [r["plan_commit_us_p99"] for r in rows], 0.4, label="p99")
    ax.axhline(50, color="grey", linestyle="--", label="target p99 (k=5)")
    ax.set_xticks(xs, labels, fontsize=6)
    ax.set_ylabel("plan+commit (µs)")
    ax.set_title(f"Planner overhead after {result['distinct_chunks']:,} distinct chunks",
                 fontsize=9)
    ax.legend(fontsize=7)
    save_figure(fig, path)


def plot_routing(result: Mapping[str, Any], path: Path) -> None:
    from craft_rag_bench.bench.routing import plot

    plot(dict(result), path)


def plot_chat(result: Mapping[str, Any], path: Path) -> None:
    from craft_rag_bench.bench.chat import plot

    plot(dict(result), path)


PLOTTERS: dict[str, Callable[[Mapping[str, Any], Path], None]] = {
    "chat": plot_chat,
    "overlap": plot_overlap,
    "kv": plot_kv,
    "ttft": plot_ttft,
    "load": plot_load,
    "topk": plot_topk,
    "sensitivity": plot_sensitivity,
    "quality": plot_quality,
    "overhead": plot_overhead,
    "routing": plot_routing,
}
