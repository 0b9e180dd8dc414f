"""``craft-rag trace``: build a replay trace from shared/data (wired into :mod:`craft_rag.cli`).

Writes JSON lines (see :mod:`craft_rag.trace`) to ``--out`` or stdout; progress and a one-line
summary go to stderr so stdout stays a clean trace.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from craft_rag.datasets import LOADERS
from craft_rag.retrieval.index import INDEX_KINDS
from craft_rag.workloads import CORPUS_CHOICES, TraceConfig, build_trace, sharing_report


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        msg = f"must be >= 1, got {value}"
        raise argparse.ArgumentTypeError(msg)
    return value


def add_trace_parser(subparsers: Any) -> None:
    """Add the ``trace`` subcommand to an argparse ``subparsers`` object; it sets
    ``func`` to a handler that takes the parsed namespace and returns an exit code."""
    defaults = TraceConfig(dataset="squad")
    p = subparsers.add_parser(
        "trace",
        help="build a replay trace (JSON lines) from shared/data",
        description=(
            "Build a replay trace from shared/data: single-turn QA with faiss retrieval over "
            "MiniLM embeddings (cached under $CRAFT_RAG_HOME/indexes), or multi-turn MTRAG / "
            "ShareGPT conversations. Data folder: $CRAFT_RAG_DATA (default ../shared/data)."
        ),
    )
    p.add_argument("--dataset", required=True, choices=list(LOADERS))
    p.add_argument(
        "--requests",
        type=_positive_int,
        default=None,
        help="trace length (default: every question/turn once, plus re-asks)",
    )
    p.add_argument("--top-k", type=_positive_int, default=defaults.top_k)
    p.add_argument(
        "--repeat",
        type=float,
        default=defaults.repeat,
        help="single-turn: probability a request re-asks an earlier question (default %(default)s)",
    )
    p.add_argument(
        "--zipf",
        type=float,
        default=defaults.zipf,
        help="single-turn: Zipf exponent of re-ask popularity, 0 = uniform (default %(default)s)",
    )
    p.add_argument(
        "--near-duplicates",
        type=float,
        default=defaults.near_duplicates,
        help="single-turn: probability a re-ask is reworded (default %(default)s)",
    )
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument(
        "--corpus",
        choices=list(CORPUS_CHOICES),
        default=defaults.corpus,
        help="retrieve over the union of all passages or the dataset's own (default %(default)s)",
    )
    p.add_argument("--index", choices=list(INDEX_KINDS), default=defaults.index)
    p.add_argument("--nlist", type=_positive_int, default=None, help="IVF lists (default ~4√n)")
    p.add_argument("--nprobe", type=_positive_int, default=None, help="IVF lists scanned")
    p.add_argument(
        "--interleave",
        action="store_true",
        help="multi-turn: interleave conversations (seeded) instead of running them in order",
    )
    p.add_argument("--concurrency", type=_positive_int, default=defaults.concurrency)
    p.add_argument(
        "--threads",
        type=_positive_int,
        default=None,
        help="torch threads for embedding (default: torch's choice, usually all cores)",
    )
    p.add_argument("--data-dir", type=Path, default=None, help="overrides $CRAFT_RAG_DATA")
    p.add_argument("--out", "-o", default="-", help="output file (default: stdout)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bars or summary")
    p.set_defaults(func=run_trace)


def run_trace(args: argparse.Namespace) -> int:
    """Handler of ``craft-rag trace``: build the trace and write it. Returns 0, or 2 with a
    message on stderr for bad options or missing data."""
    from craft_rag.trace import write_trace

    started = time.perf_counter()
    try:
        config = TraceConfig(
            dataset=args.dataset,
            requests=args.requests,
            top_k=args.top_k,
            repeat=args.repeat,
            zipf=args.zipf,
            near_duplicates=args.near_duplicates,
            seed=args.seed,
            corpus=args.corpus,
            index=args.index,
            nlist=args.nlist,
            nprobe=args.nprobe,
            interleave=args.interleave,
            concurrency=args.concurrency,
        )
        embedder = None
        if args.threads is not None and config.dataset != "mtrag":
            from craft_rag.retrieval import Embedder

            embedder = Embedder(num_threads=args.threads)
        trace = build_trace(
            config, data_dir=args.data_dir, embedder=embedder, show_progress=not args.quiet
        )
    except (ValueError, FileNotFoundError, ImportError) as e:
        print(f"craft-rag trace: error: {e}", file=sys.stderr)
        return 2
    if args.out == "-":
        write_trace(trace, sys.stdout)
        sys.stdout.flush()
    else:
        write_trace(trace, args.out)
    if not args.quiet:
        report = sharing_report(trace)
        print(
            f"craft-rag trace: {report.requests} requests from {config.dataset} "
            f"({report.sharing_requests} share a chunk with an earlier request, "
            f"{report.shared_chunk_fraction:.1%} of chunk occurrences seen before) "
            f"in {time.perf_counter() - started:.1f} s -> "
            f"{'stdout' if args.out == '-' else args.out}",
            file=sys.stderr,
        )
    return 0
