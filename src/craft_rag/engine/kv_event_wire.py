"""vLLM's KV event wire format, decoded and validated.

Each message is ``[topic, seq, payload]``: ``seq`` is 8 bytes big-endian (vLLM counts from 0), the
payload a msgpack array ``[ts, events, dp_rank?]`` whose events are maps tagged by ``"type"``
(``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``; vLLM 0.32 encodes them with msgspec).

The peer is a network publisher, so nothing is trusted: every field the sync uses is checked
(type and range) and a batch with any bad event is refused whole with :class:`MalformedBatch`
(a ``ValueError``), never applied in part; the caller treats it as a lost batch. Unknown event
types and unknown fields are skipped (newer vLLMs add both); a ``medium`` must be one of
:data:`MEDIUMS`. Cost: O(payload) to decode, plus
one type check per token id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from craft_rag.types import BlockHash, as_block_hash

SEQ_BYTES = 8
MAX_BLOCK_SIZE = 1 << 20  # far above any vLLM block size; refuses absurd values early
MAX_TOKEN_ID = (1 << 32) - 1  # token ids are vocabulary indices
MEDIUM_GPU = "GPU"
"""The engine's own KV pool (vLLM says ``GPU`` on every platform, CPU included)."""
MEDIUMS = frozenset({MEDIUM_GPU, "CPU", "STORAGE"})
"""The ``medium`` values vLLM 0.32 defines (``vllm.distributed.kv_events.MEDIUM_*``); a peer's
value is matched case-insensitively (some connectors send ``"cpu"``) and stored upper-case."""
_MAX_EXTRA_ENTRY_ITEMS = 64  # a block's extra keys: LoRA name, salt, a few mm pairs


_MISSING = object()  # a required field the peer left out


class MalformedBatch(ValueError):
    """The message is not a valid KV event batch. The text names the part that is wrong and
    quotes nothing of the payload beyond a short, repr-escaped type tag."""


@dataclass(frozen=True, slots=True)
class BlocksStored:
    """vLLM cached these full blocks (chained: ``parent`` precedes ``hashes[0]``)."""

    hashes: tuple[BlockHash, ...]
    parent: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    extra_keys: tuple[Any, ...] | None = None
    """Per block, the extra hash keys vLLM published (the ``cache_salt`` of a salted prompt's
    first block), untagged; ``None`` when the engine sent none."""
    medium: str | None = None
    """Where the blocks now live: one of :data:`MEDIUMS` (``None``: not said, the pool)."""


@dataclass(frozen=True, slots=True)
class BlocksRemoved:
    """vLLM evicted these blocks from its prefix cache (or a connector's tier: ``medium``)."""

    hashes: tuple[BlockHash, ...]
    medium: str | None = None
    """Where the blocks left: one of :data:`MEDIUMS` (``None``: not said, the pool)."""


@dataclass(frozen=True, slots=True)
class AllCleared:
    """vLLM dropped its whole prefix cache (``reset_prefix_cache``)."""


KVEvent = BlocksStored | BlocksRemoved | AllCleared


@dataclass(frozen=True, slots=True)
class DecodedBatch:
    """One valid payload: its known events in order, and how many unknown ones were skipped."""

    events: list[KVEvent]
    unknown: int


def decode_seq(frame: bytes) -> int:
    """The sequence number of a message. ``MalformedBatch`` unless it is exactly 8 bytes and
    non-negative (vLLM's counter starts at 0; a set top bit is no real sequence number)."""
    if len(frame) != SEQ_BYTES:
        msg = f"sequence frame must be {SEQ_BYTES} bytes, got {len(frame)}"
        raise MalformedBatch(msg)
    seq = int.from_bytes(frame, "big", signed=True)
    if seq < 0:
        msg = "sequence number is negative"
        raise MalformedBatch(msg)
    return seq


def decode_batch(payload: bytes) -> DecodedBatch:
    """Parse and validate one payload (module doc). ``MalformedBatch`` when it is not a KV event
    batch or any known event in it is malformed."""
    import msgpack

    try:
        # Event maps have ~20 keys: a bigger map is garbage, refused before it is built.
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False, max_map_len=1024)
    except Exception as exc:  # msgpack raises several unrelated types
        msg = f"undecodable KV event payload ({len(payload)} bytes): {type(exc).__name__}"
        raise MalformedBatch(msg) from exc
    # Items past dp_rank are a newer vLLM's additions: skipped, as unknown event fields are.
    if not isinstance(batch, list) or len(batch) < 2:
        msg = f"not a KV event batch: {_kind(batch)}"
        raise MalformedBatch(msg)
    ts, raw_events = batch[0], batch[1]
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        msg = f"batch timestamp must be a number, got {_kind(ts)}"
        raise MalformedBatch(msg)
    if not isinstance(raw_events, list):
        msg = f"batch events must be an array, got {_kind(raw_events)}"
        raise MalformedBatch(msg)
    if len(batch) >= 3 and batch[2] is not None and not _is_int(batch[2]):
        msg = f"batch data_parallel_rank must be an int or nil, got {_kind(batch[2])}"
        raise MalformedBatch(msg)
    events: list[KVEvent] = []
    unknown = 0
    for index, raw in enumerate(raw_events):
        try:
            event = _decode_event(raw)
        except MalformedBatch as exc:
            msg = f"event {index}: {exc}"
            raise MalformedBatch(msg) from None
        if event is None:
            unknown += 1
        else:
            events.append(event)
    return DecodedBatch(events, unknown)


def decode_event_batch(payload: bytes) -> list[KVEvent]:
    """Parse one published payload into typed events (unknown types are skipped).
    ``ValueError`` (:class:`MalformedBatch`) when the payload is not a valid KV event batch."""
    return decode_batch(payload).events


def _decode_event(raw: object) -> KVEvent | None:
    if not isinstance(raw, dict):
        msg = f"must be a map, got {_kind(raw)}"
        raise MalformedBatch(msg)
    kind = raw.get("type")
    if not isinstance(kind, str):
        msg = f"'type' must be a string, got {_kind(kind)}"
        raise MalformedBatch(msg)
    if kind == "BlockStored":
        parent = raw.get("parent_block_hash")
        return BlocksStored(
            hashes=_hashes(raw),
            parent=None if parent is None else _hash(parent, "parent_block_hash"),
            token_ids=_token_ids(raw.get("token_ids", _MISSING)),
            block_size=_block_size(raw.get("block_size", _MISSING)),
            extra_keys=_extra_keys(raw.get("extra_keys")),
            medium=_medium(raw.get("medium")),
        )
    if kind == "BlockRemoved":
        return BlocksRemoved(_hashes(raw), _medium(raw.get("medium")))
    if kind == "AllBlocksCleared":
        return AllCleared()
    return None


def _hashes(raw: dict[Any, Any]) -> tuple[BlockHash, ...]:
    value = raw.get("block_hashes", _MISSING)
    if not isinstance(value, list):
        msg = f"'block_hashes' must be an array, got {_kind(value)}"
        raise MalformedBatch(msg)
    return tuple(_hash(h, "block_hashes") for h in value)


def _hash(value: object, name: str) -> BlockHash:
    if not isinstance(value, bytes | int) or isinstance(value, bool):
        msg = f"{name!r}: a block hash must be bytes or an int, got {_kind(value)}"
        raise MalformedBatch(msg)
    try:
        return as_block_hash(value, repr(name))
    except ValueError as exc:
        raise MalformedBatch(str(exc)) from None


def _token_ids(value: object) -> tuple[int, ...]:
    if not isinstance(value, list):
        msg = f"'token_ids' must be an array, got {_kind(value)}"
        raise MalformedBatch(msg)
    ids = tuple(value)
    # One C-speed pass per check: type() of every id, then the range.
    if ids and (
        not all(type(t) is int for t in ids) or min(ids) < 0 or max(ids) > MAX_TOKEN_ID
    ):
        msg = f"'token_ids' must be ints in 0..{MAX_TOKEN_ID}"
        raise MalformedBatch(msg)
    return ids


def _block_size(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_BLOCK_SIZE:
        msg = f"'block_size' must be an int in 1..{MAX_BLOCK_SIZE}, got {_kind(value)}"
        raise MalformedBatch(msg)
    return value


def _medium(value: object) -> str | None:
    if value is None:
        return None
    medium = value.upper() if isinstance(value, str) and len(value) <= 16 else None
    if medium not in MEDIUMS:
        msg = f"'medium' must be one of {sorted(MEDIUMS)} or nil, got {_kind(value)}"
        raise MalformedBatch(msg)
    return medium


def _extra_keys(value: object) -> tuple[Any, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        msg = f"'extra_keys' must be an array or nil, got {_kind(value)}"
        raise MalformedBatch(msg)
    out: list[Any] = []
    for entry in value:
        if entry is None:
            out.append(None)
        elif isinstance(entry, list) and len(entry) <= _MAX_EXTRA_ENTRY_ITEMS:
            out.append(tuple(entry))
        else:
            msg = f"'extra_keys' entries must be short arrays or nil, got {_kind(entry)}"
            raise MalformedBatch(msg)
    return tuple(out)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _kind(value: object) -> str:
    """A short, safe description of a peer's value: its type (and an int's sign/size)."""
    if value is _MISSING:
        return "nothing (missing)"
    if _is_int(value):
        return f"int {value}" if abs(value) < 1 << 64 else "a huge int"  # type: ignore[arg-type]
    if isinstance(value, str):
        return f"str {value[:40]!r}"
    return type(value).__name__
