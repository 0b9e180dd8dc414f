"""Fixtures for the llama-index-postprocessor-craft tests: the shared ``events`` recorder from
:mod:`llama_index.postprocessor.craft.testing_fixtures`."""

from __future__ import annotations

from llama_index.postprocessor.craft.testing_fixtures import events

__all__ = ["events"]
