"""Not collected (no ``test_`` prefix): the cached tokens behind the trace choice of
test_routed_workers.py, measured on the session's two real servers. Run by path:

    CRAFT_RAG_SWEEP_TRACES=tests/fixtures/squad_30.jsonl,tests/fixtures/hotpotqa_60.jsonl \\
        pytest -m server tests/server/routed_ratio_sweep.py -s

For each replay-format trace named, the WHOLE trace through ``round_robin`` and through
``craft_joint`` (one process, one request at a time from empty caches, as the test's one-process
passes); prints the cached tokens of every prefix of 24, 30, 36, 48 and 60 requests (one pass
per policy serves every prefix: requests run one at a time, so the first N requests' tokens are
those of a run of N) and mean TTFT (wall time: only meaningful on a quiet machine). Token
counts do not depend on load. JSON lines go to ``CRAFT_RAG_SWEEP_OUT`` when set."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from test_routed_workers import one_process

pytestmark = pytest.mark.server

PREFIXES = (24, 30, 36, 48, 60)


def load(path: str) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [
        {"chunks": [[c["id"], c["text"]] for c in row["chunks"]], "query": row["query"]}
        for row in rows
    ]


def test_sweep(two_vllm_servers: tuple[str, str]) -> None:
    paths = [p for p in os.environ.get("CRAFT_RAG_SWEEP_TRACES", "").split(",") if p]
    if not paths:
        pytest.skip("set CRAFT_RAG_SWEEP_TRACES=trace.jsonl[,trace.jsonl...]")
    out = os.environ.get("CRAFT_RAG_SWEEP_OUT")
    for path in paths:
        trace = load(path)
        totals: dict[str, list[int]] = {}
        for policy in ("round_robin", "craft_joint"):
            rows = one_process(two_vllm_servers, trace, policy)
            cached = [r["cached"] for r in rows]
            totals[policy] = [sum(cached[:n]) for n in PREFIXES if n <= len(rows)]
            ttft = sum(r["ttft_ms"] for r in rows) / len(rows)
            print(f"\n{path} {policy}: cached {totals[policy]} mean TTFT {ttft:.0f} ms")
            if out:
                with Path(out).open("a") as f:
                    f.write(json.dumps({"trace": path, "policy": policy, "rows": rows}) + "\n")
        sizes = [n for n in PREFIXES if n <= len(trace)]
        for n, rr, joint in zip(sizes, totals["round_robin"], totals["craft_joint"], strict=True):
            print(f"{path} first {n}: craft_joint / round_robin = {joint / max(rr, 1):.3f}")
