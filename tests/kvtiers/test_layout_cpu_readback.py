"""CpuBlockReader: K/V read back from blocks packed by vLLM's own CPU kernel equal what was
written, across block boundaries, for bf16 and fp32 caches; bad input is refused clearly."""

from __future__ import annotations

import pytest
import torch

from craft_rag.kvtiers.layout_cpu import extract_block, layout_of
from craft_rag.kvtiers.layout_cpu_readback import CpuBlockReader
from craft_rag.kvtiers.layout_cpu_tokens import slot_mapping, write_tokens

LAYERS, HEADS, BLOCK, HEAD = 3, 2, 32, 64


def pool(dtype: torch.dtype, blocks: int = 4) -> dict[str, torch.Tensor]:
    return {f"model.layers.{i}.attn": torch.zeros(blocks, HEADS, BLOCK, 2 * HEAD, dtype=dtype)
            for i in range(LAYERS)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_equal_what_the_kernel_wrote(dtype: torch.dtype) -> None:
    reader = CpuBlockReader.probe(LAYERS, HEADS, BLOCK, HEAD, dtype)
    caches = pool(dtype)
    layout = layout_of(caches)
    gen = torch.Generator().manual_seed(1)
    n = 3 * BLOCK
    keys = [torch.randn(n, HEADS, HEAD, generator=gen) for _ in range(LAYERS)]
    values = [torch.randn(n, HEADS, HEAD, generator=gen) for _ in range(LAYERS)]
    block_ids = [2, 0, 3]  # a request's blocks, not in pool order
    write_tokens(caches, layout, slot_mapping(block_ids, BLOCK, 0, n), keys, values)
    payloads = [extract_block(caches, b, layout) for b in block_ids]
    for start, end in ((0, n), (5, 40), (BLOCK, 2 * BLOCK), (70, 71)):
        got_k, got_v = reader.rows(payloads, start, end)
        assert len(got_k) == LAYERS
        for layer in range(LAYERS):
            assert got_k[layer].dtype == dtype
            assert torch.equal(got_k[layer], keys[layer][start:end].to(dtype))
            assert torch.equal(got_v[layer], values[layer][start:end].to(dtype))


def test_a_wrong_unpacking_would_be_seen() -> None:
    """The identity map (no unpacking) does not read the kernel's layout back: the test above
    can fail."""
    reader = CpuBlockReader.probe(LAYERS, HEADS, BLOCK, HEAD, torch.float32)
    assert not torch.equal(reader.gather, torch.arange(reader.gather.numel()))


def test_bad_input_is_refused() -> None:
    reader = CpuBlockReader.probe(LAYERS, HEADS, BLOCK, HEAD, torch.float32)
    good = bytes(reader.payload_bytes)
    with pytest.raises(ValueError, match="outside 1 blocks"):
        reader.rows([good], 0, BLOCK + 1)
    with pytest.raises(ValueError, match="outside"):
        reader.rows([good], 4, 4)
    with pytest.raises(ValueError, match="bytes, expected"):
        reader.rows([good[:-4]], 0, 4)
    with pytest.raises(ValueError, match="heads must be an integer"):
        CpuBlockReader.probe(LAYERS, 0, BLOCK, HEAD, torch.float32)
    with pytest.raises(ValueError, match="block_size must be an integer"):
        CpuBlockReader.probe(LAYERS, HEADS, True, HEAD, torch.float32)  # type: ignore[arg-type]
    with pytest.raises(NotImplementedError, match="FP8"):
        CpuBlockReader.probe(LAYERS, HEADS, BLOCK, HEAD, torch.uint8)
