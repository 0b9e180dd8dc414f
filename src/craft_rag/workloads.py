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

import bisect
import itertools
import random
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from craft_rag.chunk import Chunk
from craft_rag.datasets import (
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
from craft_rag.retrieval import INDEX_KINDS, Embedder, Retriever, check_k
from craft_rag.trace import TraceRequest
from craft_rag.types import ChunkKey

T = TypeVar("T")

SINGLE_TURN_DATASETS: tuple[str, ...] = ("squad", "hotpotqa", "triviaqa", "2wiki")
MULTI_TURN_DATASETS: tuple[str, ...] = ("mtrag", "sharegpt")
CORPUS_CHOICES: tuple[str, ...] = ("union", "dataset")

# --------------------------------------------------------------------------- rewording

# Word lists as split strings: short to read, and one edit away from tuning.
_STOPWORDS = frozenset(
    "the a an is are was were be been did does do of to that by its it's there".split()  # noqa: SIM905
)
_PREPOSITIONS = frozenset(
    "in at on during for from after before since under within between among".split()  # noqa: SIM905
)
_WH_WORDS = frozenset("what which who whom whose when where why how".split())  # noqa: SIM905
_TEMPLATES: tuple[str, ...] = (
    "Can you tell me {lower}?",
    "I'd like to know: {q}",
    "Quick question: {q}",
    "{bare}? Please answer briefly.",
    "Do you know {lower}?",
    "Question: {q}",
    "{bare}? I need the answer.",
)


def _bare(q: str) -> str:
    return q.strip().rstrip("?.! ").strip()


def _lower_first(text: str) -> str:
    first, _, rest = text.partition(" ")
    # Lower-case only a sentence-initial function word, never a name ("NFL", "Warsaw").
    if first.lower() in _WH_WORDS | _STOPWORDS | {"name", "in", "on", "at", "for"}:
        first = first.lower()
    return f"{first} {rest}" if rest else first


def _template(q: str, rng: random.Random) -> str:
    bare = _bare(q)
    return rng.choice(_TEMPLATES).format(q=q.strip(), bare=bare, lower=_lower_first(bare))


def _front_clause(q: str, rng: random.Random) -> str:
    """Move a trailing prepositional phrase (or the part after a comma) to the front."""
    bare = _bare(q)
    if "," in bare:
        head, _, tail = bare.partition(",")
        if head.strip() and tail.strip():
            return f"{tail.strip()[0].upper()}{tail.strip()[1:]}, {_lower_first(head.strip())}?"
    words = bare.split()
    cuts = [i for i in range(2, len(words) - 1) if words[i].lower() in _PREPOSITIONS]
    if not cuts:
        return q
    i = rng.choice(cuts)
    phrase = " ".join(words[i:])
    rest = _lower_first(" ".join(words[:i]))
    return f"{phrase[0].upper()}{phrase[1:]}, {rest}?"


def _drop_stopwords(q: str, rng: random.Random) -> str:
    words = _bare(q).split()
    kept = [w for w in words if w.lower() not in _STOPWORDS]
    if len(kept) < 2:
        return q
    return " ".join(kept) + "?"


_REWORDINGS: Mapping[str, Callable[[str, random.Random], str]] = {
    "template": _template,
    "front_clause": _front_clause,
    "drop_stopwords": _drop_stopwords,
}
"""Strategy name -> rewording. Each keeps the question's content words."""


def reword(question: str, rng: random.Random) -> str:
    """A deterministic (given ``rng``'s state) rewording of ``question`` that differs from it.

    Applies one or two strategies of :data:`_REWORDINGS` (a template wrapper, a fronted clause,
    dropped stopwords); the content words survive, so dense retrieval returns an overlapping
    passage set, often in a different order. O(len(question))."""
    names = list(_REWORDINGS)
    picked = rng.sample(names, k=rng.choice((1, 2)))
    picked.sort(key=lambda name: name == "template")  # a wrapper goes on last, around the rest
    text = question
    for name in picked:
        text = _REWORDINGS[name](text, rng)
    if text.strip() == question.strip() or not text.strip():
        text = _template(question, rng)
    return re.sub(r"\s+", " ", text).strip()


# --------------------------------------------------------------------------- config


@dataclass(frozen=True, slots=True)
class TraceConfig:
    """Settings of one trace build (the ``craft-rag trace`` options).

    ``requests``: trace length (``None``: every question / turn once, plus re-asks).
    ``repeat``/``zipf``/``near_duplicates``: the single-turn knobs (see the module docstring).
    ``corpus``: ``union`` (all corpus datasets) or ``dataset`` (the dataset's own passages).
    ``interleave``: multi-turn conversations interleaved (seeded) instead of sequential, with
    ``concurrency`` open at a time. ``index``/``nlist``/``nprobe``: see
    :mod:`craft_rag.retrieval.index`. Invalid values raise ``ValueError`` naming the field.
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
        if not 0.0 <= self.repeat < 1.0:
            _bad("repeat", self.repeat, "a probability in [0, 1)")
        if self.zipf < 0.0:
            _bad("zipf", self.zipf, "an exponent >= 0 (0 = uniform)")
        if not 0.0 <= self.near_duplicates <= 1.0:
            _bad("near_duplicates", self.near_duplicates, "a probability in [0, 1]")
        if self.corpus not in CORPUS_CHOICES:
            _bad("corpus", self.corpus, "one of " + ", ".join(CORPUS_CHOICES))
        if self.concurrency < 1:
            _bad("concurrency", self.concurrency, "an int >= 1")
        if self.index not in INDEX_KINDS:
            _bad("index", self.index, "one of " + ", ".join(INDEX_KINDS))


def _bad(field: str, value: object, expected: str) -> None:
    msg = f"{field} must be {expected}, got {value!r}"
    raise ValueError(msg)


# --------------------------------------------------------------------------- single-turn


@dataclass(frozen=True, slots=True)
class PlannedQuery:
    """One request of a single-turn trace before retrieval.

    ``kind`` is ``first`` (the question's first ask, in dataset order), ``repeat`` (the same
    text again) or ``near_duplicate`` (reworded). ``text`` is what is sent to the retriever."""

    request_id: str
    question: Question
    text: str
    kind: str


def zipf_weights(n: int, s: float) -> list[float]:
    """``1 / rank**s`` for ranks 1..n (unnormalised). ``s = 0`` gives uniform weights."""
    return [1.0 / (rank**s) for rank in range(1, n + 1)]


def plan_queries(
    questions: Sequence[Question],
    *,
    requests: int | None = None,
    repeat: float = 0.3,
    zipf: float = 1.0,
    near_duplicates: float = 0.5,
    seed: int = 0,
) -> list[PlannedQuery]:
    """The request schedule of a single-turn trace (no retrieval). O(requests · log requests).

    Request ``i`` re-asks an earlier question with probability ``repeat`` (never the first
    request), else asks the next question in dataset order. Re-asked questions are drawn with
    Zipf(``zipf``) weights over a seeded popularity ranking of the eligible questions (the first
    ``requests`` of the dataset), restricted to those already asked; a re-ask is reworded with
    probability ``near_duplicates``. With ``requests=None`` the trace ends after the last
    question's first ask; with more requests than questions, the rest are all re-asks.
    Request ids: ``<dataset>:<question id>`` for a first ask, ``...#<kind>@<i>`` otherwise."""
    if not questions:
        msg = "no questions to build a trace from"
        raise ValueError(msg)
    if requests is not None and requests < 1:
        _bad("requests", requests, "an int >= 1 (or None for the whole dataset)")
    rng = random.Random(seed)
    eligible = len(questions) if requests is None else min(requests, len(questions))
    ranks = list(range(eligible))
    rng.shuffle(ranks)  # ranks[j] = popularity rank (0 = most popular) of question j
    weights = zipf_weights(eligible, zipf)
    asked: list[int] = []  # question indices in first-ask order
    cumulative: list[float] = []  # running sum of their weights, for O(log n) draws
    plan: list[PlannedQuery] = []
    next_fresh = 0
    i = 0
    while requests is None or i < requests:
        fresh_left = next_fresh < eligible
        if requests is None and not fresh_left:
            break
        if asked and (not fresh_left or rng.random() < repeat):
            pick = bisect.bisect_right(cumulative, rng.random() * cumulative[-1])
            q = questions[asked[min(pick, len(asked) - 1)]]
            if rng.random() < near_duplicates:
                plan.append(
                    PlannedQuery(
                        f"{q.dataset}:{q.id}#near_duplicate@{i}",
                        q,
                        reword(q.question, rng),
                        "near_duplicate",
                    )
                )
            else:
                plan.append(PlannedQuery(f"{q.dataset}:{q.id}#repeat@{i}", q, q.question, "repeat"))
        else:
            q = questions[next_fresh]
            plan.append(PlannedQuery(f"{q.dataset}:{q.id}", q, q.question, "first"))
            asked.append(next_fresh)
            w = weights[ranks[next_fresh]]
            cumulative.append(w + (cumulative[-1] if cumulative else 0.0))
            next_fresh += 1
        i += 1
    return plan


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
