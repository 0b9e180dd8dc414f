"""Tampered store data, written with the real clients (redis-py, sqlite3) into real stores and
read back through the public API (planner sync, ``store.read``, snapshots, prompt histories).

Every shape craft-rag did not write must be :class:`StoreCorrupted` naming the store and the
entry (or key, or row) that is bad; none may pass as data, none may escape as a raw
``ValueError``/``KeyError``/``UnicodeDecodeError``/``JSONDecodeError``/``TypeError``.
"""

from __future__ import annotations

import json
import re
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from craft_rag import CraftPlanner, make_chunk
from craft_rag.stores import StoreCorrupted, open_store
from craft_rag.stores.histories import encode_history, load_history
from craft_rag.types import ChunkKey

CHUNKS = [make_chunk(f"t{i}", id=f"doc-{i}", num_tokens=8) for i in range(6)]
CONV_KEY = "craft-rag:{default}:conv:"
NS = "default"


# ---- one valid store, then one tampering ------------------------------------------------------


def _seed(url: str, **options: object) -> dict[str, Any]:
    """Three commits by a real planner (a conversation turn with token spans, a plain commit)
    and a stored prompt history; returns the first commit entry as JSON (a template)."""
    query = "&".join(f"{k}={v}" for k, v in options.items())
    writer = CraftPlanner(store=url + (f"?{query}" if query else ""))
    writer.commit(writer.plan(CHUNKS[:3], "chat"), prefix_tokens=5)
    writer.commit(writer.plan(CHUNKS[1:4]))
    writer.commit(writer.plan(CHUNKS[2:5]))
    store = writer.store
    assert store is not None
    history = encode_history([[1, 2, 3]], [[ChunkKey("doc-0")]], 0)
    assert store.put_history(NS, "chat", 1, history, None)
    entry = json.loads(store.read(NS, 0).entries[0].data)
    assert entry["v"] == "c" and entry["c"] == "chat"
    return dict(entry)


def _commit_text(template: dict[str, Any], **changes: Any) -> str:
    data = dict(template)
    for name, value in changes.items():
        if value is _DROP:
            data.pop(name, None)
        else:
            data[name] = value
    return json.dumps(data, allow_nan=True)


_DROP = object()
_END = '{"v":"e","c":"chat","ts":1.0}'
_FORGET = '{"v":"f","c":"chat","n":1,"ts":1.0}'

# Entry texts that are not a commit craft-rag wrote. Each is stored as log entry 1.
ENTRY_SHAPES: dict[str, Callable[[dict[str, Any]], str | bytes]] = {
    "not json": lambda t: "not json at all",
    "truncated json": lambda t: _commit_text(t)[:-7],
    "json list": lambda t: "[1, 2, 3]",
    "json string": lambda t: '"c"',
    "json number": lambda t: "5",
    "json null": lambda t: "null",
    "empty": lambda t: "",
    "deep nesting": lambda t: "[" * 100_000 + "]" * 100_000,
    "deep nesting in keys": lambda t: _commit_text(t)[:-1] + ',"x":' + "[" * 50_000
    + "]" * 50_000 + "}",
    "non-utf-8": lambda t: b'{"v":"c","k":["\xff\xfe"]}',
    "lone surrogate": lambda t: _commit_text(t, k=["doc-\ud800"]),
    "unknown kind": lambda t: _commit_text(t, v="x"),
    "kind missing": lambda t: _commit_text(t, v=_DROP),
    "kind not a string": lambda t: _commit_text(t, v=["c"]),
    "ts NaN": lambda t: _commit_text(t, ts=float("nan")),
    "ts Infinity": lambda t: _commit_text(t, ts=float("inf")),
    "ts -Infinity": lambda t: _commit_text(t, ts=float("-inf")),
    "ts a string": lambda t: _commit_text(t, ts="1.5"),
    "ts a bool": lambda t: _commit_text(t, ts=True),
    "ts null": lambda t: _commit_text(t, ts=None),
    "ts missing": lambda t: _commit_text(t, ts=_DROP),
    "ts 1e400": lambda t: _commit_text(t)[:-1] + ',"ts":1e400}',
    "repeated field": lambda t: _commit_text(t)[:-1] + ',"t":2}',
    "repeated kind": lambda t: _commit_text(t)[:-1] + ',"v":"e"}',
    "keys not a list": lambda t: _commit_text(t, k="doc-0"),
    "keys with an int": lambda t: _commit_text(t, k=["doc-0", 5, "doc-2"]),
    "keys with an empty one": lambda t: _commit_text(t, k=["doc-0", "", "doc-2"]),
    "removed not a list": lambda t: _commit_text(t, d={"a": 1}),
    "turn 0": lambda t: _commit_text(t, t=0),
    "turn a bool": lambda t: _commit_text(t, t=True),
    "turn a float": lambda t: _commit_text(t, t=1.0),
    "turn a string": lambda t: _commit_text(t, t="1"),
    "turn huge": lambda t: _commit_text(t, t=2**70),
    "conversation empty": lambda t: _commit_text(t, c=""),
    "conversation an int": lambda t: _commit_text(t, c=7),
    "reused a bool": lambda t: _commit_text(t, u=True),
    "reused negative": lambda t: _commit_text(t, u=-1),
    "reused past the keys": lambda t: _commit_text(t, u=9),
    "metadata not a list": lambda t: _commit_text(t, m="x"),
    "metadata too short": lambda t: _commit_text(t, m=t["m"][:1]),
    "metadata item not a pair": lambda t: _commit_text(t, m=[[1], [2], [3]]),
    "metadata item a string": lambda t: _commit_text(t, m=["ab", "cd", "ef"]),
    "span of strings": lambda t: _commit_text(t, m=[[["0", "8"], None]] * 3),
    "span of floats": lambda t: _commit_text(t, m=[[[0.5, 8.5], None]] * 3),
    "span of bools": lambda t: _commit_text(t, m=[[[False, True], None]] * 3),
    "span reversed": lambda t: _commit_text(t, m=[[[8, 0], None]] * 3),
    "span negative": lambda t: _commit_text(t, m=[[[-8, 0], None]] * 3),
    "span of three": lambda t: _commit_text(t, m=[[[0, 4, 8], None]] * 3),
    "span a dict": lambda t: _commit_text(t, m=[[{"0": 0, "1": 8}, None]] * 3),
    "block hash not hex": lambda t: _commit_text(t, m=[[[0, 8], ["zz"]]] * 3),
    "block hash an int": lambda t: _commit_text(t, m=[[[0, 8], [5]]] * 3),
    "block hashes a string": lambda t: _commit_text(t, m=[[[0, 8], "abcd"]] * 3),
    "block hash empty": lambda t: _commit_text(t, m=[[[0, 8], [""]]] * 3),
    "location a string": lambda t: _commit_text(t, l="ab"),
    "location of ints": lambda t: _commit_text(t, l=[1, 2]),
    "location of three": lambda t: _commit_text(t, l=["a", "b", "c"]),
    "location a dict": lambda t: _commit_text(t, l={"0": "a", "1": "b"}),
    "removed_in_prompt a string": lambda t: _commit_text(t, r="yes"),
    "append token an int": lambda t: _commit_text(t, p=5),
    "end without conversation": lambda t: '{"v":"e","ts":1.0}',
    "end with ts NaN": lambda t: _END.replace("1.0", "NaN"),
    "end repeated conversation": lambda t: _END[:-1] + ',"c":"other"}',
    "forget n negative": lambda t: _FORGET.replace('"n":1', '"n":-1'),
    "forget n a bool": lambda t: _FORGET.replace('"n":1', '"n":true'),
    "forget n a float": lambda t: _FORGET.replace('"n":1', '"n":1.0'),
    "forget ts Infinity": lambda t: _FORGET.replace("1.0", "Infinity"),
}


# ---- helpers per backend ----------------------------------------------------------------------


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite://{tmp_path / 'state.db'}"


def _sql(url: str, statement: str, *args: Any) -> None:
    with sqlite3.connect(url[len("sqlite://") :]) as conn:
        conn.execute(statement, args)


def _redis_client(url: str) -> Any:
    import redis

    return redis.Redis.from_url(url)


def _expect_corrupted(action: Callable[[], object], url: str, names: str) -> StoreCorrupted:
    """``action`` raises StoreCorrupted naming the store (``url``) and ``names`` (a regex)."""
    with pytest.raises(StoreCorrupted) as info:
        action()
    text = str(info.value)
    assert url.split("?")[0] in text, text
    assert re.search(names, text), text
    assert len(text) < 2_000, "a message must not echo tampered data whole"
    return info.value


def _reader_sync(url: str) -> Callable[[], object]:
    """A new planner (it syncs while constructed), then an explicit sync."""

    def run() -> None:
        planner = CraftPlanner(store=url)
        planner.sync()

    return run


# ---- log entries (both backends) --------------------------------------------------------------


@pytest.mark.parametrize("shape", sorted(ENTRY_SHAPES))
def test_a_tampered_log_entry_in_redis_is_corrupted(redis_url: str, shape: str) -> None:
    template = _seed(redis_url)
    text = ENTRY_SHAPES[shape](template)
    data = text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass")
    client = _redis_client(redis_url)
    log = "craft-rag:{default}:log"
    client.zremrangebyscore(log, 1, 1)
    client.zadd(log, {b"1|" + data: 1})
    client.close()
    _expect_corrupted(_reader_sync(redis_url), redis_url, r"log entry 1\b")


@pytest.mark.parametrize("shape", sorted(ENTRY_SHAPES))
def test_a_tampered_log_entry_in_sqlite_is_corrupted(sqlite_url: str, shape: str) -> None:
    template = _seed(sqlite_url)
    text = ENTRY_SHAPES[shape](template)
    if isinstance(text, bytes):  # stored as TEXT that is not UTF-8
        _sql(sqlite_url, "UPDATE craft_log SET entry = CAST(? AS TEXT) WHERE seq = 1", text)
    else:
        _sql(sqlite_url, "UPDATE craft_log SET entry = ? WHERE seq = 1",
             text.encode("utf-8", "surrogatepass").decode("utf-8", "replace"))
    _expect_corrupted(_reader_sync(sqlite_url), sqlite_url, r"log entry 1\b")


# ---- Redis keys -------------------------------------------------------------------------------

LOG = "craft-rag:{default}:log"
HEAD = "craft-rag:{default}:head"
SNAP = "craft-rag:{default}:snapshot"
HIST = "craft-rag:{default}:hist:"


def _first_member(client: Any) -> bytes:
    return bytes(client.zrangebyscore(LOG, 1, 1)[0])


def _rescore(client: Any) -> None:
    member = _first_member(client)
    client.zremrangebyscore(LOG, 1, 1)
    client.zadd(LOG, {member: 2.5})


def _replace_member(client: Any, member: bytes, score: float = 1) -> None:
    client.zremrangebyscore(LOG, score, score)
    client.zadd(LOG, {member: score})


REDIS_SHAPES: dict[str, tuple[Callable[[Any], None], str]] = {
    "head not a number": (lambda c: c.set(HEAD, b"abc"), r"head"),
    "head a float": (lambda c: c.set(HEAD, b"2.5"), r"head"),
    "head not utf-8": (lambda c: c.set(HEAD, b"\xff\xfe"), r"head"),
    "head past int64": (lambda c: c.set(HEAD, b"99999999999999999999999"), r"head"),
    "head with spaces": (lambda c: c.set(HEAD, b" 3 "), r"head"),
    "head a hash": (lambda c: (c.delete(HEAD), c.hset(HEAD, "x", "1")), r"head|keys"),
    "log a string": (lambda c: (c.delete(LOG), c.set(LOG, "x")), r"log|keys"),
    "member without separator": (
        lambda c: _replace_member(c, _first_member(c).replace(b"|", b"", 1)), r"log entry 1\b"
    ),
    "member seq not a number": (
        lambda c: _replace_member(c, b"x" + _first_member(c)[1:]), r"log entry 1\b"
    ),
    "member seq empty": (
        lambda c: _replace_member(c, _first_member(c)[1:]), r"log entry 1\b"
    ),
    "member seq unicode digit": (
        lambda c: _replace_member(c, "١".encode() + _first_member(c)[1:]), r"log entry 1\b"
    ),
    "member seq with underscore": (
        lambda c: _replace_member(c, b"1_0" + _first_member(c)[1:]), r"log entry 1\b"
    ),
    "member seq with sign": (
        lambda c: _replace_member(c, b"+" + _first_member(c)), r"log entry 1\b"
    ),
    "member seq other than its score": (
        lambda c: _replace_member(c, b"7" + _first_member(c)[1:]), r"log entry [127]\b"
    ),
    "member seq not utf-8": (
        lambda c: _replace_member(c, b"\xff" + _first_member(c)[1:]), r"log entry 1\b"
    ),
    "member data not utf-8": (
        lambda c: _replace_member(c, b"1|\xff\xfe{}"), r"log entry 1\b"
    ),
    "member scored out of order": (_rescore, r"log entry [12]\b"),
    "repeated seq": (
        lambda c: c.zadd(LOG, {b'1|{"v":"e","c":"chat","ts":1.0}': 1}), r"log entry 1\b"
    ),
    "member of a megabyte": (
        lambda c: _replace_member(c, b"1|" + b"x" * 1_000_000), r"log entry 1\b"
    ),
    "log a list": (lambda c: (c.delete(LOG), c.rpush(LOG, "x")), r"keys craft-rag cannot use"),
    "format not utf-8": (lambda c: c.set("craft-rag:format", b"\xff\xfe"), r"format"),
    "format a hash": (
        lambda c: (c.delete("craft-rag:format"), c.hset("craft-rag:format", "x", "1")),
        r"keys craft-rag cannot use",
    ),
    "fingerprint not utf-8": (
        lambda c: c.set("craft-rag:{default}:fingerprint", b"\xff\xfe"), r"fingerprint"
    ),
}


@pytest.mark.parametrize("shape", sorted(REDIS_SHAPES))
def test_tampered_redis_keys_are_corrupted(redis_url: str, shape: str) -> None:
    _seed(redis_url)
    tamper, names = REDIS_SHAPES[shape]
    client = _redis_client(redis_url)
    tamper(client)
    client.close()
    _expect_corrupted(_reader_sync(redis_url), redis_url, names)


def _conv_and_hist_keys(client: Any) -> tuple[bytes, bytes]:
    conv = client.keys(CONV_KEY + "*")
    hist = client.keys(HIST + "*")
    assert len(conv) == 1 and len(hist) == 1
    return conv[0], hist[0]


REDIS_HISTORY_SHAPES: dict[str, Callable[[Any, bytes, bytes], object]] = {
    "record not a number": lambda c, conv, hist: c.set(conv, b"abc"),
    "record not utf-8": lambda c, conv, hist: c.set(conv, b"\xff"),
    "record a float": lambda c, conv, hist: c.set(conv, b"1.5"),
    "version not a number": lambda c, conv, hist: c.hset(hist, "v", b"abc"),
    "version negative": lambda c, conv, hist: c.hset(hist, "v", b"-4"),
    "data not utf-8": lambda c, conv, hist: c.hset(hist, "d", b"\xff\xfe"),
    "data not json": lambda c, conv, hist: c.hset(hist, "d", b"{nope"),
    "record a hash": lambda c, conv, hist: (c.delete(conv), c.hset(conv, "x", "1")),
    "history a string": lambda c, conv, hist: (c.delete(hist), c.set(hist, "x")),
}


@pytest.mark.parametrize("shape", sorted(REDIS_HISTORY_SHAPES))
def test_a_tampered_redis_history_is_corrupted(redis_url: str, shape: str) -> None:
    _seed(redis_url)
    client = _redis_client(redis_url)
    conv, hist = _conv_and_hist_keys(client)
    REDIS_HISTORY_SHAPES[shape](client, conv, hist)
    client.close()
    reader = CraftPlanner(store=redis_url)
    store = reader.store
    assert store is not None

    def both() -> None:
        store.get_history(NS, "chat")
        load_history(reader, "chat")

    # A key of the wrong Redis type is refused by the server (WRONGTYPE): the message names
    # the store and says which keys to delete, not the one key.
    _expect_corrupted(
        both, redis_url, r"conversation 'chat'|prompt history|keys craft-rag cannot use"
    )


# ---- SQLite rows ------------------------------------------------------------------------------

SQLITE_SHAPES: dict[str, tuple[str, tuple[Any, ...], str]] = {
    "head text": ("UPDATE craft_head SET seq = 'abc'", (), r"head"),
    "head real": ("UPDATE craft_head SET seq = 2.5", (), r"head"),
    "head blob": ("UPDATE craft_head SET seq = X'FF'", (), r"head"),
    "log seq text": ("UPDATE craft_log SET seq = 'one' WHERE seq = 1", (), r"log entry"),
    "log seq real": ("UPDATE craft_log SET seq = 1.5 WHERE seq = 1", (), r"log entry"),
    "log seq blob": ("UPDATE craft_log SET seq = X'01' WHERE seq = 1", (), r"log entry"),
    "entry blob": ("UPDATE craft_log SET entry = X'7B7D' WHERE seq = 1", (), r"log entry 1\b"),
    "entry integer": ("UPDATE craft_log SET entry = 5 WHERE seq = 1", (), r"log entry 1\b"),
    "entry real": ("UPDATE craft_log SET entry = 1.5 WHERE seq = 1", (), r"log entry 1\b"),
    "entry not utf-8": (
        "UPDATE craft_log SET entry = CAST(X'FFFE7B7D' AS TEXT) WHERE seq = 1", (),
        r"log entry 1\b",
    ),
    "format blob": (
        "UPDATE craft_meta SET value = X'FF' WHERE key = 'format'", (), r"format"
    ),
    "format not utf-8": (
        "UPDATE craft_meta SET value = CAST(X'FF' AS TEXT) WHERE key = 'format'", (), r"format"
    ),
    "fingerprint not utf-8": (
        "UPDATE craft_meta SET value = CAST(X'FF' AS TEXT) WHERE key = 'fingerprint'", (),
        r"fingerprint",
    ),
    "fingerprint blob": (
        "UPDATE craft_meta SET value = X'FF' WHERE key = 'fingerprint'", (), r"fingerprint"
    ),
}


@pytest.mark.parametrize("shape", sorted(SQLITE_SHAPES))
def test_tampered_sqlite_rows_are_corrupted(sqlite_url: str, shape: str) -> None:
    _seed(sqlite_url)
    statement, args, names = SQLITE_SHAPES[shape]
    _sql(sqlite_url, statement, *args)
    _expect_corrupted(_reader_sync(sqlite_url), sqlite_url, names)


SQLITE_HISTORY_SHAPES: dict[str, str] = {
    "record text": "UPDATE craft_conv SET last_seq = 'abc'",
    "record real": "UPDATE craft_conv SET last_seq = 1.5",
    "record expiry text": "UPDATE craft_conv SET expires = 'soon'",
    "record expiry blob": "UPDATE craft_conv SET expires = X'FF'",
    "version text": "UPDATE craft_history SET version = 'abc'",
    "version real": "UPDATE craft_history SET version = 1.5",
    "history expiry text": "UPDATE craft_history SET expires = 'soon'",
    "data blob": "UPDATE craft_history SET data = X'FFFE'",
    "data not utf-8": "UPDATE craft_history SET data = CAST(X'FFFE' AS TEXT)",
    "data integer": "UPDATE craft_history SET data = 5",
}


@pytest.mark.parametrize("shape", sorted(SQLITE_HISTORY_SHAPES))
def test_a_tampered_sqlite_history_is_corrupted(sqlite_url: str, shape: str) -> None:
    _seed(sqlite_url)
    _sql(sqlite_url, SQLITE_HISTORY_SHAPES[shape])
    reader = CraftPlanner(store=sqlite_url)
    store = reader.store
    assert store is not None

    def both() -> None:
        store.get_history(NS, "chat")
        load_history(reader, "chat")

    _expect_corrupted(both, sqlite_url, r"conversation 'chat'|prompt history")


def test_a_tampered_conversation_record_is_corrupted_on_commit_too(sqlite_url: str) -> None:
    """The commit path reads the conversation record as well (its conflict check)."""
    _seed(sqlite_url)
    writer = CraftPlanner(store=sqlite_url)
    plan = writer.plan(CHUNKS[3:6], "chat")
    _sql(sqlite_url, "UPDATE craft_conv SET expires = 'soon'")
    _expect_corrupted(lambda: writer.commit(plan), sqlite_url, r"conversation 'chat'")


# ---- stored prompt histories (JSON shapes, both backends) -------------------------------------

HISTORY_SHAPES: dict[str, str] = {
    "not an object": "[1, 2]",
    "not json": "{nope",
    "turns missing": '{"k": [], "d": 0}',
    "lengths differ": '{"t": [[1]], "k": [], "d": 0}',
    "token a string": '{"t": [["1"]], "k": [["doc-0"]], "d": 0}',
    "token negative": '{"t": [[-1]], "k": [["doc-0"]], "d": 0}',
    "token a bool": '{"t": [[true]], "k": [["doc-0"]], "d": 0}',
    "token a float": '{"t": [[1.0]], "k": [["doc-0"]], "d": 0}',
    "token NaN": '{"t": [[NaN]], "k": [["doc-0"]], "d": 0}',
    "token past int64": '{"t": [[36893488147419103232]], "k": [["doc-0"]], "d": 0}',
    "turn not a list": '{"t": [5], "k": [["doc-0"]], "d": 0}',
    "key an int": '{"t": [[1]], "k": [[5]], "d": 0}',
    "dropped negative": '{"t": [[1]], "k": [["doc-0"]], "d": -1}',
    "dropped NaN": '{"t": [[1]], "k": [["doc-0"]], "d": NaN}',
    "count below the turns": '{"t": [[1], [2]], "k": [["a"], ["b"]], "d": 0, "n": 1}',
    "repeated field": '{"t": [[1]], "k": [["doc-0"]], "d": 0, "d": 3}',
    "deep nesting": '{"t": ' + "[" * 100_000 + "]" * 100_000 + ', "k": [], "d": 0}',
}


@pytest.mark.parametrize("backend_name", ["sqlite", "redis"])
@pytest.mark.parametrize("shape", sorted(HISTORY_SHAPES))
def test_a_stored_history_of_a_wrong_shape_is_corrupted(
    backend_name: str, shape: str, request: pytest.FixtureRequest
) -> None:
    url = str(request.getfixturevalue(f"{backend_name}_url"))
    _seed(url)
    if backend_name == "sqlite":
        _sql(url, "UPDATE craft_history SET data = ?", HISTORY_SHAPES[shape])
    else:
        client = _redis_client(url)
        client.hset(_conv_and_hist_keys(client)[1], "d", HISTORY_SHAPES[shape])
        client.close()
    reader = CraftPlanner(store=url)
    _expect_corrupted(lambda: load_history(reader, "chat"), url, r"conversation 'chat'")


# ---- snapshots (both backends) ----------------------------------------------------------------

SNAPSHOT_STATES: dict[str, Callable[[dict[str, Any]], str | bytes]] = {
    "not json": lambda s: "{nope",
    "not utf-8": lambda s: b"\xff\xfe{}",
    "a list": lambda s: "[]",
    "empty object": lambda s: "{}",
    "access table missing": lambda s: json.dumps({k: v for k, v in s.items()
                                                  if k != "access_table"}),
    "prefix tree missing": lambda s: json.dumps({k: v for k, v in s.items()
                                                 if k != "prefix_tree"}),
    "conversations missing": lambda s: json.dumps({k: v for k, v in s.items()
                                                   if k != "conversations"}),
    "access table a number": lambda s: json.dumps({**s, "access_table": 5}),
    "prefix tree a list": lambda s: json.dumps({**s, "prefix_tree": []}),
    "conversations a string": lambda s: json.dumps({**s, "conversations": "x"}),
    "access table format foreign": lambda s: json.dumps(
        {**s, "access_table": {**s["access_table"], "format": "other"}}
    ),
    "clock NaN": lambda s: json.dumps({**s, "clock": float("nan")}),
    "clock a string": lambda s: json.dumps({**s, "clock": "late"}),
    "clock Infinity": lambda s: json.dumps({**s, "clock": float("inf")}),
    "repeated field": lambda s: json.dumps(s)[:-1] + ', "clock": 1.0}',
    "deep nesting": lambda s: json.dumps({**s, "x": 1})[:-2] + "[" * 100_000 + "]" * 100_000
    + "}",
}


def _seed_snapshot(url: str) -> tuple[str, dict[str, Any]]:
    """A store whose log was trimmed behind a snapshot (a new reader must load it)."""
    full = url + "?snapshot_every=2"
    writer = CraftPlanner(store=full)
    for i in range(5):
        writer.commit(writer.plan(CHUNKS[i : i + 2], "chat" if i == 0 else None))
    store = open_store(full)
    snapshot = store._snapshot(NS)
    store.close()
    assert snapshot is not None and snapshot.seq == 4
    return full, dict(json.loads(snapshot.state))


@pytest.mark.parametrize("backend_name", ["sqlite", "redis"])
@pytest.mark.parametrize("shape", sorted(SNAPSHOT_STATES))
def test_a_tampered_snapshot_is_corrupted(
    backend_name: str, shape: str, request: pytest.FixtureRequest
) -> None:
    url = str(request.getfixturevalue(f"{backend_name}_url"))
    full, state = _seed_snapshot(url)
    text = SNAPSHOT_STATES[shape](state)
    if backend_name == "sqlite":
        value: Any = text
        statement = "UPDATE craft_snapshot SET state = ?"
        if isinstance(text, bytes):
            statement = "UPDATE craft_snapshot SET state = CAST(? AS TEXT)"
        _sql(url, statement, value)
    else:
        client = _redis_client(url)
        client.hset(SNAP, "state", text)
        client.close()
    _expect_corrupted(_reader_sync(full), url, r"snapshot at seq 4")


SNAPSHOT_SEQS: dict[str, tuple[str, str]] = {
    "seq not a number": ("abc", "CAST('abc' AS TEXT)"),
    "seq a float": ("4.5", "4.5"),
    "seq past the head": ("99", "99"),
    "seq zero": ("0", "0"),
    "seq negative": ("-1", "-1"),
}


@pytest.mark.parametrize("backend_name", ["sqlite", "redis"])
@pytest.mark.parametrize("shape", sorted(SNAPSHOT_SEQS))
def test_a_tampered_snapshot_seq_is_corrupted(
    backend_name: str, shape: str, request: pytest.FixtureRequest
) -> None:
    url = str(request.getfixturevalue(f"{backend_name}_url"))
    full, _ = _seed_snapshot(url)
    redis_value, sql_value = SNAPSHOT_SEQS[shape]
    if backend_name == "sqlite":
        _sql(url, f"UPDATE craft_snapshot SET seq = {sql_value}")
    else:
        client = _redis_client(url)
        client.hset(SNAP, "seq", redis_value)
        client.close()
    _expect_corrupted(_reader_sync(full), url, r"snapshot")


@pytest.mark.parametrize(
    ("statement", "call"),
    [
        ("UPDATE craft_token SET seq = 'abc'", "settle"),
        ("UPDATE craft_token SET seq = 2.5", "settle"),
        ("UPDATE craft_token SET seq = 0, expires = 'later'", "append"),
        ("UPDATE craft_token SET seq = X'00'", "append"),
    ],
)
def test_a_tampered_append_token_row_is_corrupted(
    sqlite_url: str, statement: str, call: str
) -> None:
    _seed(sqlite_url)
    store = open_store(sqlite_url)
    head = store.read(NS, 0).head
    store.append(NS, _END, since=head, token="tok-1")
    _sql(sqlite_url, statement)

    def run() -> None:
        if call == "settle":
            store.settle(NS, "tok-1")
        else:
            store.append(NS, _END, since=head + 1, token="tok-1")

    _expect_corrupted(run, sqlite_url, r"append 'tok-1'")
    store.close()
