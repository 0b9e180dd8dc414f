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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from craft_rag.prefix_tree import KVLocation, NodeMetadata
from craft_rag.stores.base import (
    LogEntry,
    LogRead,
    Snapshot,
    StateStore,
    StoreCorrupted,
    namespace_label,
)
from craft_rag.types import BlockHash, ChunkKey, ConversationId

logger = logging.getLogger(__name__)


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
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != k:
        raise TypeError("metadata must have one item per key")
    out = []
    for span, hashes in value:
        out.append(
            NodeMetadata(
                token_span=None if span is None else (int(span[0]), int(span[1])),
                block_hashes=None
                if hashes is None
                else tuple(BlockHash(bytes.fromhex(h)) for h in hashes),
            )
        )
    return tuple(out)


def _token(value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise TypeError("the append token must be a string")
    return value


def decode_entry(entry: LogEntry, where: str) -> Entry:
    """The entry in ``entry.data``; :class:`StoreCorrupted` naming ``where`` (store and
    namespace) and the seq when it is not one this version wrote."""
    try:
        data = json.loads(entry.data)
        kind = data["v"]
        ts = float(data["ts"])
        if kind in ("e", "f"):
            conv = data["c"]
            if not isinstance(conv, str) or not conv:
                raise TypeError("conversation id must be a non-empty string")
            if kind == "e":
                return EndEntry(ConversationId(conv), ts)
            n = data["n"]
            if not isinstance(n, int) or n < 0:
                raise TypeError("forgotten turn count must be an int >= 0")
            return ForgetEntry(ConversationId(conv), n, ts)
        if kind != "c":
            raise TypeError(f"unknown entry kind {kind!r}")
        keys = _keys(data["k"])
        conv = data["c"]
        if conv is not None and (not isinstance(conv, str) or not conv):
            raise TypeError("conversation id must be a non-empty string or null")
        turn, reused = data["t"], data["u"]
        if not isinstance(turn, int) or turn < 1:
            raise TypeError("turn must be an int >= 1")
        if reused is not None and (not isinstance(reused, int) or not 0 <= reused <= len(keys)):
            raise TypeError("reused chunk count out of range")
        loc = data["l"]
        resent = data.get("r", False)
        if not isinstance(resent, bool):
            raise TypeError("removed_in_prompt must be a bool")
        return CommitEntry(
            keys=keys,
            removed=_keys(data["d"]),
            turn=turn,
            conversation=None if conv is None else ConversationId(conv),
            reused_chunks=reused,
            metadata=_metadata(data["m"], len(keys)),
            location=None if loc is None else KVLocation(str(loc[0]), str(loc[1])),
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
