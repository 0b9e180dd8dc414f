"""Replay-trace builders over shared/data: the workloads CRAFT is evaluated on.

Single-turn (``squad``, ``hotpotqa``, ``triviaqa``, ``2wiki``): questions in dataset order, each
retrieving top-k passages with faiss. Two seeded knobs make requests share chunks:

- **repetition**: each request is, with probability ``repeat``, a re-ask of a question already
  asked; which one follows a Zipf law with exponent ``zipf`` over a fixed, seeded popularity
  ranking of the eligible questions (``zipf = 0``: uniform), so popular questions come back often;
- **near-duplicates**: a re-ask is, with probability ``near_duplicates``, reworded
  (:func:`reword`: templates, fronted clauses, dropped stopwords; deterministic, offline). An
  exact re-ask retrieves the identical list; a reworded one retrieves an overlapping set, often in
  another order, which is the case CRAFT's reordering targets.

Multi-turn: ``mtrag`` (per user turn, the passages shown for that turn in the given order, and the
reference answer) and ``sharegpt`` (retrieval per user turn over the corpus, answer = the
assistant's reply). Conversations run one after another, or interleaved by a seeded scheduler
with ``concurrency`` conversations open at a time.

Everything is a pure function of (data, config, seed): the same inputs give the same trace.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from craft_rag.chunk import Chunk
from craft_rag.trace import TraceRequest
from craft_rag.types import ChunkKey
from craft_rag_bench.datasets import (
    CORPUS_DATASETS,
    Conversation,
    Dataset,
    Passage,
    Question,
    Turn,
    check_dataset_name,
    load_dataset,
    passage_corpus,
)
from craft_rag_bench.queries import bad_value as _bad
from craft_rag_bench.queries import check_trace_knobs, plan_queries
from craft_rag_bench.retrieval import INDEX_KINDS, Embedder, Retriever, check_k

T = TypeVar("T")

SINGLE_TURN_DATASETS: tuple[str, ...] = ("squad", "hotpotqa", "triviaqa", "2wiki")
MULTI_TURN_DATASETS: tuple[str, ...] = ("mtrag", "sharegpt")
CORPUS_CHOICES: tuple[str, ...] = ("union", "dataset")



# --------------------------------------------------------------------------- config


@dataclass(frozen=True, slots=True)
class TraceConfig:
    """Settings of one trace build (the ``craft-rag trace`` options).

    ``requests``: trace length (``None``: every question / turn once, plus re-asks).
    ``repeat``/``zipf``/``near_duplicates``: the single-turn knobs (see the module docstring).
    ``corpus``: ``union`` (all corpus datasets) or ``dataset`` (the dataset's own passages).
    ``interleave``: multi-turn conversations interleaved (seeded) instead of sequential, with
    ``concurrency`` open at a time. ``index``/``nlist``/``nprobe``: see
    :mod:`craft_rag_bench.retrieval.index`. Invalid values raise ``ValueError`` naming the field.
    """

    dataset: str
    requests: int | None = None
    top_k: int = 5
    repeat: float = 0.3
    zipf: float = 1.0
    near_duplicates: float = 0.5
    seed: int = 0
    corpus: str = "union"
    index: str = "ivf"
    nlist: int | None = None
    nprobe: int | None = None
    interleave: bool = False
    concurrency: int = 8

    def __post_init__(self) -> None:
        check_dataset_name(self.dataset)
        if self.requests is not None and self.requests < 1:
            _bad("requests", self.requests, "an int >= 1 (or None for the whole dataset)")
        if self.top_k < 1:
            _bad("top_k", self.top_k, "an int >= 1")
        check_trace_knobs(self.repeat, self.zipf, self.near_duplicates)
        if self.corpus not in CORPUS_CHOICES:
            _bad("corpus", self.corpus, "one of " + ", ".join(CORPUS_CHOICES))
        if self.concurrency < 1:
            _bad("concurrency", self.concurrency, "an int >= 1")
        if self.index not in INDEX_KINDS:
            _bad("index", self.index, "one of " + ", ".join(INDEX_KINDS))





def _retrieve_unique(
    retriever: Retriever, texts: Sequence[str], k: int, show_progress: bool
) -> dict[str, list[Chunk]]:
    """Retrieve once per distinct text: exact re-asks get the identical list by construction."""
    unique = list(dict.fromkeys(texts))
    results = retriever.search_batch(unique, k, show_progress=show_progress)
    return dict(zip(unique, results, strict=True))


def single_turn_trace(
    questions: Sequence[Question],
    retriever: Retriever,
    *,
    requests: int | None = None,
    top_k: int = 5,
    repeat: float = 0.3,
    zipf: float = 1.0,
    near_duplicates: float = 0.5,
    seed: int = 0,
    show_progress: bool = False,
) -> list[TraceRequest]:
    """A single-turn trace: :func:`plan_queries` then top-``top_k`` retrieval for each distinct
    query text. ``answer`` is the question's canonical gold answer. Cost: one encoder call per
    distinct text (~10 ms each on CPU) plus the index scans."""
    check_k(top_k)
    plan = plan_queries(
        questions,
        requests=requests,
        repeat=repeat,
        zipf=zipf,
        near_duplicates=near_duplicates,
        seed=seed,
    )
    found = _retrieve_unique(retriever, [p.text for p in plan], top_k, show_progress)
    return [
        TraceRequest(
            id=p.request_id,
            query=p.text,
            chunks=tuple(found[p.text]),
            answer=p.question.answers[0],
        )
        for p in plan
    ]


# --------------------------------------------------------------------------- multi-turn


def interleave(
    streams: Sequence[Sequence[T]], *, seed: int | None = None, concurrency: int = 8
) -> list[T]:
    """Merge per-conversation streams, keeping each stream's order.

    ``seed=None``: sequential (stream 0, then stream 1, ...). Otherwise at most ``concurrency``
    streams are open at once (opened in order as others finish) and each step emits the next
    item of an open stream chosen uniformly by a ``random.Random(seed)``. O(total items)."""
    if concurrency < 1:
        _bad("concurrency", concurrency, "an int >= 1")
    if seed is None:
        return [item for stream in streams for item in stream]
    rng = random.Random(seed)
    waiting: Iterator[Sequence[T]] = (stream for stream in streams if stream)
    open_: list[tuple[Sequence[T], int]] = [
        (stream, 0) for stream in itertools.islice(waiting, concurrency)
    ]
    out: list[T] = []
    while open_:
        j = rng.randrange(len(open_))
        stream, pos = open_[j]
        out.append(stream[pos])
        if pos + 1 < len(stream):
            open_[j] = (stream, pos + 1)
        else:
            open_.pop(j)
            open_.extend((nxt, 0) for nxt in itertools.islice(waiting, 1))
    return out


def _conversation_turns(
    conversations: Sequence[Conversation],
    requests: int | None,
    seed: int | None,
    concurrency: int,
) -> list[tuple[Conversation, Turn]]:
    streams = [[(c, t) for t in c.turns] for c in conversations]
    merged = interleave(streams, seed=seed, concurrency=concurrency)
    return merged if requests is None else merged[:requests]


def _request_id(conversation: Conversation, turn: Turn) -> str:
    return f"{conversation.id}#{turn.turn}"


def mtrag_trace(
    conversations: Sequence[Conversation],
    *,
    requests: int | None = None,
    interleave_seed: int | None = None,
    concurrency: int = 8,
) -> list[TraceRequest]:
    """MTRAG as a trace: one request per user turn with the passages shown for that turn, in
    the shown order with their scores; ``answer`` = the reference answer. No retrieval.
    ``requests`` keeps the first N requests of the (possibly interleaved) stream."""
    out: list[TraceRequest] = []
    for conversation, turn in _conversation_turns(
        conversations, requests, interleave_seed, concurrency
    ):
        chunks = tuple(
            Chunk(
                key=ChunkKey(s.passage.id),
                text=s.passage.content,
                score=s.score,
                metadata={"title": s.passage.title, "dataset": s.passage.dataset},
            )
            for s in turn.contexts
        )
        out.append(
            TraceRequest(
                id=_request_id(conversation, turn),
                query=turn.question,
                chunks=chunks,
                conversation_id=conversation.id,
                turn=turn.turn,
                answer=turn.answer,
            )
        )
    return out


def retrieved_conversation_trace(
    conversations: Sequence[Conversation],
    retriever: Retriever,
    *,
    top_k: int = 5,
    requests: int | None = None,
    interleave_seed: int | None = None,
    concurrency: int = 8,
    show_progress: bool = False,
) -> list[TraceRequest]:
    """Conversations (ShareGPT) as a trace with top-``top_k`` retrieval per user turn, the
    user's message as the query; ``answer`` = the assistant's reply. Only the first
    ``requests`` turns of the stream are retrieved."""
    check_k(top_k)
    picked = _conversation_turns(conversations, requests, interleave_seed, concurrency)
    found = _retrieve_unique(retriever, [t.question for _, t in picked], top_k, show_progress)
    return [
        TraceRequest(
            id=_request_id(c, t),
            query=t.question,
            chunks=tuple(found[t.question]),
            conversation_id=c.id,
            turn=t.turn,
            answer=t.answer,
        )
        for c, t in picked
    ]


# --------------------------------------------------------------------------- entry point


def _corpus_for(config: TraceConfig, dataset: Dataset, data_dir: Path | None) -> list[Passage]:
    if config.corpus == "union":
        return list(passage_corpus(CORPUS_DATASETS, data_dir))
    if not dataset.passages:
        msg = (
            f"dataset {dataset.name!r} has no passages of its own; use corpus 'union' "
            f"(--corpus union) or one of: {', '.join(CORPUS_DATASETS)}"
        )
        raise ValueError(msg)
    return list(dataset.passages)


def _single_turn(
    config: TraceConfig, dataset: Dataset, retriever: Callable[[], Retriever], progress: bool
) -> list[TraceRequest]:
    return single_turn_trace(
        dataset.questions,
        retriever(),
        requests=config.requests,
        top_k=config.top_k,
        repeat=config.repeat,
        zipf=config.zipf,
        near_duplicates=config.near_duplicates,
        seed=config.seed,
        show_progress=progress,
    )


def _mtrag(
    config: TraceConfig, dataset: Dataset, retriever: Callable[[], Retriever], progress: bool
) -> list[TraceRequest]:
    return mtrag_trace(
        dataset.conversations,
        requests=config.requests,
        interleave_seed=config.seed if config.interleave else None,
        concurrency=config.concurrency,
    )


def _sharegpt(
    config: TraceConfig, dataset: Dataset, retriever: Callable[[], Retriever], progress: bool
) -> list[TraceRequest]:
    return retrieved_conversation_trace(
        dataset.conversations,
        retriever(),
        top_k=config.top_k,
        requests=config.requests,
        interleave_seed=config.seed if config.interleave else None,
        concurrency=config.concurrency,
        show_progress=progress,
    )


WorkloadBuilder = Callable[
    [TraceConfig, Dataset, Callable[[], Retriever], bool], list[TraceRequest]
]

WORKLOADS: Mapping[str, WorkloadBuilder] = {
    "squad": _single_turn,
    "hotpotqa": _single_turn,
    "triviaqa": _single_turn,
    "2wiki": _single_turn,
    "mtrag": _mtrag,
    "sharegpt": _sharegpt,
}
"""Dataset name -> trace builder (MTRAG replays the shown passages and needs no retriever)."""


def build_trace(
    config: TraceConfig,
    *,
    data_dir: Path | None = None,
    cache_dir: Path | None = None,
    retriever: Retriever | None = None,
    embedder: Embedder | None = None,
    show_progress: bool = True,
) -> list[TraceRequest]:
    """Build the trace ``config`` describes. The retriever is built only when the workload
    needs one (not for MTRAG), over ``config.corpus`` with ``embedder`` (default: the packaged
    MiniLM), unless one is passed in. Cost: dominated by embedding the corpus the first time
    (cached on disk afterwards) and by query encoding."""
    dataset = load_dataset(config.dataset, data_dir)
    built: list[Retriever] = [retriever] if retriever is not None else []

    def get_retriever() -> Retriever:
        if not built:
            built.append(
                Retriever.build(
                    _corpus_for(config, dataset, data_dir),
                    kind=config.index,
                    nlist=config.nlist,
                    nprobe=config.nprobe,
                    embedder=embedder,
                    cache_dir=cache_dir,
                    show_progress=show_progress,
                )
            )
        return built[0]

    return WORKLOADS[config.dataset](config, dataset, get_retriever, show_progress)


# --------------------------------------------------------------------------- analysis


@dataclass(frozen=True, slots=True)
class SharingReport:
    """How much a trace's requests overlap with earlier requests (by chunk key).

    ``sharing_requests``: requests with at least one chunk seen in an earlier request;
    ``identical_sets`` / ``reordered_sets``: requests whose chunk set equals an earlier
    request's, in the same order / in another order; ``shared_chunk_fraction``: of all chunk
    occurrences, those seen in any earlier request (the reuse bound of an unbounded cache; the
    paper's Total overlap, :func:`craft_rag.metrics.total_overlap`, counts only the best single
    earlier request, so it is lower)."""

    requests: int
    sharing_requests: int
    identical_sets: int
    reordered_sets: int
    shared_chunk_fraction: float


def sharing_report(trace: Sequence[TraceRequest]) -> SharingReport:
    """Cross-request chunk sharing of ``trace``. O(total chunks)."""
    seen: set[str] = set()
    orders: dict[frozenset[str], set[tuple[str, ...]]] = {}
    sharing = identical = reordered = shared = total = 0
    for request in trace:
        keys = tuple(c.key for c in request.chunks)
        hits = sum(1 for k in keys if k in seen)
        shared += hits
        total += len(keys)
        sharing += hits > 0
        known = orders.setdefault(frozenset(keys), set())
        if keys and known:
            if keys in known:
                identical += 1
            else:
                reordered += 1
        known.add(keys)
        seen.update(keys)
    return SharingReport(
        requests=len(trace),
        sharing_requests=sharing,
        identical_sets=identical,
        reordered_sets=reordered,
        shared_chunk_fraction=shared / total if total else 0.0,
    )
