"""``CraftEngine(server=[url, url])`` over two in-process fakes of vLLM's HTTP API (fast; fakes
for unit tests only: the real two-server test is test_routed_real.py). Routing decisions, the
commit on the chosen replica's tree, sticky conversations, re-homing, retry before the first
token, streaming/async/abort, and the probe that lets a replica rejoin."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_server import CHATML, FORMAT, FakeServer, chunks, running

from craft_rag.engine.backends.server.backend import ServerSettings
from craft_rag.engine.backends.server.settings import ServerUnavailable
from craft_rag.engine.chat_format import jinja_renderer
from craft_rag.engine.driver import RequestCancelled
from craft_rag.engine.engine import CraftEngine, EngineSettings
from craft_rag.engine.results import RagRequest, SamplingRequest
from craft_rag.engine.routed_engine import RoutedEngine
from craft_rag.tokenizer import HashingTokenizer


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    return tmp_path


class Fakes:
    """Two fake servers; :meth:`stop` / :meth:`start` one by index (same port on restart)."""

    def __init__(self) -> None:
        self.fakes = [FakeServer(), FakeServer()]
        self.urls: list[str] = []
        self._cms: list[Any] = []
        for fake in self.fakes:
            cm = running(fake)
            self.urls.append(cm.__enter__())
            self._cms.append(cm)

    def stop(self, i: int) -> None:
        self._cms[i].__exit__(None, None, None)
        self._cms[i] = None

    def start(self, i: int) -> None:
        port = int(self.urls[i].rsplit(":", 1)[1])
        self.fakes[i] = FakeServer()
        cm = running(self.fakes[i], port)
        cm.__enter__()
        self._cms[i] = cm

    def close(self) -> None:
        for cm in self._cms:
            if cm is not None:
                cm.__exit__(None, None, None)


@pytest.fixture
def fakes() -> Iterator[Fakes]:
    f = Fakes()
    try:
        yield f
    finally:
        f.close()


def make_routed(urls: list[str], model_dir: Path, **kw: Any) -> CraftEngine:
    settings = [ServerSettings(u, kv_events=False, backoff=0.01, retries=0) for u in urls]
    return CraftEngine(
        EngineSettings(model=model_dir),
        tokenizer=HashingTokenizer(),
        prompt_format=FORMAT,
        chat_renderer=jinja_renderer(CHATML),
        server=settings,
        **kw,
    )


@pytest.fixture
def engine(fakes: Fakes, model_dir: Path) -> Iterator[CraftEngine]:
    e = make_routed(fakes.urls, model_dir)
    try:
        yield e
    finally:
        e.close()


def loads_zero(engine: CraftEngine) -> bool:
    assert isinstance(engine, RoutedEngine)
    return all(load.requests == 0 for load in engine.router.load().values())


def test_one_argument_makes_a_routed_engine(engine: CraftEngine, fakes: Fakes) -> None:
    assert isinstance(engine, RoutedEngine) and isinstance(engine, CraftEngine)
    assert engine.replicas == tuple(fakes.urls)
    assert engine.router.policy.name == "craft_joint"


def test_repeat_goes_to_the_replica_holding_the_chunks_and_commits_there(
    engine: CraftEngine, fakes: Fakes
) -> None:
    assert isinstance(engine, RoutedEngine)
    docs = chunks(4)
    before = [len(f.bodies) for f in fakes.fakes]  # the connect-time probes
    first = engine.generate(docs, "what?", max_tokens=2)
    home = first.report.replica
    assert home in fakes.urls and first.report.cached_tokens == 0
    other = next(u for u in fakes.urls if u != home)
    # Committed to the chosen replica's tree only.
    assert engine.replica_engine(home).planner_for(None).prefix_tree.root.children
    assert not engine.replica_engine(other).planner_for(None).prefix_tree.root.children
    # The same chunks in another order: routed back and reordered to the cached order.
    again = engine.generate(list(reversed(docs)), "and?", max_tokens=2)
    assert again.report.replica == home
    assert again.report.chunk_order == first.report.chunk_order
    assert again.report.cached_tokens > 0 and again.report.reused_chunks == 4
    # Only the chosen server saw the requests.
    served = [len(f.bodies) - b for f, b in zip(fakes.fakes, before, strict=True)]
    assert sorted(served) == [0, 2]
    assert loads_zero(engine)


def test_new_work_is_spread_over_replicas(engine: CraftEngine) -> None:
    replicas = {
        engine.generate(chunks(2, f"set{i}"), "q?", max_tokens=1).report.replica for i in range(6)
    }
    assert len(replicas) == 2


def test_conversation_stays_on_its_replica(engine: CraftEngine) -> None:
    one = engine.generate(chunks(2, "a"), "first?", conversation_id="c1", max_tokens=2)
    for i in range(3):  # other work in between
        engine.generate(chunks(2, f"x{i}"), "q?", max_tokens=1)
    two = engine.generate(chunks(2, "b"), "second?", conversation_id="c1", max_tokens=2)
    assert two.report.replica == one.report.replica
    assert (two.report.turn, two.report.rehomed) == (2, False)
    assert two.report.cached_tokens > 0
    assert engine.turn_count("c1") == 2
    assert engine.end_conversation("c1")
    assert engine.turn_count("c1") == 0


def test_dead_replica_request_is_retried_before_first_token_and_rehomed(
    engine: CraftEngine, fakes: Fakes
) -> None:
    assert isinstance(engine, RoutedEngine)
    one = engine.generate(chunks(3, "a"), "first?", conversation_id="c1", max_tokens=2)
    home = one.report.replica
    assert home is not None
    fakes.stop(fakes.urls.index(home))
    two = engine.generate(chunks(2, "b"), "second?", conversation_id="c1", max_tokens=2)
    other = next(u for u in fakes.urls if u != home)
    assert two.report.replica == other
    assert two.report.retries == 1
    # The history moved with it: the turn goes on there, nothing of it cached.
    assert two.report.rehomed and two.report.turn == 2
    assert engine.turn_count("c1") == 2
    assert engine.replica_engine(home).turn_count("c1") == 0  # dropped on the lost one
    assert not engine.router.replica(home).healthy
    assert engine.router.home("c1") == other
    assert [f.replica for f in engine.faults] == [home]
    # New requests avoid the dead replica without a retry.
    three = engine.generate(chunks(3, "a"), "again?", max_tokens=1)
    assert (three.report.replica, three.report.retries) == (other, 0)
    assert loads_zero(engine)
    # Back on the same port: the probe lets it rejoin empty.
    fakes.start(fakes.urls.index(home))
    assert engine.check_replicas() == [home]
    assert engine.router.replica(home).healthy
    assert not engine.replica_engine(home).planner_for(None).prefix_tree.root.children


def test_rehomed_conversation_keeps_its_history(engine: CraftEngine, fakes: Fakes) -> None:
    """The earlier turns are in the first prompt on the new home (rendered there from the
    carried history), the turn number goes on, and chunks sent before stay deduplicated."""
    assert isinstance(engine, RoutedEngine)
    docs = chunks(3, "a")
    one = engine.generate(docs, "first question?", conversation_id="c1", max_tokens=2)
    home = one.report.replica
    assert home is not None
    first_prompt = fakes.fakes[fakes.urls.index(home)].bodies[-1]["prompt"]
    two = engine.generate(docs[:1], "second?", conversation_id="c1", max_tokens=2)
    assert (two.report.replica, two.report.turn) == (home, 2)
    home_prompt = fakes.fakes[fakes.urls.index(home)].bodies[-1]["prompt"]
    engine.mark_down(home)
    other = next(u for u in fakes.urls if u != home)
    asked = len(fakes.fakes[fakes.urls.index(other)].bodies)
    three = engine.generate(docs[1:] + chunks(1, "b"), "third?", conversation_id="c1", max_tokens=2)
    assert (three.report.replica, three.report.rehomed, three.report.turn) == (other, True, 3)
    bodies = fakes.fakes[fakes.urls.index(other)].bodies
    assert len(bodies) == asked + 1
    prompt = bodies[-1]["prompt"]
    # Turns 1 and 2 (prompts and replies) come first, as on the old home, then turn 3.
    assert prompt[: len(first_prompt)] == first_prompt
    assert prompt[: len(home_prompt)] == home_prompt and len(prompt) > len(home_prompt)
    # Chunks already in the history are not sent again; the new one is.
    assert set(three.report.removed_duplicates) == {c.key for c in docs[1:]}
    assert three.report.chunk_order == (chunks(1, "b")[0].key,)
    # On the new home the history is computed from scratch, then reused by turn 4 there.
    four = engine.generate(chunks(1, "c"), "fourth?", conversation_id="c1", max_tokens=2)
    assert (four.report.replica, four.report.turn, four.report.rehomed) == (other, 4, False)
    assert four.report.cached_tokens >= len(home_prompt) // 2
    assert engine.export_conversation("c1") is not None
    assert engine.replica_engine(home).export_conversation("c1") is None
    with pytest.raises(RuntimeError, match="not supported"):
        engine.import_conversation("c1", engine.export_conversation("c1"))  # type: ignore[arg-type]
    assert loads_zero(engine)


def test_a_replica_refusing_at_the_start_is_marked_down_and_the_next_tried(
    engine: CraftEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert isinstance(engine, RoutedEngine)
    one = engine.generate(chunks(3, "a"), "first?", conversation_id="c1", max_tokens=2)
    home = one.report.replica
    assert home is not None

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise ServerUnavailable("refused at the start")

    monkeypatch.setattr(engine.replica_engine(home), "_start", refuse)
    two = engine.generate(chunks(2, "b"), "second?", conversation_id="c1", max_tokens=2)
    other = next(u for u in engine.replicas if u != home)
    assert (two.report.replica, two.report.retries, two.report.rehomed) == (other, 1, True)
    assert two.report.turn == 2  # its history moved with it
    assert not engine.router.replica(home).healthy
    assert loads_zero(engine)


def test_no_replica_left_raises_the_servers_error(engine: CraftEngine, fakes: Fakes) -> None:
    fakes.stop(0)
    fakes.stop(1)
    with pytest.raises(ConnectionError, match="unreachable"):
        engine.generate(chunks(2), "q?", max_tokens=1)
    with pytest.raises(RuntimeError, match="no healthy replica"):
        engine.generate(chunks(2), "q?", max_tokens=1)
    assert loads_zero(engine)


def test_stream_async_and_abort(engine: CraftEngine) -> None:
    pieces = list(engine.stream(chunks(2), "q?", max_tokens=3))
    assert len(pieces) == 4 and pieces[-1].result is not None
    assert pieces[-1].result.report.replica is not None
    assert "".join(p.text for p in pieces[:-1]) == pieces[-1].result.text

    async def collect() -> list[Any]:
        return [p async for p in engine.astream(chunks(2), "q?", max_tokens=2)]

    apieces = asyncio.run(collect())
    assert apieces[-1].result is not None and apieces[-1].result.report.cached_tokens > 0

    handle = engine.submit(RagRequest(chunks(2, "z"), "q?", conversation_id="cz"))
    handle.abort()
    with pytest.raises(RequestCancelled):
        handle.result()
    assert loads_zero(engine)
    # The aborted turn left nothing in flight: the conversation can go on.
    ok = engine.generate(chunks(2, "z"), "q?", conversation_id="cz", max_tokens=1)
    assert ok.report.turn == 1


def test_prompts_without_chunks_are_routed_and_commit_nothing(engine: CraftEngine) -> None:
    out = engine.generate_tokens([5, 6, 7, 8, 9], max_tokens=2)
    assert out.report.replica is not None and out.report.plan_id is None
    msgs = engine.generate_messages([("user", "hello")], max_tokens=1)
    assert msgs.report.replica is not None
    assert loads_zero(engine)
    assert isinstance(engine, RoutedEngine)
    for rid in engine.replicas:
        assert engine.replica_engine(rid).planner_for(None).waiting() == 0


def test_batch_spreads_and_commits_each(engine: CraftEngine) -> None:
    requests = [RagRequest(chunks(2, f"b{i}"), "q?") for i in range(4)]
    results = engine.generate_batch(requests, sampling=SamplingRequest(max_tokens=1))
    assert len(results) == 4 and all(r.report.replica for r in results)
    assert loads_zero(engine)


def test_bad_arguments(fakes: Fakes, model_dir: Path) -> None:
    with pytest.raises(ValueError, match="same server twice"):
        make_routed([fakes.urls[0], fakes.urls[0]], model_dir)
    with pytest.raises(ValueError, match="routing"):
        CraftEngine(EngineSettings(model=model_dir), server=fakes.urls[0], routing="craft_joint")
    with pytest.raises(ValueError, match="routing policy"):
        make_routed(fakes.urls, model_dir, routing="nope")
    with pytest.raises(ValueError, match="redis://"):  # shared routing needs Redis
        make_routed(fakes.urls, model_dir, store=f"sqlite:///{model_dir}/state.db")
    e = make_routed(fakes.urls, model_dir)
    with contextlib.closing(e):
        with pytest.raises(RuntimeError, match="own planner"):
            e.planner_for(None)
        with pytest.raises(ValueError, match="plan="):
            e.generate(chunks(2), "q?", plan="plan-1", max_tokens=1)
        assert loads_zero(e)


def test_concurrent_requests_survive_a_replica_loss(engine: CraftEngine, fakes: Fakes) -> None:
    assert isinstance(engine, RoutedEngine)
    warm = [engine.generate(chunks(2, f"w{i}"), "q?", max_tokens=1) for i in range(4)]
    assert {w.report.replica for w in warm} == set(fakes.urls)
    fakes.stop(0)
    # The same chunk sets again, all submitted before any is waited for: those routed to the
    # dead replica (their chunks are cached there) are retried on the live one, those routed
    # after the first failure marked it down go to the live one at once; none fails.
    requests = [RagRequest(chunks(2, f"w{i}"), "again?") for i in range(4)]
    results = engine.generate_batch(requests, sampling=SamplingRequest(max_tokens=2))
    assert {r.report.replica for r in results} == {fakes.urls[1]}
    lost = sum(w.report.replica == fakes.urls[0] for w in warm)
    assert 1 <= sum(r.report.retries for r in results) <= lost
    assert loads_zero(engine)
    engine.router._check_invariants()
