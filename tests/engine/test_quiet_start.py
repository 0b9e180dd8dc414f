"""A first engine start is quiet and says what it does (issue 25 item 7): ``EngineSettings.
log_level`` decides vLLM's level, start-up warnings and progress bars
(craft_rag.engine.backends.vllm.logs).

The unit tests need no engine; the two ``engine`` tests start one in a fresh interpreter each
(a child ``python``, not the pytest process: only a first import shows import-time output, and
pytest's own warning capture would hide the warnings being counted)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from craft_rag.engine import EngineSettings
from craft_rag.engine.backends.server.serve import LOG_LEVELS as SERVE_LOG_LEVELS
from craft_rag.engine.backends.vllm.logs import (
    LOG_LEVELS,
    check_log_level,
    is_quiet,
    quiet_start,
    start_progress,
    vllm_configures_logging,
    vllm_log_level,
)


@pytest.fixture
def clean_logging(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """No user VLLM_* logging settings; the craft_rag and vllm loggers restored afterwards."""
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    monkeypatch.delenv("VLLM_CONFIGURE_LOGGING", raising=False)
    monkeypatch.setattr(logging.getLogger("craft_rag"), "level", logging.NOTSET)
    monkeypatch.setattr(logging.getLogger("craft_rag.engine"), "level", logging.NOTSET)
    vllm_logger = logging.getLogger("vllm")
    before = vllm_logger.level
    yield monkeypatch
    vllm_logger.setLevel(before)


def test_levels_are_serves_and_default_is_error() -> None:
    assert LOG_LEVELS == SERVE_LOG_LEVELS
    assert EngineSettings().log_level == "error"
    for level in LOG_LEVELS:
        assert EngineSettings(log_level=level).log_level == level


@pytest.mark.parametrize("bad", ["ERROR", "verbose", "", None, 40])
def test_a_bad_log_level_names_the_values(bad: object) -> None:
    with pytest.raises(ValueError, match="log_level must be one of debug, info, warning, error"):
        EngineSettings(log_level=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="critical, got"):
        check_log_level(bad)


def test_vllm_level_follows_the_setting(clean_logging: pytest.MonkeyPatch) -> None:
    assert vllm_log_level("error") == logging.ERROR
    assert vllm_log_level("critical") == logging.CRITICAL
    assert vllm_log_level("info") == logging.INFO
    assert vllm_log_level("debug") == logging.DEBUG
    assert [is_quiet(level) for level in LOG_LEVELS] == [False, False, False, True, True]


def test_the_most_verbose_way_asked_wins(clean_logging: pytest.MonkeyPatch) -> None:
    assert vllm_log_level("error", {"VLLM_LOGGING_LEVEL": "DEBUG"}) == logging.DEBUG
    assert vllm_log_level("error", {"VLLM_LOGGING_LEVEL": "warning"}) == logging.WARNING
    assert vllm_log_level("info", {"VLLM_LOGGING_LEVEL": "CRITICAL"}) == logging.INFO
    assert vllm_log_level("error", {"VLLM_LOGGING_LEVEL": "nonsense"}) == logging.ERROR
    logging.getLogger("craft_rag").setLevel(logging.INFO)  # the pre-log_level way still works
    assert vllm_log_level("error", {}) == logging.INFO
    logging.getLogger("craft_rag").setLevel(logging.WARNING)  # not below WARNING: no change
    assert vllm_log_level("error", {}) == logging.ERROR
    logging.getLogger("craft_rag").setLevel(15)  # vLLM knows only the named levels
    assert vllm_log_level("error", {}) == logging.DEBUG
    logging.getLogger("craft_rag").setLevel(logging.NOTSET)
    assert vllm_log_level("error", {"VLLM_LOGGING_LEVEL": "NOTSET"}) == logging.DEBUG


def test_quiet_start_hides_start_warnings_only_inside(clean_logging: pytest.MonkeyPatch) -> None:
    root_level = logging.getLogger().level
    filters_before = list(warnings.filters)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with quiet_start(logging.ERROR, hide_warnings=True):
            assert logging.getLogger("vllm").level == logging.ERROR
            warnings.warn("old", FutureWarning, stacklevel=1)
            warnings.warn("older", DeprecationWarning, stacklevel=1)
            warnings.warn("a real problem", UserWarning, stacklevel=1)
        assert [str(w.message) for w in seen] == ["a real problem"]
        warnings.warn("after", FutureWarning, stacklevel=1)
        assert [str(w.message) for w in seen] == ["a real problem", "after"]
    assert warnings.filters == filters_before
    assert logging.getLogger().level == root_level  # the root logger is never touched
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with quiet_start(logging.INFO, hide_warnings=False):
            assert logging.getLogger("vllm").level == logging.INFO
            warnings.warn("old", FutureWarning, stacklevel=1)
        assert [str(w.message) for w in seen] == ["old"]


def test_a_user_who_owns_vllms_logger_keeps_it(clean_logging: pytest.MonkeyPatch) -> None:
    clean_logging.setenv("VLLM_CONFIGURE_LOGGING", "0")
    assert not vllm_configures_logging()
    logging.getLogger("vllm").setLevel(logging.DEBUG)
    with quiet_start(logging.ERROR, hide_warnings=True):
        assert logging.getLogger("vllm").level == logging.DEBUG


def test_progress_is_one_stderr_line_unless_critical(
    clean_logging: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    start_progress("the vLLM engine", "error", "/models/SmolLM2-135M-Instruct")()
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err == (
        "craft-rag: starting the vLLM engine for SmolLM2-135M-Instruct "
        "(usually 10-60 s on a CPU; longer on a busy machine) ...\n"
    )
    start_progress("the vLLM engine", "critical", "/m")()
    assert capsys.readouterr() == ("", "")


def test_progress_goes_to_the_logger_when_the_app_configured_info(
    clean_logging: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    with caplog.at_level(logging.INFO, logger="craft_rag.engine"):
        start_progress("the vLLM engine", "error", "/m")()
    messages = [r.getMessage() for r in caplog.records if r.name == "craft_rag.engine"]
    assert messages[0] == (
        "starting the vLLM engine for m (usually 10-60 s on a CPU; longer on a busy machine) ..."
    )
    assert messages[1].startswith("the vLLM engine ready in ")
    assert len(messages) == 2
    assert capsys.readouterr().err == ""  # not twice


def test_settings_reach_vllms_engine_args(clean_logging: pytest.MonkeyPatch) -> None:
    pytest.importorskip("vllm")
    from craft_rag.engine.backends.vllm.backend import VLLMBackend

    quiet = VLLMBackend(EngineSettings(kv_events=False), "/m").engine_kwargs
    assert quiet["log_level"] == "ERROR" and quiet["use_tqdm_on_load"] is False
    loud = VLLMBackend(EngineSettings(kv_events=False, log_level="info"), "/m").engine_kwargs
    assert loud["log_level"] == "INFO" and "use_tqdm_on_load" not in loud
    mine = EngineSettings(kv_events=False, engine_kwargs={"use_tqdm_on_load": True})
    assert VLLMBackend(mine, "/m").engine_kwargs["use_tqdm_on_load"] is True
    clean_logging.setenv("VLLM_CONFIGURE_LOGGING", "0")
    assert "log_level" not in VLLMBackend(EngineSettings(kv_events=False), "/m").engine_kwargs


FIRST_ANSWER = """
import sys
from craft_rag import make_chunk
from craft_rag.engine import CraftEngine, EngineSettings

settings = EngineSettings(log_level=sys.argv[1], kv_cache_memory_bytes=256 << 20)
chunks = [make_chunk("Super Bowl 50 was won by the Denver Broncos.", id="sb50")]
with CraftEngine(settings) as engine:
    result = engine.generate(chunks, "Who won Super Bowl 50?", max_tokens=4)
print("ANSWER", repr(result.text), flush=True)
"""


def first_start_lines(log_level: str) -> list[str]:
    """Every stdout and stderr line of a fresh interpreter's first start and first answer
    (progress-bar redraws count as lines); the answer line is left out."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_LOGGING", "TQDM"))}
    env |= {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env |= {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONWARNINGS": ""}
    done = subprocess.run(
        [sys.executable, "-c", FIRST_ANSWER, log_level],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
        cwd=Path(__file__).parent,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    lines = [line for line in output.replace("\r", "\n").splitlines() if line.strip()]
    answers = [line for line in lines if line.startswith("ANSWER ")]
    assert len(answers) == 1, output[-4000:]
    return [line for line in lines if not line.startswith("ANSWER ")]


@pytest.mark.engine
def test_a_first_start_prints_at_most_two_lines_by_default() -> None:
    lines = first_start_lines("error")
    # craft-rag's own line, and torch's C++ NUMA notice on CPU (not reachable from Python).
    assert len(lines) <= 2, "\n".join(lines)
    assert lines[0].startswith("craft-rag: starting the vLLM engine for "), lines


@pytest.mark.engine
def test_log_level_info_shows_vllms_start_up_lines() -> None:
    lines = first_start_lines("info")
    vllm_info = [line for line in lines if " INFO " in line]
    assert len(vllm_info) >= 5, "\n".join(lines)
    assert any("Loading safetensors" in line for line in lines), "\n".join(lines)
