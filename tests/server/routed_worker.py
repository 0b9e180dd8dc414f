"""One app worker process for test_routed_workers.py: ``CraftEngine(server=[...], routing=...,
store=...)`` serving the requests its parent sends, one JSON line each on stdin, answering one
JSON line each on stdout (its report's numbers). Run as a script:
``python routed_worker.py '<json config>'``; the config names the servers, the policy, the
store URL and whether an app-side planner orders the prompts first (``app_order``: an
llm-d / Dynamo-style router fed CRAFT-ordered prompts; the app planner shares the store too).
Chunk texts and questions are data only (never a path, command or control token)."""

from __future__ import annotations

import json
import sys
from typing import Any


def main(config_text: str) -> int:
    from craft_rag.chunk import make_chunk
    from craft_rag.engine import CraftEngine
    from craft_rag.planner import CraftPlanner, PlannerConfig

    config: dict[str, Any] = json.loads(config_text)
    engine = CraftEngine(
        server=list(config["servers"]), routing=config["policy"], store=config["store"]
    )
    app = None
    if config.get("app_order"):
        app = CraftPlanner(
            PlannerConfig(policy="tree", promotion="served"),
            store=config["store"],
            namespace="app-order",
        )
    try:
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            request = json.loads(line)
            chunks = [make_chunk(text, id=cid) for cid, text in request["chunks"]]
            plan = None
            if app is not None:
                plan = app.plan(chunks)
                chunks = list(plan.ordered)
            result = engine.generate(chunks, request["query"], max_tokens=1)
            report = result.report
            if app is not None and plan is not None:
                app.commit(
                    plan, prefix_tokens=report.prefix_tokens, reused_chunks=report.reused_chunks
                )
            answer = {
                "cached": report.cached_tokens,
                "prompt": report.prompt_tokens,
                "replica": report.replica,
                "ttft_ms": report.ttft_ms,
            }
            print(json.dumps(answer), flush=True)
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
