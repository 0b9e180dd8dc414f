"""The engine side over HTTP: a vLLM OpenAI-compatible server instead of an in-process engine.

``CraftEngine(server="http://127.0.0.1:8000")`` plans, renders and commits exactly as with the
in-process engine; only the last hop differs. Prompts go out token-exact as token-id prompts
on ``/v1/completions`` (``return_token_ids`` brings the reply's ids back, so multi-turn prompts
stay append-only), streamed over SSE (``stream_options.include_usage``: the last event carries
``usage.prompt_tokens_details.cached_tokens``, the server's ``num_cached_tokens``).

What the backend learns from the server at connect time (seconds; ``ServerUnavailable``
naming the URL when it is down):

* ``/v1/models``: the served model name and ``max_model_len``;
* ``/metrics`` (``vllm:cache_config_info``): ``block_size``, prefix caching on/off and the block
  hash algorithm, so expected block hashes match the server's KV events;
* ``/tokenize``: a probe text tokenized remotely must equal the local tokenizer's ids (the
  local model folder must hold the served model's tokenizer; ``ValueError`` otherwise);
* one 1-token probe request: the server must report cached tokens
  (``--enable-prompt-tokens-details``) and token ids; ``RuntimeError`` naming the flag if not.

KV events: the server's ZMQ publisher binds ``tcp://*:PORT``; we connect a SUB socket to
``tcp://HOST:PORT``. Rule (``craft-rag serve`` follows it): ``PORT = HTTP port + 1000`` unless
``kv_events=`` names a port or an endpoint (``False``: no events). Block hashes arrive as 64-bit
ints there; :class:`craft_rag.engine.kv_events.BlockHasher` with ``int_hashes=True`` produces the
same values. See :mod:`craft_rag.engine.backends.server.driver` for the per-request streams.

Errors: :class:`ServerUnavailable` (a ``ConnectionError``) when the server cannot be reached,
drops a stream or sends no token within ``read_timeout`` (a deadline between tokens: SSE
keep-alive comments do not extend it); :class:`ServerError` (an ``EngineFailure``) for 5xx
answers after retries and for any malformed or impossible answer (checked field by field in
:mod:`craft_rag.engine.backends.server.answers`, every read capped there, before anything is
committed); :class:`ServerBusy` for 429 past the retries; :class:`ServerRejected` (a
``ValueError``) for another 4xx. Connect errors, 5xx and 429 answers are retried (``retries``
times; ``Retry-After`` honoured up to ``MAX_RETRY_AFTER_S``, else exponential backoff) only
before any token arrived, so a retry never duplicates output.

Restarts: after any connection loss the connect-time checks run again before the next prompt
is sent; a server that came back with another model, tokenizer, block size, context length or
hashing is refused (``ServerError``) on every request, since its prompts would not be
token-exact nor its KV events match.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from craft_rag.engine.backends.server import settings as _settings
from craft_rag.engine.backends.server.answers import (
    MAX_JSON_BODY_BYTES,
    bad_field,
    event_cached_tokens,
    event_deltas,
    metrics_block_size,
    metrics_hash_algo,
    parse_event,
    served_model,
    sse_lines,
    tokenize_ids,
)
from craft_rag.engine.backends.server.settings import *  # noqa: F403  # re-exported (see __all__)
from craft_rag.engine.backends.server.settings import (
    ServerError,
    ServerRejected,
    ServerSettings,
    ServerUnavailable,
    as_server_settings,
    parse_cache_config,
)
from craft_rag.engine.backends.server.transport import ServerConnection
from craft_rag.engine.kv_events import BlockHasher, EvictionListener, KVEventSync
from craft_rag.engine.results import SamplingRequest, StepOutput
from craft_rag.kvtiers.approx_params import APPROX_PARAMS_KEY, ReuseCounts, reuse_counts_of
from craft_rag.kvtiers.tier_tokens import tier_tokens_of
from craft_rag.tokenizer import Tokenizer

# The client's names and, for callers that import them from here, every name of settings.
__all__ = ["ServerBackend", "connect_server", "step_output"]
__all__ += _settings.__all__

logger = logging.getLogger(__name__)

_PROBE_TEXT = "craft-rag tokenizer probe: The quick brown fox jumps over 13 lazy dogs."


@dataclass(frozen=True, slots=True)
class _Facts:
    """What the connect-time checks learn; a restarted server must answer the same."""

    model_name: str
    max_model_len: int
    block_size: int
    prefix_caching: bool
    hash_algo: str


class ServerBackend:
    """A connection to one vLLM OpenAI-compatible server (see the module doc).

    Invariants: ``max_model_len``, ``block_size``, ``model_name`` are the server's, read at
    connect time and never changed (a restarted server must match them, see the module doc);
    one ``httpx.Client`` (thread-safe, pooled) serves every request thread.
    """

    published_batches_supported = False

    def __init__(
        self,
        settings: ServerSettings,
        model_path: str | None,
        tokenizer: Tokenizer,
        *,
        transport: Any = None,
        sleep: Callable[[float], object] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Connect and check the server (module doc). ``transport``: an ``httpx`` transport
        (tests). Cost: four small HTTP round trips and a 1-token generation."""
        self.settings = settings
        self._http = ServerConnection(settings, transport=transport, sleep=sleep, clock=clock)
        self._tokenizer = tokenizer
        self._check_lock = threading.Lock()
        self._warned_no_reuse = False
        self.eos_token_ids = _eos_token_ids(model_path)
        try:
            self._connect(tokenizer)
        except BaseException:
            self._http.close()
            raise

    # ---- connect-time checks -----------------------------------------------------------------

    def _connect(self, tokenizer: Tokenizer) -> None:
        facts = self._read_facts(tokenizer)
        self._facts = facts
        self.model_name: str = facts.model_name
        self.max_model_len: int = facts.max_model_len
        self.block_size: int = facts.block_size
        self.prefix_caching: bool = facts.prefix_caching
        self.hash_algo: str = facts.hash_algo
        self._probe()

    def _read_facts(self, tokenizer: Tokenizer) -> _Facts:
        base = self.settings.base_url
        name, max_len = served_model(
            self._http.json("GET", "/v1/models"), self.settings.model_name, base
        )
        info = parse_cache_config(self._http.text("/metrics"))
        size = self.settings.block_size or metrics_block_size(info, base) or 0
        if size < 1:
            msg = (
                f"could not read the block size from {base}/metrics; pass "
                "ServerSettings(block_size=...) (craft-rag serve uses 32)"
            )
            raise ValueError(msg)
        remote = tokenize_ids(
            self._http.json(
                "POST", "/tokenize", {"prompt": _PROBE_TEXT, "add_special_tokens": False}
            ),
            base,
        )
        if remote != tokenizer.encode(_PROBE_TEXT):
            msg = (
                f"the tokenizer of the server at {base} ({name}) differs from the local one; "
                "pass the served model's folder as EngineSettings(model=DIR) so prompts are "
                "token-exact"
            )
            raise ValueError(msg)
        return _Facts(
            name,
            max_len,
            size,
            info.get("enable_prefix_caching", "True") == "True",
            self.settings.hash_algo or metrics_hash_algo(info, base),
        )

    def _probe(self) -> None:
        """A 1-token request: the server must report cached tokens."""
        probe: dict[str, Any] = {}
        ids = self._tokenizer.encode(_PROBE_TEXT)[:4]
        for piece in self._stream(ids, SamplingRequest(max_tokens=1), None, None, check=False):
            probe = piece
        if probe.get("cached_tokens") is None:
            msg = (
                f"the server at {self.settings.base_url} does not report cached tokens; start "
                "it with --enable-prompt-tokens-details (`craft-rag serve` does)"
            )
            raise RuntimeError(msg)

    def _recheck(self) -> None:
        """After a connection loss: the connect-time checks again, before any prompt goes
        out. ``ServerError`` (and still stale, so every later request checks again) when
        the server came back different. Cost: as at connect time, once per loss."""
        with self._check_lock:
            if not self._http.lost:
                return
            try:
                facts = self._read_facts(self._tokenizer)
                changed = [
                    f"{f.name} {getattr(facts, f.name)!r} (was {getattr(self._facts, f.name)!r})"
                    for f in fields(_Facts)
                    if getattr(facts, f.name) != getattr(self._facts, f.name)
                ]
                if changed:
                    raise ValueError(", ".join(changed))
                self._probe()
            except (ValueError, RuntimeError) as exc:
                msg = (
                    f"the server at {self.settings.base_url} restarted (or was replaced) and no "
                    f"longer matches this engine: {exc}; prompts would not be token-exact, so "
                    "none is sent: restart it as it was, or create a new CraftEngine"
                )
                raise ServerError(msg) from exc
            self._http.lost = False

    def block_hasher(self) -> BlockHasher | None:
        """Expected hashes in the server's KV event format (64-bit ints); ``None`` without
        prefix caching."""
        if not self.prefix_caching:
            return None
        seed = self.settings.hash_seed
        return BlockHasher.for_algo(
            self.block_size,
            self.hash_algo,
            int_hashes=True,
            seed=seed if seed is not None else "vllm-none-hash",
        )

    def subscribe(self, listener: EvictionListener) -> KVEventSync | None:
        """Subscribe to the server's KV events (``None`` when disabled or no prefix caching).
        ZMQ connects lazily and reconnects by itself after a server restart."""
        endpoint = self.settings.kv_events_endpoint
        if endpoint is None or not self.prefix_caching:
            return None
        return KVEventSync(endpoint, listener)

    # ---- HTTP --------------------------------------------------------------------------------

    def body(
        self,
        token_ids: Sequence[int],
        sampling: SamplingRequest,
        cache_salt: str | None,
        priority: int | None = None,
    ) -> dict[str, Any]:
        """The ``/v1/completions`` request body. ``read_prefix_cache=False`` (the no-cache
        baseline) has no server equivalent: it becomes a fresh random salt, so nothing cached
        can match (and what it caches, nothing else reads). ``priority`` (cache-aware
        admission; lower runs first) needs a server run with ``--scheduling-policy priority``
        (the server refuses a non-zero priority otherwise).

        ``sampling.extra`` goes in at the top level, except ``extra_args`` (what the
        in-process engine hands to ``vllm.SamplingParams(extra_args=...)``): its
        ``kv_transfer_params`` become the body's ``kv_transfer_params`` (vLLM's server puts
        them back into ``extra_args``; the chunk-cache spans travel there) and its other keys
        ``vllm_xargs`` (the server's name for the rest of ``extra_args``)."""
        extra = dict(sampling.extra)
        args = dict(extra.pop("extra_args", None) or {})
        params = args.pop("kv_transfer_params", None)
        if params is not None:
            extra["kv_transfer_params"] = {**(extra.get("kv_transfer_params") or {}), **params}
        if args:
            extra["vllm_xargs"] = {**(extra.get("vllm_xargs") or {}), **args}
        body: dict[str, Any] = {
            **extra,
            "model": self.model_name,
            "prompt": list(token_ids),
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
        }
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if sampling.stop:
            body["stop"] = list(sampling.stop)
        if priority is not None:
            body["priority"] = priority
        if not sampling.read_prefix_cache:
            import secrets

            cache_salt = f"nocache-{secrets.token_hex(16)}"
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        return body

    def stream(
        self,
        token_ids: Sequence[int],
        sampling: SamplingRequest,
        cache_salt: str | None,
        cancelled: threading.Event | None = None,
        *,
        priority: int | None = None,
    ) -> Iterator[dict[str, Any]]:
        """Run one completion (``priority``: see :meth:`body`) and yield its SSE deltas as
        ``{"token_ids", "text"}``, then ``{"done": True, "finish_reason", "cached_tokens",
        "tiers", "reuse"}`` (``reuse``: the chunk-cache connector's counts, ``None`` unless the
        request sent chunk spans and the server reported them).
        Retries happen only before the first delta. Stops early (closing the stream, so the
        server aborts the request) once ``cancelled`` is set. After a connection loss the
        server is checked again first (module doc). Every event is checked (:mod:`.answers`);
        more tokens than ``max_tokens``, an impossible ``cached_tokens``, output after the
        ``finish_reason`` or an event naming another model is a ``ServerError`` before the
        final delta, so nothing of the request is committed."""
        return self._stream(
            token_ids, sampling, cache_salt, cancelled, check=True, priority=priority
        )

    def _stream(
        self,
        token_ids: Sequence[int],
        sampling: SamplingRequest,
        cache_salt: str | None,
        cancelled: threading.Event | None,
        *,
        check: bool,
        priority: int | None = None,
    ) -> Iterator[dict[str, Any]]:
        import httpx

        body = self.body(token_ids, sampling, cache_salt, priority)
        what = "POST /v1/completions"
        base = self.settings.base_url

        def open_stream() -> Any:
            if check and self._http.lost:
                self._recheck()  # also when a retry below reached a restarted server
            return self._http.open("POST", "/v1/completions", body)

        response = self._http.retrying(what, open_stream)
        deadline = self._http.deadline()
        finish: str | None = None
        cached: int | None = None
        tiers = (0, 0)
        params: object = None
        sent = 0
        done = False
        try:
            for line in sse_lines(response.iter_raw(), base, deadline):
                if cancelled is not None and cancelled.is_set():
                    return
                if not line.startswith(b"data:"):
                    continue  # comments and other fields: no progress, the deadline runs on
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                event = parse_event(data, base)
                model = event.get("model")
                if model is not None and model != self.model_name:
                    # A balancer mixing servers, or one that changed without a restart.
                    raise bad_field(
                        base, "a stream event", "model", model, f"not {self.model_name!r}"
                    )
                reported = event_cached_tokens(event, len(token_ids), base)
                cached = cached if reported is None else reported
                if "kv_transfer_params" in event:  # vLLM 0.32 sends them only unstreamed
                    params = event["kv_transfer_params"]
                    tiers = tier_tokens_of(params, maximum=len(token_ids))
                for delta in event_deltas(event, base):
                    if finish is not None and (delta.token_ids or delta.text):
                        raise bad_field(
                            base,
                            "a stream event",
                            "finish_reason",
                            finish,
                            "output followed the sequence's end (a duplicated or spliced "
                            "stream); the reply is refused",
                        )
                    sent += len(delta.token_ids)
                    if sent > sampling.max_tokens:
                        msg = (
                            f"the server at {base} streamed more than max_tokens="
                            f"{sampling.max_tokens} tokens ({sent} so far); the reply is refused"
                        )
                        raise ServerError(msg)
                    if delta.token_ids:
                        deadline.reset()
                    finish = delta.finish_reason or finish
                    yield {"token_ids": delta.token_ids, "text": delta.text}
        except (httpx.TransportError, httpx.StreamError) as exc:
            raise self._http.unavailable(f"{what} stream", exc, 1) from exc
        except ServerUnavailable:
            self._http.lost = True
            raise
        except ServerError as exc:  # quotes the server's words, which may echo a secret
            shown = self._http.scrub(str(exc), body)
            if shown != str(exc):
                raise type(exc)(shown) from None
            raise
        finally:
            response.close()
        if not done:
            self._http.lost = True
            msg = f"the stream from {base} ended without [DONE]"
            raise ServerUnavailable(msg)
        reuse = self._reuse_counts(body, params, len(token_ids))
        yield {
            "done": True,
            "finish_reason": finish,
            "cached_tokens": cached,
            "tiers": tiers,
            "reuse": reuse,
        }

    def _reuse_counts(
        self, body: dict[str, Any], params: object, prompt_len: int
    ) -> ReuseCounts | None:
        """The chunk-cache connector's counts in a finished request's ``params``
        (:func:`~craft_rag.kvtiers.approx_params.reuse_counts_of`: ``None`` when absent or not
        adding up to the prompt). A request that sent chunk spans and got none back logs one
        warning per backend naming the fix: the server runs no chunk-cache connector (it then
        served the request exactly, under the request-scoped salt: no exact prefix hit from
        other requests) or does not stream its params back. O(1)."""
        sent = body.get("kv_transfer_params")
        asked = isinstance(sent, dict) and APPROX_PARAMS_KEY in sent
        reuse = reuse_counts_of(params, prompt_len=prompt_len) if asked else None
        if asked and reuse is None and not self._warned_no_reuse:
            self._warned_no_reuse = True
            logger.warning(
                "the server at %s sent back no chunk-cache counts for a request with chunk "
                "spans (EngineSettings.chunk_cache is on): start it with `craft-rag serve "
                "--chunk-cache` (the chunk-cache connector, and streamed replies that carry "
                "its counts); until then its ReuseReports show no chunk-cache reuse",
                self.settings.base_url,
            )
        return reuse

    def reset_prefix_cache(self) -> bool:
        """``POST /reset_prefix_cache`` (a dev-mode endpoint: ``craft-rag serve --dev`` or
        ``VLLM_SERVER_DEV_MODE=1``). ``RuntimeError`` naming that fix when it is missing.
        False when the server answers ``{"success": false}`` (running requests hold blocks:
        nothing was reset); an answer without that field counts as success."""

        try:
            raw = self._http.read("POST", "/reset_prefix_cache", MAX_JSON_BODY_BYTES)
        except ServerRejected as exc:
            msg = (
                f"the server at {self.settings.base_url} has no /reset_prefix_cache; start it "
                "with `craft-rag serve --dev` (VLLM_SERVER_DEV_MODE=1), or use a fresh "
                "cache_salt for a cold cache"
            )
            raise RuntimeError(msg) from exc
        try:
            answer = json.loads(raw)
        except ValueError:  # an empty or non-JSON body: older servers answered 200 alone
            return True
        return not (isinstance(answer, dict) and answer.get("success") is False)

    def published_batches(self) -> int | None:
        """Not countable over the network: the engine's event barrier is skipped."""
        return None

    def shutdown(self) -> None:
        """Close the HTTP connections. Idempotent."""
        self._http.close()


def _eos_token_ids(model_path: str | None) -> frozenset[int]:
    """EOS ids from the local model folder's ``generation_config.json``/``config.json``."""
    if model_path is None:
        return frozenset()
    for name in ("generation_config.json", "config.json"):
        path = Path(model_path) / name
        if not path.is_file():
            continue
        try:
            eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
        except (OSError, ValueError):
            continue
        if isinstance(eos, int):
            return frozenset([eos])
        if isinstance(eos, list):
            return frozenset(int(e) for e in eos if isinstance(e, int))
    return frozenset()


def step_output(request_id: str, delta: dict[str, Any]) -> StepOutput:
    """A stream delta from :meth:`ServerBackend.stream` as the engine's :class:`StepOutput`.
    Tier tokens are 0, and ``reuse_counts`` (the chunk-cache connector's) ``None``, unless a
    stream event carried the connector's ``kv_transfer_params`` (vLLM 0.32's server puts them
    only in non-streaming replies; ``craft-rag serve`` with a connector adds them to the
    stream's usage event)."""
    if delta.get("done"):
        ram, disk = delta.get("tiers", (0, 0))
        return StepOutput(
            request_id,
            (),
            "",
            True,
            delta.get("finish_reason"),
            delta.get("cached_tokens"),
            tier_ram_tokens=ram,
            tier_disk_tokens=disk,
            reuse_counts=delta.get("reuse"),
        )
    return StepOutput(request_id, delta["token_ids"], str(delta["text"]), False, None, None)


def connect_server(
    server: str | ServerSettings,
    model_path: str | None,
    tokenizer: Tokenizer,
    listener: EvictionListener,
) -> tuple[ServerBackend, KVEventSync | None, BlockHasher | None]:
    """Connect to ``server`` (checks in the module doc), subscribe ``listener`` to its KV
    events and build the block hasher matching its event hashes. Used by ``CraftEngine``."""
    backend = ServerBackend(as_server_settings(server), model_path, tokenizer)
    try:
        events = backend.subscribe(listener)
    except BaseException:
        backend.shutdown()
        raise
    hasher = backend.block_hasher()
    if events is not None:
        events.set_hasher(hasher)
    return backend, events, hasher
