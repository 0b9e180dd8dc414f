"""``CraftVLLM``'s constructor arguments: LlamaIndex's familiar names (``Vllm``,
``OpenAILike``) mapped onto the engine to start, the server, and sampling, or refused; and,
next to a running ``engine=``, checked against what that engine serves.

The table and the sorting are shared with the LangChain integration
(:func:`craft_rag.engine.model_args.sort_constructor_arguments`); this module adds
LlamaIndex's rules (:func:`sort_arguments`: sampling names into ``additional_kwargs``, unknown
names refused) and refuses the arguments a given engine would ignore
(:func:`check_given_engine`). Runs once per ``CraftVLLM`` (construction).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from craft_rag.engine import EngineSettings, ServerSettings
from craft_rag.engine.model_args import (
    CONNECTION_ARGS,
    MAX_TOKENS_ALIASES,
    REFUSED,
    SERVER_ALIASES,
    VLLM_SAMPLING,
    check_sampling_extra,
    sort_constructor_arguments,
)
from craft_rag.engine.model_args import ENGINE_ARGS as _ALL_ENGINE_ARGS

if TYPE_CHECKING:
    from craft_rag.engine import CraftEngine

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct (embedded)"
"""``CraftVLLM.model`` (``LLMMetadata.model_name``) when the engine serves the embedded model."""
_EMBEDDED_NAMES = frozenset({
    EMBEDDED_MODEL_NAME, "SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct",
})
"""What ``model=`` may say next to an engine serving the embedded model (whose settings name
no model)."""

SERVER_ONLY = CONNECTION_ARGS
"""``OpenAILike``'s connection settings: they act on the server (``api_base``) only."""

_WINDOW_AND_KWARGS = ("context_window", "vllm_kwargs")
ENGINE_ARGS = tuple(name for name in _ALL_ENGINE_ARGS if name not in _WINDOW_AND_KWARGS)
"""``Vllm``'s engine arguments: they shape the started engine (``context_window`` and
``vllm_kwargs``, LlamaIndex's own names, are listed apart)."""


@dataclass(slots=True)
class SortedArguments:
    """Where ``CraftVLLM(...)``'s keyword arguments go. Owner: ``CraftVLLM.__init__``."""

    settings: EngineSettings | None = None
    """The engine to start (``None``: an engine was given)."""
    server: ServerSettings | tuple[ServerSettings, ...] | None = None
    """The server (a tuple: several replicas, ``CraftEngine(server=[...])``); ``None``: the
    in-process engine or a given one."""
    fields: dict[str, Any] = field(default_factory=dict)
    """The pydantic fields of ``CraftVLLM`` (``max_tokens`` with its aliases resolved)."""


def sort_arguments(
    data: dict[str, Any],
    known_fields: set[str],
    *,
    engine_given: bool,
    engine_settings: object,
    server: object,
) -> SortedArguments:
    """Sort ``data`` (the keyword arguments other than ``engine``/``engine_settings``/
    ``server``) into engine settings, server settings and fields. ``ValueError`` for an unknown
    name (listing the accepted ones), a refused one, a value given twice, or engine-shaping
    arguments next to a running ``engine``."""
    args = sort_constructor_arguments(data, server)
    data = args.rest
    extra = dict(data.pop("additional_kwargs", None) or {})
    for name in list(data):
        if name in VLLM_SAMPLING or name in REFUSED:
            extra[name] = data.pop(name)
    data["additional_kwargs"] = check_sampling_extra(extra, "additional_kwargs")
    unknown = sorted(set(data) - known_fields)
    if unknown:
        accepted = sorted(
            known_fields | set(SERVER_ALIASES) | set(SERVER_ONLY) | set(MAX_TOKENS_ALIASES)
            | set(_ALL_ENGINE_ARGS) | {"engine", "engine_settings", "server"} | VLLM_SAMPLING
        )
        msg = f"CraftVLLM got unknown arguments {unknown}; accepted: {accepted}"
        raise ValueError(msg)
    if engine_given:
        # LlamaIndex's order in the message: the settings objects, then the window, then the
        # rest; a name given as None cannot act, so it is not refused.
        named = [(name, args.engine_args.get(name)) for name in _WINDOW_AND_KWARGS]
        named += [(k, v) for k, v in args.engine_args.items() if k not in _WINDOW_AND_KWARGS]
        given = [("engine_settings", engine_settings), ("server/api_base", args.server), *named]
        shaping = [name for name, value in given if value is not None]
        if shaping:
            msg = (
                f"engine= is a running engine, so {shaping} cannot act; pass them without "
                "engine= to start one"
            )
            raise ValueError(msg)
        return SortedArguments(None, None, data)
    settings = args.engine_settings(engine_settings, data.get("model"))
    return SortedArguments(settings, args.server, data)


def engine_model_matches(engine_model: object, model: str) -> bool:
    """Whether ``model`` names the model a running engine serves: the same string, or the
    folder's last part (``model="SmolLM2-135M-Instruct"`` for ``/cache/SmolLM2-135M-Instruct``)."""
    if engine_model is None:
        return False
    text = str(engine_model).rstrip("/")
    return model.rstrip("/") in (text, text.rsplit("/", 1)[-1])


def check_given_engine(
    engine: CraftEngine,
    model: object,
    system_prompt: str | None,
    context_prompt: str | None,
) -> None:
    """A running engine has its model and prompt head: ``model``, ``system_prompt`` and
    ``context_prompt`` given next to it must name them (``ValueError`` otherwise: they would
    not act). O(1)."""
    served = engine.settings.model
    if model is not None and not (
        engine_model_matches(served, str(model))
        or (served is None and model in _EMBEDDED_NAMES)
    ):
        msg = (
            f"model={model!r} is not the model this engine serves "
            f"({served or EMBEDDED_MODEL_NAME!r}); leave model= out with engine=, or pass "
            "model= without engine= to start an engine for it"
        )
        raise ValueError(msg)
    for name, value, attribute in (
        ("system_prompt", system_prompt, "system_prompt"),
        ("context_prompt", context_prompt, "instructions"),
    ):
        has = getattr(engine, attribute, None)
        if value is not None and value != has:
            msg = (
                f"{name}={value!r} differs from the engine's {attribute} ({has!r}): the "
                f"engine renders every prompt's head; start it with CraftEngine("
                f"{attribute}=...), or pass {name}= without engine= to start one"
            )
            raise ValueError(msg)
