"""layout_cuda on CPU tensors with vLLM 0.32's CUDA layouts: whole-block copies round-trip."""

from __future__ import annotations

import pytest
import torch

from craft_rag.kvtiers.layout_cuda import (
    BACKEND_LAYOUTS,
    KV_CACHE_LAYOUTS,
    CudaBlockLayout,
    allocate_kv_caches,
    block_runs,
    extract_block,
    extract_blocks,
    inject_block,
    inject_blocks,
    layout_of,
)

LAYERS, BLOCKS, HEADS, BLOCK, HEAD = 3, 10, 2, 4, 8


def make_caches(
    layout: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0, heads: int = HEADS
) -> dict[str, torch.Tensor]:
    caches = allocate_kv_caches(
        layout,
        num_layers=LAYERS,
        num_blocks=BLOCKS,
        num_kv_heads=heads,
        block_size=BLOCK,
        head_size=HEAD,
        dtype=dtype,
    )
    gen = torch.Generator().manual_seed(seed)
    for kv in caches.values():
        kv.copy_(torch.randn(kv.shape, generator=gen).to(dtype))
    return caches


def backing_bytes(caches: dict[str, torch.Tensor]) -> bytes:
    """The whole storage behind the views, in memory order."""
    first = next(iter(caches.values()))
    return bytes(first.untyped_storage())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("name", list(KV_CACHE_LAYOUTS))
def test_round_trip_writes_exactly_the_target_blocks(name: str, dtype: torch.dtype) -> None:
    caches = make_caches(name, dtype)
    layout = layout_of(caches, name)
    assert layout_of(caches) == layout  # inferred from the strides alone
    before = {n: kv.clone() for n, kv in caches.items()}
    src, dst = [7, 1, 2, 3], [0, 4, 5, 9]  # a run (1,2,3) and a lone block, then runs (4,5)
    copy = extract_blocks(caches, src, layout)
    assert copy.event is None  # CPU tensors: synchronous, no stream
    inject_blocks(caches, dst, copy.payloads(), layout).synchronize()
    for n, kv in caches.items():
        expected = before[n].clone()
        expected[dst] = before[n][src]
        assert torch.equal(kv.view(torch.uint8), expected.view(torch.uint8))
    for s, d in zip(src, dst, strict=True):
        assert extract_block(caches, d, layout) == extract_block(caches, s, layout)


@pytest.mark.parametrize("name", list(KV_CACHE_LAYOUTS))
def test_inject_from_a_staging_buffer_equals_inject_from_bytes(name: str) -> None:
    caches, other = make_caches(name), make_caches(name, seed=1)
    layout = layout_of(caches, name)
    staged = extract_blocks(caches, [3, 4, 8], layout)
    inject_blocks(other, [5, 6, 0], staged, layout)
    assert extract_blocks(other, [5, 6, 0], layout).payloads() == staged.payloads()


@pytest.mark.parametrize("name", ["LBHNC", "LBNHC"])
def test_layer_compact_payload_is_each_layers_block_run_in_memory_order(name: str) -> None:
    caches = make_caches(name)
    layout = layout_of(caches, name)
    raw = backing_bytes(caches)
    layer_stride = BLOCKS * layout.layer_block_bytes
    lbb = layout.layer_block_bytes
    expected = b"".join(
        raw[i * layer_stride + 6 * lbb : i * layer_stride + 7 * lbb] for i in range(LAYERS)
    )
    assert extract_block(caches, 6, layout) == expected
    assert not layout.fused


@pytest.mark.parametrize("name", ["BLHNC", "BLNHC"])
def test_cross_layer_layouts_are_fused_and_a_block_is_one_run(name: str) -> None:
    caches = make_caches(name)
    layout = layout_of(caches, name)
    assert layout.fused
    raw = backing_bytes(caches)
    assert extract_block(caches, 6, layout) == raw[6 * layout.block_bytes : 7 * layout.block_bytes]


def test_descriptor_layer_order_shared_tensors_and_fingerprint() -> None:
    caches = make_caches("LBNHC")
    renamed = {f"m.layers.{i}.attn": kv for i, kv in zip([10, 2, 1], caches.values(), strict=True)}
    renamed["m.layers.11.attn"] = renamed["m.layers.10.attn"]  # KV sharing: copied once
    layout = layout_of(renamed, "NHD")
    assert layout.layer_names == ("m.layers.1.attn", "m.layers.2.attn", "m.layers.10.attn")
    assert layout == CudaBlockLayout(
        layout="LBNHC",
        layer_names=layout.layer_names,
        block_shape=(HEADS, BLOCK, 2 * HEAD),
        dtype="bfloat16",
        layer_block_bytes=HEADS * BLOCK * 2 * HEAD * 2,
        num_blocks=BLOCKS,
    )
    assert layout.block_bytes == 3 * layout.layer_block_bytes
    assert layout.fingerprint() == f"cuda-lbnhc:3:{HEADS}x{BLOCK}x{2 * HEAD}:bfloat16"
    other = layout_of(make_caches("LBHNC"), "HND")
    assert other.fingerprint() == f"cuda-lbhnc:3:{HEADS}x{BLOCK}x{2 * HEAD}:bfloat16"


@pytest.mark.parametrize(("backend", "expected"), sorted(BACKEND_LAYOUTS.items()))
def test_backend_names_select_their_default_layout(backend: str, expected: str) -> None:
    assert layout_of(make_caches(expected), backend.lower()).layout == expected


def test_strides_of_another_layout_name_the_one_they_fit() -> None:
    caches = make_caches("LBNHC")
    with pytest.raises(ValueError, match=r"not layout LBHNC; they fit \['LBNHC'\]"):
        layout_of(caches, "LBHNC")


def test_bad_shapes_and_names_raise_naming_the_layouts() -> None:
    with pytest.raises(ValueError, match="LBHNC, LBNHC, LHBNC, BLHNC, BLNHC, BHLNC"):
        layout_of({"l.0": torch.zeros(BLOCKS, BLOCK, HEADS * 2 * HEAD)})
    with pytest.raises(ValueError, match=r"layouts: LBHNC, LBNHC.*backends: FLASH_ATTN"):
        layout_of(make_caches("LBNHC"), "paged")
    caches = make_caches("LBNHC")
    caches["model.layers.9.self_attn.attn"] = torch.zeros(BLOCKS + 1, HEADS, BLOCK, 2 * HEAD)
    with pytest.raises(ValueError, match="differ across layers"):
        layout_of(caches, "LBNHC")
    with pytest.raises(ValueError, match="no KV cache tensors"):
        layout_of({}, "LBNHC")


def test_one_head_is_ambiguous_without_a_name() -> None:
    caches = make_caches("LBNHC", heads=1)
    with pytest.raises(ValueError, match="pass the resolved layout"):
        layout_of(caches)
    assert layout_of(caches, "LBNHC").layout == "LBNHC"


def test_bad_payloads_and_ids_write_nothing() -> None:
    caches = make_caches("LBNHC")
    layout = layout_of(caches, "LBNHC")
    before = {n: kv.clone() for n, kv in caches.items()}
    good = extract_block(caches, 1, layout)
    with pytest.raises(ValueError, match="this layout's blocks have"):
        inject_block(caches, 2, good[:-2], layout)
    with pytest.raises(ValueError, match="2 payloads for 1 block ids"):
        inject_blocks(caches, [2], [good, good], layout)
    with pytest.raises(IndexError, match="outside the pool of 10 blocks"):
        inject_blocks(caches, [2, BLOCKS], [good, good], layout)
    with pytest.raises(IndexError, match="outside the pool"):
        extract_block(caches, -1, layout)
    other = layout_of(make_caches("LBHNC"), "LBHNC")
    with pytest.raises(ValueError, match="another layout"):
        inject_blocks(caches, [2], extract_blocks(make_caches("LBHNC"), [0], other), layout)
    for n, kv in caches.items():
        assert torch.equal(kv, before[n])


def test_block_runs_group_consecutive_ids_in_order() -> None:
    assert block_runs([]) == []
    assert block_runs([4]) == [(0, 4, 1)]
    assert block_runs([3, 4, 5, 9, 1, 2]) == [(0, 3, 3), (3, 9, 1), (4, 1, 2)]
    assert block_runs([5, 4]) == [(0, 5, 1), (1, 4, 1)]


def test_loads_by_path_and_round_trips_without_vllm_or_numpy() -> None:
    """What the device check relies on: torch and the standard library only."""
    import subprocess
    import sys

    code = """
import sys
sys.modules["numpy"] = None  # an import of numpy now fails, as on a torch-only machine
import importlib.util
spec = importlib.util.spec_from_file_location("lc", "src/craft_rag/kvtiers/layout_cuda.py")
m = importlib.util.module_from_spec(spec)
sys.modules["lc"] = m
spec.loader.exec_module(m)
import torch
c = m.allocate_kv_caches("LBNHC", num_layers=2, num_blocks=4, num_kv_heads=2, block_size=4,
                         head_size=8, dtype=torch.bfloat16)
for kv in c.values():
    kv.normal_()
lay = m.layout_of(c, "LBNHC")
m.inject_block(c, 3, m.extract_block(c, 0, lay), lay)
assert m.extract_block(c, 3, lay) == m.extract_block(c, 0, lay)
assert "vllm" not in sys.modules and "craft_rag" not in sys.modules
"""
    subprocess.run([sys.executable, "-c", code], check=True, cwd=_repo_root())


def _repo_root() -> str:
    from pathlib import Path

    return str(Path(__file__).resolve().parents[2])
