"""vLLM's log level follows craft-rag's; a user's VLLM_LOGGING_LEVEL wins (issue 15 item 5)."""

from __future__ import annotations

import logging

import pytest

from craft_rag.engine.logs import align_vllm_logging, start_progress, vllm_log_level


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    monkeypatch.delenv("CRAFT_RAG_SET_VLLM_LEVEL", raising=False)
    logger = logging.getLogger("craft_rag")
    monkeypatch.setattr(logger, "level", logging.NOTSET)
    return monkeypatch


def test_default_is_quiet_and_info_brings_vllm_back(clean_env: pytest.MonkeyPatch) -> None:
    import os

    assert vllm_log_level() == logging.ERROR  # unconfigured logging: WARNING -> ERROR
    align_vllm_logging()
    assert os.environ["VLLM_LOGGING_LEVEL"] == "ERROR"
    logging.getLogger("craft_rag").setLevel(logging.INFO)
    align_vllm_logging()  # set by us before: follows the new level
    assert os.environ["VLLM_LOGGING_LEVEL"] == "INFO"
    logging.getLogger("craft_rag").setLevel(logging.NOTSET)


def test_a_user_setting_wins(clean_env: pytest.MonkeyPatch) -> None:
    import os

    clean_env.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    align_vllm_logging()
    assert os.environ["VLLM_LOGGING_LEVEL"] == "DEBUG"


def test_progress_is_one_line_at_info(
    clean_env: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="craft_rag.engine"):
        done = start_progress("the vLLM engine (m)")
        done()
    messages = [r.getMessage() for r in caplog.records if r.name == "craft_rag.engine"]
    assert messages[0] == "starting the vLLM engine (m) ..."
    assert messages[1].startswith("the vLLM engine (m) ready in ")
    assert len(messages) == 2
