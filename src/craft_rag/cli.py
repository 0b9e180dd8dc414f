"""``craft-rag`` command line: replay, trace, model, demo, bench.

Each feature module owns its subcommand through an ``add_*_parser(subparsers)`` function that
sets ``func``; this file only wires them together.

User errors (see :mod:`craft_rag.cli_args`): exit status 2, one line on stderr naming the thing
and the fix, no traceback, nothing written. Interrupted (Ctrl-C): 130. A closed stdout pipe
(``craft-rag trace | head``): 141, silently.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from craft_rag.cli_args import OneLineArgumentParser, describe_error, fail
from craft_rag.replay_cli import add_replay_parser

USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, OSError, RuntimeError, ImportError)
"""Exceptions a subcommand raises for bad input or environment; anything else is a bug and
keeps its traceback."""

# (module, function) pairs of optional subcommands; a module whose dependencies are missing
# still gets a clear error when its subcommand runs, not at start-up.
_SUBCOMMANDS: tuple[tuple[str, str], ...] = (
    ("craft_rag.workloads_cli", "add_trace_parser"),
    ("craft_rag.engine.cli_commands", "add_model_parser"),
    ("craft_rag.engine.serve", "add_serve_parser"),
    ("craft_rag.demo", "add_demo_parser"),
    ("craft_rag.bench.cli", "add_bench_parser"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(
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
    """Run ``craft-rag`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status.
    Usage errors (argparse) print one line and raise ``SystemExit(2)`` as argparse does."""
    args = build_parser().parse_args(argv)
    command = str(getattr(args, "command", "") or "")
    try:
        result: int = args.func(args)
    except KeyboardInterrupt:
        print(f"craft-rag {command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        _silence_stdout()
        return 141
    except USER_ERRORS as e:
        return fail(command, describe_error(e))
    return result


def _silence_stdout() -> None:
    """After a closed pipe, point stdout at /dev/null so the interpreter's final flush does
    not print a second error."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    raise SystemExit(main())
