"""Cache-aware admission behind the router (issue 30 item 1): the router holds no queue (it
routes and returns), so each replica's engine admits; a routed request served with the
router's plan (``plan=decision.plan``) reaches its replica's backend with ``priority=`` the
admission key of that plan's predicted cached tokens (the replica's CP-Tree match)."""

from __future__ import annotations

from typing import cast

from craft_rag.engine import CraftEngine, EngineSettings
from craft_rag.planner import CraftPlanner
from craft_rag.routing import Router, RouterConfig
from craft_rag.scheduling import AdmissionOrder
from craft_rag.testing import FakeBackend, make_chunks, make_fake_engine


def test_routed_requests_carry_their_plans_admission_key() -> None:
    window = 8
    replicas: dict[str, tuple[CraftEngine, FakeBackend]] = {}
    for name in ("r0", "r1"):
        backend = FakeBackend(max_model_len=1024)
        settings = EngineSettings(admission="cache_aware", admission_window=window)
        replicas[name] = (make_fake_engine(backend, settings=settings)[0], backend)
    engines = {name: engine for name, (engine, _) in replicas.items()}
    sources = {name: (lambda salt, e=engine: cast(CraftPlanner, e.planner_for(salt)))
               for name, engine in engines.items()}
    router = Router(list(engines), "craft_joint",
                    RouterConfig(block_size=next(iter(engines.values())).block_size),
                    planner_sources=sources)
    for engine in engines.values():
        engine.set_planner(CraftPlanner(router.planner_config))
    order = AdmissionOrder("cache_aware", window)  # each engine's own: arrivals count there
    docs = make_chunks(4, words=40, seed=3)
    try:
        served: dict[str, int] = {}  # replica -> requests served there (its arrival numbers)
        keys = []
        for i, chunks in enumerate((docs, list(reversed(docs)), docs[:3])):
            decision = router.route(chunks, prompt_tokens=400)
            engine, backend = replicas[decision.replica]
            try:
                result = engine.generate(list(decision.plan.ordered), f"Question {i}?",
                                         plan=decision.plan, max_tokens=2)
            finally:
                router.finish(decision)
            arrival = served.get(decision.replica, 0)
            served[decision.replica] = arrival + 1
            prompt = result.report.prompt_tokens
            matched = decision.plan.matched_tokens or 0
            expected = order.key_of(arrival, order.fraction(min(matched, prompt), prompt))
            assert list(backend.priorities.values())[-1] == expected
            keys.append((arrival, matched, expected))
        # The first request is cold; the later ones went to the replica holding the chunks
        # (craft_joint) with a predicted hit, so each ranks ahead of a cold request that
        # arrived with it.
        assert keys[0][1] == 0 and keys[0][2] == order.key_of(0, 0.0)
        assert list(served.values()) == [3]
        for arrival, matched, key in keys[1:]:
            assert matched > 0 and key < order.key_of(arrival, 0.0)
    finally:
        for engine in engines.values():
            engine.close()
