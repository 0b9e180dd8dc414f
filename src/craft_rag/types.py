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

CacheSalt = NewType("CacheSalt", str)
"""A vLLM ``cache_salt``: prefix-cache entries are shared only between requests with the same
salt (tenants, users). Checked by :func:`craft_rag.validation.validate_cache_salt`."""

BlockHash = NewType("BlockHash", bytes)
"""An engine's hash of one full KV block, as vLLM reports it in KV cache events.

vLLM may report hashes as ``int`` or ``bytes`` depending on the hash function; adapters
normalise them with :func:`craft_rag.types.as_block_hash` before they reach the core.
"""


_MAX_HASH_BYTES = 64


def as_block_hash(value: bytes | int, name: str = "block hash") -> BlockHash:
    """Normalise an engine block hash to the canonical :data:`BlockHash` (``bytes``).

    vLLM reports ``bytes`` in process (sha256-based hashes) and 64-bit ``int``s from the
    OpenAI server's KV events (builtin hash); an int becomes its minimal signed big-endian
    bytes, so the same int always maps to the same bytes and state files store one type (hex).
    ``ValueError`` naming ``name`` for anything else: ``str``, ``bool``, ``float``, empty bytes,
    or more than 64 bytes / a 512-bit int. O(len).
    """
    if isinstance(value, bytes):
        if not 0 < len(value) <= _MAX_HASH_BYTES:
            msg = f"{name}: must be 1 to {_MAX_HASH_BYTES} bytes, got {len(value)} bytes"
            raise ValueError(msg)
        return BlockHash(value)
    if isinstance(value, int) and not isinstance(value, bool):
        if value.bit_length() >= 8 * _MAX_HASH_BYTES:
            msg = f"{name}: int hash wider than {8 * _MAX_HASH_BYTES} bits"
            raise ValueError(msg)
        length = max(1, (value.bit_length() + 8) // 8)
        return BlockHash(value.to_bytes(length, "big", signed=True))
    msg = (
        f"{name}: must be bytes or int (as vLLM reports block hashes), "
        f"got {type(value).__name__}"
    )
    raise ValueError(msg)
