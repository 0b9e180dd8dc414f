"""The engine's KV-event barrier (:class:`EventBarrier`): a turn's plan and commit see every
eviction the engine published before them. The events: :mod:`craft_rag.engine.kv_events`."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from craft_rag.engine.kv_events import KVEventSync


class EventBarrier:
    """The engine's "events so far are applied" step before a plan and before a commit: waits
    until every KV event batch the backend has published was applied to the planners (usually
    already true: microseconds; at most ``wait_through``'s 2 s if a batch was lost). A no-op
    without an event sync or when the backend cannot count its batches (``published`` returns
    None)."""

    __slots__ = ("_events", "_published")

    def __init__(self, events: KVEventSync | None, published: Callable[[], int | None]) -> None:
        self._events = events
        self._published = published

    def __call__(self) -> None:
        events = self._events
        if events is None:
            return
        published = self._published()
        if published is not None:
            events.wait_through(published - 1)
