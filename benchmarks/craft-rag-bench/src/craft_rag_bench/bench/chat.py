"""``craft-rag bench chat``: multi-turn RAG chat, CRAFT vs the frameworks' chat engines.

Every system runs on ONE in-process engine with the prefix cache on, through craft-rag's LLM
classes, with the SAME chunks per turn (a fixed retriever hands each turn the passages the
dataset shows for it), the same greedy decoding and the same ``max_tokens``:

* ``craft``: LlamaIndex :class:`CraftChatEngine` (conversation dedup, the engine's default
  history budget and turn layout: append-only, or a compacted restart when the cost model
  predicts it faster, :mod:`craft_rag.engine.turn_layout`), condense off (retrieval is fixed);
* ``craft_append``: the same, append-only every turn (the layout rule's effect);
* ``craft_condense``: the same with the condense step on (its cost lands in TTFT);
* ``craft_nobudget``: CRAFT without a history budget (full mode; the budget's effect);
* ``li_context``: LlamaIndex ``ContextChatEngine`` over ``CraftVLLM`` (context in the system
  message, ``ChatMemoryBuffer``);
* ``li_condense_plus``: LlamaIndex ``CondensePlusContextChatEngine`` (condense, then context);
* ``lc_history``: LangChain ``RunnableWithMessageHistory`` over ``ChatPromptTemplate(system
  context, history, question) | ChatCraftVLLM``.

Per turn: TTFT as the user sees it (call to first streamed text, condense included), the
engine requests it made (prompt and computed = uncached tokens, from every request's
``ReuseReport``), and the answer, scored against the dataset's reference with token F1 and the
MiniLM cosine of :mod:`craft_rag_bench.bench.quality`. Each (conversation, system) starts from an
empty prefix cache. A ``ttft_grid`` study first measures TTFT against cached and uncached
length on the bare engine (where the time goes). Workloads: MTRAG conversations (the passages
shown per turn, reference answers) and a HotpotQA multi-turn trace (questions sharing a
paragraph chained into conversations; each turn's gold paragraphs plus distractors).

The harness imports llama_index and langchain inside :func:`run` only.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from craft_rag_bench.bench.qa_metrics import paired_t_test, token_f1

if TYPE_CHECKING:
    from craft_rag.engine import CraftEngine, GenerationResult
    from craft_rag_bench.bench.context import BenchContext


@dataclass(frozen=True, slots=True)
class ChatSizes:
    """How big ``bench chat`` runs. The full default fits ~25 minutes on the shared 2-core
    machine under load (4 systems x 18 turns, ~20 s a turn there); ``craft_condense`` and
    ``craft_nobudget`` are opt-in (``--chat-systems`` is not wired: edit ``systems``). Quick:
    under a minute once the engine runs."""

    mtrag_conversations: int = 4
    mtrag_turns: int = 3
    hotpot_conversations: int = 2
    hotpot_turns: int = 3
    top_k: int = 5
    max_tokens: int = 16
    systems: tuple[str, ...] = (
        "craft", "craft_append", "li_context", "li_condense_plus", "lc_history"
    )
    grid_cached: tuple[int, ...] = (0, 512, 1024, 2048)
    grid_uncached: tuple[int, ...] = (64,)


FULL = ChatSizes()
QUICK = ChatSizes(
    mtrag_conversations=1, mtrag_turns=2, hotpot_conversations=1, hotpot_turns=2, top_k=2,
    max_tokens=4, systems=("craft", "li_context", "li_condense_plus", "lc_history"),
    grid_cached=(0, 256), grid_uncached=(64,),
)
BASELINES = ("li_context", "li_condense_plus", "lc_history")


@dataclass(frozen=True, slots=True)
class ChatTurn:
    question: str
    chunks: tuple[tuple[str, str], ...]
    """``(passage id, text)`` in the order the dataset shows them."""
    golds: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ChatConversation:
    id: str
    turns: tuple[ChatTurn, ...]


def mtrag_conversations(n: int, max_turns: int, top_k: int) -> list[ChatConversation]:
    """The first ``n`` MTRAG conversations with at least two turns that show passages, cut to
    ``max_turns`` turns and ``top_k`` passages per turn."""
    from craft_rag_bench.datasets import load_mtrag

    out: list[ChatConversation] = []
    for conv in load_mtrag().conversations:
        turns = tuple(
            ChatTurn(
                t.question,
                tuple((str(s.passage.id), s.passage.content) for s in t.contexts[:top_k]),
                (t.answer,) if t.answer else (),
            )
            for t in conv.turns[:max_turns]
            if t.contexts
        )
        if len(turns) >= 2:
            out.append(ChatConversation(str(conv.id), turns))
        if len(out) == n:
            break
    return out


def hotpot_conversations(n: int, turns: int, top_k: int, seed: int) -> list[ChatConversation]:
    """HotpotQA questions that share a paragraph, chained into conversations of ``turns``
    turns; each turn shows its gold paragraphs then distractors (``top_k`` in all), so later
    turns meet paragraphs earlier turns already showed."""
    from craft_rag_bench.datasets import load_hotpotqa

    data = load_hotpotqa()
    passages = data.passage_map()
    by_passage: dict[str, list[int]] = {}
    for i, q in enumerate(data.questions):
        for pid in q.passage_ids:
            by_passage.setdefault(str(pid), []).append(i)
    used: set[int] = set()
    out: list[ChatConversation] = []
    for key in sorted(by_passage, key=lambda p: (-len(by_passage[p]), p)):
        group = [i for i in by_passage[key] if i not in used][:turns]
        if len(group) < 2:
            continue
        used.update(group)
        chat_turns = []
        for i in group:
            q = data.questions[i]
            gold = list(q.gold_passage_ids)
            order = gold + [p for p in q.passage_ids if p not in gold]
            shown = tuple((str(p), passages[p].content) for p in order[:top_k])
            chat_turns.append(ChatTurn(q.question, shown, q.answers))
        out.append(ChatConversation(f"hotpot:{key}", tuple(chat_turns)))
        if len(out) == n:
            break
    random.Random(seed).shuffle(out)
    return out


# ---- where the time goes: TTFT against cached and uncached length --------------------------


def ttft_grid(engine: CraftEngine, cached: Sequence[int], uncached: Sequence[int], seed: int
              ) -> list[dict[str, Any]]:
    """TTFT of a prompt whose first ``c`` tokens are cached and next ``u`` are not (random
    token ids; the prefix is served once first to cache it). Three repeats, median."""
    rng = random.Random(seed)
    rows = []
    for c in cached:
        for u in uncached:
            ttfts, hits = [], []
            for _ in range(3):
                prefix = [rng.randrange(1000, 20000) for _ in range(c)]
                if prefix:
                    engine.generate_tokens(prefix, max_tokens=1)
                tail = [rng.randrange(1000, 20000) for _ in range(u)]
                result = engine.generate_tokens([*prefix, *tail], max_tokens=1)
                ttfts.append(result.report.ttft_ms)
                hits.append(result.report.cached_tokens)
            ttfts.sort()
            rows.append({"cached": c, "uncached": u, "ttft_ms": ttfts[1],
                         "cached_tokens": sorted(hits)[1]})
    return rows


# ---- the systems --------------------------------------------------------------------------


class _Requests:
    """Every engine result finished while installed (the harness wraps ``engine._finish``:
    each framework calls the engine differently, the reports are the common ground)."""

    def __init__(self, engine: CraftEngine) -> None:
        self.engine = engine
        self.results: list[GenerationResult] = []
        self._original = engine._finish

    def __enter__(self) -> _Requests:
        original = self._original

        def finish(flight: Any) -> GenerationResult:
            result = original(flight)
            self.results.append(result)
            return result

        self.engine._finish = finish  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        self.engine._finish = self._original  # type: ignore[method-assign]


Turner = Callable[[ChatTurn], Iterator[str]]
"""Runs one turn; yields text deltas as they stream."""


def _systems(engine: CraftEngine, max_tokens: int) -> dict[str, Callable[[str], Turner]]:
    """System name -> (conversation id -> turn runner). Imports the frameworks."""
    from langchain_core.chat_history import InMemoryChatMessageHistory
    from langchain_core.prompts import ChatPromptTemplate, MessagesPlaceholder
    from langchain_core.runnables.history import RunnableWithMessageHistory
    from langchain_craft import ChatCraftVLLM
    from llama_index.core.base.base_retriever import BaseRetriever
    from llama_index.core.chat_engine import CondensePlusContextChatEngine, ContextChatEngine
    from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
    from llama_index.llms.craft_vllm import CraftChatEngine, CraftVLLM

    class Fixed(BaseRetriever):
        """Returns the current turn's passages whatever the query (same chunks everywhere)."""

        def __init__(self) -> None:
            super().__init__()
            self.turn: ChatTurn | None = None

        def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
            assert self.turn is not None
            return [NodeWithScore(node=TextNode(id_=pid, text=text), score=1.0)
                    for pid, text in self.turn.chunks]

    llm = CraftVLLM(engine, max_tokens=max_tokens)

    def llama(make: Callable[[Fixed], Any]) -> Callable[[str], Turner]:
        def start(cid: str) -> Turner:
            fixed = Fixed()
            chat = make(fixed)

            def turn(t: ChatTurn) -> Iterator[str]:
                fixed.turn = t
                yield from chat.stream_chat(t.question).response_gen

            return turn
        return start

    def craft(condense: bool) -> Callable[[str], Turner]:
        return llama(lambda f: CraftChatEngine(f, llm, condense=condense))

    def langchain(cid: str) -> Turner:
        prompt = ChatPromptTemplate.from_messages([
            ("system", "Answer the question using the context.\n\nContext:\n{context}"),
            MessagesPlaceholder("history"),
            ("human", "{question}"),
        ])
        history = InMemoryChatMessageHistory()
        chain = RunnableWithMessageHistory(
            prompt | ChatCraftVLLM(engine=engine, max_tokens=max_tokens),
            lambda _: history, input_messages_key="question", history_messages_key="history",
        )

        def turn(t: ChatTurn) -> Iterator[str]:
            context = "\n\n".join(text for _, text in t.chunks)
            config: Any = {"configurable": {"session_id": cid}}
            for chunk in chain.stream({"question": t.question, "context": context}, config):
                yield chunk.text

        return turn

    return {
        "craft": craft(False),
        "craft_append": craft(False),
        "craft_nobudget": craft(False),
        "craft_condense": craft(True),
        "li_context": llama(lambda f: ContextChatEngine.from_defaults(retriever=f, llm=llm)),
        "li_condense_plus": llama(
            lambda f: CondensePlusContextChatEngine.from_defaults(retriever=f, llm=llm)
        ),
        "lc_history": langchain,
    }


def _serve(engine: CraftEngine, start: Callable[[str], Turner], conv: ChatConversation,
           system: str) -> list[dict[str, Any]]:
    """All turns of one conversation on one system, from an empty prefix cache."""
    from craft_rag.engine import APPEND_ONLY, DEFAULT_HISTORY_BUDGET, DEFAULT_TURN_LAYOUT

    engine.reset_prefix_cache()
    saved = engine.conversations.history_budget
    saved_layout = engine.conversations.turn_layout
    engine.conversations.history_budget = (
        None if system == "craft_nobudget" else DEFAULT_HISTORY_BUDGET
    )
    engine.conversations.turn_layout = (
        APPEND_ONLY if system == "craft_append" else DEFAULT_TURN_LAYOUT
    )
    turn_fn = start(f"{system}:{conv.id}")
    rows = []
    for index, t in enumerate(conv.turns, start=1):
        with _Requests(engine) as requests:
            started = time.perf_counter()
            cpu_started = time.process_time()
            first: float | None = None
            cpu_first: float | None = None
            pieces = []
            for delta in turn_fn(t):
                if delta and first is None:
                    first = time.perf_counter()
                    cpu_first = time.process_time()
                pieces.append(delta)
            done = time.perf_counter()
        reports = [r.report for r in requests.results]
        layouts = [r.layout for r in reports if r.layout is not None]
        rows.append({
            "turn": index,
            "ttft_ms": ((first or done) - started) * 1000.0,
            # This process's CPU time to the first token (the engine runs in-process on one
            # torch thread): less sensitive to other jobs on a shared machine than wall time.
            "ttft_cpu_ms": ((cpu_first or time.process_time()) - cpu_started) * 1000.0,
            "restart": any(x.restart for x in layouts),
            "layout": [asdict(x) for x in layouts],
            "latency_ms": (done - started) * 1000.0,
            "requests": len(reports),
            "prompt_tokens": sum(r.prompt_tokens for r in reports),
            "computed_tokens": sum(r.uncached_tokens for r in reports),
            "answer": "".join(pieces).strip(),
            "golds": list(t.golds),
        })
    engine.conversations.history_budget = saved
    engine.conversations.turn_layout = saved_layout
    return rows


def _score(ctx: BenchContext, rows: list[dict[str, Any]]) -> None:
    """Token F1 and MiniLM cosine (best over golds) on rows with a reference."""
    scored = [r for r in rows if r["golds"]]
    if not scored:
        return
    embedder = ctx.embedder()
    golds = [g for r in scored for g in r["golds"]]
    vectors = embedder.encode([*(r["answer"] or "-" for r in scored), *golds])
    offset = len(scored)
    for i, r in enumerate(scored):
        sims = [float(vectors[i] @ vectors[offset + j]) for j in range(len(r["golds"]))]
        offset += len(r["golds"])
        r["f1"] = token_f1(r["answer"], r["golds"])
        r["minilm_cosine"] = max(sims)


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _p99(xs: Sequence[float]) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, round(0.99 * (len(s) - 1)))]


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per system: mean/p99 TTFT over turns >= 2, computed tokens, quality; CRAFT vs the best
    baseline (lowest mean TTFT over turns >= 2) with paired tests on the same turns."""
    systems: dict[str, Any] = {}
    for name, rows in runs.items():
        later = [r for r in rows if r["turn"] >= 2]
        systems[name] = {
            "turns": len(rows),
            "mean_ttft_ms_turn1": _mean([r["ttft_ms"] for r in rows if r["turn"] == 1]),
            "mean_ttft_ms": _mean([r["ttft_ms"] for r in later]),
            "mean_ttft_cpu_ms": _mean([r["ttft_cpu_ms"] for r in later]),
            "restarts": sum(1 for r in later if r.get("restart")),
            "p99_ttft_ms": _p99([r["ttft_ms"] for r in later]),
            "mean_computed_tokens": _mean([r["computed_tokens"] for r in later]),
            "mean_prompt_tokens": _mean([r["prompt_tokens"] for r in later]),
            "mean_f1": _mean([r["f1"] for r in rows if "f1" in r]),
            "mean_minilm_cosine": _mean([r["minilm_cosine"] for r in rows if "minilm_cosine" in r]),
        }
    out: dict[str, Any] = {"systems": systems}
    baselines = [b for b in BASELINES if b in runs and systems[b]["mean_ttft_ms"] is not None]
    if "craft" not in runs or not baselines:
        return out
    best = min(baselines, key=lambda b: systems[b]["mean_ttft_ms"])
    craft_rows, best_rows = runs["craft"], runs[best]
    later_idx = [i for i, r in enumerate(craft_rows) if r["turn"] >= 2]
    ttft = paired_t_test([best_rows[i]["ttft_ms"] for i in later_idx],
                         [craft_rows[i]["ttft_ms"] for i in later_idx])
    quality = {}
    scored = [i for i, r in enumerate(craft_rows) if "f1" in r]
    for b in baselines:
        idx = scored
        for metric in ("f1", "minilm_cosine"):
            t = paired_t_test([craft_rows[i][metric] for i in idx],
                              [runs[b][i][metric] for i in idx])
            quality[f"{b}:{metric}"] = {"mean_diff": t.mean_difference, "p": t.p, "n": t.n}
    speedup = systems[best]["mean_ttft_ms"] / systems["craft"]["mean_ttft_ms"]
    cpu_best = systems[best]["mean_ttft_cpu_ms"]
    cpu_craft = systems["craft"]["mean_ttft_cpu_ms"]
    out["vs_best"] = {
        "best_baseline": best,
        "speedup_mean_ttft_turns_ge2": speedup,
        "target_1_3x_met": speedup >= 1.3,
        "speedup_mean_ttft_cpu_turns_ge2": cpu_best / cpu_craft if cpu_craft else None,
        "ttft_paired": {
            "mean_diff_ms": ttft.mean_difference, "t": ttft.t, "p": ttft.p, "n": ttft.n
        },
        "quality_paired_craft_minus_baseline": quality,
    }
    return out


def run(ctx: BenchContext) -> dict[str, Any]:
    sizes = QUICK if ctx.quick else FULL
    engine = ctx.get_engine()
    from craft_rag.planner import CraftPlanner, PlannerConfig

    engine.set_planner(CraftPlanner(PlannerConfig(policy="tree")))
    result: dict[str, Any] = {"suite": "chat", "max_tokens": sizes.max_tokens,
                              "top_k": sizes.top_k, "block_size": engine.block_size,
                              "max_model_len": engine.max_model_len}
    engine.reset_prefix_cache()
    result["ttft_grid"] = ttft_grid(engine, sizes.grid_cached, sizes.grid_uncached, ctx.seed)
    systems = _systems(engine, sizes.max_tokens)
    workloads = {
        "mtrag": mtrag_conversations(sizes.mtrag_conversations, sizes.mtrag_turns, sizes.top_k),
        "hotpotqa": hotpot_conversations(
            sizes.hotpot_conversations, sizes.hotpot_turns, sizes.top_k, ctx.seed
        ),
    }
    result["workloads"] = {}
    for workload, convs in workloads.items():
        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in sizes.systems}
        for i, conv in enumerate(ctx.bar(convs, f"chat {workload}")):
            # Rotate the order per conversation: which system runs first after a cache reset
            # measurably matters here (docs/benchmarks.md, "Multi-turn chat").
            k = i % len(sizes.systems)
            for system in (*sizes.systems[k:], *sizes.systems[:k]):
                runs[system].extend(_serve(engine, systems[system], conv, system))
                engine.end_conversation(f"{system}:{conv.id}")
        for rows in runs.values():
            _score(ctx, rows)
        result["workloads"][workload] = {
            "conversations": len(convs),
            "turns": sum(len(c.turns) for c in convs),
            **summarize(runs),
            "rows": runs,
        }
    engine.set_planner(CraftPlanner(PlannerConfig(policy="tree")))
    return result


def markdown(result: dict[str, Any]) -> list[str]:
    """The tables of docs/benchmarks.md's multi-turn chat section."""
    lines = ["| cached | uncached | TTFT ms |", "|---:|---:|---:|"]
    lines += [f"| {r['cached']} | {r['uncached']} | {r['ttft_ms']:.0f} |"
              for r in result["ttft_grid"]]
    for workload, w in result["workloads"].items():
        lines += ["", f"**{workload}** ({w['conversations']} conversations, {w['turns']} turns)",
                  "", "| system | TTFT turn 1 | mean TTFT turns>=2 | p99 | CPU ms to 1st token | "
                  "restarts | computed tok | prompt tok | F1 | MiniLM |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for name, s in w["systems"].items():
            def f(v: Any, d: int = 0) -> str:
                return "-" if v is None else f"{v:.{d}f}"
            lines.append(
                f"| {name} | {f(s['mean_ttft_ms_turn1'])} | {f(s['mean_ttft_ms'])} | "
                f"{f(s['p99_ttft_ms'])} | {f(s.get('mean_ttft_cpu_ms'))} | "
                f"{s.get('restarts', '-')} | {f(s['mean_computed_tokens'])} | "
                f"{f(s['mean_prompt_tokens'])} | {f(s['mean_f1'], 3)} | "
                f"{f(s['mean_minilm_cosine'], 3)} |"
            )
        vs = w.get("vs_best")
        if vs:
            lines += ["", f"CRAFT vs best baseline ({vs['best_baseline']}): "
                      f"{vs['speedup_mean_ttft_turns_ge2']:.2f}x lower mean TTFT on turns >= 2 "
                      f"(paired p={vs['ttft_paired']['p']}, n={vs['ttft_paired']['n']}); "
                      f"target 1.3x {'met' if vs['target_1_3x_met'] else 'NOT met'}."]
    return lines


def plot(result: dict[str, Any], path: Any) -> None:
    """Mean TTFT over turns >= 2 per system and workload (bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(result["workloads"])
    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4), squeeze=False)
    for ax, workload in zip(axes[0], workloads, strict=True):
        systems = result["workloads"][workload]["systems"]
        names = list(systems)
        ax.bar(names, [systems[n]["mean_ttft_ms"] or 0 for n in names])
        ax.set_title(f"{workload}: mean TTFT, turns >= 2")
        ax.set_ylabel("ms")
        ax.tick_params(axis="x", rotation=30)
    from craft_rag_bench.bench.plots import save_figure

    save_figure(fig, path)
