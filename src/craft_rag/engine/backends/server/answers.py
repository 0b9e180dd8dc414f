"""What an OpenAI-compatible server answers, read bounded and checked field by field.

The server is a network peer: a proxy in front of it, a wrong service on the port, a broken
build or a hostile host can answer anything. So every read here is capped (the bounds below,
stated in docs/security.md), every field is type- and range-checked, and anything impossible
is a :class:`ServerError` naming the server and the field (``"the server at URL sent
cached_tokens=1000000000: ..."``), raised before anything reaches the planner. Untrusted text
is quoted with ``repr`` and truncated, never interpreted.

Costs: O(bytes read) per answer; the per-event checks are O(tokens in the event).
"""

from __future__ import annotations

import email.utils
import json
import math
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from craft_rag.engine.backends.server.settings import ServerError, ServerUnavailable

MAX_SSE_LINE_BYTES = 1 << 20
"""Longest SSE line read (1 MiB). A vLLM delta carries a few tokens (well under 1 KiB); a
longer line is refused instead of being buffered whole."""

MAX_JSON_BODY_BYTES = 4 << 20
"""Largest JSON answer read (``/v1/models``, ``/tokenize``, ``/reset_prefix_cache``: 4 MiB)."""

MAX_METRICS_BYTES = 16 << 20
"""Largest ``/metrics`` page read (16 MiB; vLLM's is ~100 KiB)."""

MAX_ERROR_BODY_BYTES = 64 << 10
"""How much of an error answer is read (64 KiB; the message quotes its first 300 chars)."""

MAX_TOKEN_ID = 2**31 - 1
"""Largest token id accepted (vLLM's token ids are int32)."""

MAX_MODEL_LEN = 2**31 - 1
"""Largest ``max_model_len`` accepted."""

MAX_BLOCK_SIZE = 1 << 16
"""Largest KV block size accepted from ``/metrics`` (vLLM uses 16..256)."""

MAX_TEXT_PER_TOKEN = 1024
"""Most characters of ``text`` a delta may carry per token (a token decodes to a few bytes;
this bounds a reply's text by ``max_tokens``)."""

MAX_RETRY_AFTER_S = 60.0
"""Longest ``Retry-After`` wait honoured; a longer one fails the request at once (a blocking
call should not sleep for an hour on a peer's say-so)."""

_QUOTE = 80


def quote(value: object) -> str:
    """``repr(value)``, truncated: how untrusted values appear in messages."""
    text = repr(value)
    return text if len(text) <= _QUOTE else text[: _QUOTE - 3] + "..."


def bad_field(base_url: str, where: str, field: str, value: object, problem: str) -> ServerError:
    """The one error for an impossible field: names the server, the answer and the field."""
    return ServerError(
        f"the server at {base_url} sent {field}={quote(value)} in {where}: {problem}; "
        "is this a vLLM OpenAI-compatible server (`craft-rag serve`)?"
    )


def answer_int(
    value: object, base_url: str, where: str, field: str, *, minimum: int, maximum: int
) -> int:
    """``value`` if it is a JSON integer in ``[minimum, maximum]`` (not a bool, float or str)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_field(base_url, where, field, value, "not an integer")
    if not minimum <= value <= maximum:
        raise bad_field(base_url, where, field, value, f"outside [{minimum}, {maximum}]")
    return value


# ---- bounded reads ------------------------------------------------------------------------------


class Deadline:
    """A deadline that only progress moves: :meth:`reset` when a token arrives, :meth:`check`
    on every chunk read. Keep-alive comments and empty events read bytes but make no
    progress, so they cannot keep a request alive past ``seconds``."""

    __slots__ = ("_at", "_clock", "base_url", "seconds")

    def __init__(self, seconds: float, base_url: str, clock: Callable[[], float] = time.monotonic):
        self.seconds = seconds
        self.base_url = base_url
        self._clock = clock
        self._at = clock() + seconds

    def reset(self) -> None:
        self._at = self._clock() + self.seconds

    def check(self) -> None:
        if self._clock() > self._at:
            msg = (
                f"the server at {self.base_url} sent no token within read_timeout="
                f"{self.seconds:g} s (keep-alive comments and empty events do not count); it "
                "is overloaded or stuck: raise read_timeout or check the server"
            )
            raise ServerUnavailable(msg)


def read_capped(
    chunks: Iterable[bytes], cap: int, base_url: str, what: str, deadline: Deadline
) -> bytes:
    """The whole body from ``chunks`` (``ServerError`` past ``cap`` bytes). O(cap)."""
    body = bytearray()
    for chunk in chunks:
        deadline.check()
        body += chunk
        if len(body) > cap:
            msg = (
                f"the answer of {what} at {base_url} is larger than {cap} bytes; "
                "refusing to read more"
            )
            raise ServerError(msg)
    return bytes(body)


def read_head(chunks: Iterable[bytes], cap: int, deadline: Deadline) -> bytes:
    """At most the first ``cap`` bytes of a body (an error answer: only its start is shown)."""
    body = bytearray()
    for chunk in chunks:
        deadline.check()
        body += chunk
        if len(body) >= cap:
            break
    return bytes(body[:cap])


def sse_lines(chunks: Iterable[bytes], base_url: str, deadline: Deadline) -> Iterator[bytes]:
    """The lines of an SSE stream (``\\n``, ``\\r\\n`` or ``\\r`` ended), each at most
    :data:`MAX_SSE_LINE_BYTES` (``ServerError`` past that, before it is buffered whole).
    ``deadline`` is checked on every chunk read. Memory: O(line cap)."""
    buffer = bytearray()
    for chunk in chunks:
        deadline.check()
        buffer += chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        start = 0
        while (end := buffer.find(b"\n", start)) >= 0:
            if end - start > MAX_SSE_LINE_BYTES:
                break
            yield bytes(buffer[start:end])
            start = end + 1
        del buffer[:start]
        if len(buffer) > MAX_SSE_LINE_BYTES and buffer.find(b"\n", 0, MAX_SSE_LINE_BYTES + 1) < 0:
            msg = (
                f"the server at {base_url} sent an SSE line longer than {MAX_SSE_LINE_BYTES} "
                "bytes; refusing to read more"
            )
            raise ServerError(msg)
    if buffer:
        yield bytes(buffer)


def json_answer(raw: bytes, base_url: str, what: str) -> dict[str, Any]:
    """``raw`` as a JSON object (``ServerError`` naming ``what`` otherwise)."""
    try:
        answer = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
        msg = f"{what} at {base_url} did not answer JSON ({quote(raw[:200])})"
        raise ServerError(msg) from exc
    if not isinstance(answer, dict):
        msg = f"{what} at {base_url} did not answer a JSON object ({quote(answer)})"
        raise ServerError(msg)
    return answer


def retry_after_s(header: str | None, now: Callable[[], float] = time.time) -> float | None:
    """``Retry-After`` in seconds (delay-seconds or an HTTP date); ``None`` when absent or
    malformed (the caller's backoff applies). May exceed :data:`MAX_RETRY_AFTER_S`."""
    if header is None:
        return None
    text = header.strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError, OverflowError):
            return None
        if when.tzinfo is None:
            return None
        seconds = when.timestamp() - now()
        return max(0.0, seconds)
    if not math.isfinite(seconds) or seconds < 0:
        return None
    return seconds


# ---- stream events ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Delta:
    """One checked choice of an SSE event."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None


def parse_event(data: bytes, base_url: str) -> dict[str, Any]:
    """One ``data:`` payload as a JSON object; a mid-stream ``error`` is a ``ServerError``."""
    try:
        event = json.loads(data)
    except (ValueError, RecursionError) as exc:
        msg = f"malformed SSE event from {base_url}: {quote(data[:200])}"
        raise ServerError(msg) from exc
    if not isinstance(event, dict):
        msg = f"malformed SSE event from {base_url}: {quote(data[:200])}"
        raise ServerError(msg)
    if "error" in event:
        msg = f"the server at {base_url} failed mid-stream: {quote(event['error'])}"
        raise ServerError(msg)
    return event


def event_cached_tokens(event: Mapping[str, Any], prompt_len: int, base_url: str) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` if present, checked to lie in
    ``[0, prompt_len]`` (a server cannot have cached more than the prompt);
    ``usage.prompt_tokens``, if present, must be ``prompt_len``."""
    usage = event.get("usage")
    if usage is None:
        return None
    if not isinstance(usage, dict):
        raise bad_field(base_url, "a stream event", "usage", usage, "not an object")
    counted = usage.get("prompt_tokens")
    if counted is not None and (
        isinstance(counted, bool) or not isinstance(counted, int) or counted != prompt_len
    ):
        # Another prompt ran (a proxy rewrote or truncated ours): its cache says nothing of ours.
        raise bad_field(
            base_url, "the usage event", "prompt_tokens", counted, f"not the {prompt_len} sent"
        )
    details = usage.get("prompt_tokens_details")
    if details is None:
        return None
    if not isinstance(details, dict):
        raise bad_field(
            base_url, "a stream event", "usage.prompt_tokens_details", details, "not an object"
        )
    cached = details.get("cached_tokens")
    if cached is None:
        return None
    return answer_int(
        cached, base_url, "the usage event", "cached_tokens", minimum=0, maximum=prompt_len
    )


def event_deltas(event: Mapping[str, Any], base_url: str) -> list[Delta]:
    """The event's choices, each checked: ``token_ids`` a list of ints in
    ``[0, MAX_TOKEN_ID]``, ``text`` a string of at most ``MAX_TEXT_PER_TOKEN`` chars per
    token, ``finish_reason`` a short string or null. O(tokens)."""
    choices = event.get("choices")
    if choices is None:
        return []
    where = "a stream event"
    if not isinstance(choices, list):
        raise bad_field(base_url, where, "choices", choices, "not a list")
    out: list[Delta] = []
    for choice in choices:
        if not isinstance(choice, dict):
            raise bad_field(base_url, where, "choices[]", choice, "not an object")
        index = choice.get("index", 0)
        if index != 0 or isinstance(index, bool):  # n=1: another index is another sequence
            raise bad_field(base_url, where, "choices[].index", index, "not 0 (one sequence)")
        ids = choice.get("token_ids")
        if ids is None:
            msg = (
                f"the server at {base_url} sent no token_ids; it must support "
                "return_token_ids (vLLM >= 0.10)"
            )
            raise ServerError(msg)
        if not isinstance(ids, list):
            raise bad_field(base_url, where, "token_ids", ids, "not a list")
        for token in ids:
            answer_int(token, base_url, where, "token_ids[]", minimum=0, maximum=MAX_TOKEN_ID)
        text = choice.get("text", "")
        if not isinstance(text, str):
            raise bad_field(base_url, where, "text", text, "not a string")
        if len(text) > MAX_TEXT_PER_TOKEN * max(1, len(ids)):
            raise bad_field(
                base_url,
                where,
                "text",
                text,
                f"{len(text)} chars for {len(ids)} tokens (at most {MAX_TEXT_PER_TOKEN} each)",
            )
        reason = choice.get("finish_reason")
        if reason is not None and (not isinstance(reason, str) or len(reason) > 64):
            raise bad_field(base_url, where, "finish_reason", reason, "not a short string")
        out.append(Delta(tuple(ids), text, reason))
    return out


# ---- connect-time answers -----------------------------------------------------------------------


def served_model(answer: Mapping[str, Any], wanted: str | None, base_url: str) -> tuple[str, int]:
    """``(model name, max_model_len)`` from a ``/v1/models`` answer. ``ValueError`` when
    ``wanted`` is not served (or several are and none was named); ``ServerError`` for a
    malformed answer."""
    where = "/v1/models"
    models = answer.get("data")
    if not isinstance(models, list):
        raise bad_field(base_url, where, "data", models, "not a list of models")
    served: dict[str, Mapping[str, Any]] = {}
    for model in models:
        if not isinstance(model, dict):
            raise bad_field(base_url, where, "data[]", model, "not an object")
        name = model.get("id")
        if not isinstance(name, str) or not name or len(name) > 1024:
            raise bad_field(base_url, where, "id", name, "not a model name")
        served[name] = model
    if wanted is None and len(served) == 1:
        wanted = next(iter(served))
    if wanted not in served:
        names = sorted(served)
        shown = ", ".join(quote(n) for n in names[:10]) + (", ..." if len(names) > 10 else "")
        msg = (
            f"the server at {base_url} serves [{shown}] ({len(names)} models); pass "
            "ServerSettings(model_name=...) naming one of them"
        )
        raise ValueError(msg)
    length = served[wanted].get("max_model_len")
    if length is None:
        msg = f"the server at {base_url} reports no max_model_len for {wanted}"
        raise ServerError(msg)
    return wanted, answer_int(
        length, base_url, where, "max_model_len", minimum=1, maximum=MAX_MODEL_LEN
    )


def metrics_block_size(info: Mapping[str, str], base_url: str) -> int | None:
    """``block_size`` from ``vllm:cache_config_info`` labels (``None`` when absent)."""
    text = info.get("block_size")
    if text is None or text == "":
        return None
    if not text.isascii() or not text.isdigit() or len(text) > 12:
        raise bad_field(base_url, "/metrics", "block_size", text, "not a positive integer")
    return answer_int(
        int(text), base_url, "/metrics", "block_size", minimum=1, maximum=MAX_BLOCK_SIZE
    )


def metrics_hash_algo(info: Mapping[str, str], base_url: str) -> str:
    """``prefix_caching_hash_algo`` from ``vllm:cache_config_info`` (``sha256`` when absent),
    a known block hash function's name."""
    from craft_rag.engine.block_hashes import hash_function

    algo = info.get("prefix_caching_hash_algo") or "sha256"
    if not re.fullmatch(r"[a-z0-9_]{1,32}", algo):
        raise bad_field(base_url, "/metrics", "prefix_caching_hash_algo", algo, "not a name")
    try:
        hash_function(algo)
    except ImportError:
        pass  # needs vLLM here; the block hasher names that fix if it is ever built
    except (ValueError, KeyError, AttributeError) as exc:
        raise bad_field(
            base_url, "/metrics", "prefix_caching_hash_algo", algo, f"unknown ({exc})"
        ) from exc
    return algo


def tokenize_ids(answer: Mapping[str, Any], base_url: str) -> list[int]:
    """``tokens`` of a ``/tokenize`` answer: a list of token ids."""
    tokens = answer.get("tokens")
    if not isinstance(tokens, list):
        raise bad_field(base_url, "/tokenize", "tokens", tokens, "not a list of token ids")
    for token in tokens:
        answer_int(token, base_url, "/tokenize", "tokens[]", minimum=0, maximum=MAX_TOKEN_ID)
    return tokens
