"""Token-level writes of K/V computed outside vLLM into vLLM's CPU KV cache.

:mod:`craft_rag.kvtiers.layout_cpu` copies whole blocks as opaque bytes (they go back where they
came from, so the ISA packing never needs decoding). KV computed elsewhere (another copy of the
model, a re-rotated chunk-cache) arrives as plain per-layer tensors ``[tokens, kv_heads,
head_size]`` and has to be *packed*: this module hands it to the same kernel vLLM's attention
layer uses to write its own K/V, ``vllm._custom_ops.cpu_attn_reshape_and_cache``, with a slot
mapping built from the request's block ids (as ``CpuPlatform.pack_kv_cache`` does for NIXL).
So whatever the ISA's packing, the bytes are exactly the ones vLLM would have written for the
same K/V values.

Invariant held by :func:`write_tokens`: only the slots of the given token positions change;
everything else in the pool (other tokens of the same blocks included) is untouched.
Cost: one kernel call per layer, O(tokens x kv_heads x head_size) per layer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from craft_rag.kvtiers.layout_cpu import CpuBlockLayout

__all__ = ["slot_mapping", "write_tokens"]


def slot_mapping(block_ids: Sequence[int], block_size: int, start: int, end: int) -> torch.Tensor:
    """Pool slots of prompt positions ``[start, end)`` for a request whose ``j``-th block is
    ``block_ids[j]`` (slot = block id x block size + offset in the block).

    Raises ``ValueError`` for an empty or inverted range or one past the request's blocks.
    Cost: O(end - start).
    """
    if not 0 <= start < end:
        msg = f"token range [{start}, {end}) must be non-empty and start at >= 0"
        raise ValueError(msg)
    if end > len(block_ids) * block_size:
        msg = f"token range [{start}, {end}) goes past the request's {len(block_ids)} blocks"
        raise ValueError(msg)
    positions = torch.arange(start, end, dtype=torch.long)
    blocks = torch.tensor(list(block_ids), dtype=torch.long)[positions // block_size]
    return blocks * block_size + positions % block_size


def write_tokens(
    kv_caches: Mapping[str, torch.Tensor],
    layout: CpuBlockLayout,
    slots: torch.Tensor,
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
) -> None:
    """Write per-layer ``keys[i]``/``values[i]`` (``[len(slots), kv_heads, head_size]``, post-RoPE
    as the model's attention would cache them) into ``slots`` of layer ``layout.layer_names[i]``.

    Values are cast to the cache's dtype first. Raises ``ValueError`` before writing anything
    when the layer count or a tensor's shape does not match the layout, or a slot lies outside
    the pool (a caller bug or a cache from another model: the caller must not promise the
    tokens). FP8 caches are refused (``NotImplementedError``, as vLLM's own packer does).
    """
    from vllm._custom_ops import cpu_attn_reshape_and_cache
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    names = layout.layer_names
    if len(keys) != len(names) or len(values) != len(names):
        msg = f"{len(keys)} key / {len(values)} value layers for a cache of {len(names)} layers"
        raise ValueError(msg)
    heads, block_size, fused = layout.block_shape
    head_size = fused // 2
    want = (int(slots.numel()), heads, head_size)
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        if tuple(k.shape) != want or tuple(v.shape) != want:
            msg = f"layer {i}: K {tuple(k.shape)} / V {tuple(v.shape)}, expected {want}"
            raise ValueError(msg)
    first = kv_caches[names[0]]
    num_blocks = first.shape[0]
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= num_blocks * block_size):
        msg = f"slots outside the pool of {num_blocks} blocks x {block_size}"
        raise ValueError(msg)
    if first.dtype == torch.uint8:
        msg = "FP8 KV caches are not supported by token-level writes on CPU"
        raise NotImplementedError(msg)
    isa = _get_attn_isa(first.dtype, block_size, head_size)
    for name, k, v in zip(names, keys, values, strict=True):
        cache = kv_caches[name]
        key_cache, value_cache = cache.view(num_blocks, heads, 2 * block_size, head_size).chunk(
            2, dim=2
        )
        cpu_attn_reshape_and_cache(
            k.to(cache.dtype).contiguous(),
            v.to(cache.dtype).contiguous(),
            key_cache,
            value_cache,
            slots,
            isa,
        )
