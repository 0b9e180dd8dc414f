"""The models' constructor arguments: the familiar names of LangChain's ``ChatOpenAI``/``VLLM``
(``base_url``, ``max_new_tokens``, ``context_window``, ``vllm_kwargs``, ...) moved onto
``CraftEngineParams``' own fields, or refused.

The name table is shared with the LlamaIndex integration (:mod:`craft_rag.engine.model_args`);
this module only sorts one constructor call's keyword arguments. Runs once per model
(construction, as a pydantic ``mode="before"`` validator).
"""

from __future__ import annotations

from typing import Any

from langchain_core.utils.utils import _build_model_kwargs
from pydantic import BaseModel

from craft_rag.engine.model_args import (
    MAX_TOKENS_ALIASES,
    SERVER_ALIASES,
    engine_settings_with,
    server_with,
    settings_dict,
)
from craft_rag.redact import redact_url

SERVER_ONLY = ("api_key", "timeout", "max_retries")
"""ChatOpenAI's connection settings: they act on the server (``base_url``) only."""

ENGINE_ARGS = (
    "context_window", "max_model_len", "vllm_kwargs", "dtype", "gpu_memory_utilization",
    "tensor_parallel_size", "trust_remote_code", "download_dir", "quantization",
)
"""LangChain ``VLLM`` / LlamaIndex ``Vllm`` engine arguments: they shape the started engine."""


def normalise_arguments(cls: type[BaseModel], values: dict[str, Any]) -> dict[str, Any]:
    """The familiar names (``craft_rag.engine.model_args``) moved onto this model's fields:
    the server URL aliases onto ``server`` (with ``api_key``/``timeout``/``max_retries``),
    engine arguments and ``model`` into ``engine_settings``, ``max_new_tokens`` onto
    ``max_tokens``; any other unknown name goes to ``model_kwargs`` with a warning, as
    ``ChatOpenAI`` does, where it must be a vLLM sampling parameter (``ValueError``
    otherwise)."""
    values = dict(values)
    urls = {k: values.pop(k) for k in SERVER_ALIASES if values.get(k) is not None}
    if len(set(urls.values())) > 1:
        shown = {k: redact_url(str(v)) for k, v in urls.items()}
        msg = f"give the server URL once, got {shown}"
        raise ValueError(msg)
    connection = {k: values.pop(k, None) for k in SERVER_ONLY}
    server = server_with(
        values.get("server"), next(iter(urls.values()), None), **connection
    )
    values["server"] = server
    for alias in MAX_TOKENS_ALIASES:
        if alias in values:
            value = values.pop(alias)
            if values.get("max_tokens", value) != value:
                msg = f"max_tokens and {alias} differ; give one"
                raise ValueError(msg)
            values["max_tokens"] = value
    engine_args = {k: values.pop(k) for k in ENGINE_ARGS if k in values}
    model = values.get("model")
    shaped = bool(engine_args) or model is not None or values.get("engine_settings")
    if values.get("engine") is not None and (shaped or server is not None):
        msg = (
            "engine= is a running engine: its model, window and server are set; pass "
            "model=/base_url=/engine_settings= without engine= to start one"
        )
        raise ValueError(msg)
    if shaped:
        context_window = engine_args.pop("context_window", None)
        if "max_model_len" in engine_args:
            window = engine_args.pop("max_model_len")
            if context_window is not None and window != context_window:
                msg = "context_window and max_model_len differ; give one"
                raise ValueError(msg)
            context_window = window
        settings = engine_settings_with(
            values.get("engine_settings"),
            model=model,
            context_window=context_window,
            vllm_kwargs=engine_args.pop("vllm_kwargs", None),
            engine_args=engine_args,
        )
        values["engine_settings"] = settings_dict(settings)
    return _build_model_kwargs(values, _field_names(cls))


def _field_names(cls: type[BaseModel]) -> set[str]:
    """Every field name of ``cls`` and its aliases (what ``model_kwargs`` must not take)."""
    names = set()
    for name, field in cls.model_fields.items():
        names.add(name)
        if field.alias:
            names.add(field.alias)
    return names
