"""Warm restart after a crash: ``craft-rag serve`` with a disk tier and write-through (its
default) is SIGKILLed, process group and all, so no shutdown code runs; restarted on the same
folder, it serves the same prompts from the disk tier with the same greedy text. Without
write-through the blocks would have been only in RAM (tests/kvtiers/test_store_write_through.py
shows the store side). One server start pair.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from serve_process import BLOCK, LOADABLE, block_files, prompt, serve

pytestmark = pytest.mark.server

SEEDS = (21, 22, 23)


def test_sigkill_with_write_through_keeps_the_blocks(tmp_path: Path) -> None:
    from craft_rag.kvtiers.tier_tokens import tier_tokens_of

    tier_dir = tmp_path / "tiers"
    expected_files = len(SEEDS) * (LOADABLE // BLOCK)
    with serve(tier_dir) as server:
        before: dict[int, dict[str, Any]] = {s: server.complete(prompt(s)) for s in SEEDS}
        deadline = time.monotonic() + 60
        while block_files(tier_dir) < expected_files and time.monotonic() < deadline:
            time.sleep(0.5)  # the writer thread is off the request path: let it catch up
        assert block_files(tier_dir) == expected_files, "write-through wrote while serving"
        server.kill_tree()  # a crash: no connector shutdown, no store close
    with serve(tier_dir) as server:
        after = {seed: server.complete(prompt(seed)) for seed in SEEDS}
        server.terminate()
    for seed in SEEDS:
        params = after[seed]["kv_transfer_params"]
        assert tier_tokens_of(params, maximum=len(prompt(seed))) == (0, LOADABLE)
        assert after[seed]["usage"]["prompt_tokens_details"]["cached_tokens"] == LOADABLE
        assert after[seed]["choices"][0]["text"] == before[seed]["choices"][0]["text"]
