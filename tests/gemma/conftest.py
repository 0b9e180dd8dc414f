"""The second model family: Gemma 3 270M (SentencePiece) under the ``gemma`` marker.

Tests here override ``model_dir`` and ``craft_engine`` with the embedded Gemma model, so the
model-agnostic tests re-collected from the SmolLM2 suites (token exactness, injection, turn
append, reuse) run unchanged on a second tokenizer family. They run only when the marker
expression names ``gemma`` (``pytest -m gemma``, scripts/test.sh's second run): every other
run deselects them, so the main run never starts a second engine.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from craft_rag.engine.engine import CraftEngine
    from craft_rag.tokenizer import HFTokenizer

# Gemma's KV blocks are per attention group (sliding and full layers), so the SmolLM2
# engine's 128-block override is too small for one 2,048-token prompt: size by bytes.
GEMMA_KV_BYTES = 256 << 20


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect ``gemma`` tests unless ``-m`` names the marker."""
    if "gemma" in (config.getoption("markexpr", "") or ""):
        return
    keep = [item for item in items if item.get_closest_marker("gemma") is None]
    dropped = [item for item in items if item.get_closest_marker("gemma") is not None]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


def _skip_or_fail(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The prepared Gemma 3 270M folder (converted from the wheels on first use, ~40-90 s)."""
    from craft_rag.engine.model import GEMMA_EMBEDDED, prepare_embedded_model

    try:
        return prepare_embedded_model(GEMMA_EMBEDDED).path
    except (FileNotFoundError, ImportError) as exc:
        _skip_or_fail(f"embedded Gemma model unavailable: {exc}")
        raise


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> HFTokenizer:
    """Gemma's tokenizer, loaded once (its 262k-token tokenizer.json takes seconds to load)."""
    from craft_rag.tokenizer import HFTokenizer

    return HFTokenizer(model_dir / "tokenizer.json")


@pytest.fixture(scope="session")
def craft_engine(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CraftEngine]:
    """One in-process vLLM engine on Gemma for the ``-m gemma`` run (eager, block 32)."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        _skip_or_fail("vllm is not installed: pip install 'craft-rag[cpu]'")
    from craft_rag.engine.engine import CraftEngine, EngineSettings

    socket_dir = tmp_path_factory.mktemp("gemma-kv-events")
    engine = CraftEngine(
        EngineSettings(
            model=str(model_dir),
            block_size=32,
            max_model_len=2048,
            kv_cache_memory_bytes=GEMMA_KV_BYTES,
            kv_events_endpoint=f"ipc://{socket_dir}/kv-events.sock",
            seed=0,
        )
    )
    try:
        yield engine
    finally:
        engine.close()
