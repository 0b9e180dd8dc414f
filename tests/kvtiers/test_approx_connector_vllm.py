"""CraftApproxConnector on the real in-process vLLM CPU engine: injected KV, isolation, refusals.

One engine (own process, :func:`craft_rag.testing.rerun_in_own_process`) covers: KV from the
transformers copy of the model gives vLLM's own greedy answer; deliberately perturbed KV changes
the answer but never reaches another request (no prefix hit from its blocks, nothing written to
the tiers); a request-scoped request's exact prefix comes from the tiers; bad requests (no
scoped salt, unknown source, missing variant, wrong model, a span over the last token) are
computed normally and say why; chunk spans served from chunk-caches (kvtiers.blend_source): new
chunks computed in full (vLLM's answer), reordered ones reused fixed with 30% recomputed, and their
approximate KV never an exact hit for another request.
"""

from __future__ import annotations

import random
import sys
import time
from typing import Any

import pytest

from craft_rag.testing import rerun_in_own_process

pytestmark = pytest.mark.engine

BLOCK = 32
PROMPT_LEN = 200
MIB = 1 << 20


def make_prompt(seed: int, n: int = PROMPT_LEN) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(n)]


def make_llm() -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from craft_rag.engine.cpu_dtype import default_dtype
    from craft_rag.engine.model import resolve_model

    extra = {"ram_bytes": 256 * MIB,
             "kv_sources": {"noisy": "approx_sources:NoisySource",
                            "missing": "approx_sources:MissingSource"}}
    return LLM(
        model=resolve_model(None), dtype=default_dtype(), enforce_eager=True, block_size=BLOCK,
        enable_prefix_caching=True, kv_cache_memory_bytes=256 * MIB, max_model_len=1024,
        seed=0, disable_log_stats=True,
        kv_transfer_config=KVTransferConfig(
            kv_connector="CraftApproxConnector",
            kv_connector_module_path="craft_rag.kvtiers.approx_connector",
            kv_role="kv_both", kv_connector_extra_config=extra,
        ),
    )


def run(llm: Any, tokens: list[int], salt: str | None = None,
        approx: dict[str, Any] | None = None,
        harvest: list[tuple[int, int]] | None = None) -> Any:
    from vllm import SamplingParams

    transfer: dict[str, Any] = {}
    if approx is not None:
        transfer["craft_approx"] = approx
    if harvest is not None:
        transfer["craft_chunks"] = {"spans": [list(sp) for sp in harvest]}
    extra = {"kv_transfer_params": transfer} if transfer else None
    params = SamplingParams(max_tokens=12, temperature=0.0, extra_args=extra)
    prompt: dict[str, Any] = {"prompt_token_ids": tokens}
    if salt is not None:
        prompt["cache_salt"] = salt
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    return out


def greedy(out: Any) -> list[int]:
    return list(out.outputs[0].token_ids)


def reuse(out: Any) -> dict[str, Any]:
    from craft_rag.kvtiers.approx_params import reuse_counts_of

    counts = reuse_counts_of(out.kv_transfer_params, prompt_len=len(out.prompt_token_ids))
    assert counts is not None, out.kv_transfer_params
    return counts.to_params()


def span(start: int, end: int, source: str, **spec: Any) -> dict[str, Any]:
    return {"start": start, "end": end, "source": source, **spec}


def test_injected_kv_isolation_and_refusals() -> None:
    if rerun_in_own_process(__file__, "test_injected_kv_isolation_and_refusals", timeout=2400):
        return
    from craft_rag.kvtiers.approx_params import request_scoped_salt

    llm = make_llm()
    last = PROMPT_LEN - 1
    p = make_prompt(1)
    # the from-scratch answer, under a tenant nobody else uses (its blocks serve no one here)
    ref = run(llm, p, salt="reference")
    assert ref.num_cached_tokens == 0

    # (1) KV of the transformers copy, injected: vLLM computes only the last token, same answer
    hf = run(llm, make_prompt(2), salt=request_scoped_salt(),
             approx={"spans": [span(0, last, "hf_prefill")]})
    hf_ref = run(llm, make_prompt(2), salt="reference")
    assert reuse(hf) == {"exact": 0, "fixed": 0, "recomputed": last, "computed": 1,
                         "refused": None}
    assert hf.num_cached_tokens == last
    assert greedy(hf) == greedy(hf_ref)

    # (2) perturbed KV changes the answer (so the checks below can fail) ...
    bad = run(llm, p, salt=request_scoped_salt(),
              approx={"spans": [span(0, last, "noisy", scale=3.0)]})
    assert reuse(bad)["fixed"] == last and reuse(bad)["refused"] is None
    assert greedy(bad) != greedy(ref)
    # ... and a plain request with the same prompt gets no hit from its blocks (pool or tiers)
    plain = run(llm, p)
    assert plain.num_cached_tokens == 0, plain.num_cached_tokens
    assert (plain.kv_transfer_params or {}).get("craft_tiers") == {"ram_tokens": 0,
                                                                   "disk_tokens": 0}
    assert greedy(plain) == greedy(ref)

    # (3) a scoped request's exact prefix comes from the tiers (plain's write-through), the
    # approximate span after it from its source; nothing of it is written to the tiers
    half = 4 * BLOCK
    p2 = p[:half] + make_prompt(4, PROMPT_LEN - half)
    p2_ref = run(llm, p2, salt="reference")
    mixed = run(llm, p2, salt=request_scoped_salt(),
                approx={"spans": [span(half, last, "noisy", scale=3.0)]})
    assert reuse(mixed) == {"exact": half, "fixed": last - half, "recomputed": 0,
                            "computed": 1, "refused": None}
    assert mixed.kv_transfer_params["craft_tiers"]["ram_tokens"] == half
    assert greedy(mixed) != greedy(p2_ref)
    again = run(llm, p2)  # pool: p's exact blocks; no tier block of p2 past them
    assert again.num_cached_tokens == half, again.num_cached_tokens
    assert again.kv_transfer_params["craft_tiers"]["ram_tokens"] == 0
    assert greedy(again) == greedy(p2_ref)

    # (4) refusals: computed normally (same answer as from scratch), with the reason
    q = make_prompt(3)
    q_ref = run(llm, q, salt="reference")
    cases: list[tuple[str | None, dict[str, Any], str]] = [
        (None, {"spans": [span(0, last, "noisy")]}, "request-scoped"),
        ("scoped", {"spans": [span(0, last, "nope")]}, "unknown source"),
        ("scoped", {"spans": [span(0, last, "missing", variant="ab")]}, "no KV"),
        ("scoped", {"model": "other-model", "spans": [span(0, last, "noisy")]}, "wrong model"),
        ("scoped", {"spans": [span(0, PROMPT_LEN, "noisy")]}, "last prompt token"),
        ("scoped", {"spans": [span(0, last, "hf_prefill", variant="x")]}, "no span fields"),
    ]
    for salt, approx, why in cases:
        out = run(llm, q, salt=request_scoped_salt() if salt else None, approx=approx)
        counts = reuse(out)
        assert counts["refused"] is not None and why in counts["refused"], (why, counts)
        assert counts["fixed"] == counts["recomputed"] == 0
        assert greedy(out) == greedy(q_ref), why

    t0 = time.perf_counter()
    chunk_cache_section(llm)
    print(f"chunk-cache section: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    t0 = time.perf_counter()
    harvest_section(llm)
    print(f"harvest section: {time.perf_counter() - t0:.1f} s", file=sys.stderr)


def harvest_section(llm: Any) -> None:
    """(6) an exact request listing its chunks (``craft_chunks``) leaves them as chunk-caches
    read back from its exactly computed blocks (kvtiers.layout_cpu_readback): no forward."""
    from craft_rag.kvtiers.approx_params import request_scoped_salt

    head = make_prompt(20, BLOCK)
    c1, c2 = make_prompt(21, 48), make_prompt(22, 48)
    tail = make_prompt(23, 40)
    s1, s2 = (BLOCK, BLOCK + 48), (BLOCK + 48, BLOCK + 96)

    def chunk_spans(fraction: float) -> dict[str, Any]:
        return {"spans": [span(*s1, "chunk"), span(*s2, "chunk")],
                "blend": {"rule": "kv_deviation", "fraction": fraction}}

    # a bad list is ignored: the request is served exactly as without one
    exact = head + c1 + c2 + tail
    bad = run(llm, head + c2 + c1 + tail, salt="hb", harvest=[(80, 40)])
    assert (bad.kv_transfer_params or {}).get("craft_reuse") is None and len(greedy(bad)) > 0
    first = run(llm, exact, salt="h", harvest=[s1, s2])
    assert first.num_cached_tokens == 0  # computed in full by vLLM
    # the read-back variants are vLLM's K/V of those tokens: compared with the model copy's
    # own prefill of the same prompt (bf16/fp32 and kernel differences only; a wrong
    # unpacking gives unrelated values)
    connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    run(llm, make_prompt(25, 40), salt="h")  # the read-back runs at the next scheduling call
    assert connector.harvested_chunks >= 2
    assembler = connector._assembler
    from craft_rag.chunkcache.blend import full_prefill

    full = full_prefill(assembler._model.get(), exact[:s2[1]])
    for (a, b), ids in ((s1, c1), (s2, c2)):
        (variant,) = assembler.store.variants(assembler.key("chunk", ids, "h"))
        assert not variant.measured and variant.start_position == a
        for got, want in ((variant.kv.keys, full.keys), (variant.kv.values, full.values)):
            for layer in (0, len(got) // 2, len(got) - 1):
                ref = want[layer][:, a:b].float()
                err = float((got[layer] - ref).norm() / ref.norm())
                assert err < 0.05, (layer, err)
    # reordered, with a new tail: re-rotated and fixed (ceil(0.3 x 48) = 15 tokens each)
    moved = head + c2 + c1 + make_prompt(24, 40)
    swapped = run(llm, moved, salt=request_scoped_salt("h"), approx=chunk_spans(0.3))
    assert reuse(swapped) == {"exact": BLOCK, "fixed": 96 - 30, "recomputed": 30,
                              "computed": 40, "refused": None}
    # a chunk inside a span request's exact tier prefix is read back from those blocks when
    # the store lacks it (exact context for the recomputation, no forward for it): here an
    # exact request listed nothing, then a span request puts a new chunk after its first one
    d1, d2 = make_prompt(26, 2 * BLOCK), make_prompt(27, 48)
    run(llm, head + d1 + d2 + tail, salt="g")
    before = connector.harvested_chunks
    d3 = make_prompt(28, 48)  # new: the exact prefix ends with d1 (3 blocks)
    grown = run(llm, head + d1 + d3 + make_prompt(29, 40), salt=request_scoped_salt("g"),
                approx={"spans": [span(BLOCK, 3 * BLOCK, "chunk"),
                                  span(3 * BLOCK, 3 * BLOCK + 48, "chunk")]})
    assert reuse(grown) == {"exact": 3 * BLOCK, "fixed": 0, "recomputed": 48,
                            "computed": 40, "refused": None}
    assert connector.harvested_chunks == before + 1
    (d1_kept,) = assembler.store.variants(assembler.key("chunk", d1, "g"))
    assert not d1_kept.measured and d1_kept.start_position == BLOCK
    # another tenant has no read-back of them: computed in full by the model copy
    other = run(llm, exact, salt=request_scoped_salt("h2"), approx=chunk_spans(0.3))
    assert reuse(other)["fixed"] == 0 and reuse(other)["recomputed"] >= 96


def chunk_cache_section(llm: Any) -> None:
    """(5) chunk spans: the assembler over the connector's chunk-cache store."""
    from craft_rag.kvtiers.approx_params import request_scoped_salt

    head = make_prompt(10, BLOCK)
    c1, c2, c3 = make_prompt(11, 40), make_prompt(12, 40), make_prompt(13, 40)
    tail = make_prompt(14, 20)

    def chunks(*cs: list[int], blend: dict[str, Any] | None = None) -> dict[str, Any]:
        spans, start = [], BLOCK
        for c in cs:
            spans.append(span(start, start + len(c), "chunk"))
            start += len(c)
        return {"spans": spans, **({"blend": blend} if blend is not None else {})}

    # every chunk new: computed in full by the model copy (and stored) -> vLLM's own answer
    first = head + c1 + c2 + c3 + tail
    a = run(llm, first, salt=request_scoped_salt("t"), approx=chunks(c1, c2, c3))
    a_ref = run(llm, first, salt="reference")
    assert reuse(a) == {"exact": 0, "fixed": 0, "recomputed": 152, "computed": 20,
                        "refused": None}
    assert greedy(a) == greedy(a_ref)

    # reordered: head from the head cache, chunks re-rotated, ceil(0.3 x 40) = 12 recomputed each
    second = head + c3 + c1 + c2 + tail
    ask = chunks(c3, c1, c2, blend={"rule": "kv_deviation", "fraction": 0.3})
    b = run(llm, second, salt=request_scoped_salt("t"), approx=ask)
    assert reuse(b) == {"exact": BLOCK, "fixed": 120 - 36, "recomputed": 36, "computed": 20,
                        "refused": None}
    assert b.num_cached_tokens == 152 and len(greedy(b)) > 0
    # (tenants sharing no chunk-cache: tests/chunkcache/test_blend_source.py)

    # isolation: a second request-scoped request with that prompt gets no exact hit from b's
    # approximate blocks (nothing in the tiers; its fixed KV comes from the chunk-caches again)
    again = run(llm, second, salt=request_scoped_salt("t"), approx=ask)
    assert again.kv_transfer_params["craft_tiers"]["ram_tokens"] == 0
    assert reuse(again) == reuse(b)
    # ... and a plain request of the tenant gets no hit at all: computed from scratch
    plain = run(llm, second, salt="t")
    assert plain.num_cached_tokens == 0, plain.num_cached_tokens
    assert plain.kv_transfer_params["craft_tiers"] == {"ram_tokens": 0, "disk_tokens": 0}
