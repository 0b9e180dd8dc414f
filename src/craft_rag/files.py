"""The one way craft-rag writes a file: atomically, privately, never through a symlink.

Every file the project writes (planner state, traces, bench JSON and reports, model manifests)
goes through :func:`atomic_writer` / :func:`write_atomic`:

- the data goes to a fresh temp file in the target's own folder, created with
  ``O_CREAT | O_EXCL | O_NOFOLLOW`` and mode ``0600`` (a pre-existing ``<path>.tmp`` or a symlink
  planted there is never opened, followed or clobbered);
- it is flushed and ``fsync``-ed, then ``os.replace``-d over the target, so readers see either the
  old file or the whole new one, and concurrent writers of one path each install a complete file
  (last one wins);
- on any failure the temp file is removed and the target is untouched.

The target itself may not be a directory (``IsADirectoryError``, checked before any work) and a
symlink at the target is replaced by the new file, not followed.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import IO

PRIVATE_MODE = 0o600


def check_writable(path: str | os.PathLike[str]) -> Path:
    """Fail early, before expensive work, if ``path`` cannot be written by :func:`write_atomic`.

    Raises ``IsADirectoryError`` (the path is a folder), ``FileNotFoundError`` (its folder is
    missing) or ``PermissionError`` (the folder is not writable). Creates nothing. Cost: two stats.
    """
    target = Path(path)
    if target.is_dir():
        msg = f"{target} is a directory; pass a file path"
        raise IsADirectoryError(msg)
    folder = target.parent if str(target.parent) else Path(".")
    if not folder.is_dir():
        msg = f"folder {folder} does not exist; create it first"
        raise FileNotFoundError(msg)
    if not os.access(folder, os.W_OK | os.X_OK):
        msg = f"folder {folder} is not writable"
        raise PermissionError(msg)
    return target


@contextlib.contextmanager
def atomic_writer(
    path: str | os.PathLike[str], *, binary: bool = False, mode: int = PRIVATE_MODE
) -> Iterator[IO[str] | IO[bytes]]:
    """Yield a handle on a private temp file that replaces ``path`` when the block exits cleanly.

    Side effects: creates and renames one file in ``path``'s folder; on an exception the temp
    file is deleted and ``path`` is unchanged. Text handles are UTF-8.
    """
    target = check_writable(path)
    folder = target.parent if str(target.parent) else Path(".")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    flags |= getattr(os, "O_CLOEXEC", 0)
    while True:
        tmp = folder / f".{target.name}.{secrets.token_hex(8)}.tmp"
        try:
            fd = os.open(tmp, flags, mode)
        except FileExistsError:  # pragma: no cover - 64 random bits collided
            continue
        break
    try:
        handle: IO[str] | IO[bytes] = (
            os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8", newline="")
        )
        with handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_folder(folder)


def write_atomic(
    path: str | os.PathLike[str], data: str | bytes, *, mode: int = PRIVATE_MODE
) -> Path:
    """Write ``data`` to ``path`` atomically with permissions ``mode`` (default 0600).

    Returns the target path. Cost: one temp file, one fsync, one rename.
    """
    binary = isinstance(data, bytes)
    with atomic_writer(path, binary=binary, mode=mode) as handle:
        handle.write(data)  # type: ignore[arg-type]
    return Path(path)


def _fsync_folder(folder: Path) -> None:
    """Make the rename durable; best effort (some filesystems refuse directory fsync)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # pragma: no cover - platform without directory fds
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)
