"""ChatOpenAI / VLLM constructor names on ChatCraftVLLM and CraftVLLM: each maps to the one
place it acts (engine settings, server, sampling) or is refused; nothing is ignored. No engine
is started here: the mappings are read off the constructed model, and the requests off a fake
engine's backend."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.outputs import LLMResult
from langchain_craft import ChatCraftVLLM, CraftVLLM

from craft_rag.engine.engine import CraftEngine, EngineSettings
from craft_rag.engine.server_settings import ServerSettings
from craft_rag.testing import FakeBackend

MODELS = (ChatCraftVLLM, CraftVLLM)


@pytest.mark.parametrize("cls", MODELS)
def test_model_selects_the_model_to_serve(cls: Any) -> None:
    """Before: ``model=`` was ignored and the embedded model started."""
    model = cls(model="/models/llama-folder")
    assert model.engine_settings["model"] == "/models/llama-folder"
    assert model.served_model_name() == "llama-folder"
    hub = cls(model="org/name")
    assert hub.engine_settings["model"] == "org/name" and hub.model_name == "org/name"


@pytest.mark.parametrize("cls", MODELS)
@pytest.mark.parametrize("name", ["base_url", "api_base", "openai_api_base", "server"])
@pytest.mark.parametrize("url", ["http://h:8000/v1", "http://h:8000", "http://h:8000/v1/"])
def test_a_server_url_under_any_familiar_name_selects_the_server(
    cls: Any, name: str, url: str
) -> None:
    """Before: ``base_url=`` was ignored and the in-process engine started."""
    model = cls(**{name: url}, model="org/name")
    server = model.server
    assert server is not None
    settings = server if isinstance(server, ServerSettings) else ServerSettings(server)
    assert settings.base_url == "http://h:8000"


def test_connection_settings_reach_the_server_settings() -> None:
    model = ChatCraftVLLM(base_url="http://h:8000/v1", api_key="k", timeout=9.5, max_retries=4)
    assert isinstance(model.server, ServerSettings)
    assert (model.server.api_key, model.server.read_timeout, model.server.retries) == (
        "k", 9.5, 4,
    )
    with pytest.raises(ValueError, match="apply to a server"):
        ChatCraftVLLM(api_key="k")
    with pytest.raises(ValueError, match="differ"):
        ChatCraftVLLM(base_url="http://a:1/v1", server="http://b:2")


@pytest.mark.parametrize("cls", MODELS)
def test_window_and_engine_arguments_shape_the_started_engine(cls: Any) -> None:
    """Before: ``context_window``, ``vllm_kwargs`` and ``max_new_tokens`` were ignored."""
    model = cls(
        context_window=2048,
        vllm_kwargs={"swap_space": 1},
        dtype="float32",
        tensor_parallel_size=1,
        max_new_tokens=7,
    )
    settings = EngineSettings(**model.engine_settings)
    assert settings.max_model_len == 2048 and settings.dtype == "float32"
    assert dict(settings.engine_kwargs) == {"swap_space": 1, "tensor_parallel_size": 1}
    assert model.max_tokens == 7
    assert cls(max_completion_tokens=5).max_tokens == 5
    with pytest.raises(ValueError, match="differ"):
        cls(max_tokens=3, max_new_tokens=4)


@pytest.mark.parametrize("cls", MODELS)
def test_one_settings_shape_object_or_dict(cls: Any) -> None:
    as_object = cls(engine_settings=EngineSettings(model="/m/x", max_model_len=1024))
    as_dict = cls(engine_settings={"model": "/m/x", "max_model_len": 1024})
    assert as_object.engine_settings == as_dict.engine_settings
    assert EngineSettings(**as_dict.engine_settings).max_model_len == 1024
    with pytest.raises(ValueError, match=r"unknown keys \['modle'\]"):
        cls(engine_settings={"modle": "/m/x"})
    with pytest.raises(ValueError, match="disagrees"):
        cls(model="/m/y", engine_settings={"model": "/m/x"})


@pytest.mark.parametrize("cls", MODELS)
def test_unknown_arguments_go_to_model_kwargs_with_a_warning_and_must_be_vllm_sampling(
    cls: Any,
) -> None:
    """ChatOpenAI's convention (``build_extra``): warn and move to ``model_kwargs``; here a
    name vLLM does not know is then a ``ValueError`` instead of an error at request time."""
    with pytest.warns(UserWarning, match="top_k was transferred to model_kwargs"):
        model = cls(top_k=5)
    assert model.model_kwargs == {"top_k": 5}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="'frobnicate' is not a vLLM sampling parameter"):
            cls(frobnicate=1)
        with pytest.raises(ValueError, match="n=2 is not supported"):
            cls(n=2)
    assert cls(model_kwargs={"repetition_penalty": 1.1}).model_kwargs == {
        "repetition_penalty": 1.1
    }
    with pytest.warns(UserWarning, match="should be specified explicitly"):
        moved = cls(model_kwargs={"temperature": 0.5})  # ChatOpenAI moves it back, warning
    assert moved.temperature == 0.5 and moved.model_kwargs == {}


def test_engine_given_refuses_engine_shaping_arguments(
    fake: tuple[CraftEngine, FakeBackend],
) -> None:
    for kwargs in ({"model": "org/x"}, {"base_url": "http://h:1"}, {"context_window": 9}):
        with pytest.raises(ValueError, match="engine= is a running engine"):
            ChatCraftVLLM(engine=fake[0], **kwargs)


def test_sampling_names_reach_the_request(fake: tuple[CraftEngine, FakeBackend]) -> None:
    engine, backend = fake
    with pytest.warns(UserWarning):
        model = ChatCraftVLLM(engine=engine, max_new_tokens=3, top_k=4, seed=11)
    model.invoke("hi", presence_penalty=0.5, max_new_tokens=2)
    sampling = backend.added[-1][2]
    assert sampling.max_tokens == 2 and sampling.seed == 11
    assert dict(sampling.extra) == {"top_k": 4, "presence_penalty": 0.5}
    with pytest.raises(ValueError, match="not supported"):
        model.invoke("hi", logprobs=5)


def test_prompt_texts_must_agree_with_a_given_engine(
    fake: tuple[CraftEngine, FakeBackend],
) -> None:
    with pytest.raises(ValueError, match="differs from the engine's system_prompt"):
        ChatCraftVLLM(engine=fake[0], system_prompt="Be brief.")
    with pytest.raises(ValueError, match="drop the placeholder"):
        ChatCraftVLLM(context_prompt="Context: {context_str}")
    model = ChatCraftVLLM(system_prompt="Be brief.", context_prompt="Use these.")
    params = model._identifying_params
    assert params["system_prompt"] == "Be brief." and params["context_prompt"] == "Use these."


class _Ends(BaseCallbackHandler):
    def __init__(self) -> None:
        self.results: list[LLMResult] = []
        self.started: list[dict[str, Any]] = []

    def on_chat_model_start(self, serialized: Any, messages: Any, **kwargs: Any) -> None:
        self.started.append(kwargs.get("invocation_params") or {})

    def on_llm_end(self, response: LLMResult, **kwargs: Any) -> None:
        self.results.append(response)


def test_the_prompt_sent_reaches_metadata_and_callbacks(
    fake: tuple[CraftEngine, FakeBackend],
) -> None:
    engine, backend = fake
    handler = _Ends()
    msg = ChatCraftVLLM(engine=engine, max_tokens=2).invoke("hi", {"callbacks": [handler]})
    sent = list(backend.added[-1][1])
    assert msg.response_metadata["craft_prompt"]["token_ids"] == sent
    generation: Any = handler.results[-1].generations[0][0]
    assert generation.message.response_metadata["craft_prompt"]["token_ids"] == sent
    assert handler.started and handler.started[0]["model_kwargs"] == {}
    chunks = list(CraftVLLM(engine=engine, max_tokens=2).stream("hello"))
    assert chunks  # the completion LLM carries it in generation_info
    result = CraftVLLM(engine=engine, max_tokens=2).generate(["hello"])
    info = result.generations[0][0].generation_info or {}
    assert info["craft_prompt"]["token_ids"] == list(backend.added[-1][1])
