"""Chunk-Access Table (CA-Table, paper §4.1): access counts over a sliding window of requests."""

from __future__ import annotations

import json
from collections import _count_elements, deque  # type: ignore[attr-defined]
from collections.abc import Iterable, Sequence
from typing import Any

from craft_rag.types import ChunkKey
from craft_rag.validation import (
    check_optional_int,
    materialise,
    state_dict,
    state_format,
    state_keys,
    state_list,
    state_path,
)

DEFAULT_WINDOW = 1000
_FORMAT = "craft-rag/access-table/v1"


class ChunkAccessTable:
    """Counts how many of the last ``window`` requests retrieved each chunk.

    Invariants (checked by :meth:`_check_invariants`):
    - at most ``window`` requests are windowed (``window=None`` means unlimited);
    - ``self._counts[c]`` equals the number of windowed requests containing ``c``;
    - every count is >= 1: a chunk whose count reaches 0 leaves the table.

    Memory is O(distinct chunks in the window + total chunks in the window): the windowed
    requests are kept flat, every key in one deque (8 bytes a key) plus one length per request,
    not a tuple per request (+40 bytes each). Owner: only
    :meth:`record` and :meth:`from_json` mutate state.
    """

    __slots__ = ("_counts", "_keys", "_lengths", "window")

    def __init__(self, window: int | None = DEFAULT_WINDOW) -> None:
        self.window = check_optional_int(window, "window", minimum=1, none_means="unlimited")
        self._counts: dict[ChunkKey, int] = {}
        self._keys: deque[ChunkKey] = deque()  # the windowed requests' keys, oldest first
        self._lengths: deque[int] = deque()  # each windowed request's key count, oldest first

    def record(self, keys: Iterable[ChunkKey]) -> None:
        """Add one request: +1 for each distinct key; expire the oldest request if the window
        is full. O(k) for k keys (amortised; expiry touches the expired request's keys once).
        ``ValueError`` (nothing recorded) unless every key is a non-empty string."""
        request = tuple(dict.fromkeys(materialise(keys, "keys")))
        if not all(type(key) is str and key for key in request):  # one pass; subclasses below
            for i, key in enumerate(request):
                if not isinstance(key, str) or not key:
                    msg = f"keys[{i}]: must be a non-empty string (a chunk key), got {key!r}"
                    raise ValueError(msg)
        self._add(request)

    def _add(self, request: tuple[ChunkKey, ...]) -> None:
        """:meth:`record` for a request the caller already checked (distinct non-empty string
        keys, as the planner's commit holds them): no second pass over it. O(k)."""
        counts = self._counts
        _count_elements(counts, request)  # +1 each, at C level (what Counter.update runs)
        self._keys.extend(request)
        lengths = self._lengths
        lengths.append(len(request))
        if self.window is not None and len(lengths) > self.window:
            pop = self._keys.popleft
            for _ in range(lengths.popleft()):
                key = pop()
                if counts[key] == 1:
                    del counts[key]
                else:
                    counts[key] -= 1

    def count(self, key: ChunkKey) -> int:
        """Access count of ``key`` in the window (0 if absent). O(1)."""
        try:
            return self._counts.get(key, 0)
        except TypeError:
            msg = f"key: must be a chunk key (string), got {type(key).__name__}"
            raise ValueError(msg) from None

    def counts(self, keys: Sequence[ChunkKey]) -> list[int]:
        """Counts of several keys, in order. O(k)."""
        get = self._counts.get
        try:
            return [get(key, 0) for key in keys]
        except TypeError:
            msg = "keys: must be an iterable of chunk keys (strings)"
            raise ValueError(msg) from None

    def __len__(self) -> int:
        """Number of distinct chunks in the window."""
        return len(self._counts)

    def __contains__(self, key: object) -> bool:
        return key in self._counts

    @property
    def requests_in_window(self) -> int:
        return len(self._lengths)

    def _windowed(self) -> list[list[ChunkKey]]:
        """The windowed requests' keys, oldest first. O(window * k)."""
        keys = iter(self._keys)
        return [[next(keys) for _ in range(n)] for n in self._lengths]

    def to_json(self) -> dict[str, Any]:
        """Plain-JSON state (the windowed requests; counts are derived on load). O(window * k)."""
        return {
            "format": _FORMAT,
            "window": self.window,
            "requests": self._windowed(),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], *, path: str = "") -> ChunkAccessTable:
        """Rebuild a table saved by :meth:`to_json`, validating all of it first: one
        ``ValueError`` naming the JSON path (under ``path``) of the first bad field (a foreign
        format, a bad window, more requests than the window, a non-string or repeated key).
        O(window * k)."""
        state_format(data, path, _FORMAT, "access table")
        state_dict(data, path, required=("format", "window", "requests"))
        window_path = state_path(path, "window")
        try:
            table = cls(window=data["window"])
        except ValueError as exc:
            raise ValueError(f"{window_path}{str(exc).removeprefix('window')}") from None
        requests_path = state_path(path, "requests")
        requests = state_list(data["requests"], requests_path, max_len=table.window)
        parsed = [
            state_keys(request, state_path(requests_path, i))
            for i, request in enumerate(requests)
        ]
        for request in parsed:
            table.record(ChunkKey(key) for key in request)
        return table

    def dumps(self) -> str:
        return json.dumps(self.to_json())

    @classmethod
    def loads(cls, text: str) -> ChunkAccessTable:
        return cls.from_json(json.loads(text))

    def _check_invariants(self) -> None:
        if self.window is not None:
            assert len(self._lengths) <= self.window
        assert sum(self._lengths) == len(self._keys)
        recount: dict[ChunkKey, int] = {}
        for request in self._windowed():
            assert len(set(request)) == len(request), "a request counts each chunk once"
            for key in request:
                recount[key] = recount.get(key, 0) + 1
        assert recount == self._counts, "counts drifted from the windowed requests"
        assert all(count >= 1 for count in self._counts.values())
