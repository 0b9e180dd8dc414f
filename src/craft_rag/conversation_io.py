"""The JSON codec of :class:`craft_rag.conversation.ConversationStore` (validation of saved
state; see :meth:`ConversationStore.from_json`)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from craft_rag.conversation_types import _FORMAT, ConversationState
from craft_rag.types import ChunkKey, ConversationId
from craft_rag.validation import (
    state_dict,
    state_error,
    state_format,
    state_int,
    state_keys,
    state_list,
    state_number,
    state_path,
    validate_conversation_id,
)


def states_from_json(
    data: dict[str, Any], clock: Callable[[], float], path: str
) -> tuple[int, float | None, OrderedDict[ConversationId, ConversationState]]:
    """``(max_conversations, ttl_s, states)`` of a saved store, all of it validated first
    (one ``ValueError`` naming the JSON path of the first bad field). O(size)."""
    state_format(data, path, _FORMAT, "conversation state")
    state_dict(data, path, required=("format", "max_conversations", "ttl_s", "conversations"))
    for name in ("max_conversations", "ttl_s"):
        value = data[name]
        if name == "ttl_s" and value is None:
            continue
        if name == "max_conversations":
            state_int(value, state_path(path, name), minimum=1)
        else:
            state_number(value, state_path(path, name), positive=True)
    max_conversations: int = data["max_conversations"]
    items_path = state_path(path, "conversations")
    items = state_list(data["conversations"], items_path, max_len=max_conversations)
    states: OrderedDict[ConversationId, ConversationState] = OrderedDict()
    last = float("-inf")
    for i, raw in enumerate(items):
        where = state_path(items_path, i)
        item = state_dict(
            raw,
            where,
            required=("id", "turns", "last_used"),
            optional=("live_from", "tokens", "dropped", "version"),
        )
        id_path = state_path(where, "id")
        try:
            cid = validate_conversation_id(item["id"], id_path)
        except ValueError as exc:
            raise state_error(id_path, str(exc).removeprefix(f"{id_path}: ")) from None
        if cid is None:
            raise state_error(id_path, "must be a non-empty string, got None")
        if cid in states:
            raise state_error(id_path, f"repeats conversation id {cid!r}")
        turns_path = state_path(where, "turns")
        turns = [
            tuple(ChunkKey(k) for k in state_keys(t, state_path(turns_path, j)))
            for j, t in enumerate(state_list(item["turns"], turns_path))
        ]
        live_from = state_int(
            item.get("live_from", 0),
            state_path(where, "live_from"),
            minimum=0,
            maximum=len(turns),
        )
        last_used = state_number(item["last_used"], state_path(where, "last_used"))
        if last_used < last:
            raise state_error(
                state_path(where, "last_used"),
                f"{last_used} is earlier than the conversation before it ({last}); "
                "conversations are saved least recently used first",
            )
        last = last_used
        states[cid] = ConversationState(
            sent={k for t in turns[live_from:] for k in t},
            turns=turns,
            last_used=last_used,
            live_from=live_from,
            tokens=_tokens(item.get("tokens"), len(turns), live_from, where),
            dropped_since=state_int(
                item.get("dropped", 0), state_path(where, "dropped"), minimum=0
            ),
            version=state_int(item.get("version", 0), state_path(where, "version"), minimum=0),
        )
    # Times past this process's clock (saved by a process whose clock ran ahead, e.g. a
    # monotonic clock before a reboot) are brought back to now, keeping their order.
    now = clock()
    for state in states.values():
        state.last_used = min(state.last_used, now)
    return max_conversations, data["ttl_s"], states


def _tokens(
    value: Any, turns: int, live_from: int, where: str
) -> list[tuple[int, ...] | None]:
    """The saved token ids of a conversation's turns (None: none saved)."""
    if value is None:
        return [None] * turns
    path = state_path(where, "tokens")
    items = state_list(value, path)
    if len(items) != turns:
        raise state_error(path, f"has {len(items)} items for {turns} turns; one per turn")
    out: list[tuple[int, ...] | None] = []
    for i, ids in enumerate(items):
        if ids is None:
            out.append(None)
            continue
        if i < live_from:
            raise state_error(state_path(path, i), "a dropped turn keeps no token ids (null)")
        if not isinstance(ids, list) or not all(type(t) is int and t >= 0 for t in ids):
            raise state_error(state_path(path, i), "must be a list of token ids (ints >= 0)")
        out.append(tuple(ids))
    return out
