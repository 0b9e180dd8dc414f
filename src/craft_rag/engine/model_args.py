"""The familiar constructor arguments of framework LLM classes, mapped onto the engine.

LangChain (``ChatOpenAI``, ``VLLM``) and LlamaIndex (``Vllm``, ``OpenAILike``) name the same
settings differently. The LLM classes of both craft-rag integrations take those names and map
each one here to the one place it acts: the engine to start (:class:`EngineSettings`), the
server to use (:class:`ServerSettings`), or a request's sampling. A name that cannot act is
refused with a ``ValueError`` that says what to use instead; nothing is silently ignored.

=========================================  ==============================================
argument                                   acts on
=========================================  ==============================================
``model``                                  ``EngineSettings.model`` (folder or hub id)
``base_url`` / ``api_base`` /              the server backend (``server=``; ``/v1`` or not)
``openai_api_base``                        (a list: several replicas, ``server=[url, ...]``)
``api_key`` / ``timeout`` / ``max_retries``  ``ServerSettings`` (only with a server)
``context_window`` / ``max_model_len``     ``EngineSettings.max_model_len``
``vllm_kwargs``                            ``EngineSettings.engine_kwargs`` (``vllm.LLM``)
``dtype``, ``gpu_memory_utilization``      their ``EngineSettings`` fields
``max_new_tokens`` / ``max_completion_tokens``  ``max_tokens``
``top_k``, ``min_p``, penalties, ...       ``SamplingRequest.extra`` (:data:`VLLM_SAMPLING`)
``n`` / ``best_of`` > 1, ``logprobs``, ...   refused (:data:`REFUSED`)
=========================================  ==============================================

Everything here runs once per LLM object (construction), or once per call for the per-call
aliases (:func:`call_sampling`: a dict pass, microseconds).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from craft_rag.engine.backends.server.settings import ServerSettings, as_server_settings
from craft_rag.engine.backends.vllm.backend import EngineSettings
from craft_rag.engine.results import SAMPLING_KEYWORDS
from craft_rag.redact import redact_url

__all__ = [
    "CONNECTION_ARGS",
    "ENGINE_ARGS",
    "ENGINE_FIELDS",
    "MAX_TOKENS_ALIASES",
    "REFUSED",
    "SERVER_ALIASES",
    "VLLM_SAMPLING",
    "ConstructorArguments",
    "as_engine_settings",
    "call_sampling",
    "check_prompt_text",
    "check_sampling_extra",
    "engine_settings_with",
    "server_with",
    "servers_with",
    "settings_dict",
    "sort_constructor_arguments",
]

ENGINE_FIELDS = frozenset(f.name for f in fields(EngineSettings))
"""The keys of an ``engine_settings`` dict (the fields of :class:`EngineSettings`)."""

SERVER_ALIASES = ("base_url", "api_base", "openai_api_base")
"""Names of the server URL (ChatOpenAI / OpenAILike); each selects the server backend."""

MAX_TOKENS_ALIASES = ("max_new_tokens", "max_completion_tokens")
"""Names of ``max_tokens`` (LangChain/LlamaIndex ``Vllm``; OpenAI's newer name)."""

CONNECTION_ARGS = ("api_key", "timeout", "max_retries")
"""``ChatOpenAI``/``OpenAILike`` connection settings: they act on the server only."""

ENGINE_ARGS = (
    "context_window", "max_model_len", "vllm_kwargs", "dtype", "gpu_memory_utilization",
    "tensor_parallel_size", "trust_remote_code", "download_dir", "quantization",
)
"""LangChain ``VLLM`` / LlamaIndex ``Vllm`` engine arguments: they shape the started engine."""

VLLM_SAMPLING = frozenset({
    "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "ignore_eos", "min_tokens", "stop_token_ids", "bad_words", "logit_bias",
    "allowed_token_ids", "include_stop_str_in_output", "skip_special_tokens",
    "spaces_between_special_tokens",
})
"""vLLM sampling parameters passed through unchanged (``SamplingRequest.extra``: to
``vllm.SamplingParams`` in-process, into the request body for a server)."""

REFUSED: Mapping[str, str] = {
    "n": "one completion per request (n=1); call the model several times",
    "best_of": "one completion per request; call the model several times",
    "use_beam_search": "beam search is not served (greedy or sampled decoding only)",
    "logprobs": "log-probabilities are not reported",
    "prompt_logprobs": "log-probabilities are not reported",
    "top_logprobs": "log-probabilities are not reported",
    "truncate_prompt_tokens": "the prompt is token-exact: shorten the input instead",
    "output_kind": "the engine streams deltas itself",
    "detokenize": "the engine needs the text",
    "tools": "tool calling is not supported (see bind_tools)",
    "response_format": "structured output is not supported",
}
"""Familiar names the engine cannot honour, with the reason (``ValueError`` on use)."""

_ONE = {"n": 1, "best_of": 1, "use_beam_search": False, "logprobs": None}
"""Refused names whose value means "off": accepted with exactly this value."""


def as_engine_settings(value: object, name: str = "engine_settings") -> EngineSettings:
    """``value`` as :class:`EngineSettings`: the object itself, or a dict of its fields (the
    one settings shape both integrations take). ``ValueError`` naming an unknown key (and
    the valid ones) or another type. O(fields)."""
    if value is None:
        return EngineSettings()
    if isinstance(value, EngineSettings):
        return value
    if not isinstance(value, Mapping):
        msg = (
            f"{name} must be a craft_rag EngineSettings or a dict of its fields, "
            f"got {type(value).__name__}"
        )
        raise ValueError(msg)
    unknown = sorted(set(value) - ENGINE_FIELDS)
    if unknown:
        msg = f"{name} has unknown keys {unknown}; EngineSettings fields: {sorted(ENGINE_FIELDS)}"
        raise ValueError(msg)
    return EngineSettings(**dict(value))


def settings_dict(settings: EngineSettings) -> dict[str, Any]:
    """``settings`` as a dict of its fields (``engine_kwargs`` a plain dict)."""
    data = asdict(settings)
    data["engine_kwargs"] = dict(settings.engine_kwargs)
    return data


_DEFAULTS = {f.name: f.default for f in fields(EngineSettings)}


def _merge(current: object, given: object, name: str, field: str) -> object:
    """``given`` over ``current`` unless ``current`` was set (not the default) to something
    else (``ValueError``)."""
    if given is None:
        return current
    default = _DEFAULTS.get(field)
    if current is not None and current != given and current != default:
        msg = (
            f"{name}={given!r} disagrees with engine_settings {field}={current!r}; "
            "give it once"
        )
        raise ValueError(msg)
    return given


def engine_settings_with(
    settings: object,
    *,
    model: object = None,
    context_window: object = None,
    vllm_kwargs: object = None,
    engine_args: Mapping[str, Any] | None = None,
) -> EngineSettings:
    """The settings of the engine to start: ``settings`` (object or dict) with ``model``,
    ``context_window`` (``max_model_len``), ``vllm_kwargs`` (``engine_kwargs``) and
    ``engine_args`` (``dtype``, ``gpu_memory_utilization``, other ``vllm.LLM`` arguments)
    over it. ``ValueError`` when a value is given twice differently, or for a bad type."""
    base = as_engine_settings(settings)
    changes: dict[str, Any] = {}
    if model is not None:
        if not isinstance(model, str) or not model.strip():
            msg = f"model must be a model folder or a hub id (a non-empty string), got {model!r}"
            raise ValueError(msg)
        changes["model"] = _merge(
            None if base.model is None else str(base.model), model, "model", "model"
        )
    if context_window is not None:
        if isinstance(context_window, bool) or not isinstance(context_window, int):
            msg = f"context_window must be an int (tokens), got {context_window!r}"
            raise ValueError(msg)
        changes["max_model_len"] = _merge(
            base.max_model_len, context_window, "context_window", "max_model_len"
        )
    kwargs = dict(base.engine_kwargs)
    extra: dict[str, Any] = {}
    if vllm_kwargs is not None:
        if not isinstance(vllm_kwargs, Mapping):
            msg = f"vllm_kwargs must be a dict of vllm.LLM arguments, got {vllm_kwargs!r}"
            raise ValueError(msg)
        extra.update(vllm_kwargs)
    for key, value in (engine_args or {}).items():
        if key in ENGINE_FIELDS and key != "engine_kwargs":
            changes[key] = _merge(getattr(base, key), value, key, key)
        else:
            extra[key] = value
    for key, value in extra.items():
        if key in kwargs and kwargs[key] != value:
            msg = f"vLLM argument {key!r} is given twice ({kwargs[key]!r} and {value!r})"
            raise ValueError(msg)
        kwargs[key] = value
    if kwargs != dict(base.engine_kwargs):
        changes["engine_kwargs"] = kwargs
    return replace(base, **changes) if changes else base


def server_with(
    server: object,
    base_url: object = None,
    *,
    api_key: object = None,
    timeout: object = None,
    max_retries: object = None,
) -> ServerSettings | None:
    """The server to use: ``server`` (URL or :class:`ServerSettings`) or ``base_url`` (with or
    without ``/v1``), with ``api_key``, ``timeout`` (the read timeout, seconds) and
    ``max_retries`` over it. ``None``: no server (the in-process engine). ``ValueError`` when
    the two URLs differ or when server-only settings come without a server."""
    if server is not None and base_url is not None:
        url = server.url if isinstance(server, ServerSettings) else server
        if _root(str(url)) != _root(str(base_url)):
            msg = (
                f"server={redact_url(str(url))!r} and base_url={redact_url(str(base_url))!r} "
                "differ; give the server URL once"
            )
            raise ValueError(msg)
    chosen = server if server is not None else base_url
    given: dict[str, Any] = {k: v for k, v in (("api_key", api_key), ("read_timeout", timeout),
                               ("retries", max_retries)) if v is not None}
    if chosen is None:
        if given:
            names = {"read_timeout": "timeout", "retries": "max_retries"}
            listed = sorted(names.get(k, k) for k in given)
            msg = (
                f"{listed} apply to a server; pass base_url='http://HOST:PORT/v1' (a vLLM "
                "server, e.g. `craft-rag serve`) or leave them out for the in-process engine"
            )
            raise ValueError(msg)
        return None
    if not isinstance(chosen, str | ServerSettings):
        msg = f"base_url/server must be an http(s) URL string, got {type(chosen).__name__}"
        raise ValueError(msg)
    settings = as_server_settings(chosen)
    return replace(settings, **given) if given else settings


def servers_with(
    server: object,
    base_url: object = None,
    *,
    api_key: object = None,
    timeout: object = None,
    max_retries: object = None,
) -> ServerSettings | tuple[ServerSettings, ...] | None:
    """:func:`server_with`, where ``server`` or ``base_url`` may also be a list (or tuple) of
    servers: several replicas of one model (``CraftEngine(server=[url, url, ...])``, which
    routes over them). Each item gets ``api_key``/``timeout``/``max_retries``. ``ValueError``
    for an empty list, an item that is not a URL or :class:`ServerSettings`, a list given as
    both ``server`` and ``base_url`` with different items, or as :func:`server_with`.
    O(servers)."""
    many = [v for v in (server, base_url) if isinstance(v, list | tuple)]
    if not many:
        return server_with(
            server, base_url, api_key=api_key, timeout=timeout, max_retries=max_retries
        )
    items = list(many[0])
    other = base_url if many[0] is server else server
    if other is not None and (not isinstance(other, list | tuple) or list(other) != items):
        msg = (
            "server= and base_url= name different servers; give the list once: "
            "server=[url, url, ...]"
        )
        raise ValueError(msg)
    if not items:
        msg = "server=[] names no server; pass server=[url, url, ...] or one URL"
        raise ValueError(msg)
    out: list[ServerSettings] = []
    for i, item in enumerate(items):
        if not isinstance(item, str | ServerSettings):
            msg = (
                f"server=[...] item {i} must be an http(s) URL string or ServerSettings, got "
                f"{type(item).__name__}"
            )
            raise ValueError(msg)
        one = server_with(item, api_key=api_key, timeout=timeout, max_retries=max_retries)
        assert one is not None  # an item is a server
        out.append(one)
    return tuple(out)


@dataclass(slots=True)
class ConstructorArguments:
    """One LLM constructor call's keyword arguments, sorted by :func:`sort_constructor_arguments`.
    Owner: the constructor that sorted them (each integration then applies its own rules for
    a given ``engine=`` and for the names left in :attr:`rest`)."""

    server: ServerSettings | tuple[ServerSettings, ...] | None
    """The server to use (``None``: the in-process engine; a tuple: several replicas, for
    ``CraftEngine(server=[...])``)."""
    engine_args: dict[str, Any]
    """The :data:`ENGINE_ARGS` the call named, with their values as given (``None`` included,
    so an adapter can tell "named" from "set"), in :data:`ENGINE_ARGS` order."""
    rest: dict[str, Any]
    """Every other argument, in the call's order, ``max_tokens`` holding its aliases' value."""

    def engine_settings(self, settings: object, model: object) -> EngineSettings:
        """The engine to start: ``settings`` (object, dict or ``None``) with ``model`` and
        :attr:`engine_args` over it (:func:`engine_settings_with`). ``context_window`` and
        ``max_model_len`` name one value: ``ValueError`` when both are given and differ (or
        as :func:`engine_settings_with`). O(fields); changes nothing."""
        args = dict(self.engine_args)
        context_window = args.pop("context_window", None)
        if "max_model_len" in args:
            window = args.pop("max_model_len")
            if context_window is not None and window != context_window:
                msg = "context_window and max_model_len differ; give one"
                raise ValueError(msg)
            context_window = window
        return engine_settings_with(
            settings,
            model=model,
            context_window=context_window,
            vllm_kwargs=args.pop("vllm_kwargs", None),
            engine_args=args,
        )


def sort_constructor_arguments(
    values: Mapping[str, Any], server: object = None
) -> ConstructorArguments:
    """Sort an LLM constructor call's keyword arguments (``values``, not changed) by where the
    familiar names act: the URL under any of :data:`SERVER_ALIASES` (a ``None`` alias is left
    in :attr:`~ConstructorArguments.rest`) and :data:`CONNECTION_ARGS` with ``server`` into
    the server settings (:func:`servers_with`: a list is several replicas),
    :data:`MAX_TOKENS_ALIASES` onto ``max_tokens``, :data:`ENGINE_ARGS` aside for
    :meth:`ConstructorArguments.engine_settings`. ``ValueError`` for two different URLs
    (shown without credentials), two different ``max_tokens``, or as :func:`servers_with`.
    The one sorting both integrations' LLM classes use. O(arguments)."""
    rest = dict(values)
    urls = {k: rest.pop(k) for k in SERVER_ALIASES if rest.get(k) is not None}
    if any(v != first for first in urls.values() for v in urls.values()):
        shown = {k: _shown(v) for k, v in urls.items()}  # no credentials shown
        msg = f"give the server URL once, got {shown}"
        raise ValueError(msg)
    connection = {k: rest.pop(k, None) for k in CONNECTION_ARGS}
    chosen = servers_with(server, next(iter(urls.values()), None), **connection)
    for alias in MAX_TOKENS_ALIASES:
        if alias in rest:
            value = rest.pop(alias)
            if rest.get("max_tokens", value) != value:
                msg = f"max_tokens and {alias} differ; give one"
                raise ValueError(msg)
            rest["max_tokens"] = value
    engine_args = {k: rest.pop(k) for k in ENGINE_ARGS if k in rest}
    return ConstructorArguments(chosen, engine_args, rest)


def _shown(url: object) -> object:
    """``url`` (or a list of them) without credentials."""
    if isinstance(url, list | tuple):
        return [redact_url(str(u)) for u in url]
    return redact_url(str(url))


def _root(url: str) -> str:
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def check_sampling_extra(extra: Mapping[str, Any], name: str) -> dict[str, Any]:
    """``extra`` (``model_kwargs``/``additional_kwargs``) checked: each key a
    :data:`VLLM_SAMPLING` name, or a :data:`REFUSED` one at its "off" value (dropped).
    ``ValueError`` naming the key and the valid ones otherwise. O(keys)."""
    if not isinstance(extra, Mapping):
        msg = f"{name} must be a dict of sampling parameters, got {type(extra).__name__}"
        raise ValueError(msg)
    out: dict[str, Any] = {}
    for key, value in extra.items():
        if key in SAMPLING_KEYWORDS or key in MAX_TOKENS_ALIASES:
            msg = f"{key!r} is a setting of its own: pass {key}= instead of inside {name}"
            raise ValueError(msg)
        if key in REFUSED:
            if key in _ONE and value == _ONE[key]:
                continue
            msg = f"{key}={value!r} is not supported: {REFUSED[key]}"
            raise ValueError(msg)
        if key not in VLLM_SAMPLING:
            msg = (
                f"{name} key {key!r} is not a vLLM sampling parameter the engine passes on; "
                f"supported: {sorted(VLLM_SAMPLING)}"
            )
            raise ValueError(msg)
        out[key] = value
    return out


def call_sampling(kwargs: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """A call's sampling keyword arguments in ``SamplingRequest.with_overrides`` terms:
    ``max_new_tokens``/``max_completion_tokens`` -> ``max_tokens``, :data:`VLLM_SAMPLING`
    names (over the object's ``extra``) -> ``extra``; anything else is left for
    ``with_overrides`` to accept or refuse by name. O(keys)."""
    out: dict[str, Any] = {}
    merged = dict(extra)
    for key, value in kwargs.items():
        if key in MAX_TOKENS_ALIASES:
            if "max_tokens" in kwargs and kwargs["max_tokens"] != value:
                msg = f"max_tokens and {key} differ; give one"
                raise ValueError(msg)
            out["max_tokens"] = value
        elif key in VLLM_SAMPLING or key in REFUSED:
            merged.update(check_sampling_extra({key: value}, "the call"))
        else:
            out[key] = value
    if merged:
        out["extra"] = merged
    return out


def check_prompt_text(value: object, name: str) -> str | None:
    """``system_prompt``/``context_prompt``: ``None`` or a string (format text fixed at the
    head of every prompt). ``ValueError`` for a LlamaIndex-style template placeholder: the
    engine puts the documents after the context prompt itself."""
    if value is None:
        return None
    if not isinstance(value, str):
        msg = f"{name} must be a string, got {type(value).__name__}"
        raise ValueError(msg)
    for placeholder in ("{context_str}", "{context}", "{query_str}", "{question}"):
        if placeholder in value:
            msg = (
                f"{name} holds {placeholder}: it is plain text the engine puts before the "
                "documents (which it renders itself, token-exact); drop the placeholder"
            )
            raise ValueError(msg)
    return value
