"""Fixtures for engine tests; the fakes are the library's own :mod:`craft_rag.testing`."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from craft_rag.engine.engine import CraftEngine
from craft_rag.testing import FakeBackend
from craft_rag.testing import make_fake_engine as _make_fake_engine


@pytest.fixture
def make_fake_engine() -> Iterator[Callable[..., tuple[CraftEngine, FakeBackend]]]:
    """:func:`craft_rag.testing.make_fake_engine`, every engine it made closed after the test."""
    engines: list[CraftEngine] = []

    def factory(
        backend: FakeBackend | None = None, policy: str = "tree", **engine_kwargs: object
    ) -> tuple[CraftEngine, FakeBackend]:
        engine, backend = _make_fake_engine(backend, policy=policy, **engine_kwargs)
        engines.append(engine)
        return engine, backend

    yield factory
    for engine in engines:
        engine.close()
