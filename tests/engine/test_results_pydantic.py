"""A user's pydantic model can hold the engine's report types (their annotations resolve at
runtime, not only under type checking)."""

from __future__ import annotations

import pydantic

from craft_rag.engine import ReuseReport
from craft_rag.engine.turn_layout import LayoutChoice


class _UserReports(pydantic.BaseModel):
    reports: list[ReuseReport]


def _report(**changes: object) -> ReuseReport:
    base: dict[str, object] = dict(
        request_id="r1", prompt_tokens=10, cached_tokens=4, predicted_tokens=None,
        predicted_chunks=0, reused_chunks=0, prefix_tokens=0, ttft_ms=1.0, latency_ms=2.0,
        output_tokens=3, chunk_order=(), removed_duplicates=(), repeated_in_request=(),
        dropped_turns=0, conversation_id=None, turn=0, read_prefix_cache=True,
    )
    base.update(changes)
    return ReuseReport(**base)  # type: ignore[arg-type]


def test_user_pydantic_model_holding_a_reuse_report_validates() -> None:
    report = _report()
    held = _UserReports(reports=[report])
    assert held.reports[0].cached_tokens == 4
    assert held.reports[0].layout is None


def test_reuse_report_layout_annotation_resolves_at_runtime() -> None:
    import typing

    hints = typing.get_type_hints(ReuseReport)
    assert LayoutChoice in typing.get_args(hints["layout"])
