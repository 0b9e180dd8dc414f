"""TTFT of CraftTierConnector tier hits vs recompute, and its own time on requests that miss.

Usage (two processes over one tier directory: the second one's hits come from disk):

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python scripts/kvtiers_ttft.py DIR cold
    VLLM_ENABLE_V1_MULTIPROCESSING=0 python scripts/kvtiers_ttft.py DIR warm

``cold``: N fresh ~600-token prompts (misses: computed and written to the tiers; the connector's
own time is summed over its hooks), the same prompts again after a flood evicted them from the
pool (RAM hits), and recomputed with ``skip_reading_prefix_cache``. ``warm``: the same prompts
in a new engine (disk hits), then recomputed. TTFT = wall time of a ``max_tokens=1`` request.
Prints one JSON line.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

N, LEN, BLOCK = 3, 600, 32


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(LEN)]


def timed_hooks(obj: Any, names: list[str], acc: list[float]) -> None:
    """Wrap ``obj``'s methods so their wall time adds up in ``acc[0]``."""
    for name in names:
        original: Callable[..., Any] = getattr(obj, name)

        def wrapper(*args: Any, _f: Callable[..., Any] = original, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return _f(*args, **kwargs)
            finally:
                acc[0] += time.perf_counter() - start

        setattr(obj, name, wrapper)


def main() -> None:
    disk_dir, phase = Path(sys.argv[1]), sys.argv[2]
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from craft_rag.engine.cpu_dtype import default_dtype
    from craft_rag.engine.model import resolve_model
    from craft_rag.kvtiers.tier_settings import KVTierSettings

    disk_dir.mkdir(mode=0o700, exist_ok=True)
    tiers = KVTierSettings(ram_bytes=1 << 30, disk_bytes=1 << 30, disk_dir=disk_dir)
    llm = LLM(model=resolve_model(None), dtype=default_dtype(), enforce_eager=True,
              block_size=BLOCK, enable_prefix_caching=True, num_gpu_blocks_override=48,
              kv_cache_memory_bytes=256 << 20, max_model_len=1024, seed=0,
              disable_log_stats=True,
              kv_transfer_config=KVTransferConfig(**tiers.transfer_config()))
    conn = llm.llm_engine.engine_core.engine_core.scheduler.connector
    acc = [0.0]
    timed_hooks(conn, ["get_num_new_matched_tokens", "update_state_after_alloc",
                       "build_connector_meta", "update_connector_output", "request_finished"], acc)
    timed_hooks(get_kv_transfer_group(), ["start_load_kv", "wait_for_save",
                                          "build_connector_worker_meta"], acc)

    def ttft(tokens: list[int], scratch: bool = False) -> tuple[float, float, Any]:
        params = SamplingParams(max_tokens=1, temperature=0.0, skip_reading_prefix_cache=scratch)
        acc[0] = 0.0
        start = time.perf_counter()
        (out,) = llm.generate([{"prompt_token_ids": tokens}], params, use_tqdm=False)
        return time.perf_counter() - start, acc[0], out

    ttft(prompt(999)[:64])  # warm-up
    result: dict[str, Any] = {"phase": phase, "dtype": default_dtype()}
    if phase == "cold":
        miss = [ttft(prompt(i)) for i in range(N)]
        result["miss_ttft_s"] = [round(t, 3) for t, _, _ in miss]
        result["miss_connector_s"] = [round(c, 4) for _, c, _ in miss]
        result["miss_overhead_pct"] = round(
            100 * statistics.median(c / t for t, c, _ in miss), 2)
        for i in range(3):
            ttft(prompt(500 + i))  # evict the prompts from the pool
        hits = [ttft(prompt(i)) for i in range(N)]
        result["ram_hit_ttft_s"] = [round(t, 3) for t, _, _ in hits]
        result["ram_hit_cached"] = [o.num_cached_tokens for _, _, o in hits]
        result["ram_hit_tiers"] = [o.kv_transfer_params for _, _, o in hits]
    else:
        hits = [ttft(prompt(i)) for i in range(N)]
        result["disk_hit_ttft_s"] = [round(t, 3) for t, _, _ in hits]
        result["disk_hit_cached"] = [o.num_cached_tokens for _, _, o in hits]
        result["disk_hit_tiers"] = [o.kv_transfer_params for _, _, o in hits]
    recompute = [ttft(prompt(i), scratch=True) for i in range(N)]
    result["recompute_ttft_s"] = [round(t, 3) for t, _, _ in recompute]
    result["recompute_connector_s"] = [round(c, 4) for _, c, _ in recompute]
    result["store"] = {k: v for k, v in vars(conn.store.stats()).items()} if hasattr(
        conn.store.stats(), "__dict__") else str(conn.store.stats())
    llm.llm_engine.engine_core.shutdown()
    print("RESULT " + json.dumps(result, default=str))


if __name__ == "__main__":
    main()
