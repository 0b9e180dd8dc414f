"""The serving-layer routing policies (``prefix_blocks``, ``prefix_craft_order``, or any listed)
on the full lexical SQuAD + HotpotQA trace of ``bench routing``, with its stored prefill model:
the rows of docs/routing.md "With an existing serving layer" (full trace). One JSON row per
(KV size, N, policy) is printed as it finishes (~1-2 min each on a loaded 2-core machine).

    HF_HUB_OFFLINE=1 nice -n 10 .venv/bin/python \\
        benchmarks/craft-rag-bench/scripts/routing_serving_layer.py prefix_blocks,prefix_craft_order
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from craft_rag.routing.queueing import TTFTModel
from craft_rag.routing.simulator import SimConfig, prepare_trace, simulate
from craft_rag_bench.bench import routing as bench

MODEL_FILE = Path("benchmarks/results/routing.json")


def main(argv: list[str]) -> int:
    policies = argv[0].split(",") if argv else ["prefix_blocks", "prefix_craft_order"]
    stored = json.loads(MODEL_FILE.read_text())["ttft_model"]
    model = TTFTModel(stored["a"], stored["b"], stored["c"])
    from craft_rag.engine.chat_format import derive_chat_format
    from craft_rag.paths import default_model_dir
    from craft_rag.tokenizer import HFTokenizer, load_tokenizer

    trace = bench.lexical_trace(("squad", "hotpotqa"), requests=None, seed=0)
    tokenizer = load_tokenizer(fallback=True)  # as BenchContext.tokenizer / prompt_format
    fmt = derive_chat_format(default_model_dir()) if isinstance(tokenizer, HFTokenizer) else None
    prepared = prepare_trace(trace, tokenizer, fmt)
    for capacity in bench.CAPACITIES:
        for n in (2, 8, 32, 128):
            for policy in policies:
                row = simulate(prepared, SimConfig(
                    replicas=n, policy=policy, capacity_tokens=capacity, block_size=32,
                    load=bench.LOAD, seed=0, ttft_model=model,
                )).row()
                print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
