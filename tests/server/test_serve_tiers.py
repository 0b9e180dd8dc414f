"""``craft-rag serve``'s KV tier flags: off by default, ``ServeConfig.kv_tiers`` ->
``--kv-transfer-config`` (the connector's own settings JSON), bad values an argparse error
naming the fix. No server is started (tests/kvtiers/test_connector_server.py starts one)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import serve_flags_error
from craft_rag.cli import main
from craft_rag.engine.backends.server.serve import (
    TIER_SHUTDOWN_TIMEOUT_S,
    ServeConfig,
    server_command,
)
from craft_rag.kvtiers import KVTierSettings


def _printed_argv(tmp_path: Path, capsys: pytest.CaptureFixture[str], *flags: str) -> list[str]:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    assert main(["serve", "--model", str(model), *flags, "--print-command"]) == 0
    argv: list[str] = json.loads(capsys.readouterr().out)
    return argv


def _transfer_config(argv: list[str]) -> KVTierSettings:
    assert argv.count("--kv-transfer-config") == 1
    config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == "CraftTierConnector"
    assert config["kv_connector_module_path"] == "craft_rag.kvtiers.connector"
    return KVTierSettings.from_extra(config["kv_connector_extra_config"])


def test_tiers_are_off_by_default(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "--kv-transfer-config" not in _printed_argv(tmp_path, capsys)
    assert "--kv-transfer-config" not in server_command(ServeConfig(model="m"))


def test_config_adds_the_connector_settings() -> None:
    tiers = KVTierSettings(ram_bytes=1 << 20, disk_bytes=1 << 22, disk_dir="/x/kv", policy="lru")
    argv = server_command(ServeConfig(model="m", kv_tiers=tiers))
    assert _transfer_config(argv) == KVTierSettings(
        ram_bytes=1 << 20, disk_bytes=1 << 22, disk_dir="/x/kv", policy="lru"
    )


def test_cli_flags_reach_the_argv(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    kv = str(tmp_path / "kv")
    argv = _printed_argv(
        tmp_path,
        capsys,
        *("--kv-tier-ram-bytes", "4096", "--kv-tier-disk-bytes", "8192"),
        *("--kv-tier-dir", kv, "--kv-tier-policy", "lru"),
    )
    assert _transfer_config(argv) == KVTierSettings(4096, 8192, kv, "lru")


def test_one_flag_turns_tiers_on_with_defaults(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = _printed_argv(tmp_path, capsys, "--kv-tier-policy", "lru")
    assert _transfer_config(argv) == KVTierSettings(policy="lru")  # 1 GiB RAM, no disk


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (("--kv-tier-disk-bytes", "8192"), "disk_dir"),  # a disk size without a folder
        (("--kv-tier-dir", "/tmp/kv"), "disk_bytes"),  # a folder without a size
        (("--kv-tier-ram-bytes", "-1"), "non-negative"),
        (("--kv-tier-ram-bytes", "0"), "both tiers are empty"),
        (("--kv-tier-policy", "fifo"), "invalid choice"),
        (("--kv-tier-ram-bytes", "1GiB"), "invalid int value"),
        (("--kv-tier-write-through",), "give --kv-tier-dir"),  # write-through without a disk
        (("--no-kv-tier-write-through",), "give --kv-tier-dir"),
    ],
)
def test_bad_flags_are_an_argparse_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: tuple[str, ...], match: str
) -> None:
    assert match in serve_flags_error(tmp_path, capsys, flags)


def test_tiers_and_a_raw_transfer_config_conflict() -> None:
    raw = ("--kv-transfer-config", "{}")
    with pytest.raises(ValueError, match="not both"):
        ServeConfig(model="m", kv_tiers=KVTierSettings(), extra_args=raw)
    with pytest.raises(ValueError, match="KVTierSettings"):
        ServeConfig(model="m", kv_tiers={"ram_bytes": 1})  # type: ignore[arg-type]


def _stop_seconds(argv: list[str]) -> str | None:
    return argv[argv.index("--shutdown-timeout") + 1] if "--shutdown-timeout" in argv else None


def test_write_through_flag_reaches_the_connector(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    disk = ("--kv-tier-disk-bytes", "8192", "--kv-tier-dir", str(tmp_path / "kv"))
    default = _transfer_config(_printed_argv(tmp_path, capsys, *disk))
    assert default.disk_write_through is True
    off = _transfer_config(_printed_argv(tmp_path, capsys, *disk, "--no-kv-tier-write-through"))
    assert off.disk_write_through is False
    on = _transfer_config(_printed_argv(tmp_path, capsys, *disk, "--kv-tier-write-through"))
    assert on.disk_write_through is True


def test_a_disk_tier_gives_vllm_time_to_close_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # vLLM 0.32 SIGKILLs its EngineCore right after the SIGTERM unless --shutdown-timeout > 0;
    # the connector's shutdown (which copies RAM blocks down) needs that time
    disk = ("--kv-tier-disk-bytes", "8192", "--kv-tier-dir", str(tmp_path / "kv"))
    assert _stop_seconds(_printed_argv(tmp_path, capsys, *disk)) == str(TIER_SHUTDOWN_TIMEOUT_S)
    assert _stop_seconds(_printed_argv(tmp_path, capsys, "--kv-tier-ram-bytes", "4096")) is None
    assert _stop_seconds(_printed_argv(tmp_path, capsys)) is None
    tiers = KVTierSettings(disk_bytes=8192, disk_dir="/x/kv")
    assert _stop_seconds(server_command(ServeConfig(model="m", kv_tiers=tiers))) == "30"
    chosen = ServeConfig(model="m", kv_tiers=tiers, shutdown_timeout=5)
    assert _stop_seconds(server_command(chosen)) == "5"
    assert _stop_seconds(server_command(ServeConfig(model="m", shutdown_timeout=0))) == "0"
    own = ServeConfig(model="m", kv_tiers=tiers, extra_args=("--shutdown-timeout", "9"))
    assert server_command(own).count("--shutdown-timeout") == 1  # the caller's own wins
    with pytest.raises(ValueError, match="not both"):
        ServeConfig(model="m", shutdown_timeout=5, extra_args=("--shutdown-timeout", "9"))
    with pytest.raises(ValueError, match="shutdown_timeout"):
        ServeConfig(model="m", shutdown_timeout=-1)
