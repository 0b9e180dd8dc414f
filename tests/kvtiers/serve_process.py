"""``craft-rag serve`` as a child process for the warm-restart tests (not a test module).

The server runs through the real command line (``python -m craft_rag.cli serve``), so the
wrapper's signal handling is what the tests exercise: a SIGTERM goes to the wrapper's PID only,
as a process supervisor would send it. The wrapper gets its own session (process group), so a
test can SIGKILL the whole tree it started (``kill_tree``) to simulate a crash.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import pytest

PROMPT_LEN, BLOCK = 300, 32
LOADABLE = (PROMPT_LEN - 1) // BLOCK * BLOCK  # the tiers never promise the last prompt token


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(PROMPT_LEN)]


@dataclass
class Served:
    proc: subprocess.Popen[bytes]
    url: str
    model: str
    log: IO[bytes]

    def complete(self, tokens: list[int]) -> dict[str, Any]:
        import httpx

        body = {"model": self.model, "prompt": tokens, "max_tokens": 8, "temperature": 0}
        answer = httpx.post(f"{self.url}/v1/completions", json=body, timeout=600)
        answer.raise_for_status()
        result: dict[str, Any] = answer.json()
        return result

    def tail(self) -> str:
        self.log.seek(0)
        return self.log.read()[-4000:].decode(errors="replace")

    def terminate(self, timeout: float = 180.0) -> int:
        """SIGTERM to the wrapper's PID; its exit status once the whole server has stopped."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)

    def kill_tree(self) -> None:
        """SIGKILL to the wrapper's process group (the wrapper and vLLM's processes)."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=60)


@contextmanager
def serve(tier_dir: Path, *tier_flags: str) -> Iterator[Served]:
    """Run ``craft-rag serve`` with a disk tier in ``tier_dir`` until the block ends (a test
    may stop it earlier); whatever is left of its process group is killed at the end."""
    pytest.importorskip("httpx")
    pytest.importorskip("vllm")
    from craft_rag.engine.backends.server.serve import wait_ready
    from craft_rag.engine.model import resolve_model

    model = resolve_model(None)
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "craft_rag.cli",
        "serve",
        "--model",
        str(model),
        "--port",
        str(port),
        "--kv-events-port",
        str(free_port()),
        "--max-model-len",
        "1024",
        "--kv-cache-memory-bytes",
        str(128 << 20),
        "--kv-tier-ram-bytes",
        str(1 << 30),
        "--kv-tier-disk-bytes",
        str(1 << 30),
        "--kv-tier-dir",
        str(tier_dir),
        *tier_flags,
    ]
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=log, start_new_session=True)
        served = Served(proc, f"http://127.0.0.1:{port}", Path(model).name, log)
        try:
            wait_ready(served.url, timeout=600, alive=lambda: proc.poll() is None)
            yield served
        except BaseException:
            print(served.tail())
            raise
        finally:
            with contextlib.suppress(ProcessLookupError):  # leftovers of a failed test only
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)


def block_files(tier_dir: Path) -> int:
    return len(list(tier_dir.glob("*.kv")))
