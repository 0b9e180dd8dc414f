"""Fixtures for the llama-index-llms-craft-vllm tests (helpers in craft_llm_support.py).

The engine tests use the repository-wide ``craft_engine`` fixture (root conftest.py); they never
start an engine of their own.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from craft_llm_support import EventRecorder, SquadIndex, build_squad_index
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


@pytest.fixture(scope="session")
def squad_index() -> SquadIndex:
    return build_squad_index()
