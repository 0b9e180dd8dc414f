"""``craft-rag serve --admission``: the vLLM server is started with the priority policy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from craft_rag.cli import main
from craft_rag.engine.backends.server.serve import ServeConfig, server_command


def test_cache_aware_admission_starts_the_priority_scheduler() -> None:
    argv = server_command(ServeConfig(model="/m", admission="cache_aware"), python="py")
    assert argv[argv.index("--scheduling-policy") + 1] == "priority"
    assert "--scheduling-policy" not in server_command(ServeConfig(model="/m"), python="py")


def test_bad_admission_names_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"cache_aware.*fcfs"):
        ServeConfig(model="/m", admission="lifo")
    with pytest.raises(ValueError, match="not both"):
        ServeConfig(model="/m", admission="cache_aware", extra_args=("--scheduling-policy", "fcfs"))


def test_cli_flag(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    args = ["serve", "--model", str(tmp_path), "--admission", "cache_aware", "--print-command"]
    assert main(args) == 0
    argv = json.loads(capsys.readouterr().out)
    assert argv[argv.index("--scheduling-policy") + 1] == "priority"
    with pytest.raises(SystemExit):
        main(["serve", "--model", str(tmp_path), "--admission", "sjf", "--print-command"])
