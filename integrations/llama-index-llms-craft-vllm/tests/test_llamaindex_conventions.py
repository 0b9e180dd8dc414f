"""LlamaIndex ``Vllm`` / ``OpenAILike`` constructor names on CraftVLLM: each maps to where it
acts (the engine started, the server, sampling) or is refused; nothing is ignored. Fast: a
real CraftEngine over craft_rag.testing's fake forward pass, and the engine start itself
replaced by a recorder where only the mapping is under test."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.instrumentation import get_dispatcher
from llama_index.llms.craft_vllm import REUSE_KEY, CraftVLLM
from llama_index.llms.craft_vllm import base as base_module
from llama_index.llms.craft_vllm.calls import LEGACY_REUSE_KEY, PROMPT_KEY, CraftPromptEvent
from llama_index.postprocessor.craft.testing import EventRecorder

from craft_rag.engine.engine import CraftEngine, EngineSettings
from craft_rag.engine.server_settings import ServerSettings
from craft_rag.testing import FakeBackend, make_fake_engine


@pytest.fixture
def fake() -> Iterator[tuple[CraftEngine, FakeBackend]]:
    engine, backend = make_fake_engine()
    yield engine, backend
    engine.close()


@pytest.fixture
def started(
    fake: tuple[CraftEngine, FakeBackend], monkeypatch: pytest.MonkeyPatch
) -> list[dict[str, Any]]:
    """Every engine CraftVLLM starts, recorded (its arguments); the fake engine stands in."""
    calls: list[dict[str, Any]] = []

    def start(settings: EngineSettings, **kwargs: Any) -> CraftEngine:
        calls.append({"settings": settings, **kwargs})
        return fake[0]

    monkeypatch.setattr(base_module, "CraftEngine", start)
    return calls


def test_model_selects_the_model_and_names_it(started: list[dict[str, Any]]) -> None:
    """Before: ``model=X`` only renamed ``metadata.model_name``; SmolLM2 was served."""
    llm = CraftVLLM(model="/models/llama-folder")
    assert started[-1]["settings"].model == "/models/llama-folder"
    assert llm.metadata.model_name == "/models/llama-folder"


@pytest.mark.parametrize("name", ["api_base", "base_url", "openai_api_base", "server"])
@pytest.mark.parametrize("url", ["http://h:8000/v1", "http://h:8000"])
def test_a_server_url_under_any_familiar_name_selects_the_server(
    started: list[dict[str, Any]], name: str, url: str
) -> None:
    """Before: ``api_base=`` was ignored and the in-process engine started."""
    CraftVLLM(model="org/name", **{name: url}, api_key="k", timeout=5.0, max_retries=1)
    server = started[-1]["server"]
    assert isinstance(server, ServerSettings) and server.base_url == "http://h:8000"
    assert (server.api_key, server.read_timeout, server.retries) == ("k", 5.0, 1)


def test_window_engine_and_sampling_arguments_act(
    started: list[dict[str, Any]], fake: tuple[CraftEngine, FakeBackend]
) -> None:
    """Before: ``max_new_tokens``, ``context_window`` and ``vllm_kwargs`` were ignored."""
    llm = CraftVLLM(
        max_new_tokens=3,
        context_window=2048,
        vllm_kwargs={"swap_space": 1},
        dtype="float32",
        top_k=5,
        additional_kwargs={"presence_penalty": 0.5},
        stop=["\n\n"],
    )
    settings = started[-1]["settings"]
    assert settings.max_model_len == 2048 and settings.dtype == "float32"
    assert dict(settings.engine_kwargs) == {"swap_space": 1}
    assert llm.max_tokens == 3
    llm.complete("hi", min_p=0.1, max_new_tokens=2)
    sampling = fake[1].added[-1][2]
    assert sampling.max_tokens == 2 and sampling.stop == ("\n\n",)
    assert dict(sampling.extra) == {"top_k": 5, "presence_penalty": 0.5, "min_p": 0.1}


def test_one_settings_shape_object_or_dict(started: list[dict[str, Any]]) -> None:
    CraftVLLM(engine_settings={"model": "/m/x", "max_model_len": 1024})
    CraftVLLM(engine_settings=EngineSettings(model="/m/x", max_model_len=1024))
    assert started[0]["settings"] == started[1]["settings"]
    with pytest.raises(ValueError, match=r"unknown keys \['modle'\]"):
        CraftVLLM(engine_settings={"modle": "/m/x"})
    with pytest.raises(ValueError, match="disagrees"):
        CraftVLLM(model="/m/y", engine_settings={"model": "/m/x"})


def test_unknown_and_refused_arguments_are_errors(started: list[dict[str, Any]]) -> None:
    with pytest.raises(ValueError, match=r"unknown arguments \['frobnicate'\]; accepted: "):
        CraftVLLM(frobnicate=1)
    with pytest.raises(ValueError, match="n=2 is not supported"):
        CraftVLLM(n=2)
    with pytest.raises(ValueError, match="differ"):
        CraftVLLM(max_tokens=3, max_new_tokens=4)
    with pytest.raises(ValueError, match="apply to a server"):
        CraftVLLM(api_key="k")
    with pytest.raises(ValueError, match="not a vLLM sampling parameter"):
        CraftVLLM(additional_kwargs={"foo": 1})
    with pytest.raises(ValueError, match="drop the placeholder"):
        CraftVLLM(context_prompt="Context: {context_str}")
    assert started == []  # nothing was started for a refused argument


def test_a_given_engine_refuses_what_it_cannot_honour(
    fake: tuple[CraftEngine, FakeBackend],
) -> None:
    engine = fake[0]
    for kwargs in (
        {"api_base": "http://h:1/v1"},
        {"context_window": 9},
        {"vllm_kwargs": {"x": 1}},
        {"engine_settings": EngineSettings()},
    ):
        with pytest.raises(ValueError, match="engine= is a running engine"):
            CraftVLLM(engine, **kwargs)
    with pytest.raises(ValueError, match="not the model this engine serves"):
        CraftVLLM(engine, model="org/other")
    with pytest.raises(ValueError, match="differs from the engine's system_prompt"):
        CraftVLLM(engine, system_prompt="Be brief.")
    assert CraftVLLM(engine, model="SmolLM2-135M-Instruct").model == "SmolLM2-135M-Instruct"


def test_the_prompt_sent_is_on_the_response_and_the_dispatcher(
    fake: tuple[CraftEngine, FakeBackend],
) -> None:
    engine, backend = fake
    llm = CraftVLLM(engine, max_tokens=2)
    recorder = EventRecorder(events=[])
    root = get_dispatcher()
    root.add_event_handler(recorder)
    try:
        response = llm.chat([ChatMessage(role=MessageRole.USER, content="hi")])
        streamed = list(llm.stream_complete("hello"))
    finally:
        root.event_handlers.remove(recorder)
    sent = list(backend.added[-2][1])
    assert response.additional_kwargs[PROMPT_KEY]["token_ids"] == sent
    report = response.additional_kwargs[REUSE_KEY]
    assert response.additional_kwargs[LEGACY_REUSE_KEY] is report  # deprecated alias
    assert streamed[-1].additional_kwargs[PROMPT_KEY]["token_ids"] == list(backend.added[-1][1])
    prompts = [e for e in recorder.events if isinstance(e, CraftPromptEvent)]
    assert [p.token_ids for p in prompts] == [sent, list(backend.added[-1][1])]
    # The prompt event comes before the generation ends (it fires when the request starts).
    names = [type(e).__name__ for e in recorder.events]
    first_prompt = names.index("CraftPromptEvent")
    assert names.index("LLMChatStartEvent") < first_prompt < names.index("LLMChatEndEvent")
    assert names.index("LLMCompletionStartEvent") < names.index(
        "CraftPromptEvent", first_prompt + 1
    ) < names.index("LLMCompletionInProgressEvent")
    ends = [e for e in recorder.events if type(e).__name__ == "LLMChatEndEvent"]
    assert ends and ends[0].response.additional_kwargs[PROMPT_KEY]["token_ids"] == sent
