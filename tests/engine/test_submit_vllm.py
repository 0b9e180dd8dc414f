"""``CraftEngine.submit`` against the real in-process vLLM engine (session fixture
``craft_engine``): each request kind read through ``result()``, sync iteration and async
iteration gives the same greedy reply, and ``abort()`` commits nothing. Run alone:
``pytest -m engine``."""

from __future__ import annotations

import asyncio

import pytest

from craft_rag.chunk import make_chunk
from craft_rag.engine import (
    CraftEngine,
    EngineRequest,
    MessagesRequest,
    RagRequest,
    RequestCancelled,
    SamplingRequest,
    TokensRequest,
)
from craft_rag.planner import CraftPlanner, PlannerConfig

pytestmark = pytest.mark.engine

SAMPLING = SamplingRequest(max_tokens=3)
CHUNKS = [
    make_chunk("The Loire river flows west past old castles and vineyards.", id="loire"),
    make_chunk("Marie Curie won Nobel prizes in physics and in chemistry.", id="curie"),
]


def requests(engine: CraftEngine) -> dict[str, EngineRequest]:
    ids = engine.tokenizer.encode("The capital of France is")
    return {
        "rag": RagRequest(CHUNKS, "Which river flows west?", sampling=SAMPLING),
        "messages": MessagesRequest([("user", "Name a river in France.")], sampling=SAMPLING),
        "tokens": TokensRequest(ids, sampling=SAMPLING),
    }


@pytest.fixture
def fresh(craft_engine: CraftEngine) -> CraftEngine:
    craft_engine.set_planner(CraftPlanner(PlannerConfig(policy="tree")))
    craft_engine.reset_prefix_cache()
    return craft_engine


def commits(engine: CraftEngine) -> int:
    return engine.planner.stats.commits


@pytest.mark.parametrize("kind", ["rag", "messages", "tokens"])
def test_every_way_of_reading_a_request_gives_the_same_reply(fresh: CraftEngine, kind: str) -> None:
    request = requests(fresh)[kind]
    blocking = fresh.submit(request).result()
    assert len(blocking.token_ids) >= 1 and blocking.report.prompt_tokens > 0
    pieces = list(fresh.submit(request))
    last = pieces[-1].result
    assert last is not None and last.token_ids == blocking.token_ids
    assert "".join(p.text for p in pieces) == last.text == blocking.text

    async def read() -> tuple[int, ...]:
        ids: list[int] = []
        async for piece in fresh.submit(request):
            ids.extend(piece.token_ids)
        return tuple(ids)

    assert asyncio.run(read()) == blocking.token_ids  # greedy: one reply, three readings
    # A repeated prompt is served from the prefix cache: every whole block but the one holding
    # the last prompt token (which vLLM always recomputes).
    report, block = last.report, fresh.block_size
    assert report.cached_tokens == (report.prompt_tokens - 1) // block * block
    # The RAG turn is committed once per reading; the other kinds commit nothing.
    assert commits(fresh) == (3 if kind == "rag" else 0)


@pytest.mark.parametrize("kind", ["rag", "messages", "tokens"])
def test_abort_commits_nothing_and_the_engine_serves_on(fresh: CraftEngine, kind: str) -> None:
    request = requests(fresh)[kind]
    handle = fresh.submit(request)
    assert handle.abort() is True and handle.abort() is False
    with pytest.raises(RequestCancelled):
        handle.result()
    assert commits(fresh) == 0
    assert fresh.submit(request).result().finish_reason in ("length", "stop")
    assert commits(fresh) == (1 if kind == "rag" else 0)
