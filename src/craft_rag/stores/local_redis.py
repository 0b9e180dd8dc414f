"""Start a throwaway ``redis-server`` on loopback (tests, benchmarks): no disk, stopped by PID.

Not for production (see docs/deployment.md for running Redis as a service). The server binds
127.0.0.1 on a free port, saves nothing to disk (``--save ""``, ``--appendonly no``) and is
terminated by its own PID when the context exits.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def local_redis(binary: str | None = None, *, start_timeout_s: float = 10.0) -> Iterator[str]:
    """Yield ``redis://127.0.0.1:PORT/0`` of a fresh ``redis-server``; ``FileNotFoundError``
    when the binary is missing (install: ``apt-get install redis-server``), ``RuntimeError``
    when it does not answer within ``start_timeout_s``."""
    exe = binary or shutil.which("redis-server")
    if exe is None:
        msg = "redis-server not found; install it (apt-get install -y redis-server)"
        raise FileNotFoundError(msg)
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="craft-redis-") as workdir:
        args = [exe, "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                "--appendonly", "no", "--dir", workdir, "--protected-mode", "yes"]
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + start_timeout_s
            while True:
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=0.2) as conn:
                        conn.sendall(b"PING\r\n")
                        if conn.recv(16).startswith(b"+PONG"):
                            break
                except OSError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                    msg = f"redis-server did not start on 127.0.0.1:{port}: {err[-500:]}"
                    raise RuntimeError(msg)
                time.sleep(0.05)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
