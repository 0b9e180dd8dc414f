"""Shared setup for the langchain-craft tests: loading this conftest puts this folder on
``sys.path``, so both suites import the helpers in ``lc_test_support.py`` (a uniquely named
module, not ``conftest``, so a repository-wide run imports the right one). The engine tests use
the repository-wide ``craft_engine`` fixture (root conftest.py); the unit tests use ``fake``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from craft_rag.engine.engine import CraftEngine
from craft_rag.testing import FakeBackend, make_fake_engine


@pytest.fixture
def fake() -> Iterator[tuple[CraftEngine, FakeBackend]]:
    """A real CraftEngine over craft_rag.testing's simulated forward pass; closed afterwards."""
    engine, backend = make_fake_engine()
    yield engine, backend
    engine.close()
