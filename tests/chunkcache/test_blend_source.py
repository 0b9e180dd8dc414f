"""The chunk-cache assembler (kvtiers.blend_source) against the reference blend_prefill on the real
SmolLM2: same K/V given the same variants and selection; new chunks computed in full and stored;
counts; tenants isolated; the bounded store."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from craft_rag.chunkcache import (  # noqa: E402
    RANKERS,
    RankInput,
    Selection,
    assemble,
    blend_prefill,
    compute_chunk_kv,
    full_prefill,
    select_tokens,
)
from craft_rag.kvtiers.approx_params import BLEND_RULES, BlendParams  # noqa: E402
from craft_rag.kvtiers.blend_source import (  # noqa: E402
    BlendAssembler,
    CacheKey,
    ChunkCacheStore,
)
from craft_rag.kvtiers.kv_sources import LazyModel  # noqa: E402

HEAD = [1, 9690, 198, 5248, 1183, 253, 5356, 11173, 30]
C1 = [504, 3458, 314, 260, 1345, 28, 9070, 216, 1073, 30, 11237, 5]
C2 = [339, 4713, 41, 2580, 1000, 2001, 17, 88]
C3 = [2201, 355, 4711, 9, 618, 30, 77, 1290, 45, 6]
TAIL = [1812, 42]


def max_diff(a: Any, b: Any) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def spans_of(*chunks: list[int]) -> list[tuple[int, int]]:
    out, start = [], len(HEAD)
    for c in chunks:
        out.append((start, start + len(c)))
        start += len(c)
    return out


@pytest.fixture()
def assembler(model: Any) -> BlendAssembler:
    return BlendAssembler("smollm2", LazyModel("unused", loaded=model))


def test_rules_match_rankers() -> None:
    assert set(BLEND_RULES) == set(RANKERS)


def test_new_chunks_are_a_full_prefill_and_stored(model: Any, assembler: BlendAssembler) -> None:
    prompt = HEAD + C1 + C2 + TAIL
    out = assembler.assemble(prompt, spans_of(C1, C2), BlendParams(), "t")
    full = full_prefill(model, HEAD + C1 + C2)
    assert out.missing == (True, True) and not out.head_cached
    assert max_diff(out.kv.keys, full.keys) < 1e-4
    assert max_diff(out.kv.values, full.values) < 1e-4
    # every chunk token and the head were computed by the connector
    assert out.counts(0) == (0, 0, len(HEAD) + len(C1) + len(C2))
    assert out.counts(len(HEAD) + 3) == (0, 0, len(C1) + len(C2) - 3)
    # both chunks and the head are stored; C2's variant is its K/V in this context, with a CCI
    (v2,) = assembler.store.variants(assembler.key("chunk", C2, "t"))
    assert 0.0 < v2.cci < 1.0 and v2.prior_chunks == (assembler.key("chunk", C1, "t").segment,)
    span = slice(len(HEAD) + len(C1), len(HEAD) + len(C1) + len(C2))
    assert max_diff(v2.kv.keys, [k[:, span] for k in full.keys]) < 1e-4
    # its statistics equal compute_chunk_kv's for the same context (same attention pass)
    ref = compute_chunk_kv(model, HEAD, C2, prior_chunks=[C1], model_id="smollm2")
    assert v2.cci == pytest.approx(ref.cci, rel=1e-4)
    assert float((v2.outside_attention - ref.outside_attention).abs().max()) < 1e-4


@pytest.mark.parametrize("rule", ["kv_deviation", "cci"])
def test_reuse_equals_reference_blend(model: Any, assembler: BlendAssembler, rule: str) -> None:
    assembler.assemble(HEAD + C1 + C2 + TAIL, spans_of(C1, C2), BlendParams(), "t")
    v1 = assembler.store.variants(assembler.key("chunk", C1, "t"))[0]
    v2 = assembler.store.variants(assembler.key("chunk", C2, "t"))[0]
    # reordered, plus a chunk never seen: C2 C1 C3
    spans = spans_of(C2, C1, C3)
    params = BlendParams(rule=rule, fraction=0.3)
    out = assembler.assemble(HEAD + C2 + C1 + C3 + TAIL, spans, params, "t")
    assert out.head_cached and out.missing == (False, False, True)

    # the reference: blend_prefill over the same variants (C3: any variant, it is all selected)
    head_kv = full_prefill(model, HEAD)
    v3 = compute_chunk_kv(model, HEAD, C3, model_id="smollm2")
    chunks = [v2, v1, v3]
    inp = RankInput(model, assemble(model, HEAD, head_kv, chunks).kv, tuple(chunks),
                    tuple(spans))
    sel = select_tokens(rule, inp, fraction=0.3)
    sel = Selection((*sel.per_chunk[:2], tuple(range(len(C3)))))
    assert out.selection == sel
    assert [len(p) for p in sel.per_chunk] == [3, 4, len(C3)]
    ref = blend_prefill(model, HEAD, head_kv, chunks, sel)
    assert max_diff(out.kv.keys, ref.kv.keys) < 1e-5
    assert max_diff(out.kv.values, ref.kv.values) < 1e-5
    # approximate (C1 never saw C2), so the comparison above is not vacuous
    full = full_prefill(model, HEAD + C2 + C1 + C3)
    assert max_diff(out.kv.values, full.values) > 1e-3
    n = len(C1) + len(C2)
    assert out.counts(0) == (len(HEAD), n - 7, 7 + len(C3))
    # the new chunk is stored; C1 / C2 keep one variant each (the same context again? no:
    # reused variants are not stored again)
    assert len(assembler.store.variants(assembler.key("chunk", C3, "t"))) == 1
    assert len(assembler.store.variants(assembler.key("chunk", C1, "t"))) == 1


def test_zero_fraction_is_naive_reuse(model: Any, assembler: BlendAssembler) -> None:
    assembler.assemble(HEAD + C1 + C2 + TAIL, spans_of(C1, C2), BlendParams(), "t")
    out = assembler.assemble(HEAD + C2 + C1 + TAIL, spans_of(C2, C1),
                             BlendParams(fraction=0.0), "t")
    assert out.selection.total == 0
    assert out.counts(len(HEAD)) == (0, len(C1) + len(C2), 0)


def test_tenants_do_not_share(assembler: BlendAssembler) -> None:
    assembler.assemble(HEAD + C1 + C2 + TAIL, spans_of(C1, C2), BlendParams(), "a")
    other = assembler.assemble(HEAD + C2 + C1 + TAIL, spans_of(C2, C1), BlendParams(), "b")
    assert other.missing == (True, True) and not other.head_cached
    same = assembler.assemble(HEAD + C2 + C1 + TAIL, spans_of(C2, C1), BlendParams(), "a")
    assert same.missing == (False, False) and same.head_cached


def test_bad_spans(assembler: BlendAssembler) -> None:
    prompt = HEAD + C1 + C2
    for spans in ([], [(5, 5)], [(0, 4), (5, 9)], [(0, len(prompt) + 1)]):
        with pytest.raises(ValueError, match="span"):
            assembler.assemble(prompt, spans, BlendParams(), None)


def test_store_bounds_and_variants(model: Any) -> None:
    v_a = compute_chunk_kv(model, HEAD, C1, model_id="m")
    v_b = compute_chunk_kv(model, HEAD, C1, prior_chunks=[C2], model_id="m")
    size = sum(t.numel() * t.element_size() for t in (*v_a.kv.keys, *v_a.kv.values))
    store = ChunkCacheStore(capacity_bytes=3 * size, variants=2)
    k1 = CacheKey("chunk", "m", "", v_a.chunk_hash)
    assert store.put_variant(k1, v_a) and store.put_variant(k1, v_b)
    assert store.variants(k1) == (v_b, v_a)  # newest first
    # the variant whose old prior chunks match wins; else the newest
    assert store.best_variant(k1, [v_b.prior_chunks[0]]) is v_b
    assert store.best_variant(k1, []) is v_b
    assert store.put_variant(k1, v_a) and store.variants(k1) == (v_a, v_b)  # same context
    # another entry that does not fit with k1: the least recently used (k1) goes
    k2 = CacheKey("chunk", "m", "x", v_a.chunk_hash)
    assert store.put_variant(k2, v_a) and store.used_bytes == 3 * size
    k3 = CacheKey("head", "m", "", v_a.chunk_hash)
    assert store.put_head(k3, v_a.kv)
    assert store.variants(k1) == () and store.head(k3) is v_a.kv and len(store) == 2
    assert not ChunkCacheStore(capacity_bytes=size - 1).put_head(k3, v_a.kv)
    with pytest.raises(ValueError, match="variants"):
        ChunkCacheStore(variants=0)
    with pytest.raises(ValueError, match="chunk_cache_bytes"):
        ChunkCacheStore(capacity_bytes=-1)


def rows_from(kv: Any) -> Any:
    """A fake engine read-back: rows ``[tokens, heads, head]`` of ``kv`` (HF layout)."""

    def rows_of(start: int, end: int) -> Any:
        return ([k[:, start:end].transpose(0, 1) for k in kv.keys],
                [v[:, start:end].transpose(0, 1) for v in kv.values])

    return rows_of


def test_read_back_chunks_are_reused_like_computed_ones(model: Any,
                                                        assembler: BlendAssembler) -> None:
    """Chunks kept from an exactly computed prompt (no forward) serve a reordered request:
    found (not missing), head cached, and the result equals the reference blend over the
    same variants (exact K/V of the first prompt)."""
    prompt = HEAD + C1 + C2 + TAIL
    full = full_prefill(model, prompt)
    assert assembler.keep_read_back(prompt, spans_of(C1, C2), "t", rows_from(full)) == 2
    (v1,) = assembler.store.variants(assembler.key("chunk", C1, "t"))
    assert not v1.measured and v1.prior_chunks == ()
    assert max_diff(v1.kv.keys, [k[:, len(HEAD):len(HEAD) + len(C1)] for k in full.keys]) == 0
    out = assembler.assemble(HEAD + C2 + C1 + TAIL, spans_of(C2, C1), BlendParams(), "t")
    assert out.missing == (False, False) and out.head_cached
    # in place (same position, same head and prior chunks) a read-back variant is exact:
    # nothing recomputed, and the K/V is the full prefill's
    here = assembler.assemble(prompt, spans_of(C1, C2), BlendParams(), "t")
    assert here.missing == (False, False) and here.selection.total == 0
    assert here.counts(len(HEAD)) == (len(C1) + len(C2), 0, 0)  # exact, not "fixed"
    assert max_diff(here.kv.keys, [k[:, :here.end] for k in full.keys]) < 1e-5
    # the cci rule needs attention statistics a read-back variant lacks: treated as missing
    cci = assembler.assemble(HEAD + C2 + C1 + TAIL, spans_of(C2, C1),
                             BlendParams(rule="cci", fraction=0.3), "t")
    assert cci.missing == (True, True)


def test_read_back_skips_what_the_engine_lacks(model: Any, assembler: BlendAssembler) -> None:
    prompt = HEAD + C1 + C2 + TAIL
    full = full_prefill(model, prompt)
    rows = rows_from(full)
    c2 = spans_of(C1, C2)[1]
    kept = assembler.keep_read_back(prompt, spans_of(C1, C2), "t",
                                    lambda s, e: rows(s, e) if (s, e) == c2 else None)
    assert kept == 1
    assert assembler.store.variants(assembler.key("chunk", C1, "t")) == ()
    assert assembler.keep_read_back(prompt, [], "t", rows) == 0
    for spans in ([(5, 5)], [(9, 15), (12, 20)], [(0, len(prompt) + 1)]):
        with pytest.raises(ValueError, match="span"):
            assembler.keep_read_back(prompt, spans, "t", rows)
