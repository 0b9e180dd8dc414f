"""A hostile or broken OpenAI-compatible server on 127.0.0.1 (the scripted fake of
fake_server.py, answering over real HTTP): every impossible field is a ``ServerError`` naming
the server and the field with nothing committed, every read is capped, ``read_timeout`` is a
deadline between tokens, 429 is retried honouring ``Retry-After``, and a restarted server is
checked again before it serves another prompt."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_server import FakeServer, event, flood, running, sse
from test_server_backend import chunks, free_port, make_engine

from craft_rag.engine.backends.server.backend import (
    ServerBackend,
    ServerError,
    ServerRejected,
    ServerSettings,
    ServerUnavailable,
)
from craft_rag.engine.engine import CraftEngine
from craft_rag.engine.results import SamplingRequest
from craft_rag.tokenizer import HashingTokenizer


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    return tmp_path


@pytest.fixture
def served(model_dir: Path) -> Iterator[tuple[CraftEngine, FakeServer, str]]:
    fake = FakeServer()
    with running(fake) as url:
        engine = make_engine(url, model_dir)
        try:
            yield engine, fake, url
        finally:
            engine.close()


def tree_size(engine: CraftEngine) -> int:
    return len(engine.planner.prefix_tree)  # type: ignore[attr-defined]


def tokens_then_usage(cached: object, *, tokens: int = 2) -> Any:
    """A well-formed stream whose usage reports ``cached`` as the cached tokens."""

    def answer(handler: Any, body: dict[str, Any]) -> None:
        lines = [
            event({"choices": [{"text": f" t{i}", "token_ids": [1000 + i], "finish_reason": None}]})
            for i in range(tokens)
        ]
        usage = {
            "prompt_tokens": len(body["prompt"]),
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        sse(handler, [*lines, event({"choices": [], "usage": usage}), b"data: [DONE]"])

    return answer


def choices_answer(choices: object) -> Any:
    def answer(handler: Any, body: dict[str, Any]) -> None:
        usage = {"prompt_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}}
        sse(
            handler,
            [event({"choices": choices}), event({"choices": [], "usage": usage}), b"data: [DONE]"],
        )

    return answer


def assert_refused_committing_nothing(
    engine: CraftEngine,
    fake: FakeServer,
    url: str,
    field: str,
    error: type[Exception] = ServerError,
) -> None:
    before = tree_size(engine)
    with pytest.raises(error, match=field) as info:
        engine.generate(chunks(), "q?", max_tokens=4, conversation_id="conv")
    assert url in str(info.value)
    assert tree_size(engine) == before
    fake.hostile = None
    # The failed turn left no conversation behind: the next one is turn 1 again.
    assert engine.generate(chunks(), "q?", max_tokens=1, conversation_id="conv").report.turn == 1


# ---- impossible and malformed fields in a stream ------------------------------------------------


@pytest.mark.parametrize(
    "cached", [10**9, -50, "abc", math.nan, True, 1.5, [3], {"n": 3}], ids=repr
)
def test_impossible_cached_tokens_is_a_server_error_and_nothing_is_committed(
    served: tuple[CraftEngine, FakeServer, str], cached: object
) -> None:
    engine, fake, url = served
    fake.hostile = tokens_then_usage(cached)
    assert_refused_committing_nothing(engine, fake, url, "cached_tokens")


def test_a_stream_past_max_tokens_is_refused_and_fills_nothing(
    served: tuple[CraftEngine, FakeServer, str],
) -> None:
    engine, fake, url = served
    fake.hostile = tokens_then_usage(0, tokens=3004)
    assert_refused_committing_nothing(engine, fake, url, "max_tokens")


@pytest.mark.parametrize(
    ("choices", "field"),
    [
        ([{"text": "x", "token_ids": ["a"]}], "token_ids"),
        ([{"text": "x", "token_ids": [-1]}], "token_ids"),
        ([{"text": "x", "token_ids": [2**40]}], "token_ids"),
        ([{"text": "x", "token_ids": [1.5]}], "token_ids"),
        ([{"text": "x", "token_ids": [True]}], "token_ids"),
        ([{"text": "x", "token_ids": "abc"}], "token_ids"),
        ([{"text": "x", "token_ids": {"0": 1}}], "token_ids"),
        ([{"text": 5, "token_ids": [7]}], "text"),
        ([{"text": "x" * 70_000, "token_ids": [7]}], "text"),
        ([{"text": "x", "token_ids": [7], "finish_reason": 5}], "finish_reason"),
        ({"text": "x", "token_ids": [7]}, "choices"),
        ("abc", "choices"),
        (5, "choices"),
        ([5], "choices"),
        ([None], "choices"),
        ([{"index": 1, "text": "x", "token_ids": [7]}], "index"),
        ([{"index": "0", "text": "x", "token_ids": [7]}], "index"),
    ],
)
def test_malformed_stream_field_is_a_server_error_naming_it(
    served: tuple[CraftEngine, FakeServer, str], choices: object, field: str
) -> None:
    engine, fake, url = served
    fake.hostile = choices_answer(choices)
    assert_refused_committing_nothing(engine, fake, url, field)


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        (b"data: {not json", "malformed SSE event"),
        (b"data: [1, 2]", "malformed SSE event"),
        (b'data: {"usage": 5, "choices": []}', "usage"),
        (b'data: {"usage": {"prompt_tokens_details": 5}}', "prompt_tokens_details"),
        (b"data: \xff\xfe", "malformed SSE event"),
        (b'data: {"error": {"message": "boom"}}', "failed mid-stream"),
    ],
    ids=["not-json", "array", "usage-int", "details-int", "not-utf8", "error-event"],
)
def test_malformed_event_is_a_server_error(
    served: tuple[CraftEngine, FakeServer, str], line: bytes, problem: str
) -> None:
    engine, fake, url = served
    fake.hostile = lambda handler, body: sse(handler, [line, b"data: [DONE]"])
    assert_refused_committing_nothing(engine, fake, url, problem)


# ---- malformed connect-time answers -------------------------------------------------------------


def models(entry: object) -> tuple[int, bytes]:
    return 200, json.dumps({"data": [entry]}).encode()


@pytest.mark.parametrize(
    ("path", "answer", "field"),
    [
        ("/v1/models", (200, b"<html><body>gateway</body></html>"), "/v1/models"),
        ("/v1/models", (200, b'{"data": 5}'), "data"),
        ("/v1/models", (200, b'{"data": "abc"}'), "data"),
        ("/v1/models", models({"id": ["fake-model"], "max_model_len": 512}), "id"),
        ("/v1/models", models({"id": {"a": 1}, "max_model_len": 512}), "id"),
        ("/v1/models", models({"id": "fake-model", "max_model_len": "abc"}), "max_model_len"),
        ("/v1/models", models({"id": "fake-model", "max_model_len": -3}), "max_model_len"),
        ("/v1/models", models({"id": "fake-model", "max_model_len": 2**40}), "max_model_len"),
        ("/v1/models", models({"id": "fake-model", "max_model_len": True}), "max_model_len"),
        ("/v1/models", models({"id": "fake-model", "max_model_len": 51.5}), "max_model_len"),
        (
            "/v1/models",
            (200, b'{"data": [{"id": "fake-model", "max_model_len": NaN}]}'),
            "max_model_len",
        ),
        ("/tokenize", (200, b"<html>no</html>"), "/tokenize"),
        ("/tokenize", (200, b'{"tokens": "abc"}'), "tokens"),
        ("/tokenize", (200, b'{"tokens": ["a", "b"]}'), "tokens"),
        ("/tokenize", (200, b'{"tokens": [1, 2.5]}'), "tokens"),
        ("/metrics", (200, b'vllm:cache_config_info{block_size="abc"} 1.0\n'), "block_size"),
        ("/metrics", (200, b'vllm:cache_config_info{block_size="-4"} 1.0\n'), "block_size"),
        (
            "/metrics",
            (200, b'vllm:cache_config_info{block_size="99999999999"} 1.0\n'),
            "block_size",
        ),
        ("/metrics", (200, b"\xff\xfe\xfd"), "/metrics"),
        (
            "/metrics",
            (200, b'vllm:cache_config_info{block_size="4",prefix_caching_hash_algo="x<y"} 1\n'),
            "prefix_caching_hash_algo",
        ),
        (
            "/metrics",
            (200, b'vllm:cache_config_info{block_size="4",prefix_caching_hash_algo="md4"} 1\n'),
            "prefix_caching_hash_algo",
        ),
    ],
)
def test_malformed_connect_answer_is_a_server_error_naming_server_and_field(
    model_dir: Path, path: str, answer: tuple[int, bytes], field: str
) -> None:
    fake = FakeServer(answers={path: answer})
    with running(fake) as url, pytest.raises(ServerError, match=field) as info:
        make_engine(url, model_dir)
    assert url in str(info.value)


# ---- caps on every read -------------------------------------------------------------------------


def test_a_huge_sse_line_hits_the_line_cap(served: tuple[CraftEngine, FakeServer, str]) -> None:
    engine, fake, url = served
    fake.hostile = lambda handler, body: flood(
        fake, handler, head=b'data: {"choices": [{"text": "', piece=b"x" * 65536
    )
    assert_refused_committing_nothing(engine, fake, url, "longer than")
    assert fake.written < 16 << 20  # the client hung up long before the 96 MiB line ended


def test_a_huge_error_body_is_not_read_whole(served: tuple[CraftEngine, FakeServer, str]) -> None:
    engine, fake, url = served
    fake.hostile = lambda handler, body: flood(
        fake, handler, head=b"overloaded ", piece=b"x" * 65536, status=500
    )
    start = time.monotonic()
    with pytest.raises(ServerError, match="HTTP 500") as info:
        engine.generate(chunks(), "q?", max_tokens=2)
    assert len(str(info.value)) < 2000 and url in str(info.value)
    assert fake.written < 16 << 20
    assert time.monotonic() - start < 10


def test_a_thousand_models_are_named_briefly(model_dir: Path) -> None:
    data = {"data": [{"id": f"m{i}", "max_model_len": 512} for i in range(1000)]}
    fake = FakeServer(answers={"/v1/models": (200, json.dumps(data).encode())})
    with running(fake) as url, pytest.raises(ValueError, match="1000 models") as info:
        make_engine(url, model_dir)
    assert len(str(info.value)) < 1000


def test_a_huge_connect_answer_hits_the_body_cap(model_dir: Path) -> None:
    fake = FakeServer(answers={"/v1/models": (200, b'{"data": [' + b" " * (24 << 20) + b"]}")})
    with running(fake) as url, pytest.raises(ServerError, match="larger than"):
        make_engine(url, model_dir)


# ---- read_timeout is a deadline between tokens --------------------------------------------------


@pytest.mark.parametrize(
    ("head", "piece"),
    [(b"", b": keep-alive\n\n"), (b"", b"event: ping\n\n"), (b'data: {"choices": []', b" ")],
    ids=["comments", "non-data-lines", "slow-drip"],
)
def test_keepalives_do_not_defeat_read_timeout(model_dir: Path, head: bytes, piece: bytes) -> None:
    fake = FakeServer()
    with running(fake) as url:
        engine = make_engine(url, model_dir, read_timeout=0.6)
        try:
            fake.hostile = lambda handler, body: flood(
                fake, handler, head=head, piece=piece, every_s=0.05, max_s=6.0
            )
            start = time.monotonic()
            with pytest.raises(ServerUnavailable, match="read_timeout"):
                engine.generate(chunks(), "q?", max_tokens=2)
            assert time.monotonic() - start < 5
        finally:
            engine.close()


# ---- 429: busy, retried honouring Retry-After ---------------------------------------------------


def backend(url: str, sleeps: list[float], **settings: Any) -> ServerBackend:
    settings.setdefault("kv_events", False)
    settings.setdefault("backoff", 0.01)
    return ServerBackend(
        ServerSettings(url, **settings), None, HashingTokenizer(), sleep=sleeps.append
    )


def run(b: ServerBackend, max_tokens: int = 2) -> list[dict[str, Any]]:
    return list(b.stream(list(range(10, 30)), SamplingRequest(max_tokens=max_tokens), None))


def test_429_is_retried_after_the_servers_retry_after() -> None:
    fake = FakeServer()
    with running(fake) as url:
        sleeps: list[float] = []
        b = backend(url, sleeps)
        fake.fail_next, fake.fail_headers = [429, 429], {"Retry-After": "7"}
        assert run(b)[-1]["done"]
        assert sleeps == [7.0, 7.0]
        b.shutdown()


def test_429_without_retry_after_backs_off_and_past_the_retries_is_not_a_value_error() -> None:
    fake = FakeServer()
    with running(fake) as url:
        sleeps: list[float] = []
        b = backend(url, sleeps)
        fake.fail_next = [429] * 3
        with pytest.raises(ServerError, match="429") as info:
            run(b)
        assert not isinstance(info.value, ValueError)
        assert sleeps == [0.01, 0.02]
        b.shutdown()


def test_a_503_retry_after_is_honoured_too() -> None:
    fake = FakeServer()
    with running(fake) as url:
        sleeps: list[float] = []
        b = backend(url, sleeps)
        fake.fail_next, fake.fail_headers = [503], {"Retry-After": "3"}
        assert run(b)[-1]["done"]
        assert sleeps == [3.0]
        b.shutdown()


@pytest.mark.parametrize("retry_after", ["86400", "Wed, 21 Oct 2099 07:28:00 GMT"])
def test_a_retry_after_past_the_bound_fails_at_once(retry_after: str) -> None:
    fake = FakeServer()
    with running(fake) as url:
        sleeps: list[float] = []
        b = backend(url, sleeps)
        fake.fail_next, fake.fail_headers = [429], {"Retry-After": retry_after}
        with pytest.raises(ServerError, match="Retry-After"):
            run(b)
        assert sleeps == []
        b.shutdown()


@pytest.mark.parametrize("retry_after", ["abc", "-5", "nan", "1e400"])
def test_a_malformed_retry_after_falls_back_to_the_backoff(retry_after: str) -> None:
    fake = FakeServer()
    with running(fake) as url:
        sleeps: list[float] = []
        b = backend(url, sleeps)
        fake.fail_next, fake.fail_headers = [429], {"Retry-After": retry_after}
        assert run(b)[-1]["done"]
        assert sleeps == [0.01]
        b.shutdown()


def test_other_4xx_stay_rejected() -> None:
    fake = FakeServer()
    with running(fake) as url:
        b = backend(url, [])
        fake.fail_next = [422]
        with pytest.raises(ServerRejected, match="422"):
            run(b)
        b.shutdown()


# ---- a restarted server is checked again --------------------------------------------------------


@pytest.mark.parametrize(
    ("changed", "field"),
    [
        ({"block_size": 8}, "block_size"),
        ({"tokenize_shift": 1}, "tokenizer"),
        (
            {"answers": {"/v1/models": models({"id": "fake-model", "max_model_len": 256})}},
            "max_model_len",
        ),
        (
            {"answers": {"/v1/models": models({"id": "other-model", "max_model_len": 512})}},
            "other-model",
        ),
    ],
    ids=["block_size", "tokenizer", "max_model_len", "model"],
)
def test_a_restart_with_another_setup_is_refused(
    model_dir: Path, changed: dict[str, Any], field: str
) -> None:
    port = free_port()
    with running(FakeServer(), port) as url:
        engine = make_engine(url, model_dir)
        engine.generate(chunks(), "q?", max_tokens=1)
    try:
        with pytest.raises(ServerUnavailable):  # the server is down
            engine.generate(chunks(), "q?", max_tokens=1)
        restarted = FakeServer(**changed)
        with running(restarted, port):
            sent = len(restarted.bodies)
            for _ in range(2):  # and it stays refused
                with pytest.raises(ServerError, match=field) as info:
                    engine.generate(chunks(), "q?", max_tokens=1)
                assert url in str(info.value) and "restart" in str(info.value)
            # No prompt reached the restarted server (the probe is 4 ids of the local tokenizer).
            assert all(len(b["prompt"]) <= 4 for b in restarted.bodies[sent:])
    finally:
        engine.close()


def test_a_restart_with_the_same_setup_serves_again(model_dir: Path) -> None:
    port = free_port()
    with running(FakeServer(), port) as url:
        engine = make_engine(url, model_dir)
    try:
        with pytest.raises(ServerUnavailable):
            engine.generate(chunks(), "q?", max_tokens=1)
        with running(FakeServer(), port):
            assert len(engine.generate(chunks(), "q?", max_tokens=2).token_ids) == 2
    finally:
        engine.close()
