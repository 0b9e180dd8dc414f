"""layout_cpu: whole-block byte copies of vLLM's CPU KV layout round-trip exactly."""

from __future__ import annotations

import pytest
import torch

from craft_rag.kvtiers.layout_cpu import extract_block, inject_block, layout_of

BLOCKS, HEADS, BLOCK, HEAD = 8, 3, 32, 64


def make_caches(names: list[str], fill: bool = True) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shape = (BLOCKS, HEADS, BLOCK, 2 * HEAD)
    return {
        n: torch.randn(shape, generator=gen) if fill else torch.zeros(shape) for n in names
    }


def test_layer_order_is_natural_and_shared_tensors_count_once() -> None:
    caches = make_caches(["m.layers.10.attn", "m.layers.2.attn", "m.layers.1.attn"])
    caches["m.layers.11.attn"] = caches["m.layers.10.attn"]  # KV sharing: same tensor
    layout = layout_of(caches)
    assert layout.layer_names == ("m.layers.1.attn", "m.layers.2.attn", "m.layers.10.attn")
    assert layout.layer_block_bytes == HEADS * BLOCK * 2 * HEAD * 4
    assert layout.block_bytes == 3 * layout.layer_block_bytes
    assert layout.fingerprint() == f"cpu-lbhnc:3:{HEADS}x{BLOCK}x{2 * HEAD}:float32"


def test_extract_inject_round_trip_touches_only_the_target_block() -> None:
    names = ["l.0", "l.1"]
    src, dst = make_caches(names), make_caches(names, fill=False)
    payload = extract_block(src, 5)
    inject_block(dst, 2, payload)
    for n in names:
        assert torch.equal(dst[n][2], src[n][5])
        others = [b for b in range(BLOCKS) if b != 2]
        assert not dst[n][others].any()
    assert extract_block(dst, 2) == payload


def test_bad_payload_or_block_id_writes_nothing() -> None:
    names = ["l.0", "l.1"]
    src, dst = make_caches(names), make_caches(names, fill=False)
    payload = extract_block(src, 1)
    with pytest.raises(ValueError, match="bytes"):
        inject_block(dst, 2, payload[:-1])
    with pytest.raises(IndexError):
        inject_block(dst, BLOCKS, payload)
    with pytest.raises(IndexError):
        extract_block(src, -1)
    assert not any(t.any() for t in dst.values())


def test_rejects_tensors_that_are_not_the_cpu_layout() -> None:
    with pytest.raises(ValueError, match="layout_cpu knows"):
        layout_of({"l.0": torch.zeros(4, 4, 4)})
    with pytest.raises(ValueError, match="differ"):
        layout_of({"l.0": torch.zeros(4, 2, 32, 8), "l.1": torch.zeros(4, 2, 32, 16)})
    with pytest.raises(ValueError, match="no KV cache"):
        layout_of({})


def test_round_trip_on_blocks_written_by_vllms_cpu_kernel() -> None:
    """The packing is per block and independent of the block id: K/V written by vLLM's CPU
    kernel into block 3 and copied to block 6 equal the same K/V written into block 6."""
    ops = pytest.importorskip("vllm._custom_ops")
    cpu_attn = pytest.importorskip("vllm.v1.attention.backends.cpu_attn")
    dtype = torch.float32
    isa = cpu_attn._get_attn_isa(dtype, BLOCK, HEAD)
    gen = torch.Generator().manual_seed(1)
    key = torch.randn(BLOCK, HEADS, HEAD, generator=gen, dtype=dtype)
    value = torch.randn(BLOCK, HEADS, HEAD, generator=gen, dtype=dtype)

    def write(cache: torch.Tensor, block: int) -> None:
        view = cache.view(BLOCKS, HEADS, 2 * BLOCK, HEAD)
        k_cache, v_cache = view.chunk(2, dim=2)
        slots = torch.arange(block * BLOCK, (block + 1) * BLOCK, dtype=torch.int64)
        ops.cpu_attn_reshape_and_cache(key, value, k_cache, v_cache, slots, isa)

    written, copied, direct = (make_caches(["l.0"], fill=False) for _ in range(3))
    write(written["l.0"], 3)
    assert written["l.0"][3].any()
    inject_block(copied, 6, extract_block(written, 3))
    write(direct["l.0"], 6)
    assert extract_block(copied, 6) == extract_block(direct, 6)
    assert torch.equal(copied["l.0"], direct["l.0"])
