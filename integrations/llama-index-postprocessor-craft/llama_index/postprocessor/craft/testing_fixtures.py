"""Pytest fixtures over :mod:`llama_index.postprocessor.craft.testing`, for a ``conftest.py`` to
import (``from llama_index.postprocessor.craft.testing_fixtures import events, squad_index``).
Needs pytest (the ``test`` extra); ``squad_index`` also needs what
:func:`~llama_index.postprocessor.craft.testing.build_squad_index` needs, and skips without it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from llama_index.postprocessor.craft.testing import (
    EventRecorder,
    SquadIndex,
    build_squad_index,
    recording_events,
)

__all__ = ["events", "squad_index"]


@pytest.fixture
def events() -> Iterator[EventRecorder]:
    """Every instrumentation event emitted during the test (recorder removed afterwards)."""
    with recording_events() as recorder:
        yield recorder


@pytest.fixture(scope="session")
def squad_index() -> SquadIndex:
    """The real faiss SQuAD index (built once per process)."""
    return build_squad_index()
