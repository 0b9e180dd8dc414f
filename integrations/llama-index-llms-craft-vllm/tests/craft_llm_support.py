"""Test helpers for llama-index-llms-craft-vllm that the shared
:mod:`llama_index.postprocessor.craft.testing` lacks: the engine reuse check. A uniquely named
module (not ``conftest``), so a root run that also collects the sibling packages' tests imports
the right one."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def assert_whole_prefix_reused(engine: Any, chunks: Sequence[Any], report: Any) -> None:
    """``report`` (a repeated single-turn request) reused every cacheable prompt token (whole
    blocks, the last prompt token excluded), and its ``reused_chunks`` is the count of served
    chunks lying entirely inside the cached prefix (issue 11 item 9,
    :func:`craft_rag.metrics.chunks_inside_cache`) over the spans the engine's assembler gives
    ``chunks`` (any order: they are put in ``report.chunk_order``). A last chunk whose tail
    shares the trailing partial block with the question does not count."""
    from craft_rag.metrics import chunks_inside_cache

    by_key = {c.key: c for c in chunks}
    served = [by_key[k] for k in report.chunk_order]
    spans = engine.assembler.single_turn(served, "?").chunk_spans
    block = engine.block_size
    assert report.cached_tokens == (report.prompt_tokens - 1) // block * block > 0
    assert report.reused_chunks == chunks_inside_cache(spans, report.cached_tokens)
    assert report.reused_chunks >= len(served) - 1  # only a last chunk may miss the rule
