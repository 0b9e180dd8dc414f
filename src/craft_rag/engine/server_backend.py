"""The engine side over HTTP: a vLLM OpenAI-compatible server instead of an in-process engine.

``CraftEngine(server="http://127.0.0.1:8000")`` plans, renders and commits exactly as with the
in-process engine; only the last hop differs. Prompts go out token-exact as token-id prompts
on ``/v1/completions`` (``return_token_ids`` brings the reply's ids back, so multi-turn prompts
stay append-only), streamed over SSE (``stream_options.include_usage``: the last event carries
``usage.prompt_tokens_details.cached_tokens``, the server's ``num_cached_tokens``).

What the backend learns from the server at connect time (seconds; ``ServerUnavailable``
naming the URL when it is down):

* ``/v1/models``: the served model name and ``max_model_len``;
* ``/metrics`` (``vllm:cache_config_info``): ``block_size``, prefix caching on/off and the block
  hash algorithm, so expected block hashes match the server's KV events;
* ``/tokenize``: a probe text tokenized remotely must equal the local tokenizer's ids (the
  local model folder must hold the served model's tokenizer; ``ValueError`` otherwise);
* one 1-token probe request: the server must report cached tokens
  (``--enable-prompt-tokens-details``) and token ids; ``RuntimeError`` naming the flag if not.

KV events: the server's ZMQ publisher binds ``tcp://*:PORT``; we connect a SUB socket to
``tcp://HOST:PORT``. Rule (``craft-rag serve`` follows it): ``PORT = HTTP port + 1000`` unless
``kv_events=`` names a port or an endpoint (``False``: no events). Block hashes arrive as 64-bit
ints there; :class:`craft_rag.engine.kv_events.BlockHasher` with ``int_hashes=True`` produces the
same values. See :mod:`craft_rag.engine.server_driver` for the per-request streams.

Errors: :class:`ServerUnavailable` (a ``ConnectionError``) when the server cannot be reached
or drops a stream; :class:`ServerError` (an ``EngineFailure``) for 5xx answers after retries or
a malformed stream; :class:`ServerRejected` (a ``ValueError``) for a 4xx answer. Connect errors
and 5xx answers are retried with exponential backoff (``retries`` times) only before any token
arrived, so a retry never duplicates output.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from craft_rag.engine.kv_events import BlockHasher, EvictionListener, KVEventSync
from craft_rag.engine.results import SamplingRequest, StepOutput
from craft_rag.engine.server_settings import (
    KV_EVENTS_PORT_OFFSET,
    ServerError,
    ServerRejected,
    ServerSettings,
    ServerUnavailable,
    as_server_settings,
    parse_cache_config,
)
from craft_rag.tokenizer import Tokenizer

__all__ = [
    "KV_EVENTS_PORT_OFFSET",
    "ServerBackend",
    "ServerError",
    "ServerRejected",
    "ServerSettings",
    "ServerUnavailable",
    "as_server_settings",
    "connect_server",
    "parse_cache_config",
    "step_output",
]

_PROBE_TEXT = "craft-rag tokenizer probe: The quick brown fox jumps over 13 lazy dogs."


class ServerBackend:
    """A connection to one vLLM OpenAI-compatible server (see the module doc).

    Invariants: ``max_model_len``, ``block_size``, ``model_name`` are the server's, read once
    at connect time; one ``httpx.Client`` (thread-safe, pooled) serves every request thread.
    """

    published_batches_supported = False

    def __init__(
        self,
        settings: ServerSettings,
        model_path: str | None,
        tokenizer: Tokenizer,
        *,
        transport: Any = None,
        sleep: Callable[[float], object] = time.sleep,
    ) -> None:
        """Connect and check the server (module doc). ``transport``: an ``httpx`` transport
        (tests). Cost: four small HTTP round trips and a 1-token generation."""
        import httpx

        self.settings = settings
        self._sleep = sleep
        headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
        timeout = httpx.Timeout(
            settings.read_timeout, connect=settings.connect_timeout, pool=settings.read_timeout
        )
        self._client = httpx.Client(
            base_url=settings.base_url, timeout=timeout, headers=headers, transport=transport
        )
        self._closed = threading.Event()
        self.eos_token_ids = _eos_token_ids(model_path)
        try:
            self._connect(tokenizer)
        except BaseException:
            self._client.close()
            raise

    # ---- connect-time checks -----------------------------------------------------------------

    def _connect(self, tokenizer: Tokenizer) -> None:
        models = self._json("GET", "/v1/models").get("data") or []
        names = [str(m.get("id")) for m in models if isinstance(m, dict)]
        wanted = self.settings.model_name
        if wanted is None and len(names) == 1:
            wanted = names[0]
        if wanted not in names:
            msg = (
                f"the server at {self.settings.base_url} serves {names}; pass "
                "ServerSettings(model_name=...) naming one of them"
            )
            raise ValueError(msg)
        model = next(m for m in models if m.get("id") == wanted)
        self.model_name: str = str(wanted)
        self.max_model_len: int = int(model.get("max_model_len") or 0)
        if self.max_model_len < 1:
            msg = f"the server at {self.settings.base_url} reports no max_model_len for {wanted}"
            raise ServerError(msg)

        info = parse_cache_config(self._text("/metrics"))
        size = self.settings.block_size or int(info.get("block_size", "0") or 0)
        if size < 1:
            msg = (
                f"could not read the block size from {self.settings.base_url}/metrics; pass "
                "ServerSettings(block_size=...) (craft-rag serve uses 32)"
            )
            raise ValueError(msg)
        self.block_size: int = size
        self.prefix_caching: bool = info.get("enable_prefix_caching", "True") == "True"
        self.hash_algo: str = self.settings.hash_algo or info.get(
            "prefix_caching_hash_algo", "sha256"
        )

        remote = self._json(
            "POST", "/tokenize", {"prompt": _PROBE_TEXT, "add_special_tokens": False}
        )
        local = tokenizer.encode(_PROBE_TEXT)
        if list(remote.get("tokens") or []) != local:
            msg = (
                f"the server's tokenizer ({self.model_name}) differs from the local one; pass "
                "the served model's folder as EngineSettings(model=DIR) so prompts are "
                "token-exact"
            )
            raise ValueError(msg)

        probe: dict[str, Any] = {}
        for piece in self.stream([*local[:4]], SamplingRequest(max_tokens=1), None):
            probe = piece
        if probe.get("cached_tokens") is None:
            msg = (
                f"the server at {self.settings.base_url} does not report cached tokens; start "
                "it with --enable-prompt-tokens-details (`craft-rag serve` does)"
            )
            raise RuntimeError(msg)

    def block_hasher(self) -> BlockHasher | None:
        """Expected hashes in the server's KV event format (64-bit ints); ``None`` without
        prefix caching."""
        if not self.prefix_caching:
            return None
        seed = self.settings.hash_seed
        return BlockHasher.for_algo(
            self.block_size,
            self.hash_algo,
            int_hashes=True,
            seed=seed if seed is not None else "vllm-none-hash",
        )

    def subscribe(self, listener: EvictionListener) -> KVEventSync | None:
        """Subscribe to the server's KV events (``None`` when disabled or no prefix caching).
        ZMQ connects lazily and reconnects by itself after a server restart."""
        endpoint = self.settings.kv_events_endpoint
        if endpoint is None or not self.prefix_caching:
            return None
        return KVEventSync(endpoint, listener)

    # ---- HTTP --------------------------------------------------------------------------------

    def _retrying(self, what: str, call: Callable[[], Any]) -> Any:
        """``call()`` with bounded retries on connect errors and 5xx answers."""
        import httpx

        attempts = self.settings.retries + 1
        for attempt in range(attempts):
            last = attempt == attempts - 1
            try:
                return call()
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError) as exc:
                if last:
                    raise self._unavailable(what, exc, attempts) from exc
            except httpx.TimeoutException as exc:
                msg = (
                    f"{what} at {self.settings.base_url} timed out ({exc!r}); the server is "
                    "overloaded or stuck: raise read_timeout or check the server"
                )
                raise ServerUnavailable(msg) from exc
            except _Retryable as exc:
                if last:
                    msg = (
                        f"{what} at {self.settings.base_url} failed after {attempts} "
                        f"attempts: {exc}"
                    )
                    raise ServerError(msg) from exc
            self._sleep(self.settings.backoff * 2**attempt)
        raise AssertionError("unreachable")  # pragma: no cover

    def _unavailable(self, what: str, exc: BaseException, attempts: int) -> ServerUnavailable:
        msg = (
            f"the vLLM server at {self.settings.base_url} is unreachable ({what}: {exc!r}, "
            f"{attempts} attempts); start it (`craft-rag serve --port PORT`) or fix the URL"
        )
        return ServerUnavailable(msg)

    def _checked(self, response: Any, what: str) -> Any:
        if response.status_code >= 500:
            raise _Retryable(f"HTTP {response.status_code}: {response.text[:300]}")
        if response.status_code >= 400:
            msg = (
                f"{what} at {self.settings.base_url} was refused with HTTP "
                f"{response.status_code}: {response.text[:500]}"
            )
            raise ServerRejected(msg)
        return response

    def _json(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        def call() -> Any:
            return self._checked(self._client.request(method, path, json=body), path).json()

        out = self._retrying(f"{method} {path}", call)
        if not isinstance(out, dict):
            msg = f"{path} at {self.settings.base_url} did not answer a JSON object"
            raise ServerError(msg)
        return out

    def _text(self, path: str) -> str:
        def call() -> Any:
            return self._checked(self._client.get(path), path).text

        return str(self._retrying(f"GET {path}", call))

    def body(
        self, token_ids: Sequence[int], sampling: SamplingRequest, cache_salt: str | None
    ) -> dict[str, Any]:
        """The ``/v1/completions`` request body. ``read_prefix_cache=False`` (the no-cache
        baseline) has no server equivalent: it becomes a fresh random salt, so nothing cached
        can match (and what it caches, nothing else reads)."""
        body: dict[str, Any] = {
            **dict(sampling.extra),
            "model": self.model_name,
            "prompt": list(token_ids),
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
        }
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if sampling.stop:
            body["stop"] = list(sampling.stop)
        if not sampling.read_prefix_cache:
            import secrets

            cache_salt = f"nocache-{secrets.token_hex(16)}"
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        return body

    def stream(
        self,
        token_ids: Sequence[int],
        sampling: SamplingRequest,
        cache_salt: str | None,
        cancelled: threading.Event | None = None,
    ) -> Iterator[dict[str, Any]]:
        """Run one completion and yield its SSE deltas as ``{"token_ids", "text",
        "finish_reason", "cached_tokens"}`` (the last has ``done: True``). Retries happen
        only before the first delta. Stops early (closing the stream, so the server aborts
        the request) once ``cancelled`` is set."""
        import httpx

        body = self.body(token_ids, sampling, cache_salt)
        what = "POST /v1/completions"

        def open_stream() -> Any:
            request = self._client.build_request("POST", "/v1/completions", json=body)
            response = self._client.send(request, stream=True)
            if response.status_code >= 400:
                response.read()
                response.close()
                self._checked(response, what)
            return response

        response = self._retrying(what, open_stream)
        finish: str | None = None
        cached: int | None = None
        done = False
        try:
            for line in response.iter_lines():
                if cancelled is not None and cancelled.is_set():
                    return
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                event = _parse_event(data, self.settings.base_url)
                usage = event.get("usage")
                if isinstance(usage, dict):
                    details = usage.get("prompt_tokens_details")
                    if isinstance(details, dict) and details.get("cached_tokens") is not None:
                        cached = int(details["cached_tokens"])
                for choice in event.get("choices") or ():
                    finish = choice.get("finish_reason") or finish
                    ids = choice.get("token_ids")
                    if ids is None:
                        msg = (
                            f"the server at {self.settings.base_url} sent no token_ids; it must "
                            "support return_token_ids (vLLM >= 0.10)"
                        )
                        raise ServerError(msg)
                    yield {"token_ids": tuple(int(t) for t in ids), "text": choice.get("text", "")}
        except (httpx.TransportError, httpx.StreamError) as exc:
            raise self._unavailable(f"{what} stream", exc, 1) from exc
        finally:
            response.close()
        if not done:
            msg = f"the stream from {self.settings.base_url} ended without [DONE]"
            raise ServerUnavailable(msg)
        yield {"done": True, "finish_reason": finish, "cached_tokens": cached}

    def reset_prefix_cache(self) -> bool:
        """``POST /reset_prefix_cache`` (a dev-mode endpoint: ``craft-rag serve --dev`` or
        ``VLLM_SERVER_DEV_MODE=1``). ``RuntimeError`` naming that fix when it is missing.
        False when the server answers ``{"success": false}`` (running requests hold blocks:
        nothing was reset); an answer without that field counts as success."""

        def call() -> Any:
            return self._checked(self._client.post("/reset_prefix_cache"), "reset")

        try:
            response = self._retrying("POST /reset_prefix_cache", call)
        except ServerRejected as exc:
            msg = (
                f"the server at {self.settings.base_url} has no /reset_prefix_cache; start it "
                "with `craft-rag serve --dev` (VLLM_SERVER_DEV_MODE=1), or use a fresh "
                "cache_salt for a cold cache"
            )
            raise RuntimeError(msg) from exc
        try:
            answer = response.json()
        except ValueError:  # an empty or non-JSON body: older servers answered 200 alone
            return True
        return not (isinstance(answer, dict) and answer.get("success") is False)

    def published_batches(self) -> int | None:
        """Not countable over the network: the engine's event barrier is skipped."""
        return None

    def shutdown(self) -> None:
        """Close the HTTP connections. Idempotent."""
        if not self._closed.is_set():
            self._closed.set()
            self._client.close()


class _Retryable(Exception):
    """A 5xx answer: worth another attempt."""


def _parse_event(data: str, base_url: str) -> dict[str, Any]:
    try:
        event = json.loads(data)
    except json.JSONDecodeError as exc:
        msg = f"malformed SSE event from {base_url}: {data[:200]!r}"
        raise ServerError(msg) from exc
    if not isinstance(event, dict):
        msg = f"malformed SSE event from {base_url}: {data[:200]!r}"
        raise ServerError(msg)
    if "error" in event:
        msg = f"the server at {base_url} failed mid-stream: {event['error']}"
        raise ServerError(msg)
    return event


def _eos_token_ids(model_path: str | None) -> frozenset[int]:
    """EOS ids from the local model folder's ``generation_config.json``/``config.json``."""
    if model_path is None:
        return frozenset()
    for name in ("generation_config.json", "config.json"):
        path = Path(model_path) / name
        if not path.is_file():
            continue
        try:
            eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
        except (OSError, ValueError):
            continue
        if isinstance(eos, int):
            return frozenset([eos])
        if isinstance(eos, list):
            return frozenset(int(e) for e in eos if isinstance(e, int))
    return frozenset()


def step_output(request_id: str, delta: dict[str, Any]) -> StepOutput:
    """A stream delta from :meth:`ServerBackend.stream` as the engine's :class:`StepOutput`."""
    if delta.get("done"):
        return StepOutput(
            request_id, (), "", True, delta.get("finish_reason"), delta.get("cached_tokens")
        )
    return StepOutput(request_id, delta["token_ids"], str(delta["text"]), False, None, None)


def connect_server(
    server: str | ServerSettings,
    model_path: str | None,
    tokenizer: Tokenizer,
    listener: EvictionListener,
) -> tuple[ServerBackend, KVEventSync | None, BlockHasher | None]:
    """Connect to ``server`` (checks in the module doc), subscribe ``listener`` to its KV
    events and build the block hasher matching its event hashes. Used by ``CraftEngine``."""
    backend = ServerBackend(as_server_settings(server), model_path, tokenizer)
    try:
        events = backend.subscribe(listener)
    except BaseException:
        backend.shutdown()
        raise
    hasher = backend.block_hasher()
    if events is not None:
        events.set_hasher(hasher)
    return backend, events, hasher
