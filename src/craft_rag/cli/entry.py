"""The ``craft-rag`` entry point: replay, model, serve, plus the harness's demo, bench, trace.

Each feature module owns its subcommand through an ``add_*_parser(subparsers)`` function that
sets ``func``; this file only wires them together. Other distributions add subcommands through
the ``craft_rag.commands`` entry-point group (name = subcommand, value = ``module:add_function``);
the evaluation harness (``craft-rag-bench``) registers ``demo``, ``bench`` and ``trace`` there.
Without it those names still parse and fail with one line saying what to install.

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
from importlib.metadata import entry_points
from typing import Any

from craft_rag.cli.replay import add_replay_parser
from craft_rag.cli_args import OneLineArgumentParser, describe_error, fail

USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, OSError, RuntimeError, ImportError)
"""Exceptions a subcommand raises for bad input or environment; anything else is a bug and
keeps its traceback."""

# (module, function) pairs of optional subcommands; a module whose dependencies are missing
# still gets a clear error when its subcommand runs, not at start-up.
_SUBCOMMANDS: tuple[tuple[str, str], ...] = (
    ("craft_rag.engine.cli_commands", "add_model_parser"),
    ("craft_rag.engine.backends.server.serve", "add_serve_parser"),
)

COMMANDS_GROUP = "craft_rag.commands"
"""Entry-point group other distributions use to add ``craft-rag`` subcommands."""

HARNESS_COMMANDS: tuple[str, ...] = ("demo", "bench", "trace")
"""Subcommands the evaluation harness provides; without it each fails with an install hint."""

HARNESS_MISSING = (
    "this command is part of the evaluation harness: install craft-rag-bench "
    "(pip install -e benchmarks/craft-rag-bench from a checkout, or run scripts/bootstrap.sh)"
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
    added = _add_plugin_commands(subparsers)
    for name in HARNESS_COMMANDS:
        if name not in added:
            _add_missing_command(subparsers, name)
    return parser


def _add_plugin_commands(subparsers: argparse._SubParsersAction[Any]) -> set[str]:
    """Register every ``craft_rag.commands`` entry point; returns the names added. A plugin
    whose import fails for a missing third-party module is skipped (its name then gets the
    install hint), so one broken extra never breaks the core commands."""
    added: set[str] = set()
    for point in sorted(entry_points(group=COMMANDS_GROUP), key=lambda p: p.name):
        if point.name in added or point.name in subparsers.choices:
            continue
        try:
            add = point.load()
        except ModuleNotFoundError:
            continue
        add(subparsers)
        added.add(point.name)
    return added


def _add_missing_command(subparsers: argparse._SubParsersAction[Any], name: str) -> None:
    """``name`` parses any arguments and exits 2 with :data:`HARNESS_MISSING`."""
    sub = subparsers.add_parser(
        name, add_help=False, help="(needs craft-rag-bench) " + name + " from the harness"
    )

    def missing(args: argparse.Namespace) -> int:
        return fail(name, HARNESS_MISSING)

    sub.set_defaults(func=missing, accepts_any_arguments=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``craft-rag`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status.
    Usage errors (argparse) print one line and raise ``SystemExit(2)`` as argparse does."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "accepts_any_arguments", False):
        parser.error("unrecognized arguments: " + " ".join(unknown))
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
