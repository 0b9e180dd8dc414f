"""CraftTierConnector on the real in-process vLLM CPU engine, loaded by module path.

One engine start covers: a prompt evicted from the pool is served from the tiers with the same
greedy output as a from-scratch run; a flipped byte in a tier file means recompute from that
block (same output); two salts never share. Warm restart runs two engines in two processes over
one disk directory. Each engine needs its own process (vLLM's global state), hence
:func:`craft_rag.testing.rerun_in_own_process`.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from craft_rag.testing import rerun_in_own_process

pytestmark = pytest.mark.engine

BLOCK = 32
PROMPT_LEN = 600  # 18 full blocks; 17 loadable (the block holding the last token is computed)
LOADABLE = (PROMPT_LEN - 1) // BLOCK * BLOCK
MIB = 1 << 20


def make_prompt(seed: int, n: int = PROMPT_LEN) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(n)]


def make_llm(disk_dir: Path, ram_bytes: int, disk_bytes: int = 1 << 30) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from craft_rag.engine.cpu_dtype import default_dtype
    from craft_rag.engine.model import resolve_model

    extra = {"ram_bytes": ram_bytes, "disk_bytes": disk_bytes, "disk_dir": str(disk_dir),
             "policy": "pgdsf"}
    return LLM(
        model=resolve_model(None),
        dtype=default_dtype(),
        enforce_eager=True,
        block_size=BLOCK,
        enable_prefix_caching=True,
        num_gpu_blocks_override=48,  # ~2 prompts of 600 tokens: a flood evicts A from the pool
        kv_cache_memory_bytes=256 * MIB,
        max_model_len=1024,
        seed=0,
        disable_log_stats=True,
        kv_transfer_config=KVTransferConfig(
            kv_connector="CraftTierConnector",
            kv_connector_module_path="craft_rag.kvtiers.connector",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        ),
    )


def run(llm: Any, tokens: list[int], salt: str | None = None, scratch: bool = False) -> Any:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0.0, skip_reading_prefix_cache=scratch)
    prompt: dict[str, Any] = {"prompt_token_ids": tokens}
    if salt is not None:
        prompt["cache_salt"] = salt
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    return out


def tiers_of(out: Any) -> dict[str, int]:
    params = out.kv_transfer_params or {}
    return dict(params.get("craft_tiers", {}))


def flood(llm: Any, seed: int) -> None:
    for i in range(3):
        run(llm, make_prompt(seed + i))


def connector_of(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler.connector


def test_tier_hits_exact_corruption_and_salts(tmp_path: Path) -> None:
    if rerun_in_own_process(__file__, "test_tier_hits_exact_corruption_and_salts"):
        return
    from craft_rag.engine.backends.vllm.backend import step_output_of
    from craft_rag.kvtiers import Tier, chain_keys
    from craft_rag.kvtiers.disk_tier import block_path

    block_bytes = None
    llm = make_llm(tmp_path / "tiers", ram_bytes=6 * 1_500_000)  # a few blocks: most go to disk
    conn = connector_of(llm)
    a = make_prompt(1)

    # (1) from scratch (also writes A's blocks through to the tiers), evicted, served again
    base = run(llm, a, scratch=True)
    assert base.num_cached_tokens == 0
    flood(llm, 100)
    hit = run(llm, a)
    t = tiers_of(hit)
    assert hit.num_cached_tokens == LOADABLE, (hit.num_cached_tokens, t)
    assert t["ram_tokens"] + t["disk_tokens"] == LOADABLE
    assert t["disk_tokens"] > 0
    # The engine's backend reads the same split into what becomes the ReuseReport.
    step = step_output_of(hit)
    assert (step.tier_ram_tokens, step.tier_disk_tokens) == (t["ram_tokens"], t["disk_tokens"])
    assert list(hit.outputs[0].token_ids) == list(base.outputs[0].token_ids)
    stats = conn.store.stats()
    assert stats.disk_hits > 0 and stats.corrupt_drops == 0

    # (2) a flipped byte in a disk file: verified reads stop there, the rest is computed
    flood(llm, 200)
    conn.store.flush()
    keys = chain_keys(a, BLOCK, conn._namespace + "|")
    tiers = conn.store.lookup(keys[: LOADABLE // BLOCK])
    assert len(tiers) == LOADABLE // BLOCK
    j = next(i for i in range(len(tiers) - 1, -1, -1) if tiers[i] is Tier.DISK)
    path = block_path(tmp_path / "tiers", keys[j])
    raw = bytearray(path.read_bytes())
    block_bytes = len(raw)
    raw[-100] ^= 0xFF
    path.write_bytes(bytes(raw))
    again = run(llm, a)
    assert again.num_cached_tokens == j * BLOCK, (again.num_cached_tokens, j)
    assert list(again.outputs[0].token_ids) == list(base.outputs[0].token_ids)
    assert conn.store.stats().corrupt_drops == 1

    # (3) salts: a tenant's blocks (pool and tiers) never serve another tenant
    b = make_prompt(2)
    first = run(llm, b, salt="tenant-1")
    assert first.num_cached_tokens == 0
    other = run(llm, b, salt="tenant-2")
    assert other.num_cached_tokens == 0 and tiers_of(other) == {"ram_tokens": 0, "disk_tokens": 0}
    flood(llm, 300)
    same = run(llm, b, salt="tenant-1")
    assert same.num_cached_tokens == LOADABLE
    assert list(same.outputs[0].token_ids) == list(first.outputs[0].token_ids)
    assert block_bytes is not None


WARM_SCRIPT = """
import json, sys
sys.path.insert(0, {test_dir!r})
from test_connector_vllm import make_llm, make_prompt, run, tiers_of, connector_of
from pathlib import Path
llm = make_llm(Path({disk_dir!r}), ram_bytes={ram})
out = run(llm, make_prompt(7))
result = {{"cached": out.num_cached_tokens, "tiers": tiers_of(out),
          "tokens": list(out.outputs[0].token_ids)}}
llm.llm_engine.engine_core.shutdown()  # closes the store: RAM-only blocks go down to disk
print("RESULT" + json.dumps(result))
"""


def _warm_run(tmp_path: Path, ram: int) -> dict[str, Any]:
    script = WARM_SCRIPT.format(
        test_dir=str(Path(__file__).parent), disk_dir=str(tmp_path / "tiers"), ram=ram
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, check=False,
    )
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT")]
    assert done.returncode == 0 and lines, done.stdout[-2000:] + done.stderr[-3000:]
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT"):])
    return result


def test_warm_restart_serves_from_disk(tmp_path: Path) -> None:
    """Engine 1 computes a prompt and shuts down; engine 2 (a new process, same directory)
    loads it from disk with the same greedy output."""
    cold = _warm_run(tmp_path, ram=64 * MIB)
    assert cold["cached"] == 0
    warm = _warm_run(tmp_path, ram=64 * MIB)
    assert warm["cached"] == LOADABLE, warm
    assert warm["tiers"]["disk_tokens"] == LOADABLE
    assert warm["tokens"] == cold["tokens"]
