"""A tiny in-process stand-in for vLLM's OpenAI-compatible server (unit tests only).

It speaks the parts of the wire format the server backend uses (``/v1/models``, ``/metrics``,
``/tokenize``, streamed ``/v1/completions`` with ``return_token_ids`` and usage,
``/reset_prefix_cache``) and keeps a block-granular prefix cache per ``cache_salt`` like vLLM
(whole blocks, the last prompt token always recomputed). Faults are scripted through
``FakeServer.fail_next`` (HTTP statuses to answer before serving normally, with
``fail_headers``) and ``drop_after``. A hostile server: ``hostile`` writes its own answer to
``/v1/completions`` (see :func:`sse`, :func:`flood`), ``answers`` replaces the body of a
GET/POST path, ``tokenize_shift`` makes ``/tokenize`` another tokenizer.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from craft_rag.chunk import Chunk, make_chunk
from craft_rag.prompt import PromptFormat
from craft_rag.tokenizer import HashingTokenizer

BLOCK = 4
MAX_MODEL_LEN = 512

FORMAT = PromptFormat(
    head="<s>SYS. Answer from the documents.\n",
    chunk="Doc: {text}\n",
    question="Q: {question}",
    tail=" </u><a>",
    answer="{answer} </a><u>",
)
"""The prompt format the fake-server engine tests render with (HashingTokenizer text)."""
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""A ChatML template for those tests' chat renderer."""


def chunks(n: int = 4, prefix: str = "doc") -> list[Chunk]:
    """``n`` distinct 12-word chunks with ids ``{prefix}{i}``."""
    return [
        make_chunk(f"{prefix} {i} " + " ".join(f"w{i}x{j}" for j in range(10)), id=f"{prefix}{i}")
        for i in range(n)
    ]


@dataclass
class FakeServer:
    block_size: int = BLOCK
    report_cached: bool = True
    reset_endpoint: bool = True
    reset_success: bool = True  # False: answer like vLLM while running requests hold blocks
    fail_next: list[int] = field(default_factory=list)
    drop_after: int | None = None  # close the stream after this many tokens
    fail_headers: dict[str, str] = field(default_factory=dict)  # sent with scripted failures
    hostile: Callable[[Any, dict[str, Any]], None] | None = None  # (handler, body): answers
    answers: dict[str, tuple[int, bytes]] = field(default_factory=dict)  # path -> status, body
    # Sent on the usage event when set (vLLM 0.32 does not; craft-rag serve's patch does); a
    # callable answers per request: params(body), None for none.
    kv_transfer_params: object = None
    tokenize_shift: int = 0  # added to every /tokenize id: "another tokenizer"
    written: int = 0  # bytes a hostile writer got out before the client hung up
    cached: set[tuple[str | None, tuple[int, ...]]] = field(default_factory=set)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    reported: list[int] = field(default_factory=list)  # cached_tokens answered, in order
    lock: threading.Lock = field(default_factory=threading.Lock)

    def cached_tokens(self, salt: str | None, ids: list[int]) -> int:
        """Longest cached whole-block prefix (not the last token); then cache every block."""
        size = self.block_size
        hit = 0
        with self.lock:
            for end in range(size, len(ids), size):
                if (salt, tuple(ids[:end])) not in self.cached:
                    break
                hit = end
            for end in range(size, len(ids) + 1, size):
                self.cached.add((salt, tuple(ids[:end])))
        return hit


def _handler(fake: FakeServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Connection", "close")  # a stopped fake answers nothing more
            self.end_headers()
            self.wfile.write(body)
            self.close_connection = True

        def _scripted_failure(self) -> bool:
            with fake.lock:
                status = fake.fail_next.pop(0) if fake.fail_next else None
            if status is None:
                return False
            body = json.dumps({"error": f"scripted {status}"}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            for name, value in fake.fail_headers.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)
            return True

        def _scripted_answer(self) -> bool:
            answer = fake.answers.get(self.path)
            if answer is None:
                return False
            self._send(answer[0], answer[1])
            return True

        def do_GET(self) -> None:
            if self._scripted_failure() or self._scripted_answer():
                return
            if self.path == "/v1/models":
                data = {"data": [{"id": "fake-model", "max_model_len": MAX_MODEL_LEN}]}
                self._send(200, json.dumps(data).encode())
            elif self.path == "/metrics":
                line = (
                    f'vllm:cache_config_info{{block_size="{fake.block_size}",'
                    'enable_prefix_caching="True",prefix_caching_hash_algo="sha256"} 1.0\n'
                )
                self._send(200, line.encode(), "text/plain")
            else:
                self._send(404, b'{"detail":"Not Found"}')

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", "0"))
            body = json.loads(self.rfile.read(length) or b"{}")
            if self._scripted_failure() or self._scripted_answer():
                return
            if self.path == "/tokenize":
                shift = fake.tokenize_shift
                tokens = [t + shift for t in HashingTokenizer().encode(body["prompt"])]
                self._send(200, json.dumps({"tokens": tokens}).encode())
            elif self.path == "/reset_prefix_cache" and fake.reset_endpoint:
                with fake.lock:
                    if fake.reset_success:
                        fake.cached.clear()
                self._send(200, json.dumps({"success": fake.reset_success}).encode())
            elif self.path == "/v1/completions":
                with fake.lock:
                    fake.bodies.append(body)
                if fake.hostile is not None:
                    # The client hanging up mid-answer is what a bounded reader should do.
                    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                        fake.hostile(self, body)
                    self.close_connection = True
                else:
                    self._complete(body)
            else:
                self._send(404, b'{"detail":"Not Found"}')

        def _complete(self, body: dict[str, Any]) -> None:
            if body.get("model") != "fake-model":
                self._send(404, b'{"error": "model not found"}')
                return
            ids = list(body["prompt"])
            cached = fake.cached_tokens(body.get("cache_salt"), ids)
            with fake.lock:
                fake.reported.append(cached)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            n = int(body["max_tokens"])
            for i in range(n):
                if fake.drop_after is not None and i >= fake.drop_after:
                    self.wfile.flush()
                    self.close_connection = True
                    return
                token = 1000 + (sum(ids) + i) % 50
                choice = {
                    "text": f" t{token}",
                    "token_ids": [token],
                    "finish_reason": "length" if i == n - 1 else None,
                }
                self._event({"choices": [choice]})
            details = {"cached_tokens": cached} if fake.report_cached else None
            usage = {"prompt_tokens": len(ids), "prompt_tokens_details": details}
            last: dict[str, Any] = {"choices": [], "usage": usage}
            params = fake.kv_transfer_params
            if callable(params):
                params = params(body)
            if params is not None:
                last["kv_transfer_params"] = params
            self._event(last)
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
            self.close_connection = True

        def _event(self, data: dict[str, Any]) -> None:
            self.wfile.write(b"data: " + json.dumps(data).encode() + b"\n\n")
            self.wfile.flush()

    return Handler


def sse(handler: Any, lines: list[bytes], *, status: int = 200) -> None:
    """Answer with these raw SSE lines (each gets a blank line after it)."""
    handler.send_response(status)
    handler.send_header("Content-Type", "text/event-stream")
    handler.send_header("Connection", "close")
    handler.end_headers()
    for line in lines:
        handler.wfile.write(line + b"\n\n")
    handler.wfile.flush()


def event(data: object) -> bytes:
    """One ``data:`` line (``json.dumps`` writes ``NaN`` for ``math.nan``, as a broken
    server may)."""
    return b"data: " + json.dumps(data).encode()


def flood(
    fake: FakeServer,
    handler: Any,
    *,
    head: bytes,
    piece: bytes,
    limit: int = 96 << 20,
    every_s: float = 0.0,
    max_s: float = 10.0,
    status: int = 200,
) -> None:
    """Write ``head``, then ``piece`` again and again (up to ``limit`` bytes or ``max_s``
    seconds, ``every_s`` apart) until the client hangs up; ``fake.written`` counts what got
    out."""
    handler.send_response(status)
    handler.send_header("Content-Type", "text/event-stream" if status == 200 else "text/plain")
    if status != 200:
        handler.send_header("Content-Length", str(len(head) + limit))
    handler.end_headers()
    handler.wfile.write(head)
    sent = len(head)
    stop = time.monotonic() + max_s
    try:
        while sent < limit and time.monotonic() < stop:
            handler.wfile.write(piece)
            handler.wfile.flush()
            sent += len(piece)
            with fake.lock:
                fake.written = sent
            if every_s:
                time.sleep(every_s)
    finally:
        with fake.lock:
            fake.written = sent


@contextmanager
def running(fake: FakeServer, port: int = 0) -> Iterator[str]:
    """Serve ``fake`` on a loopback port (free when 0; a given one to restart a server on
    the same URL); yields its URL."""
    server = ThreadingHTTPServer(("127.0.0.1", port), _handler(fake))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
