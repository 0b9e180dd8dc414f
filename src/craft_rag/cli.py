"""``craft-rag`` command line: replay, trace, model, demo, bench.

Each feature module owns its subcommand through an ``add_*_parser(subparsers)`` function that
sets ``func``; this file only wires them together.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from craft_rag.replay_cli import add_replay_parser

# (module, function) pairs of optional subcommands; a module whose dependencies are missing
# still gets a clear error when its subcommand runs, not at start-up.
_SUBCOMMANDS: tuple[tuple[str, str], ...] = (
    ("craft_rag.workloads_cli", "add_trace_parser"),
    ("craft_rag.engine.cli_commands", "add_model_parser"),
    ("craft_rag.demo", "add_demo_parser"),
    ("craft_rag.bench.cli", "add_bench_parser"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="craft-rag",
        description="CRAFT for RAG: reorder and deduplicate retrieved chunks for KV-cache reuse.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_replay_parser(subparsers)
    for module_name, function_name in _SUBCOMMANDS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name and e.name.startswith("craft_rag"):
                continue  # subcommand not built in this version
            raise
        add = getattr(module, function_name, None)
        if add is not None:
            add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result: int = args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"craft-rag {args.command}: error: {e}", file=sys.stderr)
        return 2
    return result


if __name__ == "__main__":
    raise SystemExit(main())
