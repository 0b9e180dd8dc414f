"""A planner's link to a shared store: the commit-log entry codec and the pull/push calls.

:class:`SharedState` is owned by one :class:`craft_rag.planner.CraftPlanner` and used only under
its lock. The planner applies what ``pull``/``push`` return with its own methods; this module
only moves and decodes entries. Three entry kinds exist:

- :class:`CommitEntry`: one committed plan, with everything ``commit`` needs to change the
  CA-Table, CP-Tree and conversation registry (the served keys, the keys removed by dedup, the
  turn, the engine's reused-chunk count, token spans, block hashes, KV location, and the
  committer's clock reading, which every replaying planner uses as "now");
- :class:`EndEntry`: a conversation was ended;
- :class:`ForgetEntry`: a conversation's prompt dropped its oldest turns.

Entries are JSON objects with short field names (``"v"`` says the kind); a malformed one is
:class:`~craft_rag.stores.base.StoreCorrupted`, naming the store, the namespace and the seq.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from craft_rag.access_table import ChunkAccessTable
from craft_rag.conversation import ConversationStore
from craft_rag.prefix_tree import ChunkPrefixTree, KVLocation, NodeMetadata
from craft_rag.stores.base import (
    LogEntry,
    LogRead,
    Snapshot,
    StateStore,
    StoreCorrupted,
    namespace_label,
)
from craft_rag.stores.json_codec import MAX_STORED_INT, is_stored_int, loads_strict, preview
from craft_rag.types import BlockHash, ChunkKey, ConversationId

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SharedPosition:
    """Where a sharing planner stands: its ``store`` and ``namespace``, the last log ``seq`` it
    applied, and the conversation TTL (histories expire with the conversation records)."""

    store: StateStore
    namespace: str
    seq: int
    ttl_s: float | None

    @property
    def where(self) -> str:
        return f"store {self.store.url} {namespace_label(self.namespace)}"


@dataclass(frozen=True, slots=True)
class CommitEntry:
    """One committed plan, as every planner of the namespace replays it."""

    keys: tuple[ChunkKey, ...]
    removed: tuple[ChunkKey, ...]
    turn: int
    conversation: ConversationId | None
    reused_chunks: int | None
    metadata: tuple[NodeMetadata, ...] | None
    location: KVLocation | None
    ts: float
    removed_in_prompt: bool = False
    """The prompt carried ``removed`` too (a restarted turn): the conversation records them
    with the turn (field ``"r"``, written only when true)."""
    token: str | None = None
    """Names this append attempt (field ``"p"``): after a failure without a clear answer the
    committer asks the store whether it was written (:meth:`StateStore.settle`)."""

    def to_json(self) -> str:
        meta = None
        if self.metadata is not None:
            meta = [
                [
                    None if m.token_span is None else list(m.token_span),
                    None if m.block_hashes is None else [h.hex() for h in m.block_hashes],
                ]
                for m in self.metadata
            ]
        loc = None if self.location is None else [self.location.engine_id, self.location.tier]
        data = {
            "v": "c", "k": list(self.keys), "d": list(self.removed), "t": self.turn,
            "c": self.conversation, "u": self.reused_chunks, "m": meta, "l": loc, "ts": self.ts,
        }
        if self.removed_in_prompt:
            data["r"] = True
        if self.token is not None:
            data["p"] = self.token
        return json.dumps(data, separators=(",", ":"))


@dataclass(frozen=True, slots=True)
class EndEntry:
    """A conversation was ended (``end_conversation``) by some worker."""

    conversation: ConversationId
    ts: float

    def to_json(self) -> str:
        return json.dumps({"v": "e", "c": self.conversation, "ts": self.ts})


@dataclass(frozen=True, slots=True)
class ForgetEntry:
    """A conversation's prompt dropped its ``n`` oldest live turns (``forget_turns``)."""

    conversation: ConversationId
    n: int
    ts: float

    def to_json(self) -> str:
        return json.dumps({"v": "f", "c": self.conversation, "n": self.n, "ts": self.ts})


Entry = CommitEntry | EndEntry | ForgetEntry


def _keys(value: Any) -> tuple[ChunkKey, ...]:
    if not isinstance(value, list) or not all(isinstance(k, str) and k for k in value):
        raise TypeError("keys must be a list of non-empty strings")
    return tuple(ChunkKey(k) for k in value)


def _metadata(value: Any, k: int) -> tuple[NodeMetadata, ...] | None:
    """Per key ``[span or null, block hashes or null]``; a span is ``[start, end]`` with
    ``0 <= start <= end``, hashes are hex strings. Inlined checks: this runs for every key of
    every replayed commit."""
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != k:
        raise TypeError("metadata must have one item per key")
    out = []
    for item in value:
        if type(item) is not list or len(item) != 2:
            raise TypeError("a metadata item must be [span, block hashes]")
        span, hashes = item
        if span is not None:
            if type(span) is not list or len(span) != 2:
                raise TypeError("a token span must be [start, end]")
            start, end = span
            if type(start) is not int or type(end) is not int or not (
                0 <= start <= end <= MAX_STORED_INT
            ):
                raise TypeError("a token span must be [start, end] with 0 <= start <= end")
            span = (start, end)
        if hashes is not None:
            if type(hashes) is not list or not all(type(h) is str for h in hashes):
                raise TypeError("block hashes must be a list of hex strings")
            hashes = tuple(BlockHash(bytes.fromhex(h)) for h in hashes)
        out.append(NodeMetadata(token_span=span, block_hashes=hashes))
    return tuple(out)


def _location(value: Any) -> KVLocation | None:
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != 2 or not all(
        isinstance(v, str) for v in value
    ):
        raise TypeError("a KV location must be [engine id, tier]")
    return KVLocation(value[0], value[1])


def _ts(value: Any) -> float:
    # JSON NaN/Infinity are refused by the parser; 1e400 parses to inf, refused here.
    if type(value) not in (int, float) or not math.isfinite(value):
        raise TypeError("ts must be a finite number")
    return float(value)


def _token(value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise TypeError("the append token must be a string")
    return value


def _conversation(value: Any, *, optional: bool) -> ConversationId | None:
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value:
        raise TypeError("conversation id must be a non-empty string")
    return ConversationId(value)


def decode_entry(entry: LogEntry, where: str) -> Entry:
    """The entry in ``entry.data``; :class:`StoreCorrupted` naming ``where`` (store and
    namespace) and the seq when it is not exactly one this version writes (strict JSON: no
    NaN, no repeated field; every field of its type and range). O(entry size)."""
    try:
        data = loads_strict(entry.data)
        if not isinstance(data, dict):
            raise TypeError("not a JSON object")
        kind = data["v"]
        ts = _ts(data["ts"])
        if kind in ("e", "f"):
            conv = _conversation(data["c"], optional=False)
            assert conv is not None
            if kind == "e":
                return EndEntry(conv, ts)
            n = data["n"]
            if not is_stored_int(n):
                raise TypeError("forgotten turn count must be an int >= 0")
            return ForgetEntry(conv, n, ts)
        if kind != "c":
            raise TypeError(f"unknown entry kind {preview(kind)}")
        keys = _keys(data["k"])
        turn, reused = data["t"], data["u"]
        if not is_stored_int(turn, 1):
            raise TypeError("turn must be an int >= 1")
        if reused is not None and (not is_stored_int(reused) or reused > len(keys)):
            raise TypeError("reused chunk count out of range")
        resent = data.get("r", False)
        if not isinstance(resent, bool):
            raise TypeError("removed_in_prompt must be a bool")
        return CommitEntry(
            keys=keys,
            removed=_keys(data["d"]),
            turn=turn,
            conversation=_conversation(data["c"], optional=True),
            reused_chunks=reused,
            metadata=_metadata(data["m"], len(keys)),
            location=_location(data["l"]),
            ts=ts,
            removed_in_prompt=resent,
            token=_token(data.get("p")),
        )
    except (ValueError, TypeError, KeyError, IndexError) as e:
        msg = (
            f"{where}: log entry {entry.seq} is not a craft-rag commit ({e}); the store was "
            "written by another program or version; clear the namespace or use a fresh store"
        )
        raise StoreCorrupted(msg) from e


@dataclass(frozen=True, slots=True)
class SnapshotState:
    """A decoded, validated snapshot: the planner state at ``seq`` and the replay clock's
    floor then."""

    seq: int
    access_table: ChunkAccessTable
    prefix_tree: ChunkPrefixTree
    conversations: ConversationStore
    clock: float


def decode_snapshot(
    snapshot: Snapshot, where: str, clock: Callable[[], float]
) -> SnapshotState:
    """The state in ``snapshot`` (tree and conversations on ``clock``); :class:`StoreCorrupted`
    naming ``where`` and the snapshot's seq when it is not one this version wrote (strict
    JSON, every part validated by its ``from_json``). Nothing is changed on failure. O(state)."""
    try:
        data = loads_strict(snapshot.state)
        if not isinstance(data, dict):
            raise TypeError("not a JSON object")
        floor = data.get("clock", float("-inf"))
        if floor != float("-inf"):
            floor = _ts(floor)
        for part in ("access_table", "prefix_tree", "conversations"):
            if not isinstance(data[part], dict):
                raise TypeError(f"{part} is not a JSON object")
        return SnapshotState(
            snapshot.seq,
            ChunkAccessTable.from_json(data["access_table"], path="access_table"),
            ChunkPrefixTree.from_json(data["prefix_tree"], clock=clock, path="prefix_tree"),
            ConversationStore.from_json(
                data["conversations"], clock=clock, path="conversations"
            ),
            float(floor),
        )
    except (ValueError, TypeError, KeyError, IndexError) as e:
        msg = (
            f"{where}: the snapshot at seq {snapshot.seq} is not one craft-rag wrote "
            f"({preview(str(e), 200)}); clear the namespace or use a fresh store"
        )
        raise StoreCorrupted(msg) from e


def config_fingerprint(config: Any) -> str:
    """The planner settings every worker of a namespace must share (replay must agree)."""
    from dataclasses import asdict

    return json.dumps(asdict(config), sort_keys=True, separators=(",", ":"))


class ReplayClock:
    """The planner's clock in shared mode: ``base()`` normally, the replayed entry's time while
    an entry is applied (so every worker stamps the same times). Owner: the planner's lock.

    Entries are stamped by their committers' clocks, so a later seq may carry an earlier time
    (two workers racing); :meth:`pin` never goes back (``floor``), which keeps the registry's
    LRU order and the tree's access times monotone in log order, identically in every worker.
    """

    __slots__ = ("base", "floor", "pinned")

    def __init__(self, base: Callable[[], float]) -> None:
        self.base = base
        self.pinned: float | None = None
        self.floor = float("-inf")

    def pin(self, ts: float) -> None:
        self.floor = self.pinned = max(ts, self.floor)

    def __call__(self) -> float:
        return self.base() if self.pinned is None else self.pinned


@dataclass(slots=True)
class SharedState:
    """One planner's position in one namespace of a store. ``applied`` is the seq of the last
    entry (or snapshot) applied locally. Owner: the planner, under its lock."""

    store: StateStore
    namespace: str
    applied: int = 0

    @property
    def where(self) -> str:
        return f"store {self.store.url} {namespace_label(self.namespace)}"

    def pull(self) -> LogRead:
        """What the planner must apply now (one round trip)."""
        return self.store.read(self.namespace, self.applied)

    def push(
        self, entry: Entry, *, not_after: int | None, ttl_s: float | None
    ) -> LogRead:
        """Append ``entry`` (with the conversation check for a commit) and return what the
        planner must apply, the entry itself last (one round trip)."""
        return self.store.append(
            self.namespace,
            entry.to_json(),
            since=self.applied,
            conversation=entry.conversation,
            not_after=not_after,
            ttl_s=ttl_s,
            token=entry.token if isinstance(entry, CommitEntry) else None,
        )

    def snapshot_due(self, seq: int) -> bool:
        return seq % self.store.snapshot_every == 0

    def put_snapshot(self, seq: int, state: dict[str, Any]) -> None:
        """Store the state at ``seq`` and trim the log before the previous snapshot point.
        A failure only delays trimming, so it is logged, not raised."""
        keep_from = seq - self.store.snapshot_every + 1
        try:
            self.store.put_snapshot(self.namespace, Snapshot(seq, json.dumps(state)), keep_from)
        except Exception as e:
            logger.warning("%s: snapshot at seq %d failed (%s); the log is not trimmed",
                           self.where, seq, e)
