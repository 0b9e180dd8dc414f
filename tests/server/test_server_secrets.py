"""No credential of a server URL (``user:password@``) or ``api_key`` appears in any message, log
line, repr or serialization of the server backend and the integrations' LLM classes, while the
credentials still reach the server. Every check greps ALL the output (exception text, records
of every logger at DEBUG, including httpx/httpcore, reprs, ``str()``, dumps) for the secrets.
A loopback fake OpenAI-compatible server (:mod:`fake_server`) stands in for vLLM."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_server import FakeServer, running

from craft_rag.engine.backends.server.backend import (
    ServerError,
    ServerSettings,
    ServerUnavailable,
)
from craft_rag.engine.chat_format import jinja_renderer
from craft_rag.engine.engine import CraftEngine, EngineSettings
from craft_rag.planner import CraftPlanner, PlannerConfig
from craft_rag.prompt import PromptFormat
from craft_rag.testing import make_chunks
from craft_rag.tokenizer import HashingTokenizer

PASSWORD = "pw-SECRET-7f3a"
API_KEY = "sk-SECRET-KEY-91c2"
SECRETS = (PASSWORD, API_KEY)

FORMAT = PromptFormat(
    head="<s>SYS.\n", chunk="Doc: {text}\n", question="Q: {question}", tail=" </u><a>",
    answer="{answer} </a><u>",
)
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def with_credentials(url: str, user: str = "alice") -> str:
    scheme, rest = url.split("://", 1)
    return f"{scheme}://{user}:{PASSWORD}@{rest}"


def assert_clean(*texts: object) -> None:
    for text in texts:
        for secret in SECRETS:
            assert secret not in str(text), f"secret leaked in: {str(text)[:300]}"


@pytest.fixture
def all_logs(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """Every record of every logger (root, httpx, httpcore, craft_rag) at DEBUG."""
    caplog.set_level(logging.DEBUG)
    for name in ("httpx", "httpcore", "craft_rag"):
        caplog.set_level(logging.DEBUG, logger=name)
    yield caplog


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    return tmp_path


def make_engine(settings: ServerSettings, model_dir: Path) -> CraftEngine:
    return CraftEngine(
        EngineSettings(model=model_dir),
        CraftPlanner(PlannerConfig(policy="tree")),
        tokenizer=HashingTokenizer(),
        prompt_format=FORMAT,
        chat_renderer=jinja_renderer(CHATML),
        server=settings,
    )


class Recorder:
    """A hostile-hook that records the Authorization header and then serves normally."""

    def __init__(self) -> None:
        self.authorization: list[str | None] = []

    def __call__(self, handler: Any, body: dict[str, Any]) -> None:
        self.authorization.append(handler.headers.get("Authorization"))
        handler._complete(body)


def test_settings_repr_and_validation_errors_hide_credentials() -> None:
    settings = ServerSettings(with_credentials("http://127.0.0.1:8000"), api_key=API_KEY)
    assert settings.api_key == API_KEY  # still usable
    assert "127.0.0.1:8000" in repr(settings) and "alice" in repr(settings)
    assert_clean(repr(settings), str(settings), settings.base_url)
    odd = ServerSettings(f"http://alice:p@{PASSWORD}@127.0.0.1:8000", api_key=API_KEY)
    assert odd.auth == ("alice", f"p@{PASSWORD}") and odd.base_url == "http://127.0.0.1:8000"
    assert_clean(repr(odd))
    errors = []
    for bad in (
        "ftp://alice:{pw}@127.0.0.1:8000",
        "http://alice:{pw}@127.0.0.1:99999",
        "http://alice:{pw}@127.0.0.1:8000/v1/x",
        "http://alice:{pw}@127.0.0.1:8000/?token={pw}",
        "alice:{pw}@127.0.0.1:8000",
        "http://alice:{pw}/x@127.0.0.1:8000",  # '/' in the password: "port" is part of it
        "http://alice:p@{pw}/word@127.0.0.1:8000",  # '@' and '/' in the password
    ):
        with pytest.raises(ValueError) as refused:
            ServerSettings(bad.format(pw=PASSWORD), api_key=API_KEY)
        errors.append(refused.value)
    assert_clean(*errors)
    assert len(errors) == 7


def test_unreachable_server_hides_credentials(model_dir: Path, all_logs: Any) -> None:
    with running(FakeServer()) as url:
        pass  # stopped: the port is closed now
    settings = ServerSettings(
        with_credentials(url), api_key=API_KEY, kv_events=False, retries=1, backoff=0.01,
        connect_timeout=0.5,
    )
    with pytest.raises(ServerUnavailable) as lost:
        make_engine(settings, model_dir)
    assert url.split("://", 1)[1] in str(lost.value)  # it still names the server
    assert_clean(lost.value, repr(lost.value), lost.value.__cause__, all_logs.text)
    assert all_logs.records  # the loggers were heard


@pytest.mark.parametrize("auth", ["userinfo", "api_key"])
def test_served_requests_and_failures_hide_credentials(
    auth: str, model_dir: Path, all_logs: Any
) -> None:
    fake = FakeServer()
    recorder = Recorder()
    fake.hostile = recorder
    with running(fake) as url:
        if auth == "userinfo":
            settings = ServerSettings(with_credentials(url), kv_events=False, backoff=0.01)
        else:
            settings = ServerSettings(url, api_key=API_KEY, kv_events=False, backoff=0.01)
        engine = make_engine(settings, model_dir)
        try:
            result = engine.generate(make_chunks(2), "Q?", max_tokens=2)
            fake.fail_next = [500, 500, 500]
            with pytest.raises(ServerError) as failed:
                engine.generate(make_chunks(2), "Q2?", max_tokens=2)
            fake.fail_next = [400]
            with pytest.raises(ValueError) as rejected:
                engine.generate(make_chunks(2), "Q3?", max_tokens=2)
            texts = [
                failed.value, rejected.value, repr(engine._backend), repr(result),
                repr(settings), all_logs.text, *integration_views(engine),
            ]
            texts += [r.getMessage() for r in all_logs.records]
            texts += [repr(r.args) for r in all_logs.records]
            assert_clean(*texts)
            assert any(r.name.startswith("httpx") for r in all_logs.records)
        finally:
            engine.close()
    # The credentials still reached the server, as HTTP authorization.
    assert recorder.authorization and recorder.authorization[0] is not None
    if auth == "userinfo":
        import base64

        sent = base64.b64decode(recorder.authorization[0].split()[1]).decode()
        assert sent == f"alice:{PASSWORD}"
    else:
        assert recorder.authorization[0] == f"Bearer {API_KEY}"


def integration_views(engine: CraftEngine) -> list[object]:
    """What the integrations' LLM classes show of an engine on a credentialed server."""
    views: list[object] = []
    try:
        from llama_index.llms.craft_vllm import CraftVLLM
    except ImportError:
        pass
    else:
        llm = CraftVLLM(engine, max_tokens=2)
        views += [repr(llm), str(llm), llm.to_dict(), llm.to_json(), llm.metadata]
    try:
        from langchain_core.load import dumps
        from langchain_craft import ChatCraftVLLM
    except ImportError:
        pass
    else:
        chat = ChatCraftVLLM(engine=engine, max_tokens=2)
        views += [repr(chat), chat.model_dump(), dumps(chat), chat._identifying_params]
    return views


def test_langchain_model_repr_and_dumps_hide_credentials() -> None:
    pytest.importorskip("langchain_core")
    from langchain_core.load import dumpd, dumps
    from langchain_craft import ChatCraftVLLM

    for kwargs in (
        {"server": ServerSettings(with_credentials("http://127.0.0.1:9"), api_key=API_KEY)},
        {"base_url": with_credentials("http://127.0.0.1:9/v1"), "api_key": API_KEY},
    ):
        llm = ChatCraftVLLM(**kwargs)
        server = llm.server
        assert isinstance(server, ServerSettings) and server.api_key == API_KEY  # still usable
        assert_clean(
            repr(llm), str(llm), llm.model_dump(), llm.model_dump_json(), dumpd(llm),
            dumps(llm), llm._identifying_params,
        )
    with pytest.raises(ValueError) as differ:
        ChatCraftVLLM(
            server=with_credentials("http://127.0.0.1:9"),
            base_url=with_credentials("http://127.0.0.1:10/v1"),  # type: ignore[call-arg]
        )
    assert_clean(differ.value)


def test_llamaindex_llm_on_an_unreachable_credentialed_server(all_logs: Any) -> None:
    """``CraftVLLM(base_url=..., api_key=...)`` starts an engine on the server: when it cannot
    be reached the error and every log line still hide the credentials."""
    pytest.importorskip("llama_index.core")
    from llama_index.llms.craft_vllm import CraftVLLM

    from craft_rag.engine.model import prepare_default_model

    try:
        model = prepare_default_model().path
    except (FileNotFoundError, ImportError) as exc:
        pytest.skip(f"embedded model unavailable: {exc}")
    with running(FakeServer()) as url:
        pass  # stopped: the port is closed now
    with pytest.raises(ServerUnavailable) as lost:
        CraftVLLM(
            model=str(model), base_url=with_credentials(url) + "/v1", api_key=API_KEY,
            max_retries=0, timeout=1.0,
        )
    assert_clean(lost.value, repr(lost.value), all_logs.text)


def test_integration_constructor_errors_hide_credentials() -> None:
    """A refused constructor argument is a pydantic ValidationError, which quotes the input:
    the input (the whole argument dict for a model validator) must not be quoted."""
    bad_url = f"ftp://alice:{PASSWORD}@127.0.0.1:9/v1"
    refused: list[BaseException] = []
    try:
        from langchain_craft import ChatCraftVLLM
    except ImportError:
        pass
    else:
        for kwargs in (
            {"base_url": bad_url, "api_key": API_KEY},
            {"server": with_credentials("http://127.0.0.1:9"), "api_key": API_KEY, "top_p": 9},
        ):
            with pytest.raises(ValueError) as chat_error:
                ChatCraftVLLM(**kwargs)
            refused.append(chat_error.value)
    try:
        from llama_index.llms.craft_vllm import CraftVLLM
    except ImportError:
        pass
    else:
        with pytest.raises(ValueError) as llm_error:
            CraftVLLM(base_url=bad_url, api_key=API_KEY)
        refused.append(llm_error.value)
    assert refused
    assert_clean(*refused, *(repr(e) for e in refused))
