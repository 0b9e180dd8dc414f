"""Content keys of KV blocks: a hash chain over a prompt's full blocks, salted per tenant.

A block's key names the block *and its whole prefix*: ``key_0 = sha256(TAG + salt + tokens_0)``,
``key_j = sha256(key_{j-1} + tokens_j)``. Two blocks share a key only if every token before and in
them is equal and they were keyed under the same salt, so a tier hit is exact (up to sha256
collisions) and tenants with different salts never share an entry.

Encoding (stable across processes and machines; no Python ``hash()``): the salt is its UTF-8 bytes
after a 4-byte little-endian length (length 0 means "no salt"; the empty salt is rejected so the
two cannot be confused); token ids are little-endian signed 64-bit integers. Only *full* blocks
are keyed: a trailing partial block has no key (its KV would change when the block fills).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import NewType

BlockKey = NewType("BlockKey", bytes)
"""sha256 digest (32 bytes) of a block and its prefix; see :func:`chain_keys`."""

KEY_BYTES = 32
KEY_TAG = b"craft-kv-v1"
_MAX_TOKEN = 2**63 - 1


def encode_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian int64 bytes (the key and the disk header use this form).

    Raises ``ValueError`` for an id outside ``[0, 2**63)``. Cost: O(len(token_ids)).
    """
    for token in token_ids:
        if not 0 <= token <= _MAX_TOKEN:
            msg = f"token id {token} is outside [0, 2**63); pass the tokenizer's ids"
            raise ValueError(msg)
    return struct.pack(f"<{len(token_ids)}q", *token_ids)


def salt_bytes(salt: str | None) -> bytes:
    """The salt's length-prefixed UTF-8 form; ``None`` (no salt) is a zero length.

    Raises ``ValueError`` for the empty string, which would otherwise look like no salt.
    """
    if salt is None:
        return struct.pack("<I", 0)
    if salt == "":
        msg = "salt must be None (no salt) or a non-empty string; got ''"
        raise ValueError(msg)
    raw = salt.encode("utf-8")
    return struct.pack("<I", len(raw)) + raw


def chain_keys(token_ids: Sequence[int], block_size: int, salt: str | None) -> list[BlockKey]:
    """Keys of the full ``block_size``-token blocks of ``token_ids``, in order.

    ``len(result) == len(token_ids) // block_size``; the keys of a prompt's first blocks equal
    the keys of any prompt that starts with the same tokens (same salt). Raises ``ValueError``
    for ``block_size < 1``, the empty salt or a token id outside int64.
    Cost: O(len(token_ids)) hashing, one sha256 per block.
    """
    if block_size < 1:
        msg = f"block_size must be >= 1, got {block_size}"
        raise ValueError(msg)
    head = KEY_TAG + salt_bytes(salt)
    keys: list[BlockKey] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = encode_tokens(token_ids[start : start + block_size])
        prefix = keys[-1] if keys else head
        keys.append(BlockKey(hashlib.sha256(prefix + block).digest()))
    return keys
