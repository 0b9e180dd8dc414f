"""layout_cpu_tokens on the real CPU cache kernel (no engine): slot mapping, partial writes that
compose, untouched blocks, validation."""

from __future__ import annotations

import pytest
import torch

from craft_rag.kvtiers.layout_cpu import layout_of
from craft_rag.kvtiers.layout_cpu_tokens import slot_mapping, write_tokens

HEADS, BLOCK, HEAD, LAYERS, BLOCKS = 3, 32, 64, 2, 6


def make_cache() -> dict[str, torch.Tensor]:
    return {f"model.layers.{i}.self_attn.attn": torch.zeros(BLOCKS, HEADS, BLOCK, 2 * HEAD)
            for i in range(LAYERS)}


def make_kv(n: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return ([torch.randn(n, HEADS, HEAD, generator=gen) for _ in range(LAYERS)],
            [torch.randn(n, HEADS, HEAD, generator=gen) for _ in range(LAYERS)])


def test_slot_mapping() -> None:
    assert slot_mapping([4, 1], 4, 2, 7).tolist() == [18, 19, 4, 5, 6]
    for start, end in ((3, 3), (-1, 2), (5, 9)):
        with pytest.raises(ValueError, match="token range"):
            slot_mapping([4, 1], 4, start, end)


def test_partial_writes_compose_and_leave_other_blocks() -> None:
    # two writes (tokens [0, 3) then [3, 40)) give the same bytes as one write of [0, 40):
    # a token-level write never clobbers the other slots of its block
    kv_a, kv_b = make_cache(), make_cache()
    layout = layout_of(kv_a)
    keys, values = make_kv(40, 0)
    blocks = [4, 1]
    write_tokens(kv_a, layout, slot_mapping(blocks, BLOCK, 0, 40), keys, values)
    write_tokens(kv_b, layout, slot_mapping(blocks, BLOCK, 0, 3),
                 [k[:3] for k in keys], [v[:3] for v in values])
    write_tokens(kv_b, layout, slot_mapping(blocks, BLOCK, 3, 40),
                 [k[3:] for k in keys], [v[3:] for v in values])
    for name in kv_a:
        assert torch.equal(kv_a[name], kv_b[name])
        assert kv_a[name][4].abs().sum() > 0 and kv_a[name][1].abs().sum() > 0
        for untouched in (0, 2, 3, 5):
            assert not kv_a[name][untouched].any()
    # different values at one token change the bytes (the write is not a no-op)
    keys2 = [k.clone() for k in keys]
    keys2[1][7] += 1.0
    write_tokens(kv_b, layout, slot_mapping(blocks, BLOCK, 0, 40), keys2, values)
    name1 = layout.layer_names[1]
    assert not torch.equal(kv_a[name1], kv_b[name1])
    assert torch.equal(kv_a[layout.layer_names[0]], kv_b[layout.layer_names[0]])


def test_rejects_before_writing() -> None:
    kv = make_cache()
    layout = layout_of(kv)
    keys, values = make_kv(5, 1)
    slots = slot_mapping([2], BLOCK, 0, 5)
    with pytest.raises(ValueError, match="layers"):
        write_tokens(kv, layout, slots, keys[:1], values[:1])
    with pytest.raises(ValueError, match="expected"):
        write_tokens(kv, layout, slots, [k[:, :2] for k in keys], values)
    with pytest.raises(ValueError, match="outside the pool"):
        write_tokens(kv, layout, slots + BLOCKS * BLOCK, keys, values)
    assert not any(t.any() for t in kv.values())
