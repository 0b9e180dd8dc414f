"""The codec of a conversation's stored prompt history (what a worker needs to render its next
turn), kept in the store beside the conversation record.

Owners: the store's copy is written only by the worker that last committed a turn of the
conversation (:meth:`craft_rag.engine.engine.CraftEngine` after ``ConversationPrompts.complete``),
stamped with a ``version`` (a log seq at least the conversation's last committed seq then) and
kept only if newer than the stored one; each worker's local copy is owned by its
:class:`craft_rag.engine.conversation_prompts.ConversationPrompts`, which replaces it from the
store when the store's conversation record moved past the local copy's version.

The JSON is ``{"t": [[token ids] per turn], "k": [[chunk keys] per turn], "d": dropped}`` with
``dropped`` the turns dropped since the last served turn (reported by the next one). A value
this version did not write is :class:`~craft_rag.stores.base.StoreCorrupted` naming the
conversation.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from craft_rag.stores.base import StateStore, StoreCorrupted, StoreUnavailable
from craft_rag.types import ChunkKey

if TYPE_CHECKING:
    from craft_rag.engine.conversation_prompts import ConversationPrompts
    from craft_rag.planner import CraftPlanner

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
        return f"store {self.store.url} namespace {self.namespace!r}"


@dataclass(frozen=True, slots=True)
class StoredHistory:
    """One conversation's turns as the store holds them (decoded, validated)."""

    turns: tuple[tuple[int, ...], ...]
    keys: tuple[tuple[ChunkKey, ...], ...]
    dropped_since: int = 0

    def to_json(self) -> str:
        data = {"t": [list(t) for t in self.turns], "k": [list(k) for k in self.keys],
                "d": self.dropped_since}
        return json.dumps(data, separators=(",", ":"))


def _turn(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        type(t) is int and t >= 0 for t in value
    ):
        raise TypeError("a turn must be a list of token ids (ints >= 0)")
    return tuple(value)


def _keys(value: Any) -> tuple[ChunkKey, ...]:
    if not isinstance(value, list) or not all(isinstance(k, str) and k for k in value):
        raise TypeError("a turn's chunk keys must be a list of non-empty strings")
    return tuple(ChunkKey(k) for k in value)


def decode_history(data: str, conversation: str, where: str) -> StoredHistory:
    """The history in ``data``; :class:`StoreCorrupted` naming ``where`` (store and namespace)
    and the conversation when it is not one this version wrote. O(tokens)."""
    try:
        raw = json.loads(data)
        if not isinstance(raw, dict):
            raise TypeError("not a JSON object")
        turns = raw["t"]
        keys = raw["k"]
        dropped = raw["d"]
        if not isinstance(turns, list) or not isinstance(keys, list) or len(turns) != len(keys):
            raise TypeError("turns and keys must be lists of the same length")
        if type(dropped) is not int or dropped < 0:
            raise TypeError("the dropped-turn count must be an int >= 0")
        return StoredHistory(
            tuple(_turn(t) for t in turns), tuple(_keys(k) for k in keys), dropped
        )
    except (ValueError, TypeError, KeyError) as e:
        msg = (
            f"{where}: the stored prompt history of conversation {conversation!r} is not one "
            f"craft-rag wrote ({e}); end the conversation (end_conversation) or clear the "
            "namespace"
        )
        raise StoreCorrupted(msg) from e


def encode_history(
    turns: Sequence[Sequence[int]], keys: Sequence[Sequence[ChunkKey]], dropped_since: int
) -> str:
    return StoredHistory(
        tuple(tuple(t) for t in turns), tuple(tuple(k) for k in keys), dropped_since
    ).to_json()


def shared_position(planner: CraftPlanner) -> SharedPosition | None:
    """The planner's :class:`SharedPosition` (None for a local planner)."""
    return planner.shared_position()


def load_history(
    prompts: ConversationPrompts,
    planner: CraftPlanner,
    conversation_id: str | None,
    cache_salt: str | None,
) -> bool:
    """Before rendering (or fitting) a turn: when the store's record of ``conversation_id``
    moved past the local history's version and the store holds a newer history (another worker
    served a turn), replace the local copy by it. True when replaced. One round trip with a
    sharing planner, nothing otherwise. :class:`StoreCorrupted` (nothing changed) for a stored
    history this version did not write."""
    if conversation_id is None:
        return False
    position = shared_position(planner)
    if position is None:
        return False
    record = position.store.get_history(position.namespace, conversation_id)
    local = prompts.version(conversation_id)
    if record.last_seq <= local or record.data is None or record.version <= local:
        return False
    stored = decode_history(record.data, conversation_id, position.where)
    return prompts.adopt(conversation_id, stored, record.version, cache_salt)


def save_history(
    prompts: ConversationPrompts, planner: CraftPlanner, conversation_id: str | None
) -> bool:
    """After a turn was committed and completed: store the conversation's history at the
    planner's applied seq (at least the turn's own and its budget drops' seqs), so the next
    turn renders the same prompt on any worker. True when stored. An unreachable store is
    logged, not raised: the turn is already committed and served (other workers then render
    the older stored history; see docs/deployment.md)."""
    if conversation_id is None:
        return False
    position = shared_position(planner)
    if position is None:
        return False
    stored = prompts.export(conversation_id, position.seq)
    if stored is None:
        return False
    try:
        return position.store.put_history(
            position.namespace, conversation_id, position.seq, stored.to_json(), position.ttl_s
        )
    except StoreUnavailable as e:
        logger.warning("%s: the prompt history of conversation %r was not stored (%s); "
                       "its next turn on another worker misses this turn", position.where,
                       conversation_id, e)
        return False
