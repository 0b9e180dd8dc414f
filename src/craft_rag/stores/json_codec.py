"""Strict JSON for what a store hands back: only what craft-rag itself writes is accepted.

``json.loads`` accepts text craft-rag never writes and that other JSON readers read
differently: ``NaN``/``Infinity``, an object with a repeated key (the last one silently wins),
and nesting deep enough to raise ``RecursionError``. :func:`loads_strict` turns each into a
``ValueError`` the store decoders report as :class:`~craft_rag.stores.base.StoreCorrupted`.
Cost: the C decoder plus one small Python call per JSON object (a commit entry has one).
"""

from __future__ import annotations

import json
from typing import Any

MAX_STORED_INT = 2**63 - 1
"""The largest integer a store field may hold (a signed 64-bit seq, count or token id)."""


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"field {key[:40]!r} appears twice")
            seen.add(key)
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number craft-rag writes")


# Built once: ``json.loads`` with arguments builds a decoder per call (~8 µs).
_DECODER = json.JSONDecoder(object_pairs_hook=_unique, parse_constant=_no_constant)


def loads_strict(text: str) -> Any:
    """``text`` decoded; ``ValueError`` for malformed JSON, ``NaN``/``Infinity``, a repeated
    object key or nesting beyond the interpreter's recursion limit."""
    try:
        return _DECODER.decode(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def is_stored_int(value: Any, minimum: int = 0) -> bool:
    """``value`` is an ``int`` (not a ``bool``) in ``[minimum, MAX_STORED_INT]``."""
    return type(value) is int and minimum <= value <= MAX_STORED_INT


def preview(value: object, limit: int = 40) -> str:
    """``repr(value)`` cut to ``limit`` characters: tampered data is named, never echoed
    whole (it may be megabytes, or text meant to mislead a reader of the log)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
