"""RoPE re-rotation: a chunk with no outside context, prefilled at position P and moved to Q,
equals the same tokens prefilled from scratch at Q (explicit position_ids)."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

torch = pytest.importorskip("torch")

from craft_rag.chunkcache import LayerKV, RopeSpec, from_hf_cache, rerotate_keys  # noqa: E402

TOKENS = [504, 3458, 314, 260, 1345, 28, 9070, 216, 1073, 30, 11237, 5, 339, 4713, 41, 2580]


def prefill_at(model: Any, ids: list[int], start: int) -> LayerKV:
    """HF's own forward with the tokens at positions start, start+1, ..."""
    pos = torch.arange(start, start + len(ids))
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), position_ids=pos[None], use_cache=True)
    return from_hf_cache(out.past_key_values, pos)


@pytest.mark.parametrize(("p", "q"), [(0, 37), (120, 5), (3, 1000)])
def test_moved_chunk_equals_prefill_at_new_position(model: Any, p: int, q: int) -> None:
    """Only relative positions reach attention, so the hidden states are identical and the keys
    differ exactly by the rotation R(q - p)."""
    rope = RopeSpec.from_config(model.config)
    at_p = prefill_at(model, TOKENS, p)
    at_q = prefill_at(model, TOKENS, q)
    moved = at_p.moved_to(q, rope)
    assert torch.equal(moved.positions, at_q.positions)
    for layer in range(len(at_q.keys)):
        assert torch.allclose(moved.keys[layer], at_q.keys[layer], atol=2e-4, rtol=1e-4)
        assert torch.allclose(moved.values[layer], at_q.values[layer], atol=2e-4, rtol=1e-4)
    # The test can fail: an off-by-one shift or the inverse rotation is far off.
    for wrong in (q - p + 1, p - q):
        bad = rerotate_keys(at_p.keys[-1], wrong, rope)
        assert not torch.allclose(bad, at_q.keys[-1], atol=1e-2)


def test_head_plus_chunk_shifted_together(model: Any) -> None:
    """The system-prompt-only variant: head + chunk prefilled at 0 and moved as a whole."""
    rope = RopeSpec.from_config(model.config)
    ids = [1, 9690, 198, *TOKENS]
    moved = prefill_at(model, ids, 0).moved_to(250, rope)
    ref = prefill_at(model, ids, 250)
    assert max(float((a - b).abs().max()) for a, b in zip(moved.keys, ref.keys, strict=True)) < 2e-4


def test_per_token_delta_and_round_trip() -> None:
    rope = RopeSpec(inv_freq=1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8)),
                    rope_type="default")
    k = torch.randn(2, 5, 8)
    delta = torch.tensor([0, 1, 2, 3, 4])
    there = rerotate_keys(k, delta, rope)
    assert torch.allclose(rerotate_keys(there, -delta, rope), k, atol=1e-5)
    assert torch.allclose(there[:, 0], k[:, 0])
    # Rotations preserve norms.
    assert torch.allclose(there.norm(dim=-1), k.norm(dim=-1), atol=1e-5)


def test_bad_inputs() -> None:
    rope = RopeSpec(inv_freq=torch.ones(4), rope_type="default")
    with pytest.raises(ValueError, match="head_dim"):
        rerotate_keys(torch.zeros(1, 3, 6), 1, rope)
    with pytest.raises(ValueError, match="one per token"):
        rerotate_keys(torch.zeros(1, 3, 8), torch.tensor([1, 2]), rope)

    class Cfg:
        rope_parameters: ClassVar[dict[str, object]] = {"rope_type": "dynamic"}

    with pytest.raises(ValueError, match="supported"):
        RopeSpec.from_config(Cfg())
