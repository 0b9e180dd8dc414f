"""ChunkCacheSettings: validation naming the fix, the connector config, the engine switch."""

from __future__ import annotations

import pytest

from craft_rag.engine import ChunkCacheSettings, EngineSettings
from craft_rag.kvtiers import KVTierSettings
from craft_rag.kvtiers.approx_params import BLEND_RULES, parse_blend
from craft_rag.kvtiers.chunk_cache_settings import (
    APPROX_CONNECTOR_MODULE,
    APPROX_CONNECTOR_NAME,
    DEFAULT_CHUNK_CACHE_BYTES,
    DEFAULT_VARIANTS,
)


def test_defaults_match_the_connector_and_the_paper_setting() -> None:
    from craft_rag.kvtiers import blend_source

    s = ChunkCacheSettings()
    assert (s.rule, s.fraction, s.alpha) == ("kv_deviation", 0.3, None)
    assert DEFAULT_CHUNK_CACHE_BYTES == blend_source.DEFAULT_CHUNK_CACHE_BYTES
    assert DEFAULT_VARIANTS == blend_source.DEFAULT_VARIANTS
    assert (s.cache_bytes, s.variants) == (256 << 20, 2)
    assert (s.harvest, s.seed_cold) == (True, False)  # fill the store from exact requests


@pytest.mark.parametrize("rule", BLEND_RULES)
def test_blend_round_trips_through_the_request_parser(rule: str) -> None:
    s = ChunkCacheSettings(rule=rule, fraction=0.5, harvest=rule != "cci")
    parsed = parse_blend(s.blend())
    assert (parsed.rule, parsed.fraction, parsed.alpha) == (rule, 0.5, None)
    a = ChunkCacheSettings(rule=rule, fraction=None, alpha=2.0, harvest=False)
    parsed = parse_blend(a.blend())
    assert (parsed.rule, parsed.fraction, parsed.alpha) == (rule, None, 2.0)


@pytest.mark.parametrize(
    ("kwargs", "fix"),
    [
        ({"fraction": 1.5}, "in [0, 1]"),
        ({"fraction": -0.1}, "in [0, 1]"),
        ({"fraction": float("nan")}, "in [0, 1]"),
        ({"fraction": True}, "in [0, 1]"),
        ({"rule": "attention"}, "valid: cci, kv_deviation, random"),
        ({"fraction": None}, "give fraction"),
        ({"alpha": 1.0}, "not both"),
        ({"fraction": None, "alpha": -1.0}, ">= 0 and finite"),
        ({"cache_bytes": -1}, "cache_bytes must be an integer >= 0"),
        ({"variants": 0}, "variants must be an integer >= 1"),
        ({"max_chunks": 0}, "max_chunks must be an integer >= 1"),
        ({"seed_cold": 1}, "seed_cold must be true or false"),
        ({"harvest": "yes"}, "harvest must be true or false"),
        ({"harvest": 0}, "harvest must be true or false"),
        ({"rule": "cci"}, "harvest cannot be used with rule 'cci'.*pass harvest=False"),
        ({"fraction": None, "alpha": 1.0}, "harvest cannot be used with alpha.*harvest=False"),
    ],
)
def test_bad_settings_name_the_fix(kwargs: dict[str, object], fix: str) -> None:
    with pytest.raises(ValueError, match=fix.replace("[", r"\[").replace("]", r"\]")):
        ChunkCacheSettings(**kwargs)  # type: ignore[arg-type]


def test_harvest_off_takes_every_rule_and_alpha() -> None:
    assert ChunkCacheSettings(rule="cci", harvest=False).rule == "cci"
    assert ChunkCacheSettings(fraction=None, alpha=1.0, harvest=False).alpha == 1.0
    assert ChunkCacheSettings(rule="random").harvest


def test_transfer_config_loads_the_approx_connector_over_the_tiers() -> None:
    s = ChunkCacheSettings(cache_bytes=1 << 20, variants=3)
    cfg = s.transfer_config(None)
    assert cfg["kv_connector"] == APPROX_CONNECTOR_NAME
    assert cfg["kv_connector_module_path"] == APPROX_CONNECTOR_MODULE
    extra = cfg["kv_connector_extra_config"]
    assert extra["chunk_cache_bytes"] == 1 << 20 and extra["chunk_cache_variants"] == 3
    # Default tiers when none are given: the tier part parses back as KVTierSettings().
    tier_part = {k: v for k, v in extra.items() if not k.startswith("chunk_cache_")}
    assert KVTierSettings.from_extra(tier_part) == KVTierSettings()
    tiers = KVTierSettings(ram_bytes=1 << 22, policy="lru")
    tier_part = {k: v for k, v in s.transfer_config(tiers)["kv_connector_extra_config"].items()
                 if not k.startswith("chunk_cache_")}
    assert KVTierSettings.from_extra(tier_part) == tiers


def test_engine_settings_take_chunk_cache_and_refuse_other_types() -> None:
    assert EngineSettings().chunk_cache is None
    s = EngineSettings(chunk_cache=ChunkCacheSettings(rule="kv_deviation", fraction=0.3))
    assert s.chunk_cache == ChunkCacheSettings()
    with pytest.raises(ValueError, match="ChunkCacheSettings"):
        EngineSettings(chunk_cache="on")  # type: ignore[arg-type]
    # A dict of its fields (asdict round trip, an integration's engine_settings) is read back.
    from dataclasses import asdict

    back = EngineSettings(**asdict(s))
    assert back.chunk_cache == ChunkCacheSettings()
    assert EngineSettings(  # type: ignore[arg-type]
        chunk_cache={"rule": "cci", "harvest": False}
    ).chunk_cache == ChunkCacheSettings(rule="cci", harvest=False)
    with pytest.raises(ValueError, match="unknown chunk-cache rule"):
        EngineSettings(chunk_cache={"rule": "nope"})  # type: ignore[arg-type]
