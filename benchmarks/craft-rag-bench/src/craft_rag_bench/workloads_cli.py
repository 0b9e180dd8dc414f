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

from craft_rag.cli_args import (
    check_output_file,
    describe_error,
    fail,
    finite_float,
    float_range,
    int_range,
    seed_int,
)
from craft_rag_bench.datasets import LOADERS
from craft_rag_bench.retrieval.index import INDEX_KINDS
from craft_rag_bench.workloads import CORPUS_CHOICES, TraceConfig, build_trace, sharing_report

MAX_TRACE_REQUESTS = 10_000_000
"""--requests above this is refused: the trace is built in memory (~1 KB a request)."""


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
        type=int_range(1, MAX_TRACE_REQUESTS),
        default=None,
        help="trace length (default: every question/turn once, plus re-asks)",
    )
    p.add_argument("--top-k", type=int_range(1, 1000), default=defaults.top_k)
    p.add_argument(
        "--repeat",
        type=finite_float,
        default=defaults.repeat,
        help="single-turn: probability a request re-asks an earlier question (default %(default)s)",
    )
    p.add_argument(
        "--zipf",
        type=float_range(0.0, 100.0),
        default=defaults.zipf,
        help="single-turn: Zipf exponent of re-ask popularity, 0 = uniform (default %(default)s)",
    )
    p.add_argument(
        "--near-duplicates",
        type=finite_float,
        default=defaults.near_duplicates,
        help="single-turn: probability a re-ask is reworded (default %(default)s)",
    )
    p.add_argument("--seed", type=seed_int, default=defaults.seed)
    p.add_argument(
        "--corpus",
        choices=list(CORPUS_CHOICES),
        default=defaults.corpus,
        help="retrieve over the union of all passages or the dataset's own (default %(default)s)",
    )
    p.add_argument("--index", choices=list(INDEX_KINDS), default=defaults.index)
    p.add_argument(
        "--nlist", type=int_range(1, 1 << 20), default=None, help="IVF lists (default ~4√n)"
    )
    p.add_argument("--nprobe", type=int_range(1, 1 << 20), default=None, help="IVF lists scanned")
    p.add_argument(
        "--interleave",
        action="store_true",
        help="multi-turn: interleave conversations (seeded) instead of running them in order",
    )
    p.add_argument("--concurrency", type=int_range(1, 1 << 16), default=defaults.concurrency)
    p.add_argument(
        "--threads",
        type=int_range(1, 1024),
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
        # Before the expensive part (loading data, embedding a corpus): can we write the output,
        # does the data folder exist?
        if args.out != "-":
            check_output_file(args.out, "--out")
        if args.data_dir is not None and not args.data_dir.is_dir():
            msg = (
                f"--data-dir {args.data_dir} is not an existing folder; pass the shared/data folder"
            )
            raise FileNotFoundError(msg)
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
            from craft_rag_bench.retrieval import Embedder

            embedder = Embedder(num_threads=args.threads)
        trace = build_trace(
            config, data_dir=args.data_dir, embedder=embedder, show_progress=not args.quiet
        )
    except (ValueError, OSError, ImportError) as e:
        return fail("trace", describe_error(e))
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
