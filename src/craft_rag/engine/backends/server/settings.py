"""Where a vLLM OpenAI-compatible server is and how to talk to it (:class:`ServerSettings`),
and the errors a server request raises. Split from :mod:`craft_rag.engine.backends.server.backend`
(the HTTP client), which re-exports every name here.

Errors: :class:`ServerUnavailable` (a ``ConnectionError``) when the server cannot be reached
or drops a stream; :class:`ServerError` (an ``EngineFailure``) for 5xx answers after retries or
a malformed or impossible answer (:class:`ServerBusy` for 429 past the retries);
:class:`ServerRejected` (a ``ValueError``) for another 4xx answer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from urllib.parse import unquote, urlsplit

from craft_rag.engine.driver import EngineFailure
from craft_rag.redact import MASK, redact_url
from craft_rag.validation import check_int, check_number

__all__ = [
    "KV_EVENTS_PORT_OFFSET",
    "ServerBusy",
    "ServerError",
    "ServerRejected",
    "ServerSettings",
    "ServerUnavailable",
    "as_server_settings",
    "parse_cache_config",
]

KV_EVENTS_PORT_OFFSET = 1000
"""Default KV-events port: the HTTP port plus this (``craft-rag serve`` binds it)."""

MAX_RETRIES = 100
"""Bound on ``retries``: with the doubling backoff more would wait for years."""

MAX_BACKOFF_S = 3600.0
"""Bound on ``backoff`` (seconds; the first wait, later ones double)."""

MAX_TIMEOUT_S = 7 * 86400.0
"""Longest ``connect_timeout``/``read_timeout`` (a week): a larger one overflows the socket
clock at the first call."""

_INFO_LABEL = re.compile(r'(\w+)="([^"]*)"')


class ServerUnavailable(ConnectionError):
    """The server could not be reached (or dropped the connection); the message names the URL
    and the fix. The engine clears its CP-Trees: a restarted server has an empty cache."""


class ServerError(EngineFailure):
    """The server answered with a 5xx status (after retries) or a malformed stream."""


class ServerBusy(ServerError):
    """The server answered 429 (too many requests) past the retries, or asked to wait longer
    than the bounded ``Retry-After`` wait: back off and send the request again later."""


class ServerRejected(ValueError):
    """The server refused the request (4xx other than 429): the request itself is invalid."""


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """Where the server is and how to talk to it.

    ``kv_events``: ``None`` -> ``tcp://HOST:(PORT+1000)``; an int -> that port on the URL's
    host; a ``tcp://`` string -> that endpoint; ``False`` -> no KV events (the CP-Tree then
    learns evictions only from commits). ``block_size``/``hash_algo``: ``None`` reads them
    from the server's ``/metrics``. ``hash_seed``: the server's ``PYTHONHASHSEED`` if it
    set one (``None``: vLLM's fixed default for sha256). ``retries`` (<= 100): extra attempts
    after a connect error, 5xx or 429, waiting the answer's ``Retry-After`` (up to 60 s) or
    ``backoff * 2**i`` seconds (each wait at most 60 s). ``read_timeout``: a deadline between
    tokens (and for any other whole answer); SSE keep-alive comments and token-less events do
    not extend it. Every float is finite (``ValueError`` naming the field). Credentials (the URL's
    ``user:password@``, ``api_key``) are sent to the server and shown nowhere: not in
    :attr:`base_url`, messages, log lines or the repr.
    """

    url: str
    kv_events: int | str | bool | None = None
    model_name: str | None = None
    block_size: int | None = None
    hash_algo: str | None = None
    hash_seed: str | None = None
    connect_timeout: float = 3.0
    read_timeout: float = 300.0
    retries: int = 2
    backoff: float = 0.25
    api_key: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.url, str):
            msg = f"server must be an http(s) URL string, got {type(self.url).__name__}"
            raise ValueError(msg)
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            msg = (
                f"server URL {_shown_url(self.url)!r} is not http(s)://HOST[:PORT]; e.g. "
                "server='http://127.0.0.1:8000' (start one with `craft-rag serve`)"
            )
            raise ValueError(msg)
        try:
            parts.port  # noqa: B018  (raises ValueError for a bad port)
        except ValueError as exc:
            # Not urllib's text: it quotes the "port", which may be part of a password.
            msg = f"server URL {_shown_url(self.url)!r} has an invalid port (1..65535)"
            raise ValueError(msg) from exc
        if parts.path.rstrip("/") not in ("", "/v1") or parts.query or parts.fragment:
            msg = (
                f"server URL {_shown_url(self.url)!r} must be the server root, e.g. "
                "http://127.0.0.1:8000"
            )
            raise ValueError(msg)
        for name in ("connect_timeout", "read_timeout"):
            check_number(
                getattr(self, name), f"{name} (seconds)", positive=True, maximum=MAX_TIMEOUT_S
            )
        check_int(self.retries, "retries", minimum=0, maximum=MAX_RETRIES)
        check_number(self.backoff, "backoff (seconds)", minimum=0.0, maximum=MAX_BACKOFF_S)
        if self.block_size is not None:  # None: read from /metrics
            check_int(self.block_size, "block_size", minimum=1, maximum=1 << 16)
        if self.kv_events is not None and not isinstance(self.kv_events, int | str):
            msg = (
                "kv_events must be a port, a tcp://HOST:PORT endpoint, False or None, got "
                f"{type(self.kv_events).__name__}"
            )
            raise ValueError(msg)
        if isinstance(self.kv_events, str) and not self.kv_events.startswith("tcp://"):
            msg = f"kv_events {self.kv_events!r} must be a tcp://HOST:PORT endpoint or a port"
            raise ValueError(msg)
        if (
            isinstance(self.kv_events, int)
            and not isinstance(self.kv_events, bool)
            and not 0 < self.kv_events < 65536
        ):
            msg = f"kv_events port must be in 1..65535, got {self.kv_events}"
            raise ValueError(msg)

    @property
    def base_url(self) -> str:
        """``scheme://host[:port]`` WITHOUT the URL's ``user:password@``: the HTTP client's
        base (so httpx's request log lines carry no credentials) and what every message names.
        The credentials travel as :attr:`auth`."""
        parts = urlsplit(self.url)
        return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}"

    @property
    def shown_url(self) -> str:
        """:attr:`url` with every secret hidden: what messages, reprs and dumps show."""
        return _shown_url(self.url)

    @property
    def auth(self) -> tuple[str, str] | None:
        """HTTP basic credentials from the URL's ``user:password@`` (percent-decoded, as
        httpx reads them), or ``None``: the client sends them as the ``Authorization``
        header (taking precedence over ``api_key``'s bearer header, as before)."""
        parts = urlsplit(self.url)
        if parts.username is None and parts.password is None:
            return None
        return unquote(parts.username or ""), unquote(parts.password or "")

    def __repr__(self) -> str:
        # Secrets never shown: the URL's password (redact_url) and the API key.
        shown = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "url":
                value = _shown_url(value)
            elif f.name == "api_key" and value is not None:
                value = MASK
            shown.append(f"{f.name}={value!r}")
        return f"ServerSettings({', '.join(shown)})"

    @property
    def kv_events_endpoint(self) -> str | None:
        """The ZMQ endpoint to subscribe to, or ``None`` for no events (see the class doc)."""
        if self.kv_events is False:
            return None
        parts = urlsplit(self.url)
        host = parts.hostname
        assert host is not None  # checked in __post_init__
        if ":" in host:
            host = f"[{host}]"
        if isinstance(self.kv_events, str):
            return self.kv_events
        if isinstance(self.kv_events, int) and not isinstance(self.kv_events, bool):
            return f"tcp://{host}:{self.kv_events}"
        port = parts.port or (443 if parts.scheme == "https" else 80)
        if port + KV_EVENTS_PORT_OFFSET > 65535:
            msg = f"HTTP port {port} + {KV_EVENTS_PORT_OFFSET} is no port; pass kv_events=PORT"
            raise ValueError(msg)
        return f"tcp://{host}:{port + KV_EVENTS_PORT_OFFSET}"


def _shown_url(url: str) -> str:
    """``url`` as messages and the repr show it: :func:`~craft_rag.redact.redact_url`, and
    with several ``@`` (a password holding ``@``, maybe ``/`` too, so the authority cannot be
    told from the path) everything before the last ``@`` hidden."""
    scheme, sep, rest = url.partition("://")
    if sep and rest.count("@") > 1:
        url = f"{scheme}{sep}{MASK}@{rest.rpartition('@')[2]}"
    return redact_url(url)


def as_server_settings(server: str | ServerSettings) -> ServerSettings:
    """``server=`` as :class:`ServerSettings` (a URL string gets the defaults)."""
    return server if isinstance(server, ServerSettings) else ServerSettings(server)


def parse_cache_config(metrics_text: str) -> dict[str, str]:
    """The labels of ``vllm:cache_config_info`` in a Prometheus ``/metrics`` page ({} if absent)."""
    for line in metrics_text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            return dict(_INFO_LABEL.findall(line))
    return {}
