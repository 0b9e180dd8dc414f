"""CraftTierConnector under ``craft-rag serve`` (vLLM's OpenAI server), loaded by module path.

With vLLM's CPU default (``VLLM_ENABLE_V1_MULTIPROCESSING`` unset) the server runs the
multiprocess executor: the scheduler (EngineCore) and the worker are two processes and the KV
bytes travel in vLLM's own step messages; with it set to 0 (as the test environment may) the
worker runs inside the EngineCore process. Both were seen to work. A prompt
evicted from the pool comes back from the RAM tier with the same greedy text, and the response
carries the connector's ``kv_transfer_params`` (read back as a ``ReuseReport`` reads them). The
server is configured as ``craft-rag serve --kv-tier-*`` configures it (``ServeConfig.kv_tiers``).
"""

from __future__ import annotations

import random
import socket
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

LEN, BLOCK = 600, 32


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(LEN)]


def test_served_prompt_comes_back_from_the_tiers(tmp_path: Path) -> None:
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("vllm")
    from craft_rag.engine.backends.server.serve import (
        ServeConfig,
        start_server,
        stop_server,
        wait_ready,
    )
    from craft_rag.engine.model import resolve_model
    from craft_rag.kvtiers.tier_settings import KVTierSettings
    from craft_rag.kvtiers.tier_tokens import tier_tokens_of

    tiers = KVTierSettings(ram_bytes=1 << 30, disk_bytes=1 << 30, disk_dir=tmp_path / "tiers")
    port = _free_port()
    config = ServeConfig(
        model=resolve_model(None), port=port, kv_events_port=_free_port(), max_model_len=1024,
        kv_cache_memory_bytes=256 << 20, kv_tiers=tiers,
        extra_args=("--num-gpu-blocks-override", "48"),
    )
    with tempfile.TemporaryFile() as log:
        proc = start_server(config, log=log)
        try:
            wait_ready(config.url, timeout=600, alive=lambda: proc.poll() is None)

            def complete(tokens: list[int]) -> dict[str, object]:
                body = {"model": config.model_name, "prompt": tokens, "max_tokens": 8,
                        "temperature": 0}
                answer = httpx.post(f"{config.url}/v1/completions", json=body, timeout=600)
                answer.raise_for_status()
                result: dict[str, object] = answer.json()
                return result

            first = complete(_prompt(1))
            for seed in (500, 501, 502):  # evict it from the 48-block pool
                complete(_prompt(seed))
            again = complete(_prompt(1))
        except BaseException:
            log.seek(0)
            print(log.read()[-4000:].decode(errors="replace"))
            raise
        finally:
            stop_server(proc)
    loadable = (LEN - 1) // BLOCK * BLOCK
    assert first["kv_transfer_params"] == {"craft_tiers": {"ram_tokens": 0, "disk_tokens": 0}}
    assert again["kv_transfer_params"] == {
        "craft_tiers": {"ram_tokens": loadable, "disk_tokens": 0}
    }
    assert tier_tokens_of(again["kv_transfer_params"], maximum=LEN) == (loadable, 0)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == loadable  # type: ignore[index]
    assert again["choices"][0]["text"] == first["choices"][0]["text"]  # type: ignore[index]
