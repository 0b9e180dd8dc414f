"""``craft_rag.engine.model_args``: the one sorting of an LLM constructor's familiar keyword
arguments that both integrations' LLM classes use (their own rules are tested with them)."""

from __future__ import annotations

from typing import Any

import pytest

from craft_rag.engine.model_args import (
    ENGINE_ARGS,
    ConstructorArguments,
    sort_constructor_arguments,
)


@pytest.mark.parametrize("alias", ["base_url", "api_base", "openai_api_base"])
def test_a_url_alias_and_connection_settings_become_the_server(alias: str) -> None:
    values = {alias: "http://h:8000/v1", "api_key": "k", "timeout": 9.0, "temperature": 0.5}
    args = sort_constructor_arguments(values)
    assert args.server is not None
    assert args.server.url == "http://h:8000/v1"
    assert (args.server.api_key, args.server.read_timeout) == ("k", 9.0)
    assert args.rest == {"temperature": 0.5}
    assert args.engine_args == {}
    assert alias in values  # the caller's dict is not changed


def test_the_url_is_given_once_and_shown_without_credentials() -> None:
    with pytest.raises(ValueError, match="give the server URL once") as info:
        sort_constructor_arguments({"base_url": "http://u:secret@a:1", "api_base": "http://b:2"})
    assert "secret" not in str(info.value)
    with pytest.raises(ValueError, match="differ; give the server URL once"):
        sort_constructor_arguments({"base_url": "http://a:1"}, server="http://b:2")
    same = sort_constructor_arguments({"base_url": "http://a:1/v1"}, server="http://a:1")
    assert same.server is not None


def test_connection_settings_need_a_server_and_a_none_alias_stays() -> None:
    with pytest.raises(ValueError, match=r"\['max_retries'\] apply to a server"):
        sort_constructor_arguments({"max_retries": 3})
    args = sort_constructor_arguments({"base_url": None})
    assert args.server is None
    assert args.rest == {"base_url": None}  # left for the adapter's unknown-name rule


def test_max_tokens_aliases_name_one_value() -> None:
    assert sort_constructor_arguments({"max_new_tokens": 7}).rest == {"max_tokens": 7}
    both = {"max_tokens": 7, "max_completion_tokens": 7}
    assert sort_constructor_arguments(both).rest == {"max_tokens": 7}
    with pytest.raises(ValueError, match="max_tokens and max_new_tokens differ"):
        sort_constructor_arguments({"max_tokens": 5, "max_new_tokens": 7})


def test_engine_args_are_set_aside_as_given_in_table_order() -> None:
    values: dict[str, Any] = {"dtype": None, "model": "m", "context_window": 512, "top_k": 3}
    args = sort_constructor_arguments(values)
    assert list(args.engine_args) == [n for n in ENGINE_ARGS if n in values]
    assert args.engine_args == {"context_window": 512, "dtype": None}
    assert args.rest == {"model": "m", "top_k": 3}


def test_engine_settings_merge_window_model_and_vllm_kwargs() -> None:
    args = ConstructorArguments(
        None,
        {"context_window": 1024, "vllm_kwargs": {"enable_chunked_prefill": False},
         "quantization": "awq"},
        {},
    )
    settings = args.engine_settings({"seed": 3}, "some/model")
    assert (settings.model, settings.max_model_len, settings.seed) == ("some/model", 1024, 3)
    assert settings.engine_kwargs == {"enable_chunked_prefill": False, "quantization": "awq"}
    window = ConstructorArguments(None, {"max_model_len": 2048}, {})
    assert window.engine_settings(None, None).max_model_len == 2048
    clash = ConstructorArguments(None, {"context_window": 512, "max_model_len": 1024}, {})
    with pytest.raises(ValueError, match="context_window and max_model_len differ"):
        clash.engine_settings(None, None)
    with pytest.raises(ValueError, match="disagrees with engine_settings max_model_len"):
        window.engine_settings({"max_model_len": 3000}, None)  # not the default: a choice
