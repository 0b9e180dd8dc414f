"""Chunk-Access Table (CA-Table, paper §4.1): access counts over a sliding window of requests."""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

from craft_rag.types import ChunkKey

DEFAULT_WINDOW = 1000
_FORMAT = "craft-rag/access-table/v1"


class ChunkAccessTable:
    """Counts how many of the last ``window`` requests retrieved each chunk.

    Invariants (checked by :meth:`_check_invariants`):
    - ``len(self._requests) <= window`` (``window=None`` means unlimited);
    - ``self._counts[c]`` equals the number of windowed requests containing ``c``;
    - every count is >= 1: a chunk whose count reaches 0 leaves the table.

    Memory is O(distinct chunks in the window + total chunks in the window). Owner: only
    :meth:`record` and :meth:`load` mutate state.
    """

    __slots__ = ("_counts", "_requests", "window")

    def __init__(self, window: int | None = DEFAULT_WINDOW) -> None:
        if window is not None and (not isinstance(window, int) or window < 1):
            msg = f"window must be a positive int or None (unlimited), got {window!r}"
            raise ValueError(msg)
        self.window = window
        self._counts: dict[ChunkKey, int] = {}
        self._requests: deque[tuple[ChunkKey, ...]] = deque()

    def record(self, keys: Iterable[ChunkKey]) -> None:
        """Add one request: +1 for each distinct key; expire the oldest request if the window
        is full. O(k) for k keys (amortised; expiry touches the expired request's keys once)."""
        request = tuple(dict.fromkeys(keys))
        counts = self._counts
        for key in request:
            counts[key] = counts.get(key, 0) + 1
        self._requests.append(request)
        if self.window is not None and len(self._requests) > self.window:
            for key in self._requests.popleft():
                left = counts[key] - 1
                if left:
                    counts[key] = left
                else:
                    del counts[key]

    def count(self, key: ChunkKey) -> int:
        """Access count of ``key`` in the window (0 if absent). O(1)."""
        return self._counts.get(key, 0)

    def counts(self, keys: Sequence[ChunkKey]) -> list[int]:
        """Counts of several keys, in order. O(k)."""
        get = self._counts.get
        return [get(key, 0) for key in keys]

    def __len__(self) -> int:
        """Number of distinct chunks in the window."""
        return len(self._counts)

    def __contains__(self, key: object) -> bool:
        return key in self._counts

    @property
    def requests_in_window(self) -> int:
        return len(self._requests)

    def to_json(self) -> dict[str, Any]:
        """Plain-JSON state (the windowed requests; counts are derived on load). O(window * k)."""
        return {
            "format": _FORMAT,
            "window": self.window,
            "requests": [list(request) for request in self._requests],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ChunkAccessTable:
        """Rebuild a table saved by :meth:`to_json`. Raises ``ValueError`` on a foreign format."""
        if not isinstance(data, dict) or data.get("format") != _FORMAT:
            msg = f"not a craft-rag access table (expected format {_FORMAT!r})"
            raise ValueError(msg)
        table = cls(window=data["window"])
        for request in data["requests"]:
            table.record(ChunkKey(str(key)) for key in request)
        return table

    def dumps(self) -> str:
        return json.dumps(self.to_json())

    @classmethod
    def loads(cls, text: str) -> ChunkAccessTable:
        return cls.from_json(json.loads(text))

    def _check_invariants(self) -> None:
        if self.window is not None:
            assert len(self._requests) <= self.window
        recount: dict[ChunkKey, int] = {}
        for request in self._requests:
            assert len(set(request)) == len(request), "a request counts each chunk once"
            for key in request:
                recount[key] = recount.get(key, 0) + 1
        assert recount == self._counts, "counts drifted from the windowed requests"
        assert all(count >= 1 for count in self._counts.values())
