"""Identifier types shared by every craft-rag module.

NewTypes cost nothing at run time; they let mypy catch a conversation id passed where a
chunk key was expected.
"""

from __future__ import annotations

from typing import NewType

ChunkKey = NewType("ChunkKey", str)
"""Globally unique, process-stable identity of a chunk (see :mod:`craft_rag.chunk`)."""

ConversationId = NewType("ConversationId", str)
"""Caller-chosen id of a multi-turn conversation."""

BlockHash = NewType("BlockHash", bytes)
"""An engine's hash of one full KV block, as vLLM reports it in KV cache events.

vLLM may report hashes as ``int`` or ``bytes`` depending on the hash function; adapters
normalise them with :func:`craft_rag.types.as_block_hash` before they reach the core.
"""


def as_block_hash(value: bytes | int) -> BlockHash:
    """Normalise an engine block hash (bytes, or int for builtin-hash engines) to bytes."""
    if isinstance(value, bytes):
        return BlockHash(value)
    if isinstance(value, int):
        length = max(1, (value.bit_length() + 8) // 8)
        return BlockHash(value.to_bytes(length, "big", signed=True))
    msg = f"block hash must be bytes or int, got {type(value).__name__}"
    raise ValueError(msg)
