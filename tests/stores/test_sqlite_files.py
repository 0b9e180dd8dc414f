"""The file behind a ``sqlite://`` store: every path shape gets a clear error naming the path
(ValueError for a path that cannot be a store, StoreUnavailable for one this process may not
write, StoreCorrupted for a file that is not a craft-rag store), never a raw ``OSError`` or
``sqlite3`` error, and never advice to throw away a store that holds good state. Each file
involved is left byte-for-byte unchanged."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from craft_rag import CraftPlanner, make_chunk
from craft_rag.stores import StoreCorrupted, StoreUnavailable, open_store

CHUNKS = [make_chunk(f"t{i}", id=f"doc-{i}", num_tokens=8) for i in range(4)]
DISCARD_ADVICE = ("move the file away", "start with a new one", "use a fresh file")


def _seed(path: Path) -> None:
    planner = CraftPlanner(store=f"sqlite://{path}")
    planner.commit(planner.plan(CHUNKS[:2], "chat"))
    assert planner.store is not None
    planner.store.close()


def _open_and_commit(path: str) -> None:
    planner = CraftPlanner(store=f"sqlite://{path}")
    planner.commit(planner.plan(CHUNKS[1:3]))


@contextmanager
def _readonly(target: Path) -> Iterator[None]:
    """``target`` read-only even for root (``chattr +i``) or by mode for other users."""
    if os.geteuid() != 0:
        mode = target.stat().st_mode
        target.chmod(0o555 if target.is_dir() else 0o444)
        try:
            yield
        finally:
            target.chmod(mode)
        return
    if shutil.which("chattr") is None:
        pytest.skip("running as root without chattr: cannot make a file read-only")
    done = subprocess.run(["chattr", "+i", str(target)], capture_output=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"chattr +i is not supported here: {done.stderr.decode()[:200]}")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(target)], check=True)


def _snapshot_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


@pytest.mark.parametrize("what", ["file", "folder"])
def test_a_read_only_store_is_named_read_only_and_kept(tmp_path: Path, what: str) -> None:
    folder = tmp_path / "data"
    folder.mkdir()
    path = folder / "state.db"
    _seed(path)
    before = _snapshot_files(folder)
    target = path if what == "file" else folder
    with _readonly(target), pytest.raises(StoreUnavailable) as info:
        _open_and_commit(str(path))
    text = str(info.value)
    assert "read-only" in text and str(path) in text and "not changed" in text, text
    assert not any(advice in text for advice in DISCARD_ADVICE), text
    assert _snapshot_files(folder) == before
    _open_and_commit(str(path))  # writable again: the state is all there
    store = open_store(f"sqlite://{path}")
    assert store.read("default", 0).head == 2
    store.close()


def _bad_path(tmp_path: Path, shape: str) -> str:
    if shape == "directory":
        (tmp_path / "dir.db").mkdir()
        return str(tmp_path / "dir.db")
    if shape == "directory with a slash":
        (tmp_path / "dir.db").mkdir()
        return str(tmp_path / "dir.db") + "/"
    if shape == "missing parent":
        return str(tmp_path / "nope" / "state.db")
    if shape == "parent is a file":
        (tmp_path / "file").write_text("x")
        return str(tmp_path / "file" / "state.db")
    if shape == "symlink":
        (tmp_path / "real.db").write_bytes(b"")
        (tmp_path / "link.db").symlink_to(tmp_path / "real.db")
        return str(tmp_path / "link.db")
    if shape == "dangling symlink":
        (tmp_path / "link.db").symlink_to(tmp_path / "gone.db")
        return str(tmp_path / "link.db")
    if shape == "fifo":
        os.mkfifo(tmp_path / "fifo.db")
        return str(tmp_path / "fifo.db")
    if shape == "device":
        return "/dev/null"
    if shape == "NUL byte":
        return str(tmp_path / "a\x00b.db")
    if shape == "name too long":
        return str(tmp_path / ("x" * 300 + ".db"))
    if shape == "path too long":
        return str(tmp_path / "/".join(["y" * 200] * 30))
    raise AssertionError(shape)


@pytest.mark.parametrize(
    ("shape", "names"),
    [
        ("directory", "is a directory"),
        ("directory with a slash", "is a directory"),
        ("missing parent", "does not exist; create it first"),
        ("parent is a file", "not a folder"),
        ("symlink", "is a symlink"),
        ("dangling symlink", "is a symlink"),
        ("fifo", "not a regular file"),
        ("device", "not a regular file"),
        ("NUL byte", "NUL byte"),
        ("name too long", "too long"),
        ("path too long", "too long|does not exist"),
    ],
)
def test_paths_that_cannot_be_a_store_are_a_clear_value_error(
    tmp_path: Path, shape: str, names: str
) -> None:
    path = _bad_path(tmp_path, shape)
    with pytest.raises(ValueError, match=names) as info:
        _open_and_commit(path)
    assert not isinstance(info.value, StoreCorrupted)
    assert "SQLite store" in str(info.value)


@pytest.mark.parametrize(
    ("content", "names"),
    [
        (b"not a database at all" * 100, "not a readable SQLite database"),
        (b"SQLite format 3\x00" + b"\xff" * 4000, "not a readable SQLite database"),
    ],
)
def test_a_file_that_is_not_sqlite_is_corrupted_and_untouched(
    tmp_path: Path, content: bytes, names: str
) -> None:
    path = tmp_path / "state.db"
    path.write_bytes(content)
    with pytest.raises(StoreCorrupted, match=names) as info:
        _open_and_commit(str(path))
    assert "was not changed" in str(info.value)
    assert not any(advice in str(info.value) for advice in DISCARD_ADVICE)
    assert path.read_bytes() == content


def test_a_truncated_store_is_corrupted_and_untouched(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    _seed(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2 + 100])
    with pytest.raises(StoreCorrupted, match="not a readable SQLite database"):
        _open_and_commit(str(path))
    assert path.read_bytes() == data[: len(data) // 2 + 100]


def test_another_programs_database_is_refused_untouched(tmp_path: Path) -> None:
    path = tmp_path / "app.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE users(id INTEGER, name TEXT)")
        conn.execute("INSERT INTO users VALUES (1, 'a')")
    conn.close()
    before = path.read_bytes()
    with pytest.raises(StoreCorrupted, match=r"another program's SQLite database.*users"):
        _open_and_commit(str(path))
    assert path.read_bytes() == before


def test_an_empty_file_is_a_new_store(tmp_path: Path) -> None:
    """An empty file (e.g. left by an open that was interrupted) is a new, empty store."""
    path = tmp_path / "state.db"
    path.write_bytes(b"")
    _open_and_commit(str(path))
    store = open_store(f"sqlite://{path}")
    assert store.read("default", 0).head == 1
    store.close()
