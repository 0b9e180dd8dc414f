"""Fixtures for engine tests; the fakes live in ``engine_fakes``."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from engine_fakes import CHATML, FAKE_FORMAT, FakeBackend

from craft_rag.engine.chat_format import jinja_renderer
from craft_rag.engine.engine import CraftEngine
from craft_rag.planner import CraftPlanner, PlannerConfig
from craft_rag.tokenizer import HashingTokenizer


@pytest.fixture
def make_fake_engine() -> Iterator[Callable[..., tuple[CraftEngine, FakeBackend]]]:
    engines: list[CraftEngine] = []

    def factory(
        backend: FakeBackend | None = None, policy: str = "tree", **engine_kwargs: object
    ) -> tuple[CraftEngine, FakeBackend]:
        backend = backend or FakeBackend()
        engine = CraftEngine(
            planner=CraftPlanner(PlannerConfig(policy=policy)),
            backend=backend,
            tokenizer=HashingTokenizer(),
            prompt_format=FAKE_FORMAT,
            block_hasher=backend.hasher,
            chat_renderer=jinja_renderer(CHATML),
            **engine_kwargs,  # type: ignore[arg-type]
        )
        engines.append(engine)
        return engine, backend

    yield factory
    for engine in engines:
        engine.close()
