"""Selective recomputation against the reference: all tokens recomputed == full prefill (HF's own
forward); none recomputed == naive concatenation of moved caches."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from craft_rag.chunkcache import (  # noqa: E402
    RankInput,
    Selection,
    assemble,
    blend_prefill,
    compute_chunk_kv,
    continue_greedy,
    full_prefill,
    select_tokens,
)

HEAD = [1, 9690, 198, 5248, 1183, 253, 5356, 11173, 30]
C1 = [504, 3458, 314, 260, 1345, 28, 9070, 216, 1073, 30, 11237, 5]
C2 = [339, 4713, 41, 2580, 1000, 2001, 17, 88]


def max_diff(a: Any, b: Any) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def parts(model: Any) -> tuple[Any, Any, Any]:
    head_kv = full_prefill(model, HEAD)
    # Each chunk in its own context (the independent variant); reused in the order C2, C1.
    c1 = compute_chunk_kv(model, HEAD, C1, model_id="smollm2")
    c2 = compute_chunk_kv(model, HEAD, C2, model_id="smollm2")
    return head_kv, c1, c2


def test_all_selected_equals_full_prefill(model: Any, parts: Any) -> None:
    head_kv, c1, c2 = parts
    full = full_prefill(model, HEAD + C2 + C1)
    everything = Selection((tuple(range(len(C2))), tuple(range(len(C1)))))
    out = blend_prefill(model, HEAD, head_kv, [c2, c1], everything)
    assert out.token_ids == tuple(HEAD + C2 + C1)
    assert out.recomputed == len(C1) + len(C2)
    assert max_diff(out.kv.keys, full.keys) < 1e-4
    assert max_diff(out.kv.values, full.values) < 1e-4


def test_none_selected_equals_naive_reuse(model: Any, parts: Any) -> None:
    head_kv, c1, c2 = parts
    naive = assemble(model, HEAD, head_kv, [c2, c1])
    out = blend_prefill(model, HEAD, head_kv, [c2, c1], Selection(((), ())))
    assert max_diff(out.kv.keys, naive.kv.keys) == 0.0
    # Naive reuse is approximate: C1 never saw C2, so the test above is not vacuous.
    full = full_prefill(model, HEAD + C2 + C1)
    assert max_diff(naive.kv.keys, full.keys) > 1e-2
    # The first chunk after the head had the head as its only context: exact after the move.
    span = slice(len(HEAD), len(HEAD) + len(C2))
    assert max(float((a[:, span] - b[:, span]).abs().max())
               for a, b in zip(naive.kv.keys, full.keys, strict=True)) < 2e-4


def test_partial_selection_moves_towards_full(model: Any, parts: Any) -> None:
    head_kv, c1, c2 = parts
    full = full_prefill(model, HEAD + C2 + C1)
    inp = RankInput(model, assemble(model, HEAD, head_kv, [c2, c1]).kv, (c2, c1),
                    ((9, 17), (17, 29)))
    errs = []
    for fraction in (0.0, 0.5, 1.0):
        sel = select_tokens("kv_deviation", inp, fraction=fraction)
        out = blend_prefill(model, HEAD, head_kv, [c2, c1], sel)
        errs.append(max_diff(out.kv.values[-1:], full.values[-1:]))
    assert errs[0] > errs[2] and errs[2] < 1e-4


def test_continuation_matches_hf_on_full_kv(model: Any) -> None:
    ids = HEAD + C1
    tail = [28, 1183, 30]
    cont = continue_greedy(model, full_prefill(model, ids), tail, 4)
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids + tail])).logits[0, -1]
    assert torch.allclose(cont.first_logits, ref, atol=1e-3)
    assert cont.tokens[0] == int(ref.argmax())
    assert len(cont.tokens) == 4


def test_bad_inputs(model: Any, parts: Any) -> None:
    head_kv, c1, c2 = parts
    with pytest.raises(ValueError, match="selection has 1 chunks"):
        blend_prefill(model, HEAD, head_kv, [c1, c2], Selection(((),)))
    with pytest.raises(ValueError, match="out of range"):
        blend_prefill(model, HEAD, head_kv, [c1], Selection(((len(C1),),)))
    with pytest.raises(ValueError, match="head_kv"):
        assemble(model, HEAD[:-1], head_kv, [c1])
    with pytest.raises(ValueError, match="empty"):
        compute_chunk_kv(model, HEAD, [], model_id="smollm2")
