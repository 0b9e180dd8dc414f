"""Repo-wide pytest setup: offline hubs, the prepared embedded model, one shared vLLM engine.

Real-engine tests are marked ``@pytest.mark.engine``; run them alone with ``pytest -m engine``
or skip them with ``pytest -m "not engine"``. They all share ONE in-process engine (session
scope): starting vLLM costs seconds and RAM, and the machine may be shared. The engine is sized
for eviction tests: 128 KV blocks of 32 tokens (4,096 tokens; two full-length prompts) and
max_model_len 2048.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

# Nothing may reach a model hub; vLLM runs in this process.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

# src layout without an editable install: make `import craft_rag` (and the harness,
# `import craft_rag_bench`) work from a bare checkout.
_ROOT = Path(__file__).resolve().parent
for _SRC in (_ROOT / "src", _ROOT / "benchmarks" / "craft-rag-bench" / "src"):
    if _SRC.is_dir() and str(_SRC) not in sys.path:
        sys.path.insert(0, str(_SRC))

if TYPE_CHECKING:
    from craft_rag.engine.engine import CraftEngine

# Shared fixtures that code built on craft-rag can use too: ``two_vllm_servers`` (two real
# servers for the routed engine's tests; craft_rag/testing/servers.py).
pytest_plugins = ("craft_rag.testing.servers",)

TEST_ENGINE_BLOCKS = 128
TEST_BLOCK_SIZE = 32
TEST_MAX_MODEL_LEN = 2048


def _skip_or_fail(reason: str) -> None:
    """Skip engine tests where the engine cannot exist; in CI (``CI`` set) that is a failure,
    because .ci/run installs everything and a silent skip would hide a broken install."""
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The prepared embedded model folder (converted from the wheel on first use, ~30 s)."""
    from craft_rag.engine.model import prepare_default_model

    try:
        return prepare_default_model().path
    except (FileNotFoundError, ImportError) as exc:
        _skip_or_fail(f"embedded model unavailable: {exc}")


@pytest.fixture(scope="session")
def craft_engine(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CraftEngine]:
    """One in-process vLLM engine for the whole run: eager, block 32, 128 blocks, KV events on.

    Tests share it, so each test must not assume an empty cache: call
    ``craft_engine.reset_prefix_cache()`` and use fresh planners/conversation ids.
    """
    try:
        import vllm  # noqa: F401
    except ImportError:
        _skip_or_fail("vllm is not installed: pip install 'craft-rag[cpu]'")
    from craft_rag.engine.engine import CraftEngine, EngineSettings

    socket_dir = tmp_path_factory.mktemp("kv-events")
    engine = CraftEngine(
        EngineSettings(
            model=str(model_dir),
            block_size=TEST_BLOCK_SIZE,
            max_model_len=TEST_MAX_MODEL_LEN,
            num_gpu_blocks_override=TEST_ENGINE_BLOCKS,
            kv_cache_memory_bytes=256 << 20,
            kv_events_endpoint=f"ipc://{socket_dir}/kv-events.sock",
            seed=0,
        )
    )
    try:
        yield engine
    finally:
        engine.close()
