"""Multi-turn RAG chat with CraftConversation on the embedded default engine (MTRAG turns).

Each turn sends the passages MTRAG showed for it. The engine keeps the session's prompt
append-only and leaves out passages an earlier turn already sent, so each turn reuses all
earlier turns' KV. Its first turn then runs for another tenant (a session with its own
``cache_salt``): the same prompt reuses nothing across tenants. The same conversation then runs
again with prefix-cache reads off (the no-cache baseline) for comparison; the last turn
streams token by token.

Needs: pip install -e benchmarks/craft-rag-bench (the data loaders); pip install --no-deps -e
integrations/langchain-craft. Run:
python examples/langchain_chat.py [--turns N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from langchain_core.documents import Document
from langchain_craft import ChatCraftVLLM, CraftConversation
from langchain_craft.conversation import InMemoryHistory

from craft_rag.engine.engine import CraftEngine, EngineSettings
from craft_rag_bench.datasets import Conversation, load_dataset


class SessionStore:
    """Session id -> message list; any BaseChatMessageHistory works here too."""

    def __init__(self) -> None:
        self.sessions: dict[str, InMemoryHistory] = {}

    def get(self, session_id: str) -> InMemoryHistory:
        return self.sessions.setdefault(session_id, InMemoryHistory())


def turn_documents(conversation: Conversation, i: int) -> list[Document]:
    return [
        Document(page_content=p.content, id=p.id, metadata={"title": p.title})
        for p in (shown.passage for shown in conversation.turns[i].contexts)
    ]


def pick_conversation(turns: int) -> Conversation:
    """The MTRAG conversation whose first ``turns`` turns re-show the most passages, among
    those whose passages fit comfortably in the context (~9,000 characters)."""
    best, best_repeats = None, -1
    for conv in load_dataset("mtrag").conversations:
        if len(conv.turns) < turns:
            continue
        shown = [s.passage for t in conv.turns[:turns] for s in t.contexts]
        unique = {p.id: p for p in shown}
        if sum(len(p.content) for p in unique.values()) > 9000:
            continue
        repeats = len(shown) - len(unique)
        if repeats > best_repeats:
            best, best_repeats = conv, repeats
    assert best is not None, "no MTRAG conversation fits; lower --turns"
    return best


def chat(
    engine: CraftEngine,
    conversation: Conversation,
    turns: int,
    *,
    read_cache: bool,
    show: bool,
    cache_salt: str | None = None,
) -> list[dict[str, Any]]:
    store = SessionStore()
    bot = CraftConversation(
        llm=ChatCraftVLLM(engine=engine, max_tokens=24, read_prefix_cache=read_cache),
        get_session_history=store.get,
        cache_salt=cache_salt,  # one salt per session: its prefix-cache namespace
    )
    config: Any = {"configurable": {"session_id": f"demo-{uuid.uuid4().hex[:8]}"}}
    reports = []
    for i in range(turns):
        question = conversation.turns[i].question
        request = {"question": question, "documents": turn_documents(conversation, i)}
        if show and i == turns - 1:
            print(f"  turn {i + 1} (streamed): {question[:60]!r}\n    -> ", end="", flush=True)
            for chunk in bot.stream(request, config):
                print(chunk.text, end="", flush=True)
                if chunk.response_metadata.get("craft"):
                    reports.append(chunk.response_metadata["craft"])
            print()
        else:
            reply = bot.invoke(request, config)
            reports.append(reply.response_metadata["craft"])
            if show:
                print(f"  turn {i + 1}: {question[:60]!r}\n    -> {reply.text.strip()[:70]!r}")
        if show:
            r = reports[-1]
            print(
                f"     sent {len(r['chunk_order'])} new passages, left out "
                f"{len(r['removed_duplicates'])} already sent; cached {r['cached_tokens']}/"
                f"{r['prompt_tokens']} tokens ({r['cached_fraction']:.0%}), "
                f"TTFT {r['ttft_ms']:.0f} ms"
            )
    history = store.sessions[config["configurable"]["session_id"]].messages
    assert len(history) == 2 * turns
    return reports


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=5)
    args = parser.parse_args()
    conversation = pick_conversation(args.turns)
    print(f"MTRAG conversation {conversation.id} ({conversation.domain}), {args.turns} turns")

    t0 = time.perf_counter()
    with CraftEngine(EngineSettings()) as engine:  # the embedded SmolLM2-135M-Instruct
        print(f"engine up in {time.perf_counter() - t0:.1f} s")
        print("CRAFT (append-only, deduplicated):")
        craft = chat(engine, conversation, args.turns, read_cache=True, show=True)
        same = chat(engine, conversation, 1, read_cache=True, show=False)[0]
        tenant = chat(engine, conversation, 1, read_cache=True, show=False, cache_salt="b")[0]
        print(
            f"turn 1 again in a new session: cached {same['cached_tokens']}/"
            f"{same['prompt_tokens']} tokens; for another tenant (cache_salt): "
            f"{tenant['cached_tokens']}/{tenant['prompt_tokens']}"
        )
        engine.reset_prefix_cache()
        baseline = chat(engine, conversation, args.turns, read_cache=False, show=False)

    print()
    print("turn  prompt  cached  TTFT CRAFT  TTFT no-cache")
    for i, (c, b) in enumerate(zip(craft, baseline, strict=True)):
        print(
            f"{i + 1:4d}  {c['prompt_tokens']:6d}  {c['cached_tokens']:6d}  "
            f"{c['ttft_ms']:7.0f} ms  {b['ttft_ms']:10.0f} ms"
        )
    later_c = statistics.mean(c["ttft_ms"] for c in craft[1:])
    later_b = statistics.mean(b["ttft_ms"] for b in baseline[1:])
    left_out = sum(len(c["removed_duplicates"]) for c in craft)
    print(
        f"turns 2..{args.turns}: mean TTFT {later_c:.0f} ms with reuse vs {later_b:.0f} ms "
        f"without ({later_b / later_c:.1f}x); passages left out as already sent: {left_out}"
    )


if __name__ == "__main__":
    main()
