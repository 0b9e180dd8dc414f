"""One HTTP connection to an OpenAI-compatible server: bounded reads and bounded retries.

Split from :mod:`.backend` (what is asked and checked) so this module is only the transport
rules: every answer read through :mod:`.answers`'
caps, ``read_timeout`` a deadline per answer, connection errors, 5xx and 429 retried
``retries`` times (``Retry-After`` honoured up to ``MAX_RETRY_AFTER_S``, else
``backoff * 2**attempt`` capped at :data:`MAX_BACKOFF_S`), every connection loss recorded in
:attr:`ServerConnection.lost` so the backend checks the server again before the next prompt.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Callable
from typing import Any

from craft_rag.engine.backends.server.answers import (
    MAX_ERROR_BODY_BYTES,
    MAX_JSON_BODY_BYTES,
    MAX_METRICS_BYTES,
    MAX_RETRY_AFTER_S,
    Deadline,
    json_answer,
    quote,
    read_capped,
    read_head,
    retry_after_s,
)
from craft_rag.engine.backends.server.settings import (
    ServerBusy,
    ServerError,
    ServerRejected,
    ServerSettings,
    ServerUnavailable,
)
from craft_rag.redact import redact_url

__all__ = ["MAX_BACKOFF_S", "ServerConnection"]

MAX_BACKOFF_S = 60.0
"""Longest single backoff wait (``backoff * 2**attempt`` grows past it with many retries)."""


class ServerConnection:
    """A pooled ``httpx.Client`` (thread-safe) to ``settings.base_url`` with the rules above.

    ``lost``: set by this connection on any connection error, timeout or dropped stream (and by
    the backend when a stream breaks); cleared only by the backend once the server passed its
    checks again. A plain bool: a stale read costs at most one extra check.
    """

    def __init__(
        self,
        settings: ServerSettings,
        *,
        transport: Any = None,
        sleep: Callable[[float], object] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        import httpx

        self.settings = settings
        self.lost = False
        self._sleep = sleep
        self._clock = clock
        headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
        headers["Accept-Encoding"] = "identity"  # caps count wire bytes: no decompression bombs
        timeout = httpx.Timeout(
            settings.read_timeout, connect=settings.connect_timeout, pool=settings.read_timeout
        )
        if transport is None:
            transport = _head_deadline_transport()
        # base_url carries no credentials (httpx logs every request URL at INFO): a URL's
        # user:password@ goes as basic auth instead.
        self._client = httpx.Client(
            base_url=settings.base_url,
            auth=settings.auth,
            timeout=timeout,
            headers=headers,
            transport=transport,
        )
        self._closed = threading.Event()
        self._secrets = _secret_spellings(settings)

    def close(self) -> None:
        """Close the HTTP connections. Idempotent."""
        if not self._closed.is_set():
            self._closed.set()
            self._client.close()

    def retrying(self, what: str, call: Callable[[], Any]) -> Any:
        """``call()`` with bounded retries on connection errors, 5xx and 429 answers."""
        import httpx

        attempts = self.settings.retries + 1
        for attempt in range(attempts):
            last = attempt == attempts - 1
            backoff = min(self.settings.backoff * 2**attempt, MAX_BACKOFF_S)
            try:
                return call()
            except httpx.TransportError as exc:
                self.lost = True
                if isinstance(exc, httpx.TimeoutException) and not isinstance(
                    exc, httpx.ConnectTimeout
                ):
                    msg = (
                        f"{what} at {self.settings.base_url} timed out ({exc!r}); the server "
                        "is overloaded or stuck: raise read_timeout or check the server"
                    )
                    raise ServerUnavailable(msg) from exc
                if last:
                    raise self.unavailable(what, exc, attempts) from exc
                wait = backoff
            except _Retryable as exc:
                error = ServerBusy if exc.status == 429 else ServerError
                if last:
                    msg = (
                        f"{what} at {self.settings.base_url} failed after {attempts} "
                        f"attempts: {exc}"
                    )
                    raise error(msg) from exc
                if exc.retry_after is not None and exc.retry_after > MAX_RETRY_AFTER_S:
                    msg = (
                        f"{what} at {self.settings.base_url}: {exc}, and its Retry-After asks "
                        f"for {exc.retry_after:.0f} s, more than the {MAX_RETRY_AFTER_S:.0f} s "
                        "waited at most; send the request again later"
                    )
                    raise error(msg) from exc
                wait = backoff if exc.retry_after is None else exc.retry_after
            self._sleep(wait)
        raise AssertionError("unreachable")  # pragma: no cover

    def unavailable(self, what: str, exc: BaseException, attempts: int) -> ServerUnavailable:
        self.lost = True
        msg = (
            f"the vLLM server at {self.settings.base_url} is unreachable ({what}: {exc!r}, "
            f"{attempts} attempts); start it (`craft-rag serve --port PORT`) or fix the URL"
        )
        return ServerUnavailable(msg)

    def scrub(self, text: str, body: Any = None) -> str:
        """``text`` (a server's words) without this connection's credentials nor the salt
        of the request ``body``. O(len(text) * secrets)."""
        salt = body.get("cache_salt") if isinstance(body, dict) else None
        return _scrub(text, (*self._secrets, *_spellings(salt)))

    def deadline(self) -> Deadline:
        return Deadline(self.settings.read_timeout, self.settings.base_url, self._clock)

    def open(self, method: str, path: str, body: Any = None) -> Any:
        """Send one request; a 4xx/5xx answer raises (only its first
        ``MAX_ERROR_BODY_BYTES`` are read). Returns the streaming response (close it)."""
        request = self._client.build_request(method, path, json=body)
        # httpx's read timeout is per socket read: headers dripped a line at a time would
        # never trip it. The whole head must arrive within read_timeout.
        _HEAD_DEADLINE.at = time.monotonic() + self.settings.read_timeout
        try:
            response = self._client.send(request, stream=True)
        finally:
            _HEAD_DEADLINE.at = None
        status = response.status_code
        if status < 300:
            return response
        if status < 400:
            response.close()
            # Never followed: the Authorization header (api_key) would go to another host.
            where = redact_url(response.headers.get("location", ""))
            msg = (
                f"{method} {path} at {self.settings.base_url} answered a redirect (HTTP "
                f"{status} to {quote(where)}), which is not followed (the api key would go "
                "along); pass the server's own URL"
            )
            raise ServerError(msg)
        try:
            head = read_head(response.iter_raw(), MAX_ERROR_BODY_BYTES, self.deadline())
        finally:
            response.close()
        # A server may echo what it got ("Incorrect API key provided: sk-..."): the quoted
        # body loses every credential and the request's salt before it is cut short.
        text = self.scrub(head.decode("utf-8", "replace"), body)
        if status >= 500 or status == 429:
            retry_after = retry_after_s(response.headers.get("retry-after"))
            raise _Retryable(status, f"HTTP {status}: {text[:300]!r}", retry_after)
        msg = (
            f"{method} {path} at {self.settings.base_url} was refused with HTTP {status}: "
            f"{text[:500]!r}"
        )
        raise ServerRejected(msg)

    def read(self, method: str, path: str, cap: int, body: Any = None) -> bytes:
        """A whole answer, at most ``cap`` bytes, retried like any request."""

        def call() -> bytes:
            response = self.open(method, path, body)
            try:
                what = f"{method} {path}"
                return read_capped(
                    response.iter_raw(), cap, self.settings.base_url, what, self.deadline()
                )
            finally:
                response.close()

        return bytes(self.retrying(f"{method} {path}", call))

    def json(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        raw = self.read(method, path, MAX_JSON_BODY_BYTES, body)
        return json_answer(raw, self.settings.base_url, f"{method} {path}")

    def text(self, path: str) -> str:
        raw = self.read("GET", path, MAX_METRICS_BYTES)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            msg = f"GET {path} at {self.settings.base_url} did not answer UTF-8 text"
            raise ServerError(msg) from exc


class _Retryable(Exception):
    """A 5xx or 429 answer: worth another attempt (after ``retry_after`` s if it said so)."""

    def __init__(self, status: int, message: str, retry_after: float | None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


def _spellings(secret: object) -> tuple[str, ...]:
    """``secret`` as it may appear in an echoed body: itself and JSON-escaped."""
    if not isinstance(secret, str) or not secret:
        return ()
    escaped = json.dumps(secret)[1:-1]
    return (secret, escaped) if escaped != secret else (secret,)


def _secret_spellings(settings: ServerSettings) -> tuple[str, ...]:
    """Every credential of ``settings`` as a server could echo it: the api key, the URL's
    password and its basic-auth header value (base64 of ``user:password``)."""
    found: list[str] = [*_spellings(settings.api_key)]
    if settings.auth is not None:
        user, password = settings.auth
        found += _spellings(password)
        found.append(base64.b64encode(f"{user}:{password}".encode()).decode("ascii"))
    return tuple(found)


def _scrub(text: str, secrets: tuple[str, ...]) -> str:
    """``text`` with every one of ``secrets`` replaced by ``***`` (longest first)."""
    for secret in sorted(secrets, key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


# ---- a deadline for an answer's head ------------------------------------------------------------

_HEAD_DEADLINE = threading.local()
"""``at``: the monotonic time by which this thread's pending answer head must be complete
(``None``: no request head pending; body reads are bounded by :class:`Deadline` instead)."""


def _head_deadline_transport() -> Any:
    """httpx's default transport, its sockets' reads bounded by :data:`_HEAD_DEADLINE`. If
    httpcore's pool ever stops exposing its network backend, the plain transport is used."""
    import httpx

    transport = httpx.HTTPTransport()
    pool = getattr(transport, "_pool", None)
    backend = getattr(pool, "_network_backend", None)
    if backend is not None:
        pool._network_backend = _head_deadline_backend()(backend)  # type: ignore[union-attr]
    return transport


def _head_deadline_backend() -> type[Any]:
    """A network backend whose streams cap each read's timeout at the pending head's
    deadline (built here: httpcore is imported only where the server backend is used)."""
    import httpcore

    class Stream(httpcore.NetworkStream):
        def __init__(self, inner: httpcore.NetworkStream) -> None:
            self._inner = inner

        def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
            at = getattr(_HEAD_DEADLINE, "at", None)
            if at is not None:
                left = at - time.monotonic()
                if left <= 0:
                    raise httpcore.ReadTimeout("the answer's head took longer than read_timeout")
                timeout = left if timeout is None else min(timeout, left)
            return self._inner.read(max_bytes, timeout)

        def write(self, buffer: bytes, timeout: float | None = None) -> None:
            self._inner.write(buffer, timeout)

        def close(self) -> None:
            self._inner.close()

        def start_tls(self, *args: Any, **kwargs: Any) -> httpcore.NetworkStream:
            return Stream(self._inner.start_tls(*args, **kwargs))

        def get_extra_info(self, info: str) -> Any:
            return self._inner.get_extra_info(info)

    class Backend(httpcore.NetworkBackend):
        def __init__(self, inner: httpcore.NetworkBackend) -> None:
            self._inner = inner

        def connect_tcp(self, *args: Any, **kwargs: Any) -> httpcore.NetworkStream:
            return Stream(self._inner.connect_tcp(*args, **kwargs))

        def connect_unix_socket(self, *args: Any, **kwargs: Any) -> httpcore.NetworkStream:
            return Stream(self._inner.connect_unix_socket(*args, **kwargs))

        def sleep(self, seconds: float) -> None:
            self._inner.sleep(seconds)

    return Backend
