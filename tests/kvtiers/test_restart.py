"""Warm restart of the disk tier under ``craft-rag serve``, after a SIGTERM and after a crash:
three server starts on one folder (a pair per case would take four; each start is most of the
cost on a 2-core CPU).

1. Write-through off, SIGTERM to the server's PID: every block is only in RAM when the signal
   comes, so they reach the disk only if the SIGTERM reaches the connector's ``shutdown()``
   (the store's close copies them down). vLLM 0.32's API server kills its EngineCore at once
   unless ``--shutdown-timeout`` gives it time; ``craft-rag serve`` passes one when a disk tier
   is on.
2. Restarted with write-through (the default): the SIGTERM case's prompts come from the disk
   tier with the same greedy text; new prompts' blocks are written through while serving, then
   the whole process group is SIGKILLed (a crash: no shutdown code runs).
3. Restarted again: the crash case's prompts come from the disk tier with the same greedy text.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from serve_process import BLOCK, LOADABLE, block_files, prompt, serve

pytestmark = pytest.mark.server

TERM_SEEDS = (11, 12, 13)
KILL_SEEDS = (21, 22, 23)
PER_PROMPT = LOADABLE // BLOCK  # full blocks a prompt leaves in the tiers


def _from_disk(answer: dict[str, Any], seed: int) -> None:
    from craft_rag.kvtiers.tier_tokens import tier_tokens_of

    params = answer["kv_transfer_params"]
    assert tier_tokens_of(params, maximum=len(prompt(seed))) == (0, LOADABLE)
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == LOADABLE


def test_warm_restart_after_sigterm_and_after_sigkill(tmp_path: Path) -> None:
    tier_dir = tmp_path / "tiers"
    with serve(tier_dir, "--no-kv-tier-write-through") as server:
        term_before = {s: server.complete(prompt(s)) for s in TERM_SEEDS}
        assert block_files(tier_dir) == 0, "write-through is off: nothing on disk yet"
        server.terminate()
    assert block_files(tier_dir) == len(TERM_SEEDS) * PER_PROMPT, "SIGTERM reached shutdown()"

    with serve(tier_dir) as server:
        term_after = {s: server.complete(prompt(s)) for s in TERM_SEEDS}
        kill_before = {s: server.complete(prompt(s)) for s in KILL_SEEDS}
        expected = (len(TERM_SEEDS) + len(KILL_SEEDS)) * PER_PROMPT
        deadline = time.monotonic() + 60
        while block_files(tier_dir) < expected and time.monotonic() < deadline:
            time.sleep(0.5)  # the writer thread is off the request path: let it catch up
        assert block_files(tier_dir) == expected, "write-through wrote while serving"
        server.kill_tree()  # a crash: no connector shutdown, no store close

    with serve(tier_dir) as server:
        kill_after = {s: server.complete(prompt(s)) for s in KILL_SEEDS}
        server.terminate()

    for seed in TERM_SEEDS:
        _from_disk(term_after[seed], seed)
        assert term_after[seed]["choices"][0]["text"] == term_before[seed]["choices"][0]["text"]
    for seed in KILL_SEEDS:
        _from_disk(kill_after[seed], seed)
        assert kill_after[seed]["choices"][0]["text"] == kill_before[seed]["choices"][0]["text"]
