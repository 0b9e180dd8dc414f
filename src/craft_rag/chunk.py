"""Chunk identity: the atomic unit CRAFT reorders, deduplicates and caches.

A chunk key is the caller's id when one is given (e.g. ``"doc-17:2048"``: document id plus
offset), otherwise ``"sha256:" + sha256(text)``. Keys never use Python's ``hash()``, so they are
stable across processes and restarts. The same text under two different ids is two chunks: the
caller's id is authoritative, because two documents may legitimately share a paragraph while
carrying different metadata.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from craft_rag.types import ChunkKey

CONTENT_KEY_PREFIX = "sha256:"


def content_key(text: str) -> ChunkKey:
    """Key of a chunk that has no caller id: ``sha256:<hex of the UTF-8 text>``. O(len(text))."""
    return ChunkKey(CONTENT_KEY_PREFIX + hashlib.sha256(text.encode("utf-8")).hexdigest())


@dataclass(frozen=True, slots=True)
class Chunk:
    """One retrieved passage.

    Invariants: ``key`` is a non-empty string; ``text`` is a string (may be empty only when a
    caller id is given); ``num_tokens`` is ``None`` or >= 0.
    """

    key: ChunkKey
    text: str
    score: float | None = None
    num_tokens: int | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)


def make_chunk(
    text: str | None = None,
    *,
    id: str | None = None,
    score: float | None = None,
    num_tokens: int | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> Chunk:
    """Build a :class:`Chunk`, keyed by ``id`` when given, else by the text's sha256.

    Raises ``ValueError`` naming the field when neither ``id`` nor ``text`` is given, when ``id``
    or ``text`` is not a string, or when ``num_tokens`` is negative.
    """
    if id is None and text is None:
        msg = "chunk needs an 'id' or a 'text' field (got neither)"
        raise ValueError(msg)
    if id is not None and (not isinstance(id, str) or not id):
        msg = f"chunk 'id' must be a non-empty string, got {id!r} ({type(id).__name__})"
        raise ValueError(msg)
    if text is not None and not isinstance(text, str):
        msg = f"chunk 'text' must be a string, got {type(text).__name__}"
        raise ValueError(msg)
    if num_tokens is not None and (
        not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 0
    ):
        msg = f"chunk 'num_tokens' must be a non-negative int, got {num_tokens!r}"
        raise ValueError(msg)
    if score is not None and (not isinstance(score, (int, float)) or isinstance(score, bool)):
        msg = f"chunk 'score' must be a number, got {type(score).__name__}"
        raise ValueError(msg)
    key = ChunkKey(id) if id is not None else content_key(text or "")
    return Chunk(
        key=key,
        text=text if text is not None else "",
        score=float(score) if score is not None else None,
        num_tokens=num_tokens,
        metadata=dict(metadata or {}),
    )
