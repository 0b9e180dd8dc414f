"""The models' constructor arguments: the familiar names of LangChain's ``ChatOpenAI``/``VLLM``
(``base_url``, ``max_new_tokens``, ``context_window``, ``vllm_kwargs``, ...) moved onto
``CraftEngineParams``' own fields, or refused.

The name table and the sorting are shared with the LlamaIndex integration
(:func:`craft_rag.engine.model_args.sort_constructor_arguments`); this module only applies
LangChain's rules to what is left (unknown names to ``model_kwargs``). Runs once per model
(construction, as a pydantic ``mode="before"`` validator).
"""

from __future__ import annotations

from typing import Any

from langchain_core.utils.utils import _build_model_kwargs
from pydantic import BaseModel

from craft_rag.engine.model_args import (
    CONNECTION_ARGS,
    ENGINE_ARGS,
    settings_dict,
    sort_constructor_arguments,
)

__all__ = ["ENGINE_ARGS", "SERVER_ONLY", "normalise_arguments"]

SERVER_ONLY = CONNECTION_ARGS
"""ChatOpenAI's connection settings: they act on the server (``base_url``) only."""


def normalise_arguments(cls: type[BaseModel], values: dict[str, Any]) -> dict[str, Any]:
    """The familiar names (``craft_rag.engine.model_args``) moved onto this model's fields:
    the server URL aliases onto ``server`` (with ``api_key``/``timeout``/``max_retries``),
    engine arguments and ``model`` into ``engine_settings``, ``max_new_tokens`` onto
    ``max_tokens``; any other unknown name goes to ``model_kwargs`` with a warning, as
    ``ChatOpenAI`` does, where it must be a vLLM sampling parameter (``ValueError``
    otherwise)."""
    args = sort_constructor_arguments(values, values.get("server"))
    values = args.rest
    values["server"] = args.server
    model = values.get("model")
    shaped = bool(args.engine_args) or model is not None or values.get("engine_settings")
    if values.get("engine") is not None and (shaped or args.server is not None):
        msg = (
            "engine= is a running engine: its model, window and server are set; pass "
            "model=/base_url=/engine_settings= without engine= to start one"
        )
        raise ValueError(msg)
    if shaped:
        settings = args.engine_settings(values.get("engine_settings"), model)
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
