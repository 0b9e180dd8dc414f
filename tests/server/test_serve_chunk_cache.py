"""``craft-rag serve``'s chunk-cache flags: off by default; ``--chunk-cache`` (or a size flag)
-> ``--kv-transfer-config`` loading CraftApproxConnector over the tiers
(``ChunkCacheSettings.transfer_config``) and the streaming patch's server module; bad values an
argparse error naming the fix. No server is started (test_real_chunk_cache_server.py starts
one)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_serve_tiers import _printed_argv

from conftest import serve_flags_error
from craft_rag.engine.backends.server.serve import (
    TIER_SERVER_MODULE,
    ServeConfig,
    server_command,
)
from craft_rag.kvtiers import KVTierSettings
from craft_rag.kvtiers.chunk_cache_settings import ChunkCacheSettings


def _connector(argv: list[str]) -> dict[str, Any]:
    assert argv.count("--kv-transfer-config") == 1
    config: dict[str, Any] = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == "CraftApproxConnector"
    assert config["kv_connector_module_path"] == "craft_rag.kvtiers.approx_connector"
    assert argv[1:3] == ["-m", TIER_SERVER_MODULE]  # streamed replies carry the counts
    return config


def _tiers(extra: dict[str, Any]) -> KVTierSettings:
    """The tier part of the approximate connector's extra config."""
    return KVTierSettings.from_extra(
        {k: v for k, v in extra.items() if not k.startswith("chunk_cache_")}
    )


def test_off_by_default(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = _printed_argv(tmp_path, capsys)
    assert "--kv-transfer-config" not in argv and "CraftApproxConnector" not in " ".join(argv)


def test_flag_loads_the_connector_over_default_tiers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _connector(_printed_argv(tmp_path, capsys, "--chunk-cache"))
    assert config == ChunkCacheSettings().transfer_config(None)
    assert _tiers(config["kv_connector_extra_config"]) == KVTierSettings()


def test_sizes_and_tiers_reach_the_connector(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = _printed_argv(
        tmp_path, capsys,
        *("--chunk-cache-bytes", "1048576", "--chunk-cache-variants", "3"),  # turn it on alone
        *("--kv-tier-ram-bytes", "4096", "--kv-tier-policy", "lru"),
    )
    extra = _connector(argv)["kv_connector_extra_config"]
    assert (extra["chunk_cache_bytes"], extra["chunk_cache_variants"]) == (1 << 20, 3)
    assert _tiers(extra) == KVTierSettings(ram_bytes=4096, policy="lru")
    config = ServeConfig(model="m", chunk_cache=ChunkCacheSettings(variants=3))
    assert _connector(server_command(config)) == ChunkCacheSettings(variants=3).transfer_config(
        None
    )


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (("--chunk-cache-bytes", "-1"), "cache_bytes must be an integer >= 0"),
        (("--chunk-cache-variants", "0"), "variants must be an integer >= 1"),
        (("--chunk-cache-variants", "two"), "invalid int value"),
        (("--chunk-cache", "--kv-tier-ram-bytes", "0"), "both tiers are empty"),
    ],
)
def test_bad_flags_are_an_argparse_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: tuple[str, ...], match: str
) -> None:
    assert match in serve_flags_error(tmp_path, capsys, flags)


def test_chunk_cache_and_a_raw_transfer_config_conflict() -> None:
    raw = ("--kv-transfer-config", "{}")
    with pytest.raises(ValueError, match="not both"):
        ServeConfig(model="m", chunk_cache=ChunkCacheSettings(), extra_args=raw)
    with pytest.raises(ValueError, match="ChunkCacheSettings"):
        ServeConfig(model="m", chunk_cache={"variants": 1})  # type: ignore[arg-type]
