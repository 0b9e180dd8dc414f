"""The file behind a ``sqlite://`` store: path checks before SQLite sees it, and what an
SQLite error while opening or writing means for the user.

Nothing here ever advises discarding a store that may hold good state: a read-only file, a
folder without write access or a path that is a directory are named as such (fix the
permissions or the URL); only a file SQLite itself reports as "not a database" or "malformed"
is called damaged, and even then the advice is to restore or start on a new path, never to
delete. Checks run once per open (a few ``stat`` calls), never on the read or commit path.
"""

from __future__ import annotations

import errno
import os
import sqlite3
import stat
from pathlib import Path

from craft_rag.stores.base import StoreCorrupted, StoreError, StoreUnavailable

_WAL_NOTE = "SQLite creates its -wal and -shm files beside it, so its folder must be writable too"


def _shown(path: Path) -> str:
    text = str(path)
    return repr(text if len(text) <= 200 else text[:197] + "...")


def prepare_store_file(path: Path) -> None:
    """Check ``path`` and create it empty with mode 0600 when missing. ``ValueError`` naming
    the path for one that cannot be a store file (a symlink, a directory, a device or FIFO, a
    missing or non-folder parent, a NUL byte, a name too long); :class:`StoreUnavailable`
    when this process may not create or write it (permissions, read-only file system)."""
    shown = _shown(path)
    if "\x00" in str(path):
        raise ValueError(f"SQLite store path {shown} contains a NUL byte")
    try:
        info = path.lstat()
    except FileNotFoundError:
        info = None
    except OSError as e:
        raise _path_error(path, e) from None
    if info is not None:
        if stat.S_ISLNK(info.st_mode):
            msg = f"SQLite store path {shown} is a symlink; point the store URL at the real file"
            raise ValueError(msg)
        if stat.S_ISDIR(info.st_mode):
            msg = (
                f"SQLite store path {shown} is a directory; name a file in it, e.g. "
                f"sqlite://{path / 'state.db'}"
            )
            raise ValueError(msg)
        if not stat.S_ISREG(info.st_mode):
            msg = f"SQLite store path {shown} is not a regular file (a device, FIFO or socket)"
            raise ValueError(msg)
        sidecars = all(os.access(f"{path}{x}", os.W_OK) for x in ("-wal", "-shm"))
        if not os.access(path, os.R_OK | os.W_OK) or not (
            sidecars or os.access(path.parent, os.W_OK)
        ):
            raise read_only(path, None)
        return
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o600)
    except FileExistsError:  # created by another worker just now
        return
    except OSError as e:
        raise _path_error(path, e) from None
    os.close(fd)


def _path_error(path: Path, error: OSError) -> ValueError | StoreUnavailable:
    shown = _shown(path)
    if error.errno == errno.ENOENT:
        folder = _shown(path.parent)
        return ValueError(f"SQLite store folder {folder} does not exist; create it first")
    if error.errno == errno.ENOTDIR:
        return ValueError(f"SQLite store path {shown}: a parent of it is a file, not a folder")
    if error.errno == errno.ENAMETOOLONG:
        return ValueError(f"SQLite store path {shown} is too long for the file system")
    if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return read_only(path, error)
    return StoreUnavailable(f"SQLite store path {shown} cannot be used ({error.strerror})")


def read_only(path: Path, error: BaseException | None) -> StoreUnavailable:
    """The error for a store this process may not write (its data is intact)."""
    why = f" ({error})" if error is not None else ""
    msg = (
        f"SQLite store {_shown(path)} is read-only for this process{why}: workers append to "
        f"it, so make the file writable by this user ({_WAL_NOTE}); its data was not changed"
    )
    return StoreUnavailable(msg)


def open_error(
    path: Path, url: str, error: sqlite3.DatabaseError, busy_timeout_ms: int
) -> StoreError:
    """What ``error`` (raised while opening ``path``) means, with the fix."""
    name = getattr(error, "sqlite_errorname", "") or ""
    if is_locked(error):
        msg = (
            f"store {url} stayed locked by another process for {busy_timeout_ms} ms while "
            "opening; raise ?busy_timeout_ms= or check for a hung worker"
        )
        return StoreUnavailable(msg)
    if name.startswith("SQLITE_READONLY") or name.startswith("SQLITE_PERM"):
        return read_only(path, error)
    if name.startswith("SQLITE_CANTOPEN") or name.startswith("SQLITE_IOERR"):
        msg = (
            f"store {url} cannot be opened ({error}): check that the path is a file this "
            f"user may read and write ({_WAL_NOTE})"
        )
        return StoreUnavailable(msg)
    return damaged(url, error)


def damaged(url: str, error: sqlite3.DatabaseError) -> StoreCorrupted:
    """A file SQLite cannot read as a database (not SQLite, or damaged)."""
    msg = (
        f"store {url} is not a readable SQLite database ({error}): check the path in the URL "
        "(this file was not changed); if it is the store, restore it from a backup or try "
        "sqlite3's .recover; to start afresh, name a new file"
    )
    return StoreCorrupted(msg)


def write_error(url: str, error: sqlite3.OperationalError) -> StoreError | None:
    """The error for a failed write inside a transaction (None: not a file problem)."""
    name = getattr(error, "sqlite_errorname", "") or ""
    if name.startswith("SQLITE_READONLY"):
        msg = (
            f"store {url} became read-only for this process ({error}): make it writable "
            f"again ({_WAL_NOTE}); its data was not changed"
        )
        return StoreUnavailable(msg)
    if name.startswith(("SQLITE_IOERR", "SQLITE_FULL", "SQLITE_CANTOPEN")):
        return StoreUnavailable(f"store {url} could not be written ({error}); check the disk")
    return None


def foreign_tables(conn: sqlite3.Connection) -> list[str]:
    """Tables of another program in a database without craft-rag's (craft-rag never adds its
    tables to another program's database)."""
    names = [str(r[0]) for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")]
    if "craft_meta" in names:
        return []
    return [n for n in names if not n.startswith(("craft_", "sqlite_"))]


def is_locked(error: sqlite3.DatabaseError) -> bool:
    """SQLite's "another connection holds the lock" (retryable), as opposed to a bad file."""
    text = str(error)
    return isinstance(error, sqlite3.OperationalError) and ("locked" in text or "busy" in text)
