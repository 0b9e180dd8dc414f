"""Warm restart after a SIGTERM: ``craft-rag serve`` with a disk tier, stopped by a SIGTERM to
its PID, restarted on the same folder, serves the same prompts from the disk tier with the same
greedy text.

Write-through is off here, so every block is only in RAM when the signal comes: they reach the
disk only if the SIGTERM reaches the connector's ``shutdown()`` (the store's close copies them
down). vLLM 0.32's API server kills its EngineCore at once unless ``--shutdown-timeout`` gives it
time; ``craft-rag serve`` passes one when a disk tier is on. One server start pair.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from serve_process import LOADABLE, block_files, prompt, serve

pytestmark = pytest.mark.server

SEEDS = (11, 12, 13)


def test_sigterm_keeps_ram_blocks_for_the_restart(tmp_path: Path) -> None:
    from craft_rag.kvtiers.tier_tokens import tier_tokens_of

    tier_dir = tmp_path / "tiers"
    flags = ("--no-kv-tier-write-through",)
    before: dict[int, dict[str, Any]] = {}
    with serve(tier_dir, *flags) as server:
        for seed in SEEDS:
            server.complete(prompt(seed))
            before[seed] = server.complete(prompt(seed))  # a pool hit; the blocks are in RAM
        assert block_files(tier_dir) == 0, "write-through is off: nothing on disk yet"
        server.terminate()
    assert block_files(tier_dir) == len(SEEDS) * (LOADABLE // 32)
    with serve(tier_dir, *flags) as server:
        after = {seed: server.complete(prompt(seed)) for seed in SEEDS}
        server.terminate()
    for seed in SEEDS:
        assert before[seed]["usage"]["prompt_tokens_details"]["cached_tokens"] == LOADABLE
        params = after[seed]["kv_transfer_params"]
        assert tier_tokens_of(params, maximum=len(prompt(seed))) == (0, LOADABLE)
        assert after[seed]["usage"]["prompt_tokens_details"]["cached_tokens"] == LOADABLE
        assert after[seed]["choices"][0]["text"] == before[seed]["choices"][0]["text"]
