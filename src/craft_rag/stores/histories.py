"""The codec of a conversation's stored prompt history (what a worker needs to render its next
turn), kept in the store beside the conversation record.

Owners: the store's copy is written only by the worker that last committed a turn of the
conversation (the engine's RAG turn, after the commit), stamped with a ``version`` (a log seq at
least the conversation's last committed seq then) and kept only if newer than the stored one.
Each worker's copy lives in its planner's one conversation store
(:class:`craft_rag.conversation.ConversationStore`): the committing worker records a turn's
tokens with its keys; another worker replays the keys from the commit log and fills the tokens
from this copy (:func:`load_history`) when the store's record moved past its own version.

The JSON is ``{"t": [[token ids] per live turn], "k": [[chunk keys] per live turn], "d":
dropped, "n": turns}`` with ``dropped`` the turns dropped since the last served turn (reported
by the next one) and ``turns`` every turn of the conversation then (which turns ``t`` holds;
optional). A value this version did not write is :class:`~craft_rag.stores.base.StoreCorrupted`
naming the conversation.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from craft_rag.conversation import ConversationHistory
from craft_rag.stores.base import StoreCorrupted, StoreUnavailable
from craft_rag.stores.json_codec import is_stored_int, loads_strict

# Lives with the shared-store log (the planner reads it without importing this module, which
# reads planners); still importable from here.
from craft_rag.stores.shared import SharedPosition as SharedPosition
from craft_rag.types import ChunkKey, ConversationId

if TYPE_CHECKING:
    from craft_rag.planner import CraftPlanner

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StoredHistory:
    """One conversation's turns as the store holds them (decoded, validated)."""

    turns: tuple[tuple[int, ...], ...]
    keys: tuple[tuple[ChunkKey, ...], ...]
    dropped_since: int = 0
    turn_count: int | None = None
    """Every turn of the conversation when stored (None: the live turns are its last)."""

    def to_json(self) -> str:
        data: dict[str, Any] = {
            "t": [list(t) for t in self.turns], "k": [list(k) for k in self.keys],
            "d": self.dropped_since,
        }
        if self.turn_count is not None:
            data["n"] = self.turn_count
        return json.dumps(data, separators=(",", ":"))


def _turn(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(is_stored_int(t) for t in value):
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
        raw = loads_strict(data)  # no NaN, no repeated field, bounded nesting
        if not isinstance(raw, dict):
            raise TypeError("not a JSON object")
        turns = raw["t"]
        keys = raw["k"]
        dropped = raw["d"]
        if not isinstance(turns, list) or not isinstance(keys, list) or len(turns) != len(keys):
            raise TypeError("turns and keys must be lists of the same length")
        if not is_stored_int(dropped):
            raise TypeError("the dropped-turn count must be an int >= 0")
        count = raw.get("n")
        if count is not None and (not is_stored_int(count) or count < len(turns)):
            raise TypeError("the turn count must be an int >= the stored turns")
        return StoredHistory(
            tuple(_turn(t) for t in turns), tuple(_keys(k) for k in keys), dropped, count
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


LOST_HISTORY_GRACE_S = 30.0
"""How long after a turn was committed its token ids may still be on their way to the store
(the committing worker stores them right after its commit); past that, a turn whose ids no
worker can load is given up (:func:`load_history`)."""


def load_history(planner: CraftPlanner, conversation_id: str | None) -> bool:
    """Before rendering (or fitting) a turn: when the store's record of ``conversation_id``
    moved past the local history's version and the store holds a newer history (another worker
    served a turn), bring the planner up to date and fill the token ids of its live turns from
    it. True when filled. One round trip with a sharing planner (two when filling), nothing
    otherwise. :class:`StoreCorrupted` (nothing changed) for a stored history this version did
    not write.

    A conversation must stay usable whatever happened to a turn's ids (its worker died between
    commit and store, the store failed that write): a live turn whose ids are still unknown
    here afterwards, ``LOST_HISTORY_GRACE_S`` after the conversation's last commit, is
    forgotten with the turns before it (``forget_turns``: logged, so every worker drops them
    alike); their chunks count as new again and the next turn re-sends them. A conversation
    with a turn in flight is left alone."""
    if conversation_id is None:
        return False
    position = shared_position(planner)
    if position is None:
        return False
    cid = ConversationId(conversation_id)
    filled = _fill(planner, position, cid)
    _give_up_lost_turns(planner, position, cid)
    return filled


def _give_up_lost_turns(
    planner: CraftPlanner, position: SharedPosition, cid: ConversationId
) -> int:
    """Forget the live turns up to the last one whose token ids are unknown here, once they
    can no longer arrive (see :func:`load_history`). Returns the turns forgotten."""
    history = planner.conversations.history(cid)
    if history is None or history.in_flight or None not in history.turns:
        return 0
    if planner.now() - history.last_used < LOST_HISTORY_GRACE_S:
        return 0  # the committing worker may still be storing them
    n = max(i for i, t in enumerate(history.turns) if t is None) + 1
    logger.warning("%s: conversation %r: the token ids of %d turn(s) were never stored (their "
                   "worker failed after committing); they are dropped from its prompt and "
                   "their chunks sent again", position.where, str(cid), n)
    return planner.forget_turns(cid, n)


def _fill(planner: CraftPlanner, position: SharedPosition, cid: ConversationId) -> bool:
    conversation_id = str(cid)
    record = position.store.get_history(position.namespace, conversation_id)
    local = planner.conversations.history(cid)
    version = local.version if local is not None else 0
    if record.last_seq <= version or record.data is None or record.version <= version:
        return False
    stored = decode_history(record.data, conversation_id, position.where)
    planner.sync()  # the turns' keys, from the log, at least up to the history's version
    local = planner.conversations.history(cid)
    count = stored.turn_count
    if count is None:
        count = local.turn_count if local is not None else len(stored.turns)
    view = ConversationHistory(
        stored.turns, stored.keys, count, stored.dropped_since, False, record.version
    )
    return planner.conversations.adopt(cid, view, record.version)


def save_history(planner: CraftPlanner, conversation_id: str | None) -> bool:
    """After a turn was committed (and its budget drops forgotten): store the conversation's
    history at the planner's applied seq (at least the turn's own and its drops' seqs), so the
    next turn renders the same prompt on any worker. True when stored. An unreachable store is
    logged, not raised: the turn is already committed and served (other workers then refuse
    to render the turn they miss; see docs/deployment.md)."""
    if conversation_id is None:
        return False
    position = shared_position(planner)
    if position is None:
        return False
    exported = planner.conversations.export(ConversationId(conversation_id), position.seq)
    if exported is None:
        return False
    history, count = exported
    turns = tuple(t for t in history.turns if t is not None)
    stored = StoredHistory(turns, history.keys, history.dropped_since, count)
    try:
        return position.store.put_history(
            position.namespace, conversation_id, position.seq, stored.to_json(), position.ttl_s
        )
    except StoreUnavailable as e:
        logger.warning("%s: the prompt history of conversation %r was not stored (%s); "
                       "its next turn on another worker misses this turn", position.where,
                       conversation_id, e)
        return False
