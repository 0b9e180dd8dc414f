"""One app worker process for test_routed_workers.py: ``CraftEngine(server=[...], routing=...,
store=...)`` serving the requests its parent sends, one JSON line each on stdin, answering one
JSON line each on stdout (its report's numbers, or the error). Run as a script:
``python routed_worker.py '<json config>'``; the config names the servers (each a URL, or an
object of :class:`ServerSettings` fields with its ``url``: a server behind a proxy names its
KV events port), the policy, the store URL and whether an app-side planner orders the prompts
first (``app_order``: an llm-d / Dynamo-style router fed CRAFT-ordered prompts; the app planner
shares the store too).

Each answer carries the request's ``i`` (from the request), ``ok`` (False: ``error`` is the
exception's repr; the worker goes on with the next request), ``t0``/``t1`` (``time.monotonic``
before and after the request: one system-wide clock on Linux, so the parent can tell which
requests were in flight at a moment it measured) and, when it succeeded, the report's numbers
(``replica``, ``retries``, ``rehomed``...). At the end of stdin the worker prints one last line
``{"faults": [...]}``: the replicas it saw lost (``engine.faults``). Chunk texts and questions
are data only (never a path, command or control token)."""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def main(config_text: str) -> int:
    from craft_rag.chunk import make_chunk
    from craft_rag.engine import CraftEngine, RoutedEngine, ServerSettings
    from craft_rag.planner import CraftPlanner, PlannerConfig

    config: dict[str, Any] = json.loads(config_text)
    servers: list[str | ServerSettings] = [
        spec if isinstance(spec, str) else ServerSettings(**spec) for spec in config["servers"]
    ]
    engine = CraftEngine(server=servers, routing=config["policy"], store=config["store"])
    assert isinstance(engine, RoutedEngine)
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
            t0 = time.monotonic()
            plan = None
            answer: dict[str, Any] = {"i": request.get("i")}
            try:
                if app is not None:
                    plan = app.plan(chunks)
                    chunks = list(plan.ordered)
                result = engine.generate(chunks, request["query"], max_tokens=1)
            except Exception as exc:  # reported per request; the worker serves the next one
                if app is not None and plan is not None:
                    app.abort(plan)
                answer |= {"ok": False, "error": repr(exc), "t0": t0, "t1": time.monotonic()}
                print(json.dumps(answer), flush=True)
                continue
            t1 = time.monotonic()
            report = result.report
            if app is not None and plan is not None:
                app.commit(
                    plan, prefix_tokens=report.prefix_tokens, reused_chunks=report.reused_chunks
                )
            answer |= {
                "ok": True,
                "t0": t0,
                "t1": t1,
                "cached": report.cached_tokens,
                "prompt": report.prompt_tokens,
                "replica": report.replica,
                "retries": report.retries,
                "rehomed": report.rehomed,
                "ttft_ms": report.ttft_ms,
            }
            print(json.dumps(answer), flush=True)
        faults = [{"replica": f.replica, "inflight_lost": f.inflight_lost} for f in engine.faults]
        print(json.dumps({"faults": faults}), flush=True)
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
