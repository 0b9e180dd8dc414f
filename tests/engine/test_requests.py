"""The one request entry point against a fake backend: request kinds, ``SamplingRequest.
with_overrides``, and ``CraftEngine.submit``'s handle (result, iteration, async iteration,
abort) for each kind."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import pytest

from craft_rag.engine import (
    SAMPLING_KEYWORDS,
    EngineRequest,
    MessagesRequest,
    RagRequest,
    RequestCancelled,
    RequestHandle,
    SamplingRequest,
    TokensRequest,
)
from craft_rag.engine.engine import CraftEngine
from craft_rag.planner import CraftPlanner
from craft_rag.testing import FakeBackend, make_chunks

Factory = Callable[..., tuple[CraftEngine, FakeBackend]]
KINDS = ("rag", "messages", "tokens")


def make_request(
    kind: str, max_tokens: int = 3, conversation_id: str | None = None
) -> EngineRequest:
    sampling = SamplingRequest(max_tokens=max_tokens)
    if kind == "rag":
        return RagRequest(make_chunks(2), "Which?", conversation_id, sampling=sampling)
    if kind == "messages":
        return MessagesRequest([("user", "Hi there")], sampling=sampling)
    return TokensRequest([5, 6, 7, 8], sampling=sampling)


def commits(engine: CraftEngine) -> int:
    planner = engine.planner
    assert isinstance(planner, CraftPlanner)
    return planner.stats.commits


# ---- SamplingRequest.with_overrides -------------------------------------------------------------


def test_with_overrides_maps_keywords_and_none_keeps_a_field() -> None:
    base = SamplingRequest(max_tokens=8, temperature=0.5, stop=("x",), seed=3)
    out = base.with_overrides(max_tokens=2, top_p=0.9, stop="end", read_prefix_cache=False)
    assert (out.max_tokens, out.top_p, out.stop, out.read_prefix_cache) == (2, 0.9, ("end",), False)
    assert (out.temperature, out.seed) == (0.5, 3)  # untouched
    assert base.with_overrides(max_tokens=None, seed=None) == base
    assert base.with_overrides(stop=["a", "b"], temperature=1).stop == ("a", "b")
    assert set(SAMPLING_KEYWORDS) == {
        "max_tokens",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "read_prefix_cache",
        "extra",
    }


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"beam_width": 3}, r"unsupported call arguments \['beam_width'\].*unknown keyword"),
        ({"max_tokens": True}, "max_tokens must be a number"),
        ({"seed": False}, "seed must be a number"),
        ({"temperature": True}, "temperature must be a number"),
        ({"max_tokens": "4"}, "max_tokens must be a number"),
        ({"read_prefix_cache": 1}, "read_prefix_cache must be a bool"),
        ({"stop": [1]}, "stop must be a string or a list of strings"),
        ({"max_tokens": 0}, "max_tokens must be an int >= 1"),
    ],
)
def test_with_overrides_refuses_bad_keywords(overrides: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingRequest().with_overrides(**overrides)


def test_sampling_refuses_a_bool_max_tokens() -> None:
    with pytest.raises(ValueError, match="max_tokens must be an int >= 1"):
        SamplingRequest(max_tokens=True)


# ---- request kinds are checked when made --------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: RagRequest(make_chunks(1), "  "), "question must be a non-empty string"),
        (lambda: RagRequest("text", "Q?"), "chunks: must be a list"),
        (lambda: RagRequest([], "Q?", conversation_id=7), "conversation_id: must be"),  # type: ignore[arg-type]
        (lambda: RagRequest([], "Q?", cache_salt="a/b"), "cache_salt must be"),
        (lambda: MessagesRequest([]), "messages must be a non-empty sequence"),
        (lambda: MessagesRequest([("user",)]), r"messages\[0\] must be a \(role, text\) pair"),  # type: ignore[list-item]
        (lambda: TokensRequest([]), "token_ids must be a non-empty sequence"),
        (lambda: TokensRequest([1, True]), "ints >= 0"),
        (lambda: TokensRequest([1, -2]), "ints >= 0"),
        (
            lambda: TokensRequest([1], sampling={"max_tokens": 2}),
            "sampling must be a SamplingRequest",
        ),  # type: ignore[arg-type]
    ],
)
def test_request_kinds_refuse_bad_fields(make: Callable[[], object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()


def test_one_shot_iterables_are_read_once() -> None:
    chunks = make_chunks(3)
    request = RagRequest(iter(chunks), "Q?")
    assert request.chunks == tuple(chunks)
    assert MessagesRequest(iter([["user", "Hi"]])).messages == (("user", "Hi"),)
    assert TokensRequest(range(3)).token_ids == (0, 1, 2)


# ---- submit: every kind, every way of reading ---------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_submit_result(make_fake_engine: Factory, kind: str) -> None:
    engine, backend = make_fake_engine()
    handle = engine.submit(make_request(kind, max_tokens=3))
    assert isinstance(handle, RequestHandle)
    result = handle.result()
    assert result.token_ids == (101, 102, 103) and result.text == "t101 t102 t103 "
    assert result.report.request_id == handle.request_id == backend.added[0][0]
    assert handle.done() and handle.result() is result  # cached, committed once
    assert commits(engine) == (1 if kind == "rag" else 0)
    assert result.report.plan_id is not None if kind == "rag" else result.report.plan_id is None
    assert handle.abort() is False  # already finished: nothing to stop


@pytest.mark.parametrize("kind", KINDS)
def test_submit_sync_iteration(make_fake_engine: Factory, kind: str) -> None:
    engine, _ = make_fake_engine()
    handle = engine.submit(make_request(kind, max_tokens=4))
    pieces = list(handle)
    assert [p.token_ids for p in pieces[:-1]] == [(101,), (102,), (103,), (104,)]
    final = pieces[-1].result
    assert final is not None and final.text == "".join(p.text for p in pieces)
    assert handle.result() is final
    assert commits(engine) == (1 if kind == "rag" else 0)


@pytest.mark.parametrize("kind", KINDS)
def test_submit_async_iteration(make_fake_engine: Factory, kind: str) -> None:
    engine, _ = make_fake_engine()

    async def run() -> list[tuple[int, ...]]:
        handle = engine.submit(make_request(kind, max_tokens=3))
        return [p.token_ids async for p in handle]

    assert asyncio.run(run()) == [(101,), (102,), (103,), ()]
    assert commits(engine) == (1 if kind == "rag" else 0)


@pytest.mark.parametrize("kind", KINDS)
def test_submit_abort_commits_nothing(make_fake_engine: Factory, kind: str) -> None:
    engine, backend = make_fake_engine(FakeBackend(step_delay=0.01))
    handle = engine.submit(make_request(kind, max_tokens=400, conversation_id="c"))
    assert handle.abort() is True and handle.abort() is False
    assert backend.aborted == [handle.request_id] and not backend.running
    with pytest.raises(RequestCancelled):
        handle.result()
    with pytest.raises(RequestCancelled):
        list(handle)  # iterating after abort ends in the same error, no pieces
    assert commits(engine) == 0
    if kind == "rag":  # the conversation was left as it was: the next turn is its first
        again = engine.submit(make_request(kind, max_tokens=1, conversation_id="c")).result()
        assert again.report.turn == 1 and commits(engine) == 1


def test_closing_an_iteration_early_aborts(make_fake_engine: Factory) -> None:
    engine, backend = make_fake_engine(FakeBackend(step_delay=0.01))
    pieces: Iterator[object] = iter(engine.submit(make_request("rag", max_tokens=50)))
    next(pieces)
    pieces.close()  # type: ignore[attr-defined]
    assert backend.aborted and commits(engine) == 0

    async def run() -> None:
        handle = engine.submit(make_request("tokens", max_tokens=50))
        agen = handle.__aiter__()
        await anext(agen)
        await agen.aclose()
        assert handle.abort() is False  # the close already aborted it

    asyncio.run(run())
    assert len(backend.aborted) == 2


def test_submit_refuses_other_objects_and_starts_nothing(make_fake_engine: Factory) -> None:
    engine, backend = make_fake_engine()
    with pytest.raises(ValueError, match="submit takes a RagRequest, MessagesRequest or"):
        engine.submit(("user", "Hi"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_model_len"):
        engine.submit(TokensRequest([1] * 500, sampling=SamplingRequest(max_tokens=20)))
    assert backend.added == []


def test_generate_batch_sampling_replaces_each_requests_own(make_fake_engine: Factory) -> None:
    engine, backend = make_fake_engine()
    own = SamplingRequest(max_tokens=1)
    requests = [RagRequest(make_chunks(1, prefix=f"b{i}"), "Q?", sampling=own) for i in range(2)]
    assert [len(r.token_ids) for r in engine.generate_batch(requests)] == [1, 1]
    assert [len(r.token_ids) for r in engine.generate_batch(requests, max_tokens=2)] == [2, 2]
    assert {s.max_tokens for _, _, s in backend.added} == {1, 2}


def test_aresult_waits_without_blocking_the_loop(make_fake_engine: Factory) -> None:
    engine, _ = make_fake_engine(FakeBackend(step_delay=0.01))

    async def run() -> tuple[int, int]:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.005)

        ticker = asyncio.create_task(tick())
        result = await engine.submit(make_request("rag", max_tokens=5)).aresult()
        ticker.cancel()
        return len(result.token_ids), ticks

    produced, ticks = asyncio.run(run())
    assert produced == 5 and ticks >= 3  # the loop ran while the engine decoded
    assert commits(engine) == 1


@pytest.mark.parametrize("kind", KINDS)
def test_prompt_token_ids_are_known_at_submission(make_fake_engine: Factory, kind: str) -> None:
    engine, backend = make_fake_engine(FakeBackend(step_delay=0.01))
    handle = engine.submit(make_request(kind, max_tokens=50, conversation_id="p"))
    ids = handle.prompt_token_ids
    assert ids == tuple(backend.added[-1][1]) and not handle.done()  # before generation ends
    assert handle.abort() and handle.prompt_token_ids == ids  # still readable after abort
    done = engine.submit(make_request(kind, max_tokens=1))
    assert done.result().prompt_token_ids == done.prompt_token_ids
