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
from craft_rag.validation import check_int, check_number, check_text

CONTENT_KEY_PREFIX = "sha256:"


def content_key(text: str) -> ChunkKey:
    """Key of a chunk that has no caller id: ``sha256:<hex of the UTF-8 text>``. O(len(text))."""
    return ChunkKey(CONTENT_KEY_PREFIX + hashlib.sha256(text.encode("utf-8")).hexdigest())


@dataclass(frozen=True, slots=True)
class Chunk:
    """One retrieved passage.

    Invariants (checked at construction, ``ValueError`` naming the field): ``key`` is a
    non-empty string and ``text`` a string, both valid Unicode (no lone surrogates, which no
    tokenizer accepts); ``score`` is ``None`` or a finite number; ``num_tokens`` is ``None`` or
    an int >= 0; ``metadata`` is a mapping. Bools are refused where numbers are meant. Cost:
    O(len(text)) for non-ASCII text, O(1) otherwise.
    """

    key: ChunkKey
    text: str
    score: float | None = None
    num_tokens: int | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        check_text(self.key, "Chunk.key", nonempty=True)
        check_text(self.text, "Chunk.text")
        if self.score is not None:
            check_number(self.score, "Chunk.score")
        if self.num_tokens is not None:
            check_int(self.num_tokens, "Chunk.num_tokens", minimum=0)
        if not isinstance(self.metadata, Mapping):
            msg = f"Chunk.metadata: must be a mapping, got {type(self.metadata).__name__}"
            raise ValueError(msg)


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
    if id is not None:
        check_text(id, "chunk 'id'", nonempty=True)
    if text is not None:
        check_text(text, "chunk 'text'")
    if num_tokens is not None:
        check_int(num_tokens, "chunk 'num_tokens'", minimum=0)
    if score is not None:
        check_number(score, "chunk 'score'")
    if metadata is not None and not isinstance(metadata, Mapping):
        msg = f"chunk 'metadata': must be a mapping, got {type(metadata).__name__}"
        raise ValueError(msg)
    key = ChunkKey(id) if id is not None else content_key(text or "")
    return Chunk(
        key=key,
        text=text if text is not None else "",
        score=float(score) if score is not None else None,
        num_tokens=num_tokens,
        metadata=dict(metadata or {}),
    )
