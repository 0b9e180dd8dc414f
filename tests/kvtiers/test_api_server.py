"""``craft_rag.kvtiers.api_server``: the wrapper that puts the tier counts in a streamed
completion's final usage chunk, on a fake of vLLM's stream generator (its shape as in vLLM 0.32:
it reads ``(prompt index, RequestOutput)`` pairs, yields one event per output, then the usage
chunk, then ``[DONE]``). The real vLLM server runs it in tests/kvtiers/test_connector_server.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest

from craft_rag.kvtiers.api_server import add_params_to_usage_chunk, with_stream_params

PARAMS = {"craft_tiers": {"ram_tokens": 64, "disk_tokens": 32}}


@dataclass
class Output:
    text: str
    kv_transfer_params: dict[str, Any] | None = None


@dataclass
class Request:
    n: int | None = None
    include_usage: bool = True


async def fake_vllm_stream(
    self: object,
    request: Request,
    engine_inputs: list[object],
    result_generator: AsyncIterator[tuple[int, Output]],
    request_id: str,
    *,
    num_prompts: int = 1,
) -> AsyncGenerator[str, None]:
    async for index, output in result_generator:
        chunk = {"id": request_id, "choices": [{"index": index, "text": output.text}]}
        yield f"data: {json.dumps(chunk)}\n\n"
    if request.include_usage:
        usage = {"id": request_id, "choices": [], "usage": {"prompt_tokens": 3}}
        yield f"data: {json.dumps(usage)}\n\n"
    yield "data: [DONE]\n\n"


async def outputs(*items: tuple[int, Output]) -> AsyncIterator[tuple[int, Output]]:
    for item in items:
        yield item


def run(request: Request, *items: tuple[int, Output]) -> list[str]:
    wrapped = with_stream_params(fake_vllm_stream)

    async def collect() -> list[str]:
        return [line async for line in wrapped(None, request, [], outputs(*items), "req-1")]

    return asyncio.run(collect())


def events(lines: list[str]) -> list[Any]:
    return [json.loads(line[6:]) for line in lines if not line.startswith("data: [DONE]")]


def test_the_finished_requests_params_ride_on_the_usage_chunk_only() -> None:
    lines = run(Request(), (0, Output("a")), (0, Output("b", PARAMS)))
    got = events(lines)
    assert [e.get("kv_transfer_params") for e in got] == [None, None, PARAMS]
    assert got[-1]["usage"] == {"prompt_tokens": 3} and got[-1]["choices"] == []
    assert lines[-1] == "data: [DONE]\n\n"
    # the token events are vLLM's own bytes
    assert lines[0] == 'data: {"id": "req-1", "choices": [{"index": 0, "text": "a"}]}\n\n'


def test_nothing_is_added_without_params_usage_chunk_or_a_single_request() -> None:
    plain = run(Request(), (0, Output("a")), (0, Output("b")))
    assert all("kv_transfer_params" not in e for e in events(plain))
    no_usage = run(Request(include_usage=False), (0, Output("a", PARAMS)))
    assert all("kv_transfer_params" not in e for e in events(no_usage))
    several = run(Request(), (0, Output("a", PARAMS)), (1, Output("b", PARAMS)))
    assert all("kv_transfer_params" not in e for e in events(several))
    n_two = run(Request(n=2), (0, Output("a", PARAMS)))
    assert all("kv_transfer_params" not in e for e in events(n_two))


def test_the_wrapper_adds_no_latency_each_event_leaves_as_it_is_made() -> None:
    seen: list[str] = []

    async def slow() -> AsyncIterator[tuple[int, Output]]:
        yield 0, Output("a")
        seen.append("second output requested")
        yield 0, Output("b", PARAMS)

    async def first_line() -> str:
        wrapped = with_stream_params(fake_vllm_stream)
        lines = wrapped(None, Request(), [], slow(), "req-1")
        line = await lines.__anext__()
        await lines.aclose()
        return line

    assert '"text": "a"' in asyncio.run(first_line())
    assert seen == []  # the first event came out before the next output was read


@pytest.mark.parametrize(
    "line",
    [
        "data: [DONE]\n\n",
        'data: {"choices": [{"text": "x"}], "usage": {"prompt_tokens": 1}}\n\n',
        'data: {"choices": []}\n\n',
        'data: {"choices": [], "usage": {}, "kv_transfer_params": {"other": 1}}\n\n',
        "data: {not json\n\n",
        'data: ["choices"]\n\n',
        ": keep-alive\n\n",
    ],
)
def test_only_a_final_usage_chunk_is_changed(line: str) -> None:
    assert add_params_to_usage_chunk(line, PARAMS) is None


def test_install_wraps_vllms_generator_once() -> None:
    pytest.importorskip("vllm")
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    from craft_rag.kvtiers.api_server import install

    original = OpenAIServingCompletion.completion_stream_generator
    try:
        assert install() is True
        assert install() is False
        assert OpenAIServingCompletion.completion_stream_generator.__wrapped__ is original  # type: ignore[attr-defined]
    finally:
        OpenAIServingCompletion.completion_stream_generator = original  # type: ignore[method-assign]


def test_craft_rag_serve_runs_the_wrapper_only_with_tiers() -> None:
    from craft_rag.engine.backends.server.serve import ServeConfig, server_command
    from craft_rag.kvtiers.tier_settings import KVTierSettings

    plain = server_command(ServeConfig(model="/m"), python="py")
    tiers = server_command(
        ServeConfig(model="/m", kv_tiers=KVTierSettings(ram_bytes=1 << 20)), python="py"
    )
    assert plain[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
    assert tiers[:3] == ["py", "-m", "craft_rag.kvtiers.api_server"]
    at = tiers.index("--kv-transfer-config")
    assert tiers[3:at] + tiers[at + 2 :] == plain[3:]  # the same server arguments
