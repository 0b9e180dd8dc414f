"""KVTierSettings: validation, the connector's extra config round trip, EngineSettings wiring."""

from __future__ import annotations

from pathlib import Path

import pytest

from craft_rag.kvtiers.tier_settings import CONNECTOR_MODULE, CONNECTOR_NAME, KVTierSettings


def test_extra_config_round_trips() -> None:
    settings = KVTierSettings(ram_bytes=10, disk_bytes=20, disk_dir=Path("/x/y"), policy="lru")
    back = KVTierSettings.from_extra(settings.extra_config())
    assert back == KVTierSettings(ram_bytes=10, disk_bytes=20, disk_dir="/x/y", policy="lru")
    config = settings.transfer_config()
    assert config["kv_connector"] == CONNECTOR_NAME == "CraftTierConnector"
    assert config["kv_connector_module_path"] == CONNECTOR_MODULE == "craft_rag.kvtiers.connector"
    assert config["kv_role"] == "kv_both"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"ram_bytes": -1}, "non-negative"),
        ({"ram_bytes": True}, "non-negative"),
        ({"ram_bytes": 1.5}, "non-negative"),
        ({"policy": "fifo"}, "valid: lru, pgdsf"),
        ({"disk_bytes": 10}, "both disk_bytes"),
        ({"disk_dir": "/tmp/x"}, "both disk_bytes"),
        ({"ram_bytes": 0}, "both tiers are empty"),
        ({"disk_write_through": "yes"}, "true or false"),
        ({"disk_write_through": 1}, "true or false"),
    ],
)
def test_bad_settings_name_the_fix(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        KVTierSettings(**kwargs)  # type: ignore[arg-type]


def test_write_through_is_on_by_default_and_round_trips() -> None:
    on = KVTierSettings(disk_bytes=20, disk_dir="/x/y")
    assert on.disk_write_through is True
    off = KVTierSettings(disk_bytes=20, disk_dir="/x/y", disk_write_through=False)
    assert off.extra_config()["disk_write_through"] is False
    assert KVTierSettings.from_extra(off.extra_config()) == off
    older = {k: v for k, v in off.extra_config().items() if k != "disk_write_through"}
    assert KVTierSettings.from_extra(older) == on  # a config written before the switch


def test_unknown_extra_key_names_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="valid: \\['ram_bytes'"):
        KVTierSettings.from_extra({"ram": 1})


def test_engine_settings_pass_the_transfer_config() -> None:
    pytest.importorskip("vllm")
    from craft_rag.engine.backends.vllm.backend import EngineSettings, VLLMBackend

    assert EngineSettings().kv_tiers is None
    plain = VLLMBackend(EngineSettings(kv_events=False), "/m").engine_kwargs
    assert "kv_transfer_config" not in plain
    tiers = KVTierSettings(ram_bytes=1 << 20)
    kwargs = VLLMBackend(EngineSettings(kv_events=False, kv_tiers=tiers), "/m").engine_kwargs
    config = kwargs["kv_transfer_config"]
    assert config.kv_connector == "CraftTierConnector"
    assert config.kv_connector_module_path == "craft_rag.kvtiers.connector"
    assert config.kv_connector_extra_config == tiers.extra_config()
