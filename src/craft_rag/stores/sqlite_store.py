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

from craft_rag.redact import redact_url
from craft_rag.stores import base
from craft_rag.stores.json_codec import MAX_STORED_INT, preview
from craft_rag.stores.sqlite_files import (
    damaged,
    foreign_tables,
    is_locked,
    open_error,
    prepare_store_file,
    write_error,
)

_OPTIONS = {
    **base.SNAPSHOT_EVERY_OPTION,
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


class SQLiteStore(base.StateStore):
    """Store in one SQLite file (WAL). Thread-safe (one connection per instance, under a
    lock); safe across processes (SQLite's file locks). Each call is one transaction."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        snapshot_every: int = base.DEFAULT_SNAPSHOT_EVERY,
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
        prepare_store_file(self.path)
        try:
            self._conn = sqlite3.connect(
                self.path, timeout=busy_timeout_ms / 1000, isolation_level=None,
                check_same_thread=False,
            )
        except sqlite3.DatabaseError as e:
            raise open_error(self.path, self.url, e, busy_timeout_ms) from e
        try:
            foreign = foreign_tables(self._conn)
            if foreign:
                msg = (
                    f"store {self.url} is another program's SQLite database (tables "
                    f"{preview(foreign[:5], 120)}); craft-rag adds nothing to it: name a new file"
                )
                raise base.StoreCorrupted(msg)
            _enable_wal(self._conn, busy_timeout_ms / 1000)
            self._conn.execute(f"PRAGMA synchronous={synchronous.upper()}")
            with self._transaction() as cur:
                for statement in _SCHEMA:
                    cur.execute(statement)
                row = self._text_row(
                    cur, "SELECT value FROM craft_meta WHERE ns = '' AND key = 'format'", (),
                    None, "the format row",
                )
                if row is None:
                    cur.execute(
                        "INSERT INTO craft_meta VALUES ('', 'format', ?)", (base.STORE_FORMAT,)
                    )
                elif row[0] != base.STORE_FORMAT:
                    msg = (
                        f"store {self.url} has format {row[0]!r}, this craft-rag reads "
                        f"{base.STORE_FORMAT!r}; use a new file (or move this one away)"
                    )
                    raise base.StoreCorrupted(msg)
        except sqlite3.DatabaseError as e:
            self._conn.close()
            raise open_error(self.path, self.url, e, busy_timeout_ms) from e
        except BaseException:
            self._conn.close()
            raise

    @classmethod
    def from_url(cls, url: str) -> SQLiteStore:
        rest = url[len("sqlite://") :]
        path, _, query = rest.partition("?")
        if not path:
            msg = f"store URL {redact_url(url)!r} names no file; use sqlite:///absolute/path/state.db"
            raise ValueError(msg)
        options = base.parse_options(url, query, _OPTIONS)
        return cls(
            path,
            snapshot_every=base.snapshot_every_option(url, options),
            synchronous=options.get("synchronous", "normal"),
            busy_timeout_ms=base.positive_int_option(url, options, "busy_timeout_ms", 5000),
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
                if is_locked(e):
                    msg = (
                        f"store {self.url} stayed locked by another process ({e}); raise "
                        "?busy_timeout_ms= or check for a hung worker"
                    )
                    raise base.StoreUnavailable(msg) from e
                raise (write_error(self.url, e) or damaged(self.url, e)) from e
            except sqlite3.DatabaseError as e:
                raise damaged(self.url, e) from e
            finally:
                cur.close()

    def attach(self, namespace: str, fingerprint: str) -> None:
        base.check_namespace(namespace)
        with self._transaction() as cur:
            what = "the config fingerprint"
            row = self._text_row(
                cur, "SELECT value FROM craft_meta WHERE ns = ? AND key = 'fingerprint'",
                (namespace,), namespace, what,
            )
            if row is not None and type(row[0]) is not str:
                raise self._corrupted(namespace, what, f"found {preview(row[0])}")
            if row is None:
                cur.execute(
                    "INSERT INTO craft_meta VALUES (?, 'fingerprint', ?)", (namespace, fingerprint)
                )
                cur.execute("INSERT OR IGNORE INTO craft_head VALUES (?, 0)", (namespace,))
            elif row[0] != fingerprint:
                raise self._fingerprint_mismatch(namespace, str(row[0]))

    def _head_and_after(
        self, cur: sqlite3.Cursor, namespace: str, since: int
    ) -> tuple[int, list[base.LogEntry]]:
        """The head and the entries after ``since``, each checked to be what craft-rag
        writes (an INTEGER seq, TEXT entry in UTF-8): two type checks per row."""
        row = cur.execute("SELECT seq FROM craft_head WHERE ns = ?", (namespace,)).fetchone()
        head = 0 if row is None else self._int(row[0], namespace, "the log head")
        try:
            rows = cur.execute(
                "SELECT seq, entry FROM craft_log WHERE ns = ? AND seq > ? ORDER BY seq",
                (namespace, since),
            ).fetchall()
        except sqlite3.OperationalError as e:
            if not _is_decode_error(e):
                raise
            raise self._bad_text(cur, namespace, since) from None
        out = []
        for position, (seq, entry) in enumerate(rows, start=since + 1):
            if type(seq) is not int:
                what = f"log entry {position} (seq {preview(seq)})"
                raise self._corrupted(namespace, what, "its seq is not an integer")
            if type(entry) is not str:
                raise self._corrupted(namespace, f"log entry {seq}", f"found {preview(entry)}")
            out.append(base.LogEntry(seq, entry))
        return head, out

    def _bad_text(self, cur: sqlite3.Cursor, namespace: str, since: int) -> base.StoreCorrupted:
        """The error for a log entry that is not UTF-8 (found on the error path only)."""
        rows = cur.execute(
            "SELECT seq, CAST(entry AS BLOB) FROM craft_log WHERE ns = ? AND seq > ? "
            "ORDER BY seq",
            (namespace, since),
        ).fetchall()
        for seq, raw in rows:
            try:
                bytes(raw).decode("utf-8")
            except UnicodeDecodeError:
                return self._corrupted(namespace, f"log entry {seq}", "not UTF-8 text")
        return self._corrupted(namespace, "a log entry", "not UTF-8 text")

    def _int(self, value: object, namespace: str | None, what: str) -> int:
        if type(value) is int and 0 <= value <= MAX_STORED_INT:
            return value
        raise self._corrupted(namespace, what, f"found {preview(value)}")

    def _live(self, value: object, now: float, namespace: str, what: str) -> bool:
        """Whether a row with expiry ``value`` (None: never) is live at ``now``."""
        if value is None:
            return True
        if isinstance(value, int | float) and not isinstance(value, bool) and value == value:
            return value > now
        raise self._corrupted(namespace, what, f"its expiry is {preview(value)}")

    def _text_row(
        self, cur: sqlite3.Cursor, sql: str, args: tuple[object, ...], namespace: str | None,
        what: str,
    ) -> tuple[object, ...] | None:
        """``cur.execute(sql, args).fetchone()``; a TEXT value that is not UTF-8 is
        :class:`StoreCorrupted` naming ``what``."""
        try:
            row = cur.execute(sql, args).fetchone()
        except sqlite3.OperationalError as e:
            if not _is_decode_error(e):
                raise
            raise self._corrupted(namespace, what, "not UTF-8 text") from None
        return None if row is None else tuple(row)

    def _range(self, namespace: str, since: int) -> tuple[int, list[base.LogEntry]]:
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
                if isinstance(e, sqlite3.OperationalError) and is_locked(e):
                    msg = f"store {self.url} stayed locked by another process ({e})"
                    raise base.StoreUnavailable(msg) from e
                raise damaged(self.url, e) from e

    def _append(
        self, namespace: str, request: base.AppendRequest
    ) -> tuple[int, list[base.LogEntry]]:
        conversation, token = request.conversation, request.token
        now = self._clock()
        with self._transaction() as cur:
            if token is not None:
                row = cur.execute(
                    "SELECT seq, expires FROM craft_token WHERE ns = ? AND token = ?",
                    (namespace, token),
                ).fetchone()
                if row is not None:  # rare: a retried or settled token
                    what = f"the record of append {preview(token)}"
                    if self._int(row[0], namespace, what) == 0 and self._live(
                        row[1], now, namespace, what
                    ):
                        raise request.voided()
            if conversation is not None and request.not_after is not None:
                row = cur.execute(
                    "SELECT last_seq, expires FROM craft_conv WHERE ns = ? AND id = ?",
                    (namespace, conversation),
                ).fetchone()
                what = f"the record of conversation {preview(conversation)}"
                if row is not None and self._live(row[1], now, namespace, what):
                    request.check_last(self._int(row[0], namespace, what))
            cur.execute(
                "INSERT INTO craft_head VALUES (?, 1) "
                "ON CONFLICT(ns) DO UPDATE SET seq = seq + 1",
                (namespace,),
            )
            seq = self._int(
                cur.execute("SELECT seq FROM craft_head WHERE ns = ?", (namespace,)).fetchone()[0],
                namespace, "the log head",
            )
            cur.execute("INSERT INTO craft_log VALUES (?, ?, ?)", (namespace, seq, request.data))
            if token is not None:
                cur.execute(
                    "INSERT OR REPLACE INTO craft_token VALUES (?, ?, ?, NULL)",
                    (namespace, token, seq),
                )
            if conversation is not None:
                cur.execute(
                    "INSERT OR REPLACE INTO craft_conv VALUES (?, ?, ?, ?)",
                    (namespace, conversation, seq, request.expiry(now)),
                )
                if seq % 1024 == 0:
                    for table in ("craft_conv", "craft_history"):
                        cur.execute(
                            f"DELETE FROM {table} WHERE ns = ? AND expires <= ?", (namespace, now)
                        )
            return self._head_and_after(cur, namespace, request.since)

    def settle(self, namespace: str, token: str) -> int:
        now = self._clock()
        with self._transaction() as cur:
            row = cur.execute(
                "SELECT seq FROM craft_token WHERE ns = ? AND token = ?", (namespace, token)
            ).fetchone()
            if row is not None:
                seq = self._int(row[0], namespace, f"the record of append {preview(token)}")
                if seq > 0:
                    return seq
            cur.execute(
                "DELETE FROM craft_token WHERE ns = ? AND seq = 0 AND expires <= ?",
                (namespace, now),
            )
            cur.execute(
                "INSERT OR REPLACE INTO craft_token VALUES (?, ?, 0, ?)",
                (namespace, token, now + base.TOKEN_VOID_TTL_S),
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

    def get_history(self, namespace: str, conversation: str) -> base.HistoryRecord:
        now = self._clock()
        record = f"the record of conversation {preview(conversation)}"
        history = f"the prompt history of conversation {preview(conversation)}"
        with self._transaction() as cur:
            conv = cur.execute(
                "SELECT last_seq, expires FROM craft_conv WHERE ns = ? AND id = ?",
                (namespace, conversation),
            ).fetchone()
            hist = self._text_row(
                cur, "SELECT version, data, expires FROM craft_history WHERE ns = ? AND id = ?",
                (namespace, conversation), namespace, history,
            )
        last = 0
        if conv is not None and self._live(conv[1], now, namespace, record):
            last = self._int(conv[0], namespace, record)
        if hist is None or not self._live(hist[2], now, namespace, history):
            return base.HistoryRecord(last)
        if type(hist[1]) is not str:
            raise self._corrupted(namespace, history, f"found {preview(hist[1])}")
        return base.HistoryRecord(last, self._int(hist[0], namespace, history), hist[1])

    def _snapshot(self, namespace: str) -> base.Snapshot | None:
        with self._transaction() as cur:  # read as bytes: rare, and names a bad one's seq
            row = cur.execute(
                "SELECT seq, typeof(state), CAST(state AS BLOB) FROM craft_snapshot WHERE ns = ?",
                (namespace,),
            ).fetchone()
        if row is None:
            return None
        seq = self._int(row[0], namespace, "the snapshot's seq")
        what = f"the snapshot at seq {seq}"
        if row[1] != "text":
            raise self._corrupted(namespace, what, f"a value of type {preview(row[1])}")
        try:
            return base.Snapshot(seq, bytes(row[2]).decode("utf-8"))
        except UnicodeDecodeError:
            raise self._corrupted(namespace, what, "not UTF-8 text") from None

    def put_snapshot(self, namespace: str, snapshot: base.Snapshot, keep_from: int) -> None:
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
        base.check_namespace(namespace)
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
            if not is_locked(e) or time.monotonic() >= deadline:
                raise
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


def _is_decode_error(error: sqlite3.OperationalError) -> bool:
    """sqlite3's error for a TEXT value that is not UTF-8 (tampered data, not a bad file)."""
    return str(error).startswith("Could not decode to UTF-8")
