"""``python -m craft_rag.kvtiers.api_server ARGS``: vLLM's OpenAI server (the same ``ARGS``)
whose *streamed* completions carry each request's KV tier counts.

Why: :class:`~craft_rag.kvtiers.connector.CraftTierConnector` reports a request's tier tokens
in vLLM's ``kv_transfer_params`` when it finishes (:mod:`craft_rag.kvtiers.tier_tokens`).
vLLM 0.32's ``/v1/completions`` puts them in a non-streaming reply only: its stream generator
(``OpenAIServingCompletion.completion_stream_generator``) drops them, although the stream's last
``RequestOutput`` (the finished one) carries them. ``CraftEngine(server=...)`` streams, so
without this its ``ReuseReport`` could not split the cached tokens by source.

What it changes: :func:`install` wraps that generator. The wrapper watches the request's
``RequestOutput`` s as vLLM's generator reads them and, once they are drained (the request
finished), adds the last non-``None`` ``kv_transfer_params`` to the final usage chunk, the
event vLLM sends after the last token when ``stream_options.include_usage`` is true (or with
``--enable-force-include-usage``)::

    data: {"id": ..., "choices": [], "usage": {...}, "kv_transfer_params":
           {"craft_tiers": {"ram_tokens": 256, "disk_tokens": 0}}}

exactly the dict a non-streaming reply carries at its top level. Nothing else changes: every
other event passes through as vLLM wrote it, nothing is held back (no added latency), and a
request with several prompts or ``n > 1`` gets nothing (the params would not be one
request's, as vLLM's own per-request metrics rule). Without ``include_usage`` there is no such
chunk and nothing is added. Chat completions are not changed.

Scope and bounds: the patch lives in the API server process that runs this module. vLLM's
``--api-server-count`` > 1 starts other API server processes that do not carry it (their
streams then have no counts: the client reads 0, as before). If vLLM's generator no longer has
the expected signature, :func:`install` logs a warning and changes nothing (the server still
runs). ``craft-rag serve`` starts the server through this module whenever tiers are on.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from functools import wraps
from typing import Any

__all__ = ["add_params_to_usage_chunk", "install", "main", "with_stream_params"]

logger = logging.getLogger(__name__)

_EXPECTED = ("self", "request", "engine_inputs", "result_generator")
_MARK = "_craft_stream_params"
_DATA = "data: "

StreamGenerator = Callable[..., AsyncGenerator[str, None]]


def add_params_to_usage_chunk(line: str, params: dict[str, Any]) -> str | None:
    """``line`` (one SSE event as vLLM yields it) with ``params`` added as
    ``kv_transfer_params`` when it is the final usage chunk (a JSON object with ``usage``, no
    choices and no ``kv_transfer_params`` yet); ``None`` for any other line. O(len(line))."""
    if not line.startswith(_DATA):
        return None
    payload = line[len(_DATA) :].strip()
    if not payload.startswith("{"):
        return None  # "[DONE]"
    try:
        event = json.loads(payload)
    except ValueError:
        return None
    if (
        not isinstance(event, dict)
        or event.get("usage") is None
        or event.get("choices")
        or "kv_transfer_params" in event
    ):
        return None
    event["kv_transfer_params"] = params
    return f"{_DATA}{json.dumps(event, separators=(',', ':'))}\n\n"


class _Seen:
    """What the wrapper learned from the request's outputs (one per stream)."""

    __slots__ = ("drained", "params", "several")

    def __init__(self) -> None:
        self.params: dict[str, Any] | None = None
        self.drained = False
        self.several = False  # more than one prompt: the params are no single request's


def with_stream_params(original: StreamGenerator) -> StreamGenerator:
    """``original`` (vLLM's ``completion_stream_generator``) that adds the finished request's
    ``kv_transfer_params`` to its final usage chunk (module doc). The other arguments pass
    through unchanged; closing the wrapper closes ``original``."""

    @wraps(original)
    async def completion_stream_generator(
        self: Any,
        request: Any,
        engine_inputs: Any,
        result_generator: AsyncIterator[tuple[int, Any]],
        *args: Any,
        **kwargs: Any,
    ) -> AsyncGenerator[str, None]:
        seen = _Seen()

        async def watch() -> AsyncIterator[tuple[int, Any]]:
            async for item in result_generator:
                index, output = item
                if index != 0:
                    seen.several = True
                params = getattr(output, "kv_transfer_params", None)
                if isinstance(params, dict):
                    seen.params = params
                yield item
            seen.drained = True

        single = (getattr(request, "n", None) or 1) == 1
        lines = original(self, request, engine_inputs, watch(), *args, **kwargs)
        async with contextlib.aclosing(lines):
            async for line in lines:
                if seen.drained and seen.params is not None and single and not seen.several:
                    changed = add_params_to_usage_chunk(line, seen.params)
                    if changed is not None:
                        line, seen.params = changed, None
                yield line

    setattr(completion_stream_generator, _MARK, True)
    return completion_stream_generator


def install() -> bool:
    """Wrap vLLM's ``OpenAIServingCompletion.completion_stream_generator`` (module doc).
    True when this call installed it; False when it was already installed or vLLM's
    generator has another signature (a warning says so; nothing changes). Idempotent."""
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    current = OpenAIServingCompletion.completion_stream_generator
    if getattr(current, _MARK, False):
        return False
    names = tuple(inspect.signature(current).parameters)[: len(_EXPECTED)]
    if names != _EXPECTED:
        logger.warning(
            "craft-rag: vLLM's completion_stream_generator takes %s, not %s...: streamed "
            "completions will not carry the KV tier counts",
            names,
            _EXPECTED,
        )
        return False
    OpenAIServingCompletion.completion_stream_generator = with_stream_params(current)  # type: ignore[method-assign]
    return True


def main() -> None:
    """Install the wrapper, then run vLLM's OpenAI server on ``sys.argv`` (as
    ``python -m vllm.entrypoints.openai.api_server`` does)."""
    install()
    from vllm.entrypoints.launchers.api_server.entry import main as serve

    serve()  # type: ignore[no-untyped-call]


if __name__ == "__main__":
    main()
