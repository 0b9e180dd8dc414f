"""Every float setting in the project refuses NaN and infinities at construction, naming the
field (a NaN backoff, temperature or routing weight used to be accepted and fail later with
an unclear error, or turn every routing cost into NaN).

The case list is the whole inventory: a new float field on a settings class belongs here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest

Factory = Callable[[float], object]


def _server(field: str) -> Factory:
    from craft_rag.engine.backends.server.settings import ServerSettings

    return lambda v: ServerSettings("http://127.0.0.1:8000", **{field: v})


def _sampling(field: str) -> Factory:
    from craft_rag.engine.results import SamplingRequest

    return lambda v: SamplingRequest(**{field: v})


def _sampling_override(field: str) -> Factory:
    from craft_rag.engine.results import SamplingRequest

    return lambda v: SamplingRequest().with_overrides(**{field: v})


def _router(field: str) -> Factory:
    from craft_rag.routing.router import RouterConfig

    return lambda v: RouterConfig(**{field: v})


def _ttft(field: str) -> Factory:
    from craft_rag.routing.queueing import TTFTModel

    base = {"a": 0.03, "b": 0.001, "c": 0.0}
    return lambda v: TTFTModel(**{**base, field: v})


def _tier_costs(field: str) -> Factory:
    from craft_rag.routing.tier_costs import TierCosts

    return lambda v: TierCosts(**{field: v})


def _sim(field: str) -> Factory:
    from craft_rag.routing.simulator import SimConfig

    return lambda v: SimConfig(replicas=2, **{field: v})


def _turn_cost(field: str) -> Factory:
    from craft_rag.engine.turn_layout import TurnCostModel

    return lambda v: TurnCostModel(**{field: v})


def _turn_layout(field: str) -> Factory:
    from craft_rag.engine.turn_layout import TurnLayoutPolicy

    return lambda v: TurnLayoutPolicy(**{field: v})


def _planner(field: str) -> Factory:
    from craft_rag.plans import PlannerConfig

    return lambda v: PlannerConfig(**{field: v})


def _engine(field: str) -> Factory:
    from craft_rag.engine.backends.vllm.backend import EngineSettings

    return lambda v: EngineSettings(**{field: v})


def _conversations(field: str) -> Factory:
    from craft_rag.conversation import ConversationStore

    return lambda v: ConversationStore(**{field: v})


def _chunk(field: str) -> Factory:
    from craft_rag.chunk import make_chunk

    return lambda v: make_chunk("text", id="c", **{field: v})


def _fake_backend(field: str) -> Factory:
    from craft_rag.testing import FakeBackend

    return lambda v: FakeBackend(**{field: v})


def _redis_store(field: str) -> Factory:
    pytest.importorskip("redis")
    from craft_rag.stores.redis_store import RedisStore

    return lambda v: RedisStore("redis://127.0.0.1:6390/0", **{field: v})


def _trace(field: str) -> Factory:
    pytest.importorskip("craft_rag_bench")
    from craft_rag_bench.workloads import TraceConfig

    return lambda v: TraceConfig("squad", **{field: v})


def _bench_sizes(field: str) -> Factory:
    pytest.importorskip("craft_rag_bench")
    from craft_rag_bench.bench.context import BenchSizes

    return lambda v: BenchSizes(**{field: (1.0, v)})


def _langchain(field: str) -> Factory:
    pytest.importorskip("langchain_craft")
    from langchain_craft import ChatCraftVLLM

    from craft_rag.testing import make_fake_engine

    engine, _ = make_fake_engine()
    return lambda v: ChatCraftVLLM(engine=engine, **{field: v})


def _llama_index(field: str) -> Factory:
    pytest.importorskip("llama_index.llms.craft_vllm")
    from llama_index.llms.craft_vllm import CraftVLLM

    from craft_rag.testing import make_fake_engine

    engine, _ = make_fake_engine()
    return lambda v: CraftVLLM(engine, **{field: v})


CASES: list[tuple[str, Callable[[str], Factory], str]] = [
    ("ServerSettings", _server, "connect_timeout"),
    ("ServerSettings", _server, "read_timeout"),
    ("ServerSettings", _server, "backoff"),
    ("SamplingRequest", _sampling, "temperature"),
    ("SamplingRequest", _sampling, "top_p"),
    ("SamplingRequest.with_overrides", _sampling_override, "temperature"),
    ("SamplingRequest.with_overrides", _sampling_override, "top_p"),
    ("RouterConfig", _router, "load_weight"),
    ("RouterConfig", _router, "balance_slack"),
    ("TTFTModel", _ttft, "a"),
    ("TTFTModel", _ttft, "b"),
    ("TTFTModel", _ttft, "c"),
    ("TierCosts", _tier_costs, "ram"),
    ("TierCosts", _tier_costs, "disk"),
    ("SimConfig", _sim, "load"),
    ("TurnCostModel", _turn_cost, "per_token_ms"),
    ("TurnCostModel", _turn_cost, "per_context_ms"),
    ("TurnLayoutPolicy", _turn_layout, "ratio"),
    ("TurnLayoutPolicy", _turn_layout, "min_gain_ms"),
    ("PlannerConfig", _planner, "conversation_ttl_s"),
    ("EngineSettings", _engine, "gpu_memory_utilization"),
    ("ConversationStore", _conversations, "ttl_s"),
    ("Chunk", _chunk, "score"),
    ("FakeBackend", _fake_backend, "step_delay"),
    ("RedisStore", _redis_store, "timeout_s"),
    ("TraceConfig", _trace, "repeat"),
    ("TraceConfig", _trace, "zipf"),
    ("TraceConfig", _trace, "near_duplicates"),
    ("BenchSizes", _bench_sizes, "load_rates"),
    ("langchain ChatCraftVLLM", _langchain, "temperature"),
    ("langchain ChatCraftVLLM", _langchain, "top_p"),
    ("llama-index CraftVLLM", _llama_index, "temperature"),
    ("llama-index CraftVLLM", _llama_index, "top_p"),
]


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize(
    ("owner", "make", "field"), CASES, ids=[f"{owner}.{field}" for owner, _, field in CASES]
)
def test_non_finite_float_setting_is_refused_naming_the_field(
    owner: str, make: Callable[[str], Factory], field: str, value: float
) -> None:
    factory = make(field)
    with pytest.raises(ValueError, match=field) as info:
        factory(value)
    text = str(info.value)
    assert "finite" in text or repr(value) in text, text  # refused for its value, not by chance


def test_finite_values_still_construct() -> None:
    """The checks refuse only what is not finite (or out of range), not ordinary values."""
    ok: dict[str, Any] = {
        "connect_timeout": 1.5,
        "read_timeout": 2.0,
        "backoff": 0.0,
    }
    for field, value in ok.items():
        _server(field)(value)
    _sampling("temperature")(0.7)
    _sampling("top_p")(0.9)
    _router("load_weight")(0.0)
    _sim("load")(0.5)
    _engine("gpu_memory_utilization")(0.5)
