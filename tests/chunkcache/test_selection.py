"""Count rules and rankers on hand-made variants (no model needed except kv_deviation, tested
in test_blend)."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from craft_rag.chunkcache import (  # noqa: E402
    RANKERS,
    ChunkKV,
    LayerKV,
    RankInput,
    SegmentHash,
    beta_prime,
    cfo,
    cfo_counts,
    fixed_counts,
    get_ranker,
    kendall_distance,
    segment_hash,
    select_tokens,
    select_top,
)


def make_chunk(ids: list[int], *, cci: float = 0.8, prior: tuple[list[int], ...] = (),
               inter: tuple[float, ...] = (), outside: list[float] | None = None) -> ChunkKV:
    n = len(ids)
    kv = LayerKV((torch.zeros(1, n, 4),), (torch.zeros(1, n, 4),), torch.arange(n))
    return ChunkKV(
        model_id="m", token_ids=tuple(ids), kv=kv, context=segment_hash("m", [0]),  # type: ignore[arg-type]
        prior_chunks=tuple(segment_hash("m", p) for p in prior), inter_by_chunk=inter,
        outside_attention=torch.tensor(outside if outside is not None else [0.0] * n),
        cci=cci,
    )


def h(*ids: int) -> SegmentHash:
    return segment_hash("m", list(ids))


def test_kendall_distance_exact() -> None:
    a, b, c = h(1), h(2), h(3)
    assert kendall_distance([a, b, c], [a, b, c]) == 0.0
    assert kendall_distance([a, b, c], [c, b, a]) == 1.0
    assert kendall_distance([a, b, c], [b, a, c]) == pytest.approx(1 / 3)
    assert kendall_distance([a, b], [b, h(9)]) == 0.0  # one common item


def test_beta_prime_paper_cases() -> None:
    # C3 cached after C1 C2 (inter 3 and 1).
    c3 = make_chunk([7, 8], prior=([1], [2]), inter=(3.0, 1.0))
    assert beta_prime(c3, [h(1), h(2)]) == 1.0
    assert beta_prime(c3, [h(4), h(2)]) == pytest.approx(0.25)
    assert beta_prime(c3, [h(5), h(6)]) == 0.0
    assert beta_prime(c3, [h(2), h(1)]) == 0.0  # same set, reversed: gamma = 1
    assert beta_prime(make_chunk([7]), [h(1)]) == 0.0  # independent variant


def test_cfo_and_counts() -> None:
    c = make_chunk(list(range(10)), cci=0.9)
    assert cfo(c, [], 0.5) == pytest.approx(0.45)
    assert cfo(c, [], 5.0) == 1.0
    assert cfo_counts([c], 0.5) == [5]  # ceil(4.5)
    assert cfo_counts([c], 0.0) == [0]
    assert fixed_counts([c, make_chunk([1, 2, 3])], 0.3) == [3, 1]
    assert fixed_counts([c], 1.0) == [10]
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"\[0, 1\]"):
            fixed_counts([c], bad)
    with pytest.raises(ValueError, match="alpha"):
        cfo(c, [], -1.0)


def test_select_top_orders_and_ties() -> None:
    sel = select_top([torch.tensor([0.1, 0.9, 0.5, 0.9]), torch.tensor([1.0, 2.0])], [2, 0])
    assert sel.per_chunk == ((1, 3), ())
    assert sel.total == 2
    with pytest.raises(ValueError, match="counts"):
        select_top([torch.zeros(2)], [1, 1])


def test_rankers_registry_and_rules() -> None:
    assert sorted(RANKERS) == ["cci", "kv_deviation", "random"]
    with pytest.raises(ValueError, match=r"\['cci', 'kv_deviation', 'random'\]"):
        get_ranker("attention")
    c = make_chunk(list(range(6)), outside=[0.0, 5.0, 1.0, 4.0, 2.0, 3.0], cci=0.6)
    inp = RankInput(model=None, assembled=c.kv, chunks=(c,), spans=((0, 6),), seed=3)
    assert select_tokens("cci", inp, fraction=0.5).per_chunk == ((1, 3, 5),)
    assert select_tokens("cci", inp, alpha=1.0).per_chunk == ((1, 3, 4, 5),)  # ceil(3.6)
    r1 = select_tokens("random", inp, fraction=0.5)
    assert r1 == select_tokens("random", inp, fraction=0.5)  # seeded
    assert r1.total == 3 and len(set(r1.per_chunk[0])) == 3
    with pytest.raises(ValueError, match="exactly one"):
        select_tokens("cci", inp)
    with pytest.raises(ValueError, match="exactly one"):
        select_tokens("cci", inp, fraction=0.1, alpha=1.0)
    assert math.isclose(c.cci, 0.6)
