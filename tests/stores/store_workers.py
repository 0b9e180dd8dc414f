"""Worker processes for the multi-process store tests (spawned: this module is imported fresh).

A worker owns one planner attached to a shared store and answers commands over a pipe.
Requests name chunks by index; every process builds the same chunks from them.
"""

from __future__ import annotations

from multiprocessing.connection import Connection
from typing import Any

from craft_rag import Chunk, CraftPlanner, PlannerConfig, make_chunk

CONFIG = PlannerConfig(policy="tree", window=40, max_tree_nodes=60, max_conversations=8)


def chunk(i: int) -> Chunk:
    return make_chunk(f"passage {i}", id=f"doc-{i}", num_tokens=20 + i % 7)


def serve(planner: CraftPlanner, ids: list[int], conv: str | None, reused: int | None) -> Any:
    plan = planner.plan([chunk(i) for i in ids], conv)
    result = planner.commit(plan, prefix_tokens=11, reused_chunks=reused)
    planner._check_invariants()
    return (
        list(plan.keys),
        [c.key for c in plan.removed_duplicates],
        plan.turn,
        plan.matched_chunks,
        (result.reused_chunks, result.inserted_path, result.stale_nodes_removed),
    )


def state_of(planner: CraftPlanner) -> Any:
    planner.sync()
    planner._check_invariants()
    nodes = []
    stack = list(planner.prefix_tree.root.children.values())
    while stack:
        node = stack.pop()
        nodes.append((node.path(), node.token_start, node.token_end))
        stack.extend(node.children.values())
    convs = planner.conversations.to_json()["conversations"]
    return (
        sorted(planner.access_table._counts.items()),
        sorted(nodes),
        [(c["id"], c["turns"]) for c in convs],
    )


def worker(url: str, conn: Connection, config: PlannerConfig = CONFIG) -> None:
    """Answer ``("serve", ids, conv, reused)``, ``("run", requests)`` (serve a list, planning
    a turn again when another worker committed one first), ``("state",)``, ``("stop",)``."""
    planner = CraftPlanner(config, store=url)
    while True:
        command = conn.recv()
        if command[0] == "serve":
            conn.send(serve(planner, *command[1:]))
        elif command[0] == "run":
            done, conflicts = [], 0
            for ids, conv in command[1]:
                while True:
                    try:
                        done.append((conv, serve(planner, ids, conv, None)))
                        break
                    except RuntimeError as e:
                        if "moved on" not in str(e):
                            raise
                        conflicts += 1
            conn.send((done, conflicts))
        elif command[0] == "state":
            conn.send(state_of(planner))
        else:
            conn.send("bye")
            return


def commit_forever(url: str, ready: Any) -> None:
    """Commit in a loop until killed (the SIGKILL test)."""
    planner = CraftPlanner(CONFIG, store=url)
    i = 0
    while True:
        ids = [(i * 7 + j * 3) % 50 for j in range(5)]
        conv = f"chat-{i % 5}" if i % 2 else None
        serve(planner, ids, conv, None)
        i += 1
        if i == 20:
            ready.set()
