"""Store faults: Redis down (error or explicit fallback), SQLite after SIGKILL mid-commit,
corrupted or version-mismatched stores, bad URLs."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import sqlite3
import stat
import time
from pathlib import Path

import pytest
import store_workers

from craft_rag import CraftPlanner, PlannerConfig, make_chunk
from craft_rag.stores import (
    StoreCorrupted,
    StoreUnavailable,
    check_namespace,
    namespace_for_salt,
    open_store,
)
from craft_rag.stores.local_redis import free_port, local_redis
from craft_rag.stores.sqlite_store import SQLiteStore

CHUNKS = [make_chunk(f"t{i}", id=f"doc-{i}", num_tokens=8) for i in range(6)]


# ---- Redis down ----------------------------------------------------------------------------


def test_unreachable_redis_is_a_connection_error_naming_the_url_and_fix() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0?timeout_ms=300"
    with pytest.raises(StoreUnavailable) as info:
        CraftPlanner(store=url)
    assert isinstance(info.value, ConnectionError)
    text = str(info.value)
    assert f"127.0.0.1:{url.split(':')[2].split('/')[0]}/0" in text
    assert "redis-server" in text and "fallback=memory" in text


def test_fallback_to_local_state_is_explicit_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0?timeout_ms=300&fallback=memory"
    with caplog.at_level(logging.WARNING):
        planner = CraftPlanner(store=url)
    assert planner.store is None and planner.store_fallback is not None
    assert any("LOCAL state" in r.message for r in caplog.records)
    planner.commit(planner.plan(CHUNKS[:3], "chat"))
    assert planner.plan(CHUNKS[:4], "chat2").turn == 1
    assert planner.access_table.count(CHUNKS[0].key) == 1


def test_redis_dying_mid_run_raises_or_falls_back_keeping_state() -> None:
    with local_redis() as url:
        strict = CraftPlanner(store=url + "?timeout_ms=300")
        lenient = CraftPlanner(store=url + "?timeout_ms=300&fallback=memory", namespace="b")
        for planner in (strict, lenient):
            planner.commit(planner.plan(CHUNKS[:3]))
    # The server is stopped now.
    with pytest.raises(StoreUnavailable, match="cannot reach Redis"):
        strict.plan(CHUNKS[:3])
    plan = lenient.plan(CHUNKS[:3])
    assert lenient.store is None and plan.matched_chunks == 3  # state kept
    lenient.commit(plan)
    assert lenient.access_table.count(CHUNKS[0].key) == 2


# ---- SQLite: SIGKILL mid-commit ----------------------------------------------------------------


def test_sqlite_survives_sigkill_of_the_writer(tmp_path: Path) -> None:
    url = f"sqlite://{tmp_path / 'state.db'}"
    ctx = mp.get_context("spawn")
    for round_ in range(3):
        ready = ctx.Event()
        child = ctx.Process(target=store_workers.commit_forever, args=(url, ready))
        child.start()
        assert ready.wait(60), "writer did not start committing"
        time.sleep(0.05 * (round_ + 1))
        os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
        child.join(10)
        assert child.exitcode == -signal.SIGKILL
    store = SQLiteStore(tmp_path / "state.db")
    assert store.integrity_check() == "ok"
    read = store.read("default", 0)
    assert read.head >= 60 and [e.seq for e in read.entries] == list(range(1, read.head + 1))
    planner = CraftPlanner(store_workers.CONFIG, store=store)
    planner._check_invariants()
    # The reopened planner serves on from the same log.
    store_workers.serve(planner, [1, 2, 3], "chat-0", None)
    assert store.read("default", 0).head == read.head + 1


# ---- corrupted / foreign stores --------------------------------------------------------------


def test_sqlite_format_mismatch_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    SQLiteStore(path).close()
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE craft_meta SET value = 'craft-rag/store/v0' WHERE key = 'format'")
    with pytest.raises(StoreCorrupted, match=r"format 'craft-rag/store/v0'.*new file"):
        open_store(f"sqlite://{path}")


def test_a_file_that_is_not_a_database_is_refused_untouched(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    path.write_bytes(b"not a database at all" * 100)
    with pytest.raises(StoreCorrupted, match=r"not a readable SQLite database.*was not changed"):
        open_store(f"sqlite://{path}")
    assert path.read_bytes() == b"not a database at all" * 100


def test_redis_format_mismatch_and_foreign_keys_are_refused(redis_url: str) -> None:
    import redis

    client = redis.Redis.from_url(redis_url)
    client.set("craft-rag:format", "craft-rag/store/v0")
    with pytest.raises(StoreCorrupted, match="format 'craft-rag/store/v0'"):
        CraftPlanner(store=redis_url)
    client.flushdb()
    client.hset("craft-rag:{default}:head", "x", "1")
    with pytest.raises(StoreCorrupted, match="keys craft-rag cannot use"):
        CraftPlanner(store=redis_url)
    client.close()


# ---- URLs and files ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("postgres://x/y", r"unknown store scheme 'postgres'.*\['memory', 'redis', 'rediss', "),
        ("state.db", "supported schemes"),
        ("memory://somewhere", "takes no host or path"),
        ("memory://?snapshot_every=0", "snapshot_every must be a positive integer"),
        ("memory://?color=red", "unknown or repeated option 'color'"),
        ("sqlite://", "names no file"),
        ("sqlite:///tmp/x.db?synchronous=sometimes", "synchronous must be"),
        ("redis://127.0.0.1:6379/0?fallback=disk", "fallback must be 'memory'"),
    ],
)
def test_bad_urls_name_the_fix(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        open_store(url)


def test_sqlite_files_are_private_and_symlinks_refused(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    planner = CraftPlanner(store=f"sqlite://{path}")
    planner.commit(planner.plan(CHUNKS[:2]))
    for name in ("state.db", "state.db-wal", "state.db-shm"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600, name
    link = tmp_path / "link.db"
    link.symlink_to(path)
    with pytest.raises(ValueError, match="is a symlink"):
        open_store(f"sqlite://{link}")
    with pytest.raises(ValueError, match="does not exist; create it first"):
        open_store(f"sqlite://{tmp_path / 'missing' / 'state.db'}")


def test_namespaces_are_checked_and_salt_namespaces_are_digests() -> None:
    with pytest.raises(ValueError, match="namespace_for_salt"):
        check_namespace("tenant/../x")
    a, b = namespace_for_salt("tenant-a"), namespace_for_salt("tenant-b")
    assert a != b and check_namespace(a) == a and "tenant" not in a
    assert namespace_for_salt(None) == "default"


def test_config_validation_still_applies_with_a_store() -> None:
    with pytest.raises(ValueError):
        CraftPlanner(PlannerConfig(window=0), store="memory://")


def test_a_new_sqlite_store_locked_while_opening_waits_then_opens(tmp_path: Path) -> None:
    """Opening switches a new file to WAL, which needs an exclusive lock; another process holding
    it (e.g. a second worker opening the same new file) is waited on up to busy_timeout_ms."""
    import sqlite3
    import threading

    from craft_rag.stores.sqlite_store import SQLiteStore

    path = tmp_path / "new.db"
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN EXCLUSIVE")
    release = threading.Timer(0.3, lambda: holder.execute("COMMIT"))
    release.start()
    try:
        store = SQLiteStore(path, busy_timeout_ms=5000)
    finally:
        release.join()
        holder.close()
    store.close()


def test_a_sqlite_store_locked_past_the_timeout_while_opening_is_unavailable_not_corrupt(
    tmp_path: Path,
) -> None:
    import sqlite3

    from craft_rag.stores import StoreUnavailable
    from craft_rag.stores.sqlite_store import SQLiteStore

    path = tmp_path / "held.db"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(StoreUnavailable, match="busy_timeout_ms"):
            SQLiteStore(path, busy_timeout_ms=200)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert path.exists()
