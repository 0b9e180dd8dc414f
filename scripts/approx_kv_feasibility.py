"""Can KV computed outside vLLM (a transformers copy of the model) stand in for vLLM's own?

Usage: ``VLLM_ENABLE_V1_MULTIPROCESSING=0 nice -n 10 python scripts/approx_kv_feasibility.py
[N] [OUT.json]`` (default 20 SQuAD dev prompts, docs/results/approx_kv_feasibility.json).

One in-process engine with :class:`craft_rag.kvtiers.approx_connector.CraftApproxConnector`
(prefix caching on, tiers RAM-only). For each SQuAD prompt (chat template: paragraph +
question), three runs of the same token ids:

- ``vllm``: vLLM's own full prefill (tenant salt "baseline", so no other run hits its blocks);
- ``vllm_again``: the same again with ``skip_reading_prefix_cache`` (the noise floor: 0 unless
  vLLM is nondeterministic);
- ``hf``: every prompt token but the last injected by the connector from ``hf_prefill`` (float32
  transformers forward), under a request-scoped salt; vLLM computes only the last token.

Per run: 16 greedy tokens with the top-20 logprobs at each step (one request). Reports the first
token's top-1 agreement and KL(vllm || run) over vLLM's top-20 (truncated, see ``kl``), greedy
16-token agreement (exact match of all 16, and mean matching prefix length), and the
connector's reuse report.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from craft_rag.metrics import lcp

TOP = 20
SQUAD = Path("/work/shared/data/squad")
BLOCK = 32


def squad_prompts(n: int, tokenizer: Any) -> list[list[int]]:
    """The first ``n`` (paragraph, question) pairs of SQuAD dev, one per paragraph."""
    data: list[Any] = []
    for part in sorted(SQUAD.glob("dev-v1.1.part*.json")):
        data.extend(json.loads(part.read_text())["data"])
    out: list[list[int]] = []
    for article in data:
        for para in article["paragraphs"]:
            question = para["qas"][0]["question"]
            messages = [
                {"role": "system", "content": "Answer the question from the context, briefly."},
                {"role": "user", "content": f"Context: {para['context']}\n\nQuestion: {question}"},
            ]
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                tokenize=True)
            if hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            out.append(list(ids))
            if len(out) == n:
                return out
            break  # one question per article keeps topics varied
    return out


def first_token_dist(output: Any) -> dict[int, float]:
    lps = output.outputs[0].logprobs[0]
    return {int(t): float(lp.logprob) for t, lp in lps.items()}


def kl(p: dict[int, float], q: dict[int, float]) -> float:
    """KL(p || q) over ``p``'s top-``TOP`` tokens, a token missing from ``q``'s top list taking
    ``q``'s smallest listed logprob (an upper bound on its true logprob, so a lower bound on
    its term) -- truncated: the tail beyond ``p``'s top-``TOP`` is left out."""
    floor = min(q.values())
    total = sum(math.exp(lp) * (lp - q.get(t, floor)) for t, lp in p.items())
    return max(total, 0.0)


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    out_path = Path(sys.argv[2] if len(sys.argv) > 2 else "docs/results/approx_kv_feasibility.json")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from craft_rag.engine.cpu_dtype import default_dtype
    from craft_rag.engine.model import embedded_model_dir
    from craft_rag.kvtiers.approx_params import request_scoped_salt, reuse_counts_of

    model_dir = str(embedded_model_dir())
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = squad_prompts(n, tok)
    dtype = default_dtype()
    llm = LLM(
        model=model_dir, dtype=dtype, enforce_eager=True, block_size=BLOCK,
        enable_prefix_caching=True, kv_cache_memory_bytes=512 << 20, max_model_len=2048,
        max_logprobs=TOP, seed=0, disable_log_stats=True,
        kv_transfer_config=KVTransferConfig(
            kv_connector="CraftApproxConnector",
            kv_connector_module_path="craft_rag.kvtiers.approx_connector",
            kv_role="kv_both", kv_connector_extra_config={"ram_bytes": 64 << 20},
        ),
    )

    def run(tokens: list[int], *, salt: str, extra: dict[str, Any] | None = None,
            scratch: bool = False) -> tuple[Any, float]:
        args = {"kv_transfer_params": extra} if extra else None
        prompt = {"prompt_token_ids": tokens, "cache_salt": salt}
        # one call: 16 greedy tokens with the top-20 logprobs of each (the full vocabulary's
        # logprobs cost minutes per request on this loaded 2-core machine)
        params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=TOP,
                                extra_args=args, skip_reading_prefix_cache=scratch,
                                detokenize=False)
        t = time.perf_counter()
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        return out, time.perf_counter() - t

    def summary(rows: list[dict[str, Any]], name: str) -> dict[str, Any]:
        xs = [r[name] for r in rows]
        return {
            "top1_agreement": sum(x["top1_agree"] for x in xs) / len(xs),
            "kl_mean": statistics.fmean(x["kl"] for x in xs),
            "kl_max": max(x["kl"] for x in xs),
            "max_abs_logprob_diff_top5": max(x["max_abs_logprob_diff_top5"] for x in xs),
            "greedy16_exact": sum(x["greedy16_equal"] for x in xs) / len(xs),
            "greedy_prefix_mean": statistics.fmean(x["greedy_prefix"] for x in xs),
        }

    def write(rows: list[dict[str, Any]]) -> dict[str, Any]:
        result = {
            "what": "KV of all prompt tokens but the last from a transformers float32 copy of the "
                    "embedded model, injected into vLLM's paged cache by CraftApproxConnector, vs "
                    "vLLM's own full prefill (same token ids)",
            "model": "SmolLM2-135M-Instruct (embedded)", "vllm_dtype": dtype, "hf_dtype": "float32",
            "block_size": BLOCK, "n": len(rows), "dataset": "SQuAD v1.1 dev (first question of the "
            "first paragraph of each article)",
            "prompt_tokens_mean": statistics.fmean(r["prompt_tokens"] for r in rows),
            "all_hf_reports_recomputed": all(
                r["hf_report"] is not None
                and r["hf_report"]["recomputed"] == r["prompt_tokens"] - 1 for r in rows),
            "vllm_again": summary(rows, "vllm_again"), "hf": summary(rows, "hf"),
            "cpu": os.uname().machine, "rows": rows,
        }
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(result, indent=1) + "\n")
        return result

    rows: list[dict[str, Any]] = []
    for i, tokens in enumerate(prompts):
        base1, t_base = run(tokens, salt="baseline", scratch=True)
        again1, _ = run(tokens, salt="baseline", scratch=True)
        spans = {"craft_approx": {"spans": [{"start": 0, "end": len(tokens) - 1,
                                             "source": "hf_prefill"}]}}
        hf1, t_hf = run(tokens, salt=request_scoped_salt(), extra=spans)
        p = first_token_dist(base1)
        report = reuse_counts_of(hf1.kv_transfer_params, prompt_len=len(tokens))
        g_base = list(base1.outputs[0].token_ids)
        row = {
            "prompt_tokens": len(tokens),
            "hf_report": None if report is None else report.to_params(),
            "hf_num_cached_tokens": hf1.num_cached_tokens,
            "time_vllm_s": round(t_base, 4), "time_hf_inject_s": round(t_hf, 4),
        }
        for name, one in (("vllm_again", again1), ("hf", hf1)):
            q = first_token_dist(one)
            g = list(one.outputs[0].token_ids)
            row[name] = {
                "top1_agree": max(p, key=p.__getitem__) == max(q, key=q.__getitem__),
                "kl": kl(p, q),
                "max_abs_logprob_diff_top5": max(
                    abs(p[t] - q.get(t, -1e9)) for t in sorted(p, key=p.__getitem__)[-5:]),
                "greedy16_equal": g == g_base,
                "greedy_prefix": lcp(g, g_base),
            }
        rows.append(row)
        print(i, json.dumps(row), flush=True)
        write(rows)  # after every row: a partial run still leaves its numbers
    final = write(rows)
    print(json.dumps({k: v for k, v in final.items() if k != "rows"}, indent=1))


if __name__ == "__main__":
    main()
