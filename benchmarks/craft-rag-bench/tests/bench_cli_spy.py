"""A spy on the bench CLI's ``run_suites``: the tests of ``craft-rag bench`` options read the
:class:`BenchContext` the parsed flags produced, without running a suite. (Imported by the
tests in this folder; pytest puts the folder on ``sys.path``.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from craft_rag_bench.bench.context import BenchContext


def spy_run_suites(monkeypatch: pytest.MonkeyPatch) -> list[BenchContext]:
    """Replace ``cli.run_suites`` for this test; returns the list each call's context lands in."""
    from craft_rag_bench.bench import cli

    seen: list[BenchContext] = []

    def run_suites(
        ctx: BenchContext, names: list[str], out: Path, plots: bool = True
    ) -> dict[str, Any]:
        seen.append(ctx)
        return {}

    monkeypatch.setattr(cli, "run_suites", run_suites)
    return seen
