"""Fixtures for the llama-index-retrievers-craft tests: the shared ``events`` and
``squad_index`` from :mod:`llama_index.postprocessor.craft.testing_fixtures`."""

from __future__ import annotations

from llama_index.postprocessor.craft.testing_fixtures import events, squad_index

__all__ = ["events", "squad_index"]
