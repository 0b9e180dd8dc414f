"""What a :class:`~craft_rag.engine.engine.CraftEngine` talks to, set up once at start-up.

:func:`prompt_pieces` derives the prompt format and tokenizer from the model folder (cheap,
checked first so a bad argument fails before vLLM takes seconds and RAM); :func:`wire_backend`
picks the backend (a vLLM server, the in-process vLLM engine, or a caller's backend such as a
test fake), subscribes to its KV events and makes the block hasher; :meth:`Wiring.driver` makes
the driver that steps it (:class:`~craft_rag.engine.driver.EngineDriver`) or streams to it
(:class:`~craft_rag.engine.server_driver.ServerDriver`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from craft_rag.engine.chat_format import derive_chat_format
from craft_rag.engine.driver import EngineBackend, EngineDriver
from craft_rag.engine.kv_events import BlockHasher, KVEventSync
from craft_rag.engine.logs import align_vllm_logging, start_progress
from craft_rag.engine.planners import PlannerNamespaces
from craft_rag.engine.server_backend import ServerBackend, ServerSettings, connect_server
from craft_rag.engine.server_driver import ServerDriver
from craft_rag.engine.vllm_backend import EngineSettings, VLLMBackend
from craft_rag.prompt import PromptFormat
from craft_rag.tokenizer import HFTokenizer, Tokenizer

__all__ = ["ManagedBackend", "Wiring", "prompt_pieces", "wire_backend"]


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

    def driver(self, on_server_lost: Callable[[], object]) -> EngineDriver | ServerDriver:
        """The driver (starts its thread for an in-process backend). ``on_server_lost`` runs
        when a server is unreachable: a restarted server's cache is empty."""
        if isinstance(self.backend, ServerBackend):
            return ServerDriver(self.backend, on_server_lost=on_server_lost)
        return EngineDriver(self.backend)


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
    (no ``model_path``) comes without them."""
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
    vllm_backend = VLLMBackend(settings, model_path)
    kv_events = None
    if vllm_backend.kv_events_endpoint is not None:
        # Subscribe before the engine binds the endpoint (ZMQ connects lazily).
        kv_events = KVEventSync(vllm_backend.kv_events_endpoint, namespaces)
    align_vllm_logging()  # before vLLM is imported: its level follows craft-rag's
    ready = start_progress(f"the vLLM engine ({model_path})")
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
