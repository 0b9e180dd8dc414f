"""Fixtures for the llama-index-llms-craft-vllm tests (shared ones from
:mod:`llama_index.postprocessor.craft.testing_fixtures`; helpers in craft_llm_support.py).

The engine tests use the repository-wide ``craft_engine`` fixture (root conftest.py); they never
start an engine of their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from llama_index.postprocessor.craft.testing_fixtures import events, squad_index

__all__ = ["events", "squad_index", "submitted"]


@pytest.fixture
def submitted(craft_engine: Any, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """Token ids of every prompt the engine's driver receives (a spy on its submit; undone by
    ``monkeypatch`` when the test ends)."""
    prompts: list[tuple[int, ...]] = []
    driver = craft_engine._driver
    original = driver.submit

    def spy(token_ids: Sequence[int], *args: Any, **kwargs: Any) -> Any:
        prompts.append(tuple(token_ids))
        return original(token_ids, *args, **kwargs)

    monkeypatch.setattr(driver, "submit", spy)
    return prompts
