"""Every int setting of the public settings objects refuses what is not an int in range at
construction, naming the field: a bool (``True`` is an int in Python), a string of digits, a
float (``3.0``, ``-0.0``), an int past int64. Before, ``ServerSettings(block_size=True)``,
``SamplingRequest(seed="5")``, ``EngineSettings(seed=2**70)`` or ``ServeConfig(port=True)``
were accepted and failed later (in vLLM, in the server, in a socket call) or silently meant 1;
``EngineSettings(max_model_len="4096")`` raised a raw ``TypeError``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

NOT_INTS: list[object] = [True, False, "5", 3.0, -0.0, 2**70]


def _server(**kw: Any) -> object:
    from craft_rag.engine.backends.server.settings import ServerSettings

    return ServerSettings("http://127.0.0.1:8000", **kw)


def _sampling(**kw: Any) -> object:
    from craft_rag.engine.results import SamplingRequest

    return SamplingRequest(**kw)


def _sampling_override(**kw: Any) -> object:
    from craft_rag.engine.results import SamplingRequest

    return SamplingRequest().with_overrides(**kw)


def _engine(**kw: Any) -> object:
    from craft_rag.engine.backends.vllm.backend import EngineSettings

    return EngineSettings(**kw)


def _serve(**kw: Any) -> object:
    from craft_rag.engine.backends.server.serve import ServeConfig

    return ServeConfig(model="/tmp", **kw)


def _router(**kw: Any) -> object:
    from craft_rag.routing.router import RouterConfig

    return RouterConfig(**kw)


def _sim(**kw: Any) -> object:
    from craft_rag.routing.simulator import SimConfig

    return SimConfig(replicas=2, **kw)


CASES: list[tuple[str, Callable[..., object], str, list[object]]] = [
    ("RouterConfig", _router, "balance_headroom", [True, 2**70]),
    ("RouterConfig", _router, "block_size", [True, 2**70]),
    ("SimConfig", _sim, "block_size", [True, 2**70]),
    ("SimConfig", _sim, "capacity_tokens", [2**70]),
    ("SimConfig", _sim, "seed", NOT_INTS),
    ("ServerSettings", _server, "block_size", [*NOT_INTS, 0, -4]),
    ("ServerSettings", _server, "kv_events", [3.0, -0.0, 2**70, 0]),
    ("SamplingRequest", _sampling, "seed", NOT_INTS),
    ("SamplingRequest", _sampling, "max_tokens", [True, "5", 3.0, 2**70]),
    ("SamplingRequest.with_overrides", _sampling_override, "seed", [2**70]),
    ("SamplingRequest.with_overrides", _sampling_override, "max_tokens", [2**70]),
    ("EngineSettings", _engine, "seed", NOT_INTS),
    ("EngineSettings", _engine, "kv_cache_memory_bytes", [*NOT_INTS, 0, -1]),
    ("EngineSettings", _engine, "num_gpu_blocks_override", [*NOT_INTS, 0]),
    ("EngineSettings", _engine, "max_model_len", ["4096", 4096.0, 2**70]),
    ("EngineSettings", _engine, "block_size", ["32", 32.0]),
    ("ServeConfig", _serve, "port", [True, 8000.0, "8000"]),
    ("ServeConfig", _serve, "kv_events_port", [True, 9000.0, "9000"]),
]


@pytest.mark.parametrize(
    ("factory", "field", "value"),
    [(f, field, v) for _, f, field, values in CASES for v in values],
    ids=[f"{name}.{field}={v!r}"[:60] for name, _, field, values in CASES for v in values],
)
def test_a_bad_int_setting_is_refused_naming_the_field(
    factory: Callable[..., object], field: str, value: object
) -> None:
    with pytest.raises(ValueError, match=field):
        factory(**{field: value})


@pytest.mark.parametrize(
    ("factory", "field", "value"),
    [
        (_server, "block_size", 16),
        (_server, "kv_events", 9000),
        (_server, "kv_events", False),
        (_sampling, "seed", 2**63 - 1),
        (_sampling, "seed", 0),
        (_engine, "seed", 7),
        (_engine, "kv_cache_memory_bytes", None),
        (_engine, "num_gpu_blocks_override", 64),
        (_serve, "port", 8123),
        (_serve, "kv_events_port", 9123),
        (_router, "block_size", 16),
        (_sim, "seed", 3),
    ],
)
def test_good_int_settings_still_pass(
    factory: Callable[..., object], field: str, value: object
) -> None:
    assert getattr(factory(**{field: value}), field) == value


@pytest.mark.parametrize("field", ["connect_timeout", "read_timeout"])
@pytest.mark.parametrize("value", [2**70, 1e300, 10.0**9])
def test_a_timeout_past_any_clock_is_refused_at_construction(field: str, value: float) -> None:
    """A finite but huge timeout was accepted and failed at the first socket call with a raw
    ``OverflowError`` (timestamp too large for the C clock)."""
    with pytest.raises(ValueError, match=field):
        _server(**{field: value})
