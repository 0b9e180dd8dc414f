"""Argument checks and error reporting shared by every ``craft-rag`` subcommand.

The contract of the command line for user errors (bad options, missing or unreadable files,
outputs that cannot be written, a wrong ``CRAFT_RAG_DATA``): exit status 2 and ONE line on
stderr, ``craft-rag <command>: error: <what> ...; <how to fix>``, no traceback, and no output
file created or changed. Numeric options are checked while parsing (before any work); outputs
are checked with :func:`check_output_file` / :func:`check_output_folder` before the expensive
part (embedding a corpus, starting an engine).
"""

from __future__ import annotations

import argparse
import errno
import math
import os
import secrets
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from craft_rag.files import check_writable

MAX_INT = 2**31 - 1
"""Upper bound of integer options: they reach C code (torch threads, vLLM, faiss) as C ints."""
MAX_SEED = 2**32 - 1


class OneLineArgumentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line on stderr (exit 2), naming the
    option and pointing at ``--help`` instead of printing the whole usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {one_line(message)}; see `{self.prog} --help`\n")


def int_range(low: int, high: int = MAX_INT) -> Callable[[str], int]:
    """An argparse ``type`` accepting a decimal int in ``[low, high]`` (bools, floats and
    words are refused: ``int("True")`` fails)."""

    def parse(text: str) -> int:
        try:
            value = int(text.strip(), 10)
        except ValueError:
            msg = f"expected an integer, got {text!r}"
            raise argparse.ArgumentTypeError(msg) from None
        if not low <= value <= high:
            msg = f"must be in [{low}, {high:,}], got {value}"
            raise argparse.ArgumentTypeError(msg)
        return value

    parse.__name__ = "int"  # argparse names the type in its own messages
    return parse


def float_range(low: float, high: float = math.inf) -> Callable[[str], float]:
    """An argparse ``type`` accepting a finite float in ``[low, high]`` (nan/inf refused)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            msg = f"expected a number, got {text!r}"
            raise argparse.ArgumentTypeError(msg) from None
        if not math.isfinite(value) or not low <= value <= high:
            bounds = f" in [{low}, {high}]" if math.isfinite(low) or math.isfinite(high) else ""
            msg = f"must be a finite number{bounds}, got {text}"
            raise argparse.ArgumentTypeError(msg)
        return value

    parse.__name__ = "float"
    return parse


positive_int = int_range(1)
non_negative_int = int_range(0)
seed_int = int_range(0, MAX_SEED)
probability = float_range(0.0, 1.0)
finite_float = float_range(-math.inf, math.inf)
"""Any finite float (nan and inf refused); the range is left to the config's own check."""


def one_line(text: str) -> str:
    """``text`` with every run of whitespace (newlines included) folded into one space."""
    return " ".join(str(text).split())


_OS_HINTS: dict[type[OSError], str] = {
    FileNotFoundError: "check the path",
    IsADirectoryError: "pass a file, not a folder",
    NotADirectoryError: "a part of the path is a file, not a folder",
    PermissionError: "check its permissions or choose another path",
    FileExistsError: "choose another path",
}


def describe_error(exc: BaseException) -> str:
    """One line saying what went wrong and, where known, how to fix it. ``OSError``s raised by
    the OS (they carry ``filename`` and ``strerror``) get a hint by type; our own messages
    already name the fix."""
    if isinstance(exc, OSError) and exc.strerror and exc.filename is not None:
        hint = next((h for t, h in _OS_HINTS.items() if isinstance(exc, t)), None)
        if exc.errno == errno.ENOSPC:
            hint = "free some space or choose another folder"
        text = f"{exc.filename}: {exc.strerror}" + (f"; {hint}" if hint else "")
    else:
        text = str(exc) or type(exc).__name__
    return one_line(text)


def fail(command: str, message: str) -> int:
    """Print the one-line error of ``craft-rag <command>`` and return exit status 2."""
    print(f"craft-rag {command}: error: {one_line(message)}", file=sys.stderr)
    return 2


def check_output_file(path: str | os.PathLike[str], option: str) -> Path:
    """Fail fast (``ValueError`` naming ``option``) if ``path`` cannot be written atomically;
    creates nothing. Call it before any expensive work."""
    try:
        target = check_writable(path)
        _probe(target.parent if str(target.parent) else Path("."))
    except OSError as e:
        text = describe_error(e)
        if isinstance(e, PermissionError) and ";" not in text:
            text += "; choose a writable location"
        msg = f"{option} {os.fspath(path) or repr('')}: {text}"
        raise ValueError(msg) from e
    return target


def _probe(folder: Path) -> None:
    """Create and remove a private temp file in ``folder``: the only writability test that
    holds for root, read-only mounts and ACLs alike (``os.access`` says yes to root)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    probe = folder / f".craft-rag-probe-{secrets.token_hex(8)}.tmp"
    fd = os.open(probe, flags, 0o600)
    os.close(fd)
    os.unlink(probe)


def check_output_folder(path: str | os.PathLike[str], option: str) -> Path:
    """Fail fast if ``path`` cannot be the results folder (a file is in the way, or it or the
    nearest existing parent is not writable); creates nothing. ``ValueError`` naming
    ``option``."""
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        msg = f"{option} {folder} is a file, not a folder; pass a folder path"
        raise ValueError(msg)
    existing = folder
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        msg = f"{option} {folder}: {existing} is a file, not a folder; pass a folder path"
        raise ValueError(msg)
    try:
        if not os.access(existing, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, "not writable", str(existing))
        _probe(existing)
    except OSError as e:
        msg = f"{option} {folder}: {describe_error(e)}"
        raise ValueError(msg) from e
    return folder


def check_input_file(path: str | os.PathLike[str], option: str) -> Path:
    """Fail fast if ``path`` is not a readable regular file (``ValueError`` naming ``option``):
    a folder, a fifo or a device would fail late, block or never end."""
    target = Path(path)
    if not os.fspath(path):
        msg = f"{option}: empty path; pass a trace file"
        raise ValueError(msg)
    if not target.exists():
        msg = f"{option} {target}: no such file; check the path"
        raise ValueError(msg)
    if target.is_dir():
        msg = f"{option} {target} is a folder; pass a trace file (JSON lines)"
        raise ValueError(msg)
    if not target.is_file():
        msg = f"{option} {target} is not a regular file (a fifo or device); save it to a file"
        raise ValueError(msg)
    if not os.access(target, os.R_OK):
        msg = f"{option} {target} is not readable; check its permissions"
        raise ValueError(msg)
    return target
