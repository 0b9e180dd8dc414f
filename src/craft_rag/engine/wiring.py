"""What a :class:`~craft_rag.engine.engine.CraftEngine` talks to, set up once at start-up.

:func:`prompt_pieces` derives the prompt format and tokenizer from the model folder, and
:func:`conversation_format` the format of conversation turns (both cheap, checked first so a bad
argument fails before vLLM takes seconds and RAM); :func:`wire_backend`
picks the backend (a vLLM server, the in-process vLLM engine, or a caller's backend such as a
test fake), subscribes to its KV events and makes the block hasher; :meth:`Wiring.driver` makes
the driver that steps it (:class:`~craft_rag.engine.driver.EngineDriver`) or streams to it
(:class:`~craft_rag.engine.backends.server.driver.ServerDriver`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from craft_rag.engine.admission import Admission
from craft_rag.engine.backends.server.backend import ServerBackend, ServerSettings, connect_server
from craft_rag.engine.backends.server.driver import ServerDriver
from craft_rag.engine.backends.vllm.backend import EngineSettings, VLLMBackend
from craft_rag.engine.backends.vllm.logs import LOGGER, start_progress
from craft_rag.engine.chat_format import derive_chat_format
from craft_rag.engine.driver import EngineBackend, EngineDriver
from craft_rag.engine.kv_events import BlockHasher, KVEventSync
from craft_rag.engine.planners import PlannerNamespaces
from craft_rag.prompt import PromptFormat
from craft_rag.tokenizer import HFTokenizer, Tokenizer

__all__ = [
    "ChatFormatChoice",
    "ChatRendering",
    "ManagedBackend",
    "Wiring",
    "check_prompt_format",
    "conversation_format",
    "prompt_pieces",
    "wire_backend",
]

ChatRendering = Literal["question_message", "single_turn", "prompt_format", "chat_prompt_format"]
"""How conversation turns are rendered (:attr:`ChatFormatChoice.rendering`):
``"question_message"`` (derived: the question is its own user message after the documents'
one), ``"single_turn"`` (derived: the template refuses, merges or rewrites two user messages in
a row, so conversations use the single-turn rendering), ``"prompt_format"`` (the caller's
``prompt_format``, given without a chat format) or ``"chat_prompt_format"`` (the caller's)."""


class ManagedBackend(EngineBackend, Protocol):
    """A backend the engine can also query and shut down (``VLLMBackend`` or a test fake)."""

    max_model_len: int
    block_size: int
    prefix_caching: bool
    eos_token_ids: frozenset[int]

    def reset_prefix_cache(self) -> bool: ...

    def published_batches(self) -> int | None: ...

    def shutdown(self) -> None: ...


@dataclass(slots=True)
class Wiring:
    """The engine's backend, KV-event subscriber and block hasher; ``takes_salt``: the backend
    accepts ``cache_salt`` (a caller's backend may not)."""

    backend: ManagedBackend | ServerBackend
    kv_events: KVEventSync | None
    block_hasher: BlockHasher | None
    takes_salt: bool

    def driver(
        self, on_server_lost: Callable[[], object], admission: Admission | None = None
    ) -> EngineDriver | ServerDriver:
        """The driver (starts its thread for an in-process backend). ``on_server_lost`` runs
        when a server is unreachable: a restarted server's cache is empty. ``admission``: the
        engine's (:mod:`craft_rag.engine.admission`); a server takes only its priority form
        (``ValueError`` for ``admission_queue``)."""
        if isinstance(self.backend, ServerBackend):
            if admission is not None and not admission.uses_priority:
                msg = (
                    "admission_queue holds requests for the in-process engine only; with "
                    "server=, leave it None and start the server with --scheduling-policy "
                    "priority (craft-rag serve --admission cache_aware)"
                )
                raise ValueError(msg)
            return ServerDriver(
                self.backend, on_server_lost=on_server_lost, admission=admission
            )
        return EngineDriver(self.backend, admission=admission)


@dataclass(frozen=True, slots=True)
class ChatFormatChoice:
    """The format of conversation turns and why it was chosen (see :data:`ChatRendering`)."""

    format: PromptFormat
    rendering: ChatRendering


def check_prompt_format(value: object, name: str) -> None:
    """``ValueError`` naming ``name`` unless ``value`` is a ``PromptFormat`` or ``None``."""
    if value is not None and not isinstance(value, PromptFormat):
        msg = (
            f"{name} must be a craft_rag.prompt.PromptFormat or None (derived from the model's "
            f"chat template), got {type(value).__name__}"
        )
        raise ValueError(msg)


def prompt_pieces(
    model_path: str | None,
    prompt_format: PromptFormat | None,
    tokenizer: Tokenizer | None,
    *,
    system_prompt: str | None,
    instructions: str,
) -> tuple[PromptFormat, Tokenizer]:
    """The prompt format (from the model's chat template unless given) and the tokenizer
    (the model folder's ``tokenizer.json`` unless given). ``ValueError`` when a custom backend
    (no ``model_path``) comes without them, or for a ``prompt_format`` that is not one."""
    check_prompt_format(prompt_format, "prompt_format")
    if prompt_format is None:
        if model_path is None:
            msg = "pass prompt_format= when passing a custom backend"
            raise ValueError(msg)
        prompt_format = derive_chat_format(
            model_path, system_prompt=system_prompt, instructions=instructions
        )
    if tokenizer is None:
        if model_path is None:
            msg = "pass tokenizer= when passing a custom backend"
            raise ValueError(msg)
        tokenizer = _model_tokenizer(model_path)
    return prompt_format, tokenizer


def conversation_format(
    model_path: str | None,
    single_turn: PromptFormat,
    *,
    prompt_format: PromptFormat | None,
    chat_prompt_format: PromptFormat | None,
    system_prompt: str | None,
    instructions: str,
) -> ChatFormatChoice:
    """The format of conversation turns. Explicit choices win: ``chat_prompt_format``, else
    the caller's ``prompt_format`` (``single_turn``, the same format for every request, as
    before there were two). Otherwise derived from the model's chat template with the question
    as its own user message (better multi-turn answers: docs/benchmarks.md), unless the
    template refuses, merges or rewrites two user messages in a row: then ``single_turn``
    (logged once at INFO on ``craft_rag.engine``). ``ValueError`` for a ``chat_prompt_format``
    that is not a ``PromptFormat``. Cost: milliseconds (a few template renders)."""
    check_prompt_format(chat_prompt_format, "chat_prompt_format")
    if chat_prompt_format is not None:
        return ChatFormatChoice(chat_prompt_format, "chat_prompt_format")
    if prompt_format is not None or model_path is None:
        return ChatFormatChoice(single_turn, "prompt_format")
    try:
        derived = derive_chat_format(
            model_path, system_prompt=system_prompt, instructions=instructions,
            question_message=True,
        )
    except ValueError as exc:
        LOGGER.info(
            "conversation prompts use the single-turn rendering (the question closes the "
            "documents' message): %s", exc,
        )
        return ChatFormatChoice(single_turn, "single_turn")
    return ChatFormatChoice(derived, "question_message")


def wire_backend(
    settings: EngineSettings,
    model_path: str | None,
    tokenizer: Tokenizer,
    namespaces: PlannerNamespaces,
    *,
    server: str | ServerSettings | None,
    backend: ManagedBackend | None,
    block_hasher: BlockHasher | None,
) -> Wiring:
    """Connect to ``server``, or start vLLM in-process (KV events subscribed before it binds
    the endpoint), or take ``backend`` as given. Cost: seconds for vLLM's start-up (plus ~30 s
    the first time the embedded model is converted); ``EngineStartError``/``ImportError`` and
    ``ServerUnavailable`` name the fix."""
    if server is not None:
        if backend is not None:
            msg = "pass server= (a vLLM server URL) or backend=, not both"
            raise ValueError(msg)
        remote, kv_events, hasher = connect_server(server, model_path, tokenizer, namespaces)
        return Wiring(remote, kv_events, block_hasher or hasher, takes_salt=True)
    if backend is not None:
        takes_salt = _takes_keyword(backend.add_request, "cache_salt")
        return Wiring(backend, None, block_hasher, takes_salt)
    assert model_path is not None
    # Announced before vLLM is imported: the import alone takes seconds.
    ready = start_progress("the vLLM engine", settings.log_level, model_path)
    vllm_backend = VLLMBackend(settings, model_path)
    kv_events = None
    if vllm_backend.kv_events_endpoint is not None:
        # Subscribe before the engine binds the endpoint (ZMQ connects lazily).
        kv_events = KVEventSync(vllm_backend.kv_events_endpoint, namespaces)
    try:
        vllm_backend.start()
    except BaseException:
        if kv_events is not None:
            kv_events.close()
        raise
    ready()
    if block_hasher is None and vllm_backend.prefix_caching:
        block_hasher = BlockHasher.from_engine(vllm_backend.vllm_config)
    return Wiring(vllm_backend, kv_events, block_hasher, takes_salt=True)


def _takes_keyword(fn: Callable[..., object], name: str) -> bool:
    """Whether ``fn`` accepts the keyword argument ``name`` (or any keyword)."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in parameters or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()
    )


def _model_tokenizer(model_path: str) -> Tokenizer:
    """The served model's ``tokenizer.json`` (the same ids vLLM would produce)."""
    path = Path(model_path) / "tokenizer.json"
    if not path.is_file():
        msg = (
            f"{model_path} has no tokenizer.json; pass a local model folder (hub ids need a "
            "local copy for token-exact prompts) or tokenizer=..."
        )
        raise FileNotFoundError(msg)
    return HFTokenizer(path)
