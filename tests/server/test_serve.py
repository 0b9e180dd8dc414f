"""``craft-rag serve``: the command line it builds, its environment and its checks (no server
is started here; the real server tests start one through the same functions)."""

from __future__ import annotations

import json

import pytest

from craft_rag.cli import main
from craft_rag.engine.backends.server.serve import ServeConfig, server_command, server_env


def test_command_has_the_flags_craft_needs_and_the_events_port_rule() -> None:
    argv = server_command(ServeConfig(model="/m", port=8100), python="py")
    assert argv[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
    for flag in (
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--enforce-eager",
    ):
        assert flag in argv
    assert argv[argv.index("--block-size") + 1] == "32"
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    events = json.loads(argv[argv.index("--kv-events-config") + 1])
    assert events["endpoint"] == "tcp://*:9100" and events["enable_kv_cache_events"] is True
    explicit = server_command(ServeConfig(model="/m", port=8100, kv_events_port=7000))
    assert "tcp://*:7000" in explicit[explicit.index("--kv-events-config") + 1]


def test_env_is_offline_without_hash_seed_and_dev_only_when_asked() -> None:
    base = {"PYTHONHASHSEED": "1", "VLLM_SERVER_DEV_MODE": "1", "PATH": "/bin"}
    env = server_env(ServeConfig(model="/m"), base)
    assert env["HF_HUB_OFFLINE"] == "1" and "PYTHONHASHSEED" not in env
    assert "VLLM_SERVER_DEV_MODE" not in env and env["PATH"] == "/bin"
    assert server_env(ServeConfig(model="/m", dev=True), base)["VLLM_SERVER_DEV_MODE"] == "1"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"port": 0}, "port"),
        ({"port": 70000}, "port"),
        ({"port": 65000}, "--kv-events-port"),
        ({"port": 8000, "kv_events_port": 8000}, "differ"),
        ({"block_size": 20}, "multiple of 16"),
        ({"max_model_len": 8}, "max_model_len"),
    ],
)
def test_bad_config_is_a_value_error(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ServeConfig(model="/m", **kwargs)  # type: ignore[arg-type]


def test_cli_prints_the_command(capsys: pytest.CaptureFixture[str], tmp_path: object) -> None:
    from pathlib import Path

    model = Path(str(tmp_path))
    (model / "config.json").write_text("{}")
    assert main(["serve", "--model", str(model), "--port", "8300", "--print-command"]) == 0
    argv = json.loads(capsys.readouterr().out)
    assert argv[argv.index("--model") + 1] == str(model)
    assert argv[argv.index("--port") + 1] == "8300"


def test_model_is_served_under_its_folder_name_unless_named() -> None:
    argv = server_command(ServeConfig(model="/cache/models/SmolLM2-135M-Instruct"), python="py")
    assert argv[argv.index("--served-model-name") + 1] == "SmolLM2-135M-Instruct"
    named = server_command(ServeConfig(model="/m", served_model_name="smollm2"), python="py")
    assert named[named.index("--served-model-name") + 1] == "smollm2"


def test_quiet_by_default_and_info_on_request() -> None:
    quiet = ServeConfig(model="/m")
    argv = server_command(quiet, python="py")
    assert argv[argv.index("--uvicorn-log-level") + 1] == "error"
    assert "--disable-uvicorn-access-log" in argv
    env = server_env(quiet, {})
    assert env["VLLM_LOGGING_LEVEL"] == "ERROR" and env["TQDM_DISABLE"] == "1"
    assert "ignore::DeprecationWarning" in env["PYTHONWARNINGS"]
    loud = ServeConfig(model="/m", log_level="info")
    assert "--disable-uvicorn-access-log" not in server_command(loud, python="py")
    assert server_env(loud, {})["VLLM_LOGGING_LEVEL"] == "INFO"
    assert "TQDM_DISABLE" not in server_env(loud, {})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"log_level": "loud"}, "log_level"),
        ({"served_model_name": " "}, "served_model_name"),
        ({"served_model_name": "x" * 300}, "served_model_name"),
    ],
)
def test_bad_name_or_level_is_a_value_error(kwargs: dict[str, str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ServeConfig(model="/m", **kwargs)  # type: ignore[arg-type]


def test_cli_passes_name_and_level(capsys: pytest.CaptureFixture[str], tmp_path: object) -> None:
    from pathlib import Path

    model = Path(str(tmp_path))
    (model / "config.json").write_text("{}")
    args = ["serve", "--model", str(model), "--served-model-name", "mine", "--log-level", "info"]
    assert main([*args, "--print-command"]) == 0
    argv = json.loads(capsys.readouterr().out)
    assert argv[argv.index("--served-model-name") + 1] == "mine"
    assert argv[argv.index("--uvicorn-log-level") + 1] == "info"
