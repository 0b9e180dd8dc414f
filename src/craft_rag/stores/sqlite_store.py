"""``sqlite:///path/state.db``: the store in one SQLite file, shared by processes on one host.

- WAL journal: readers never block the writer; each ``append`` is one ``BEGIN IMMEDIATE``
  transaction (check the conversation, add the entry, update the record), so two workers never
  get the same ``seq`` and a conversation never gets two turns from one plan.
- Durability: a SIGKILLed process leaves the file intact (a transaction is in the file whole or
  not at all; tested). ``synchronous=NORMAL`` (default) may lose the last commits on power loss,
  never corrupt; ``?synchronous=full`` fsyncs each commit (slower, ~ms on disks).
- The file (and SQLite's ``-wal``/``-shm`` files, which copy its mode) is created ``0600``;
  a symlink at the path is refused. The path is the caller's configuration, never chunk text.
- A busy database (another process mid-transaction) is waited on up to ``busy_timeout_ms``
  (default 5,000 ms), then :class:`StoreUnavailable`.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from craft_rag.stores.base import (
    DEFAULT_SNAPSHOT_EVERY,
    STORE_FORMAT,
    TOKEN_VOID_TTL_S,
    CommitVoided,
    ConversationConflict,
    HistoryRecord,
    LogEntry,
    Snapshot,
    StateStore,
    StoreCorrupted,
    StoreUnavailable,
    check_namespace,
    conflict_message,
    parse_options,
    positive_int_option,
)

_OPTIONS = {
    "snapshot_every": "commits between snapshots; the log keeps up to twice that",
    "synchronous": "normal (default) or full (fsync every commit)",
    "busy_timeout_ms": "how long to wait for another process's transaction (default 5000)",
}

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS craft_meta(ns TEXT NOT NULL, key TEXT NOT NULL, "
    "value TEXT NOT NULL, PRIMARY KEY (ns, key)) WITHOUT ROWID",
    "CREATE TABLE IF NOT EXISTS craft_head(ns TEXT PRIMARY KEY, seq INTEGER NOT NULL) "
    "WITHOUT ROWID",
    "CREATE TABLE IF NOT EXISTS craft_log(ns TEXT NOT NULL, seq INTEGER NOT NULL, "
    "entry TEXT NOT NULL, PRIMARY KEY (ns, seq)) WITHOUT ROWID",
    "CREATE TABLE IF NOT EXISTS craft_conv(ns TEXT NOT NULL, id TEXT NOT NULL, "
    "last_seq INTEGER NOT NULL, expires REAL, PRIMARY KEY (ns, id)) WITHOUT ROWID",
    "CREATE TABLE IF NOT EXISTS craft_history(ns TEXT NOT NULL, id TEXT NOT NULL, "
    "version INTEGER NOT NULL, data TEXT NOT NULL, expires REAL, PRIMARY KEY (ns, id)) "
    "WITHOUT ROWID",
    "CREATE TABLE IF NOT EXISTS craft_snapshot(ns TEXT PRIMARY KEY, seq INTEGER NOT NULL, "
    "state TEXT NOT NULL) WITHOUT ROWID",
    # append token -> its entry's seq (trimmed with the log), or 0: settled as never written
    # (expires: when that void ends).
    "CREATE TABLE IF NOT EXISTS craft_token(ns TEXT NOT NULL, token TEXT NOT NULL, "
    "seq INTEGER NOT NULL, expires REAL, PRIMARY KEY (ns, token)) WITHOUT ROWID",
)


def _create_private(path: Path) -> None:
    """Create ``path`` empty with mode 0600 unless it exists; refuse a symlink there."""
    if path.is_symlink():
        msg = f"SQLite store path {path} is a symlink; point the store URL at the real file"
        raise ValueError(msg)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return
    except FileNotFoundError:
        msg = f"SQLite store folder {path.parent} does not exist; create it first"
        raise ValueError(msg) from None
    os.close(fd)


class SQLiteStore(StateStore):
    """Store in one SQLite file (WAL). Thread-safe (one connection per instance, under a
    lock); safe across processes (SQLite's file locks). Each call is one transaction."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        snapshot_every: int = DEFAULT_SNAPSHOT_EVERY,
        synchronous: str = "normal",
        busy_timeout_ms: int = 5000,
        clock: Callable[[], float] = time.time,
        url: str | None = None,
    ) -> None:
        if synchronous not in ("normal", "full"):
            msg = f"synchronous must be 'normal' or 'full', got {synchronous!r}"
            raise ValueError(msg)
        self.path = Path(path)
        self.url = url or f"sqlite://{self.path}"
        self.snapshot_every = snapshot_every
        self._clock = clock
        self._lock = threading.Lock()
        _create_private(self.path)
        self._conn = sqlite3.connect(
            self.path, timeout=busy_timeout_ms / 1000, isolation_level=None,
            check_same_thread=False,
        )
        try:
            _enable_wal(self._conn, busy_timeout_ms / 1000)
            self._conn.execute(f"PRAGMA synchronous={synchronous.upper()}")
            with self._transaction() as cur:
                for statement in _SCHEMA:
                    cur.execute(statement)
                row = cur.execute(
                    "SELECT value FROM craft_meta WHERE ns = '' AND key = 'format'"
                ).fetchone()
                if row is None:
                    cur.execute(
                        "INSERT INTO craft_meta VALUES ('', 'format', ?)", (STORE_FORMAT,)
                    )
                elif row[0] != STORE_FORMAT:
                    msg = (
                        f"store {self.url} has format {row[0]!r}, this craft-rag reads "
                        f"{STORE_FORMAT!r}; use a new file (or move this one away)"
                    )
                    raise StoreCorrupted(msg)
        except sqlite3.DatabaseError as e:
            self._conn.close()
            if _is_locked(e):
                msg = (
                    f"store {self.url} stayed locked by another process for "
                    f"{busy_timeout_ms} ms while opening; raise ?busy_timeout_ms= or check "
                    "for a hung worker"
                )
                raise StoreUnavailable(msg) from e
            msg = (
                f"store {self.url} is not a readable craft-rag SQLite store ({e}); move the "
                "file away and start with a new one"
            )
            raise StoreCorrupted(msg) from e
        except BaseException:
            self._conn.close()
            raise

    @classmethod
    def from_url(cls, url: str) -> SQLiteStore:
        rest = url[len("sqlite://") :]
        path, _, query = rest.partition("?")
        if not path:
            msg = f"store URL {url!r} names no file; use sqlite:///absolute/path/state.db"
            raise ValueError(msg)
        options = parse_options(url, query, _OPTIONS)
        return cls(
            path,
            snapshot_every=positive_int_option(
                url, options, "snapshot_every", DEFAULT_SNAPSHOT_EVERY
            ),
            synchronous=options.get("synchronous", "normal"),
            busy_timeout_ms=positive_int_option(url, options, "busy_timeout_ms", 5000),
            url=url.split("?", 1)[0],
        )

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Cursor]:
        """One ``BEGIN IMMEDIATE`` transaction under the instance lock; SQLite errors become
        :class:`StoreUnavailable` (busy) or :class:`StoreCorrupted` (not a database)."""
        with self._lock:
            cur = self._conn.cursor()
            try:
                cur.execute("BEGIN IMMEDIATE")
                try:
                    yield cur
                except BaseException:
                    cur.execute("ROLLBACK")
                    raise
                cur.execute("COMMIT")
            except sqlite3.OperationalError as e:
                if _is_locked(e):
                    msg = (
                        f"store {self.url} stayed locked by another process ({e}); raise "
                        "?busy_timeout_ms= or check for a hung worker"
                    )
                    raise StoreUnavailable(msg) from e
                raise StoreCorrupted(f"store {self.url}: {e}; use a fresh file") from e
            except sqlite3.DatabaseError as e:
                msg = (
                    f"store {self.url} is not a readable craft-rag SQLite store ({e}); move the "
                    "file away and start with a new one"
                )
                raise StoreCorrupted(msg) from e
            finally:
                cur.close()

    def attach(self, namespace: str, fingerprint: str) -> None:
        check_namespace(namespace)
        with self._transaction() as cur:
            row = cur.execute(
                "SELECT value FROM craft_meta WHERE ns = ? AND key = 'fingerprint'", (namespace,)
            ).fetchone()
            if row is None:
                cur.execute(
                    "INSERT INTO craft_meta VALUES (?, 'fingerprint', ?)", (namespace, fingerprint)
                )
                cur.execute("INSERT OR IGNORE INTO craft_head VALUES (?, 0)", (namespace,))
            elif row[0] != fingerprint:
                raise self._fingerprint_mismatch(namespace, row[0])

    @staticmethod
    def _head_and_after(
        cur: sqlite3.Cursor, namespace: str, since: int
    ) -> tuple[int, list[LogEntry]]:
        row = cur.execute("SELECT seq FROM craft_head WHERE ns = ?", (namespace,)).fetchone()
        head = int(row[0]) if row is not None else 0
        rows = cur.execute(
            "SELECT seq, entry FROM craft_log WHERE ns = ? AND seq > ? ORDER BY seq",
            (namespace, since),
        ).fetchall()
        return head, [LogEntry(int(seq), str(entry)) for seq, entry in rows]

    def _range(self, namespace: str, since: int) -> tuple[int, list[LogEntry]]:
        # A read transaction (deferred would do; IMMEDIATE keeps one code path and is cheap
        # in WAL mode, where it never blocks readers).
        with self._lock:
            try:
                cur = self._conn.cursor()
                try:
                    cur.execute("BEGIN")
                    try:
                        return self._head_and_after(cur, namespace, since)
                    finally:
                        cur.execute("COMMIT")
                finally:
                    cur.close()
            except sqlite3.DatabaseError as e:
                msg = f"store {self.url} could not be read ({e}); move the file away"
                raise StoreCorrupted(msg) from e

    def _append(
        self,
        namespace: str,
        data: str,
        since: int,
        conversation: str | None,
        not_after: int | None,
        ttl_s: float | None,
        token: str | None = None,
    ) -> tuple[int, list[LogEntry]]:
        now = self._clock()
        with self._transaction() as cur:
            if token is not None:
                row = cur.execute(
                    "SELECT seq, expires FROM craft_token WHERE ns = ? AND token = ?",
                    (namespace, token),
                ).fetchone()
                if row is not None and row[0] == 0 and row[1] > now:
                    raise CommitVoided(f"append {token!r} was settled as not written")
            if conversation is not None and not_after is not None:
                row = cur.execute(
                    "SELECT last_seq, expires FROM craft_conv WHERE ns = ? AND id = ?",
                    (namespace, conversation),
                ).fetchone()
                if row is not None and (row[1] is None or row[1] > now) and row[0] > not_after:
                    raise ConversationConflict(conflict_message(conversation, row[0], not_after))
            cur.execute(
                "INSERT INTO craft_head VALUES (?, 1) "
                "ON CONFLICT(ns) DO UPDATE SET seq = seq + 1",
                (namespace,),
            )
            seq = int(
                cur.execute("SELECT seq FROM craft_head WHERE ns = ?", (namespace,)).fetchone()[0]
            )
            cur.execute("INSERT INTO craft_log VALUES (?, ?, ?)", (namespace, seq, data))
            if token is not None:
                cur.execute(
                    "INSERT OR REPLACE INTO craft_token VALUES (?, ?, ?, NULL)",
                    (namespace, token, seq),
                )
            if conversation is not None:
                expires = now + ttl_s if ttl_s is not None else None
                cur.execute(
                    "INSERT OR REPLACE INTO craft_conv VALUES (?, ?, ?, ?)",
                    (namespace, conversation, seq, expires),
                )
                if seq % 1024 == 0:
                    for table in ("craft_conv", "craft_history"):
                        cur.execute(
                            f"DELETE FROM {table} WHERE ns = ? AND expires <= ?", (namespace, now)
                        )
            return self._head_and_after(cur, namespace, since)

    def settle(self, namespace: str, token: str) -> int:
        now = self._clock()
        with self._transaction() as cur:
            row = cur.execute(
                "SELECT seq FROM craft_token WHERE ns = ? AND token = ?", (namespace, token)
            ).fetchone()
            if row is not None and row[0] > 0:
                return int(row[0])
            cur.execute(
                "DELETE FROM craft_token WHERE ns = ? AND seq = 0 AND expires <= ?",
                (namespace, now),
            )
            cur.execute(
                "INSERT OR REPLACE INTO craft_token VALUES (?, ?, 0, ?)",
                (namespace, token, now + TOKEN_VOID_TTL_S),
            )
            return 0

    def put_history(
        self, namespace: str, conversation: str, version: int, data: str, ttl_s: float | None
    ) -> bool:
        now = self._clock()
        with self._transaction() as cur:
            row = cur.execute(
                "SELECT version, expires FROM craft_history WHERE ns = ? AND id = ?",
                (namespace, conversation),
            ).fetchone()
            if row is not None and (row[1] is None or row[1] > now) and row[0] >= version:
                return False
            expires = now + ttl_s if ttl_s is not None else None
            cur.execute(
                "INSERT OR REPLACE INTO craft_history VALUES (?, ?, ?, ?, ?)",
                (namespace, conversation, version, data, expires),
            )
            return True

    def get_history(self, namespace: str, conversation: str) -> HistoryRecord:
        now = self._clock()
        with self._transaction() as cur:
            conv = cur.execute(
                "SELECT last_seq, expires FROM craft_conv WHERE ns = ? AND id = ?",
                (namespace, conversation),
            ).fetchone()
            hist = cur.execute(
                "SELECT version, data, expires FROM craft_history WHERE ns = ? AND id = ?",
                (namespace, conversation),
            ).fetchone()
        last = int(conv[0]) if conv is not None and (conv[1] is None or conv[1] > now) else 0
        if hist is None or (hist[2] is not None and hist[2] <= now):
            return HistoryRecord(last)
        return HistoryRecord(last, int(hist[0]), str(hist[1]))

    def _snapshot(self, namespace: str) -> Snapshot | None:
        with self._transaction() as cur:
            row = cur.execute(
                "SELECT seq, state FROM craft_snapshot WHERE ns = ?", (namespace,)
            ).fetchone()
        return None if row is None else Snapshot(int(row[0]), str(row[1]))

    def put_snapshot(self, namespace: str, snapshot: Snapshot, keep_from: int) -> None:
        with self._transaction() as cur:
            cur.execute(
                "INSERT INTO craft_snapshot VALUES (?, ?, ?) ON CONFLICT(ns) DO UPDATE SET "
                "seq = excluded.seq, state = excluded.state WHERE excluded.seq > seq",
                (namespace, snapshot.seq, snapshot.state),
            )
            cur.execute("DELETE FROM craft_log WHERE ns = ? AND seq < ?", (namespace, keep_from))
            cur.execute(
                "DELETE FROM craft_token WHERE ns = ? AND seq > 0 AND seq < ?",
                (namespace, keep_from),
            )

    def clear(self, namespace: str) -> None:
        check_namespace(namespace)
        with self._transaction() as cur:
            for table in (
                "craft_meta", "craft_head", "craft_log", "craft_conv", "craft_history",
                "craft_snapshot", "craft_token",
            ):
                cur.execute(f"DELETE FROM {table} WHERE ns = ?", (namespace,))

    def integrity_check(self) -> str:
        """SQLite's ``PRAGMA integrity_check`` (``"ok"`` when the file is sound)."""
        with self._lock:
            return str(self._conn.execute("PRAGMA integrity_check").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            self._conn.close()


def _enable_wal(conn: sqlite3.Connection, timeout_s: float) -> None:
    """``PRAGMA journal_mode=WAL``, retried until ``timeout_s``: switching a new database to WAL
    takes an exclusive lock, and SQLite answers a concurrent switch (two workers opening one new
    file at once) with an immediate "database is locked" that its busy handler does not wait on.
    """
    deadline = time.monotonic() + timeout_s
    delay = 0.005
    while True:
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as e:
            if not _is_locked(e) or time.monotonic() >= deadline:
                raise
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


def _is_locked(error: sqlite3.DatabaseError) -> bool:
    """SQLite's "another connection holds the lock" (retryable), as opposed to a bad file."""
    text = str(error)
    return isinstance(error, sqlite3.OperationalError) and ("locked" in text or "busy" in text)
