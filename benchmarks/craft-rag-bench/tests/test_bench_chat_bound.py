"""``craft_rag_bench.bench.chat_bound``: the TTFT fit and the per-layout simulation (pure
arithmetic on synthetic token counts; no engine, no tokenizer)."""

from __future__ import annotations

import pytest

from craft_rag_bench.bench.chat_bound import SYSTEMS, TtftFit, TurnTokens, fit_ttft, simulate

FIT = TtftFit(o=80.0, a=0.7, b=0.0004)


def test_fit_recovers_the_coefficients_of_exact_rows() -> None:
    rows = []
    for cached, new in [(0, 100), (0, 900), (512, 64), (1024, 300), (2048, 64), (300, 1200)]:
        rows.append({"requests": 1, "prompt_tokens": cached + new, "computed_tokens": new,
                     "ttft_ms": FIT.ms(cached, new)})
    rows.append({"requests": 2, "prompt_tokens": 10, "computed_tokens": 10, "ttft_ms": 1e6})
    got = fit_ttft(rows)  # the two-request row is ignored
    assert (got.o, got.a, got.b) == pytest.approx((FIT.o, FIT.a, FIT.b), rel=1e-6)
    with pytest.raises(ValueError, match="at least 3"):
        fit_ttft(rows[:2])


def conv(*turns: tuple[list[str], int]) -> list[TurnTokens]:
    return [TurnTokens(tuple((k, 200) for k in keys), q) for keys, q in turns]


def run(*convs: list[TurnTokens]) -> dict[str, float]:
    res = simulate(list(convs), FIT, head=36, close=5, reply_tokens=16)
    return {s: res.mean(s) for s in SYSTEMS}


def test_all_new_chunks_leave_no_layout_much_below_the_framework() -> None:
    # Every turn retrieves passages never seen: the oracle still computes all chunk tokens.
    m = run(conv((["a", "b"], 20), (["c", "d"], 20), (["e", "f"], 20)))
    assert m["oracle"] <= m["craft3"] <= min(m["append"], m["restart"], m["chunks_first"])
    assert m["lc_history"] / m["oracle"] < 1.15  # only the head and history can be saved
    assert m["restart"] == pytest.approx(m["lc_history"])  # same tokens, head-only cache


def test_repeated_chunks_make_append_and_the_oracle_cheap() -> None:
    # The same passages every turn, in another order each time.
    m = run(conv((["a", "b", "c"], 20), (["c", "a", "b"], 20), (["b", "c", "a"], 20)))
    assert m["append"] < m["restart"]
    assert m["oracle"] <= m["append"]
    assert m["lc_history"] / m["oracle"] > 3  # only the question and a close are new
    # the framework caches its leading chunks too when they repeat in the same order
    same = run(conv((["a", "b", "c"], 20), (["a", "b", "c"], 20), (["a", "b", "c"], 20)))
    assert same["lc_history"] < m["lc_history"] / 3


def test_chunks_first_reuses_the_leading_chunks_of_an_earlier_prompt() -> None:
    # Turn 2 brings back turn 1's first two chunks (in another order) and many new ones.
    c = conv((["a", "b", "x"], 20), (["y", "b", "a", "z", "w"], 20))
    res = simulate([c], FIT, head=36, close=5, reply_tokens=16)
    cf, restart = res.ttft["chunks_first"][0], res.ttft["restart"][0]
    head_cached, lead_cached = 32, (36 + 400) // 32 * 32
    total = 36 + 1000 + (20 + 21) + 20
    assert restart == pytest.approx(FIT.ms(head_cached, total - head_cached))
    assert cf == pytest.approx(FIT.ms(lead_cached, total - lead_cached))
    assert res.turns == 1 and res.chunk_tokens == 1000 and res.new_chunk_tokens == 600
