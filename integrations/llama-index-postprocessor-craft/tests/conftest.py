"""Fixtures for the llama-index-postprocessor-craft tests (helpers in craft_pp_support.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from craft_pp_support import EventRecorder
from llama_index_instrumentation import get_dispatcher


@pytest.fixture
def events() -> Iterator[EventRecorder]:
    recorder = EventRecorder(events=[])
    root = get_dispatcher()
    root.add_event_handler(recorder)
    try:
        yield recorder
    finally:
        root.event_handlers = [h for h in root.event_handlers if h is not recorder]
