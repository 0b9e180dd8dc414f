"""kv_sources: the built-in sources on the transformers copy of the embedded model, and the
registry."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from craft_rag.kvtiers.kv_sources import (
    BUILTIN_SOURCES,
    HeadOnlyChunkSource,
    HFPrefillSource,
    LazyModel,
    build_sources,
)


@pytest.fixture(scope="module")
def model_dir() -> str:
    from craft_rag.engine.model import embedded_model_dir

    folder = embedded_model_dir()
    if not (folder / "config.json").exists():
        pytest.skip("embedded model not prepared (craft-rag model prepare)")
    return str(folder)


@pytest.fixture(scope="module")
def shared(model_dir: str) -> LazyModel:
    return LazyModel(model_dir)


def make_tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(n)]


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def test_hf_prefill_rows_layout(model_dir: str, shared: LazyModel) -> None:
    tokens = make_tokens(40)
    kv = HFPrefillSource(model_dir, model=shared).kv(tokens, 10, 30, {})
    assert kv is not None
    keys, values = kv
    cfg = shared.get().config
    assert len(keys) == len(values) == cfg.num_hidden_layers
    assert tuple(keys[0].shape) == (20, cfg.num_key_value_heads, cfg.head_dim)
    # causal: positions [10, 30) do not depend on tokens after 30
    longer = HFPrefillSource(model_dir, model=shared).kv(tokens + make_tokens(5, 1), 10, 30, {})
    assert longer is not None and max_diff(keys, longer[0]) < 1e-4


def test_head_only_chunk_exact_at_its_own_context_and_moved(
    model_dir: str, shared: LazyModel
) -> None:
    head, mid, chunk = make_tokens(12, 1), make_tokens(20, 2), make_tokens(16, 3)
    exact = HFPrefillSource(model_dir, model=shared)
    naive = HeadOnlyChunkSource(model_dir, model=shared)
    # right after the head: the variant's own context, a re-rotation by 0 -> exact
    p = head + chunk + [5]
    ref, got = exact.kv(p, 12, 28, {}), naive.kv(p, 12, 28, {"head_end": 12})
    assert ref is not None and got is not None
    assert max_diff(ref[0], got[0]) < 1e-4 and max_diff(ref[1], got[1]) < 1e-4
    # after other tokens: layer 0 keys equal the exact ones (they see only their own token,
    # re-rotated to the new position), deeper layers differ (the chunk never saw `mid`)
    q = head + mid + chunk + [5]
    ref, got = exact.kv(q, 32, 48, {}), naive.kv(q, 32, 48, {"head_end": 12})
    assert ref is not None and got is not None
    assert float((ref[0][0] - got[0][0]).abs().max()) < 1e-3
    assert float((ref[0][-1] - got[0][-1]).abs().max()) > 1e-2


@pytest.mark.parametrize("spec", [{}, {"head_end": 13}, {"head_end": -1}, {"head_end": True},
                                  {"head_end": 4, "x": 1}, {"head_end": "4"}])
def test_head_only_chunk_rejects_bad_spec(model_dir: str, spec: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="head_end"):
        HeadOnlyChunkSource(model_dir).kv(make_tokens(30), 12, 20, spec)


def test_hf_prefill_rejects_fields_and_bad_span(model_dir: str) -> None:
    src = HFPrefillSource(model_dir)
    with pytest.raises(ValueError, match="no span fields"):
        src.kv(make_tokens(30), 0, 10, {"variant": "x"})
    with pytest.raises(ValueError, match="outside"):
        src.kv(make_tokens(30), 20, 31, {})


def test_build_sources_registry(tmp_path: Any) -> None:
    built = build_sources(str(tmp_path))
    assert set(built) == set(BUILTIN_SOURCES)
    extra = build_sources(str(tmp_path), {"mine": "craft_rag.kvtiers.kv_sources:HFPrefillSource"})
    assert isinstance(extra["mine"], HFPrefillSource)
    with pytest.raises(ValueError, match="shadows a built-in"):
        build_sources(str(tmp_path), {"hf_prefill": "craft_rag.kvtiers.kv_sources:LazyModel"})
    for bad in ("nocolon", "craft_rag.kvtiers.kv_sources:nope", "os:path.join"):
        with pytest.raises(ValueError, match="kv source"):
            build_sources(str(tmp_path), {"x": bad})
