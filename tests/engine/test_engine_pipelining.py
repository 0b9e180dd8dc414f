"""Speculative prefill over a real ``CraftEngine`` and planner with the fake backend
(:mod:`craft_rag.engine.pipelining`): speculations are prefill-only requests that commit
nothing, a restart aborts the stale one, a stable set's speculation is reused by the final
request (same plan, same prompt, served from the prefix cache), the queue gate holds, and the
final request is exactly the non-pipelined one."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence

import pytest

from craft_rag.chunk import Chunk
from craft_rag.engine.engine import CraftEngine
from craft_rag.engine.pipelining import SpeculativePrefill
from craft_rag.engine.results import RagRequest, SamplingRequest
from craft_rag.testing import FakeBackend, make_chunks

MakeEngine = Callable[..., tuple[CraftEngine, FakeBackend]]
QUESTION = "Which document names the river?"
SAMPLING = SamplingRequest(max_tokens=3)

POOL = make_chunks(6, words=40, prefix="doc")
A, B, C, D, E, F = POOL


def speculative(backend: FakeBackend) -> list[tuple[int, ...]]:
    """Prompts the backend got as prefill-only (max_tokens=1) requests."""
    return [ids for _, ids, s in backend.added if s.max_tokens == 1]


def state(engine: CraftEngine) -> dict[str, object]:
    """What the planner learned (CA-Table, CP-Tree, conversations); the clock's readings and
    the count of plans made aside."""
    saved = engine.planner.to_json()
    for node in saved["prefix_tree"]["nodes"]:
        del node["last_access"]
    return {k: v for k, v in saved.items() if k != "stats"}


def test_restart_commits_only_the_final_request(make_fake_engine: MakeEngine) -> None:
    engine, backend = make_fake_engine()
    baseline, _ = make_fake_engine()
    stages = [[A, B, C], [A, B, D], [B, D, A], [A, B, D]]
    out = SpeculativePrefill(engine).run(stages, QUESTION, sampling=SAMPLING)
    report = out.report
    assert (report.speculations, report.restarts, report.reused) == (2, 1, True)
    assert len(speculative(backend)) == 2
    assert engine.planner.stats.commits == 1  # the final request only
    assert engine.planner.waiting() == 0  # no speculative plan left behind
    engine.planner.check_invariants()
    # The non-pipelined request: same prompt, same reply, same planner state afterwards.
    expected = baseline.generate([A, B, D], QUESTION, sampling=SAMPLING)
    assert out.result.prompt_token_ids == expected.prompt_token_ids
    assert out.result.token_ids == expected.token_ids
    assert state(engine) == state(baseline)
    assert out.chunks == (A, B, D)
    # The aborted speculation's prompt ran past the shared prefix: wasted tokens are reported.
    assert 0 < report.wasted_tokens < len(speculative(backend)[0])


def test_a_stable_set_is_prefilled_once_and_reused(make_fake_engine: MakeEngine) -> None:
    engine, backend = make_fake_engine()
    out = SpeculativePrefill(engine).run([[C, A], [A, C], [C, A]], QUESTION, sampling=SAMPLING)
    (spec_prompt,) = speculative(backend)
    assert out.report.restarts == 0 and out.report.reused and out.report.wasted_tokens == 0
    assert out.result.prompt_token_ids == spec_prompt
    # Served from the speculation's blocks: every full block but the last partial one.
    block = backend.block_size
    assert out.result.report.cached_tokens == (len(spec_prompt) - 1) // block * block > 0
    assert engine.planner.stats.commits == 1


def test_known_last_stage_goes_straight_to_the_final_request(
    make_fake_engine: MakeEngine,
) -> None:
    engine, backend = make_fake_engine()
    out = SpeculativePrefill(engine).run([[A, B], [E, F]], QUESTION, total=2, sampling=SAMPLING)
    assert len(speculative(backend)) == 1 and out.report.restarts == 1
    assert not out.report.reused
    assert [s.max_tokens for _, _, s in backend.added] == [1, SAMPLING.max_tokens]
    assert out.chunks == (E, F) and engine.planner.stats.commits == 1


def test_the_queue_gate_holds_speculation_back(make_fake_engine: MakeEngine) -> None:
    gate = threading.Event()
    engine, backend = make_fake_engine(FakeBackend(step_gate=gate, max_model_len=2048))
    # Two other requests in flight (the backend steps only when the gate opens).
    others = [
        engine.submit(RagRequest(make_chunks(1, prefix=f"o{i}"), "Q?", sampling=SAMPLING))
        for i in range(2)
    ]
    assert engine.requests_in_flight == 2

    def stages() -> Iterator[Sequence[Chunk]]:
        yield [A, B]
        yield [A, C]
        gate.set()  # the engine may step again: the final request gets served

    pipelined = SpeculativePrefill(engine, max_in_flight=1)
    out = pipelined.run(stages(), QUESTION, sampling=SAMPLING)
    assert speculative(backend) == []
    assert (out.report.speculations, out.report.gated) == (0, 2)
    for handle in others:
        handle.result()
    assert engine.planner.stats.commits == 3


def test_disabled_is_search_then_serve(make_fake_engine: MakeEngine) -> None:
    engine, backend = make_fake_engine()
    out = SpeculativePrefill(engine, enabled=False).run([[A], [B]], QUESTION, sampling=SAMPLING)
    assert speculative(backend) == [] and out.chunks == (B,)
    assert out.report.non_overlapped_search_s == out.report.search_s


def test_a_failing_search_leaves_no_trace(make_fake_engine: MakeEngine) -> None:
    engine, backend = make_fake_engine()
    before = state(engine)

    def stages() -> Iterator[Sequence[Chunk]]:
        yield [A, B]
        yield [C, D]
        raise OSError("the index went away")

    with pytest.raises(OSError, match="went away"):
        SpeculativePrefill(engine).run(stages(), QUESTION, sampling=SAMPLING)
    assert len(speculative(backend)) == 2
    assert engine.planner.stats.commits == 0 and engine.planner.waiting() == 0
    assert state(engine) == before
    assert engine.requests_in_flight == 0


def test_prepare_hands_the_kept_plan_to_the_caller(make_fake_engine: MakeEngine) -> None:
    engine, backend = make_fake_engine()
    out = SpeculativePrefill(engine).prepare([[A, B], [C, D], [D, C]], QUESTION)
    plan = out.result
    assert out.report.restarts == 1 and out.report.reused
    assert engine.planner.is_pending(plan) and engine.planner.stats.commits == 0
    assert [c.key for c in plan.ordered] == [C.key, D.key]  # the speculation's order
    served = engine.generate(list(plan.ordered), QUESTION, plan=plan, sampling=SAMPLING)
    assert served.prompt_token_ids == speculative(backend)[-1]
    assert served.report.cached_tokens > 0 and engine.planner.stats.commits == 1
    # No speculation kept: a new pending plan for the final set.
    fresh = SpeculativePrefill(engine).prepare([[A], [E]], QUESTION, total=2).result
    assert engine.planner.is_pending(fresh) and [c.key for c in fresh.ordered] == [E.key]
    assert engine.planner.abort(fresh) and engine.planner.waiting() == 0


def test_bad_input(make_fake_engine: MakeEngine) -> None:
    engine, _ = make_fake_engine()
    with pytest.raises(ValueError, match="CraftEngine"):
        SpeculativePrefill(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_in_flight"):
        SpeculativePrefill(engine, max_in_flight=-1)
    with pytest.raises(ValueError, match="question"):
        SpeculativePrefill(engine).run([[A]], "  ")
    with pytest.raises(ValueError, match=r"craft_rag\.Chunk"):
        SpeculativePrefill(engine).run([["not a chunk"]], QUESTION)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="no stage"):
        SpeculativePrefill(engine).run([], QUESTION)


@pytest.mark.engine
def test_real_engine_restart_and_reuse(craft_engine: CraftEngine) -> None:
    """The shared vLLM engine (tiny prompts, 2 reply tokens): a restart commits only the final
    request, which is served from the kept speculation's prefill and answers exactly as the
    non-pipelined request does."""
    from craft_rag.chunk import make_chunk
    from craft_rag.planner import CraftPlanner, PlannerConfig

    def fresh() -> None:
        craft_engine.set_planner(CraftPlanner(PlannerConfig(policy="tree")))
        craft_engine.reset_prefix_cache()

    loire = make_chunk("The Loire river flows west past old castles and vineyards.", id="loire")
    curie = make_chunk("Marie Curie won Nobel prizes in physics and in chemistry.", id="curie")
    alps = make_chunk(
        "Mont Blanc is the highest mountain of the Alps, on the French side.", id="alps"
    )
    question = "Which river flows west?"
    sampling = SamplingRequest(max_tokens=2)
    fresh()
    out = SpeculativePrefill(craft_engine).run(
        [[loire, curie], [alps, loire], [alps, loire]], question, sampling=sampling
    )
    assert (out.report.speculations, out.report.restarts, out.report.reused) == (2, 1, True)
    assert craft_engine.planner.stats.commits == 1 and craft_engine.planner.waiting() == 0
    block = craft_engine.block_size
    prompt = out.result.prompt_token_ids
    assert out.result.report.cached_tokens == (len(prompt) - 1) // block * block > 0
    fresh()
    expected = craft_engine.generate([alps, loire], question, sampling=sampling)
    assert expected.report.cached_tokens == 0
    assert (prompt, out.result.token_ids) == (expected.prompt_token_ids, expected.token_ids)
