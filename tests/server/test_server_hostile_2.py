"""More of a hostile or broken OpenAI-compatible server on 127.0.0.1 (the scripted fake of
fake_server.py over real HTTP): a stream that goes on after its finish_reason, events naming
another model, redirects (never followed: the api key would go to another host) and headers
dripped slowly enough to dodge a per-read timeout. Each is a clear error naming the server,
with nothing committed."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_server import FakeServer, event, running, sse
from test_server_backend import chunks, make_engine

from craft_rag.engine.backends.server.backend import ServerError, ServerUnavailable
from craft_rag.engine.engine import CraftEngine


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


def token(i: int, finish: str | None = None, **extra: Any) -> bytes:
    return event(
        {"choices": [{"text": f" t{i}", "token_ids": [1000 + i], "finish_reason": finish}], **extra}
    )


USAGE = event({"choices": [], "usage": {"prompt_tokens_details": {"cached_tokens": 0}}})


def refused(
    engine: CraftEngine, fake: FakeServer, url: str, error: type[Exception], match: str
) -> None:
    before = tree_size(engine)
    with pytest.raises(error, match=match) as info:
        engine.generate(chunks(), "q?", max_tokens=4, conversation_id="conv")
    assert url in str(info.value)
    assert tree_size(engine) == before
    fake.hostile = None
    # Nothing of the refused turn was kept: the next one is turn 1 again, served normally.
    assert engine.generate(chunks(), "q?", max_tokens=1, conversation_id="conv").report.turn == 1


# ---- a stream that goes on after its end ---------------------------------------------------------


@pytest.mark.parametrize(
    "lines",
    [
        [token(0), token(1, "length"), token(1, "length"), USAGE, b"data: [DONE]"],
        [token(0, "stop"), token(1), USAGE, b"data: [DONE]"],
        [
            token(0, "stop"),
            event({"choices": [{"text": " more", "token_ids": [], "finish_reason": None}]}),
            USAGE,
            b"data: [DONE]",
        ],
    ],
    ids=["duplicated-final-chunk", "token-after-stop", "text-after-stop"],
)
def test_output_after_the_finish_reason_is_refused(
    served: tuple[CraftEngine, FakeServer, str], lines: list[bytes]
) -> None:
    engine, fake, url = served
    fake.hostile = lambda handler, body: sse(handler, lines)
    refused(engine, fake, url, ServerError, "finish_reason")


def test_an_empty_delta_after_the_finish_reason_is_fine(
    served: tuple[CraftEngine, FakeServer, str],
) -> None:
    engine, fake, _ = served
    empty = event({"choices": [{"text": "", "token_ids": [], "finish_reason": None}]})
    fake.hostile = lambda handler, body: sse(
        handler, [token(0, "stop"), empty, USAGE, b"data: [DONE]"]
    )
    result = engine.generate(chunks(), "q?", max_tokens=4)
    assert result.token_ids == (1000,) and result.text == " t0"


# ---- another model mid-run ----------------------------------------------------------------------


def test_events_from_another_model_are_refused(
    served: tuple[CraftEngine, FakeServer, str],
) -> None:
    engine, fake, url = served
    lines = [token(0, "length", model="other-model"), USAGE, b"data: [DONE]"]
    fake.hostile = lambda handler, body: sse(handler, lines)
    refused(engine, fake, url, ServerError, "other-model")


def test_events_naming_the_served_model_are_fine(
    served: tuple[CraftEngine, FakeServer, str],
) -> None:
    engine, fake, _ = served
    lines = [token(0, "length", model="fake-model"), USAGE, b"data: [DONE]"]
    fake.hostile = lambda handler, body: sse(handler, lines)
    assert engine.generate(chunks(), "q?", max_tokens=4).token_ids == (1000,)


# ---- redirects ----------------------------------------------------------------------------------


def redirect(status: int, location: str) -> Any:
    def answer(handler: Any, body: dict[str, Any]) -> None:
        handler.send_response(status)
        handler.send_header("Location", location)
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    return answer


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_redirect_is_not_followed_and_says_so(
    served: tuple[CraftEngine, FakeServer, str], status: int
) -> None:
    engine, fake, url = served
    fake.hostile = redirect(status, "http://user:hunter2@127.0.0.2:9/steal")
    before = len(fake.bodies)
    with pytest.raises(ServerError, match="redirect") as info:
        engine.generate(chunks(), "q?", max_tokens=2)
    assert url in str(info.value) and "hunter2" not in str(info.value)
    assert len(fake.bodies) == before + 1  # asked once, not retried, nothing followed
    fake.hostile = None
    assert engine.generate(chunks(), "q?", max_tokens=1).token_ids


def test_a_redirect_at_connect_time_says_so(model_dir: Path) -> None:
    fake = FakeServer(answers={"/v1/models": (302, b"")})
    with running(fake) as url, pytest.raises(ServerError, match="redirect") as info:
        make_engine(url, model_dir)
    assert url in str(info.value)


# ---- slow headers -------------------------------------------------------------------------------


def test_headers_dripped_slowly_do_not_defeat_read_timeout(model_dir: Path) -> None:
    """Each header line arrives well within read_timeout, so a per-read timeout never fires;
    the whole head must arrive within read_timeout."""
    fake = FakeServer()

    def drip(handler: Any, body: dict[str, Any]) -> None:
        handler.wfile.write(b"HTTP/1.1 200 OK\r\n")
        stop = time.monotonic() + 8.0
        while time.monotonic() < stop:
            handler.wfile.write(b"X-Drip: 1\r\n")
            handler.wfile.flush()
            time.sleep(0.1)

    with running(fake) as url:
        engine = make_engine(url, model_dir, read_timeout=0.8, retries=0)
        try:
            fake.hostile = drip
            start = time.monotonic()
            with pytest.raises(ServerUnavailable, match="timed out"):
                engine.generate(chunks(), "q?", max_tokens=2)
            assert time.monotonic() - start < 4.0
        finally:
            engine.close()


# ---- error bodies that echo the request's secrets ------------------------------------------------


@pytest.mark.parametrize("status", [401, 500])
def test_an_error_body_echoing_the_api_key_or_salt_is_scrubbed(
    model_dir: Path, status: int
) -> None:
    """OpenAI-compatible servers answer 401 'Incorrect API key provided: sk-...' (and a proxy
    may echo the request): the error quotes the body, never the api key, password or salt."""
    api_key, password, salt = "sk-live-4f9a7c", "pw-31d8e0", "tenant-salt-8c2b"
    fake = FakeServer()
    with running(fake) as url:
        authed = url.replace("http://", f"http://alice:{password}@")
        engine = make_engine(authed, model_dir, api_key=api_key, retries=0)
        try:

            def echo(handler: Any, body: dict[str, Any]) -> None:
                text = (
                    f"Incorrect API key provided: {api_key}; auth "
                    f"{handler.headers.get('Authorization')}; salt {body.get('cache_salt')}; "
                    f"pw {password}"
                )
                data = json.dumps({"error": {"message": text}}).encode()
                handler.send_response(status)
                handler.send_header("Content-Length", str(len(data)))
                handler.end_headers()
                handler.wfile.write(data)

            fake.hostile = echo
            with pytest.raises((ServerError, ValueError)) as info:
                engine.generate(chunks(), "q?", max_tokens=2, cache_salt=salt)
            shown = str(info.value)
            assert "Incorrect API key provided" in shown
            for secret in (api_key, password, salt):
                assert secret not in shown
        finally:
            engine.close()


@pytest.mark.parametrize(
    "line",
    [
        b'data: {"error": {"message": "bad key SECRET for SALT"}}',
        b"data: {not json SECRET SALT",
        b'data: {"choices": [{"text": "x", "token_ids": ["SECRET SALT"]}]}',
    ],
    ids=["error-event", "malformed-event", "bad-field"],
)
def test_a_stream_event_echoing_secrets_is_quoted_without_them(
    model_dir: Path, line: bytes
) -> None:
    api_key, salt = "sk-k3y-77aa", "tenant-s4lt-19"
    line = line.replace(b"SECRET", api_key.encode()).replace(b"SALT", salt.encode())
    fake = FakeServer()
    with running(fake) as url:
        engine = make_engine(url, model_dir, api_key=api_key)
        try:
            fake.hostile = lambda handler, body: sse(handler, [line, b"data: [DONE]"])
            with pytest.raises(ServerError) as info:
                engine.generate(chunks(), "q?", max_tokens=2, cache_salt=salt)
            assert url in str(info.value)
            assert api_key not in str(info.value) and salt not in str(info.value)
        finally:
            engine.close()


# ---- usage about another prompt -----------------------------------------------------------------


@pytest.mark.parametrize("prompt_tokens", [1, 10**6, -1, "12", True, 3.5])
def test_usage_counting_another_prompt_is_refused(
    served: tuple[CraftEngine, FakeServer, str], prompt_tokens: object
) -> None:
    """``usage.prompt_tokens`` other than the prompt sent: the server (or a proxy) ran another
    prompt, so its cached_tokens say nothing about ours and must not reach the planner."""
    engine, fake, url = served

    def answer(handler: Any, body: dict[str, Any]) -> None:
        usage = {"prompt_tokens": prompt_tokens, "prompt_tokens_details": {"cached_tokens": 0}}
        sse(handler, [token(0, "length"), event({"choices": [], "usage": usage}), b"data: [DONE]"])

    fake.hostile = answer
    refused(engine, fake, url, ServerError, "prompt_tokens")


def test_usage_counting_our_prompt_is_fine(served: tuple[CraftEngine, FakeServer, str]) -> None:
    engine, fake, _ = served

    def answer(handler: Any, body: dict[str, Any]) -> None:
        usage = {
            "prompt_tokens": len(body["prompt"]),
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        sse(handler, [token(0, "length"), event({"choices": [], "usage": usage}), b"data: [DONE]"])

    fake.hostile = answer
    assert engine.generate(chunks(), "q?", max_tokens=2).token_ids == (1000,)
