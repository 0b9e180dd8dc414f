"""The one ``craft-rag`` command: core subcommands built in, harness subcommands (demo, bench,
trace) discovered through the ``craft_rag.commands`` entry-point group that craft-rag-bench
registers. Without the harness those names fail with one line (exit 2) saying what to install.
"""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points

import pytest

from craft_rag.cli import entry as cli


def no_plugins(group: str) -> list[EntryPoint]:
    assert group == cli.COMMANDS_GROUP
    return []


@pytest.mark.parametrize(
    "argv",
    [
        ["demo"],
        ["demo", "--requests", "5", "--trace", "t.jsonl"],
        ["bench", "all", "--quick"],
        ["trace", "--dataset", "squad", "--out", "t.jsonl"],
    ],
)
def test_harness_command_without_the_harness_names_the_package(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli, "entry_points", no_plugins)
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(f"craft-rag {argv[0]}: error:")
    assert "craft-rag-bench" in lines[0]
    assert "Traceback" not in captured.err


def test_core_commands_do_not_need_the_harness(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "entry_points", no_plugins)
    parser = cli.build_parser()
    choices = parser._subparsers._group_actions[0].choices or {}  # type: ignore[union-attr]
    assert {"replay", "model", "serve"} <= set(choices)
    args = parser.parse_args(["replay", "t.jsonl"])
    assert args.command == "replay"


def test_a_plugin_whose_module_is_missing_gets_the_install_hint(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = EntryPoint(name="demo", value="no_such_module_for_craft:add", group=cli.COMMANDS_GROUP)
    monkeypatch.setattr(cli, "entry_points", lambda group: [broken])
    assert cli.main(["demo"]) == 2
    assert "craft-rag-bench" in capsys.readouterr().err


def test_the_harness_registers_demo_bench_and_trace() -> None:
    """In the development install (scripts/bootstrap.sh) craft-rag-bench is installed and its
    entry points replace the install-hint stubs with the real subcommands."""
    names = {p.name: p.value for p in entry_points(group=cli.COMMANDS_GROUP)}
    assert names == {
        "demo": "craft_rag_bench.demo:add_demo_parser",
        "bench": "craft_rag_bench.bench.cli:add_bench_parser",
        "trace": "craft_rag_bench.workloads_cli:add_trace_parser",
    }
    args = cli.build_parser().parse_args(["demo", "--requests", "3"])
    assert args.func.__module__ == "craft_rag_bench.demo"
    assert args.requests == 3
