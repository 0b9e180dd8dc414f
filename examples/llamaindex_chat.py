"""Multi-turn RAG chat in LlamaIndex: CRAFT's append-only CraftChatEngine vs ContextChatEngine.

Both run the same follow-up questions over the same faiss index, LLM (CraftVLLM on the embedded
default engine) and ``ChatMemoryBuffer``, each from an empty prefix cache:

* ``ContextChatEngine`` (LlamaIndex's default) writes each turn's retrieved passages into the
  system message at the front, so every turn changes the first tokens and the history's KV is
  recomputed;
* ``CraftChatEngine`` appends each turn (new, deduplicated passages + question) after the
  previous turn's answer, so the whole history is a cached prefix.

Prints cached tokens, new vs. repeated passages and TTFT per turn, then a summary.

Needs: as examples/llamaindex_query_engine.py. Run: python examples/llamaindex_chat.py [--k K]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from llama_index.core.chat_engine import ContextChatEngine
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.base import BaseEvent
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent
from llama_index.core.memory import ChatMemoryBuffer
from llama_index.llms.craft_vllm import REUSE_KEY, CraftChatEngine, CraftVLLM
from llamaindex_query_engine import build_index

from craft_rag import CraftPlanner
from craft_rag.engine.engine import CraftEngine, EngineSettings
from craft_rag.engine.results import ReuseReport

TURNS = (
    "Who won Super Bowl 50?",
    "Who did they beat?",
    "Where was the game played?",
    "Who was named the game's MVP?",
    "Which team won Super Bowl 50 and what was the score?",
)


class ChatReports(BaseEventHandler):
    """Collects the reuse report of every LLM chat call (ContextChatEngine calls llm.chat)."""

    reports: list[ReuseReport]

    @classmethod
    def class_name(cls) -> str:
        return "ChatReports"

    def handle(self, event: BaseEvent, **kwargs: Any) -> None:
        if isinstance(event, LLMChatEndEvent) and event.response is not None:
            report = event.response.additional_kwargs.get(REUSE_KEY)
            if isinstance(report, ReuseReport):
                self.reports.append(report)


def line(turn: int, report: ReuseReport, extra: str, answer: str) -> str:
    return (
        f"  turn {turn}: cached {report.cached_tokens:4d}/{report.prompt_tokens:4d} tokens, "
        f"{extra}TTFT {report.ttft_ms:6.1f} ms -> {answer.strip()[:50]!r}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--k", type=int, default=3, help="passages per turn")
    args = parser.parse_args()

    index = build_index()
    retriever = index.as_retriever(similarity_top_k=args.k)
    retriever.retrieve(TURNS[0])  # warm the query encoder
    t0 = time.perf_counter()
    engine = CraftEngine(EngineSettings())
    print(f"engine up in {time.perf_counter() - t0:.1f} s")
    with engine:
        print("ContextChatEngine (context in the system message):")
        engine.reset_prefix_cache()
        engine.set_planner(CraftPlanner())
        llm = CraftVLLM(engine, max_tokens=24)
        recorder = ChatReports(reports=[])
        get_dispatcher().add_event_handler(recorder)
        baseline = ContextChatEngine.from_defaults(
            retriever=retriever, llm=llm, memory=ChatMemoryBuffer.from_defaults(llm=llm)
        )
        for i, q in enumerate(TURNS, 1):
            answer = str(baseline.chat(q))
            print(line(i, recorder.reports[-1], "", answer))
        context_reports = list(recorder.reports)

        print("CraftChatEngine (append-only, deduplicated):")
        engine.reset_prefix_cache()
        engine.set_planner(CraftPlanner())
        llm = CraftVLLM(engine, max_tokens=24)
        chat = CraftChatEngine(retriever, llm, memory=ChatMemoryBuffer.from_defaults(llm=llm))
        craft_reports = []
        for i, q in enumerate(TURNS, 1):
            streamed = chat.stream_chat(q)
            answer = "".join(streamed.response_gen)
            report = chat.last_reuse_report
            assert report is not None
            craft_reports.append(report)
            extra = (
                f"{len(report.chunk_order)} new + {len(report.removed_duplicates)} repeated "
                "passages, "
            )
            print(line(i, report, extra, answer))
        print(f"  memory holds {len(chat.chat_history)} messages")

    # Uncached tokens are what prefill computes; on a busy shared CPU they are a steadier
    # measure than TTFT, which is roughly proportional to them (docs/engine.md).
    runs = (("ContextChatEngine", context_reports), ("CraftChatEngine", craft_reports))
    for name, reports in runs:
        later = reports[1:]  # turn 1 is cold for both
        cached = sum(r.cached_tokens for r in later) / sum(r.prompt_tokens for r in later)
        print(
            f"{name:<18} turns 2-{len(reports)}: mean TTFT "
            f"{statistics.mean(r.ttft_ms for r in later):7.1f} ms, cached-token fraction "
            f"{cached:5.1%}, uncached (computed) tokens {sum(r.uncached_tokens for r in later)}"
        )


if __name__ == "__main__":
    main()
