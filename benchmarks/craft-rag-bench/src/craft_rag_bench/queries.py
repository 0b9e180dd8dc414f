"""Single-turn request schedules: which question each request asks, and how it is reworded.

The two seeded knobs of :mod:`craft_rag_bench.workloads` live here, without retrieval:
**repetition** (a re-ask of an earlier question, drawn with Zipf weights over a seeded
popularity ranking) and **near-duplicates** (a re-ask reworded by :func:`reword`: templates,
fronted clauses, dropped stopwords; deterministic, offline). Pure functions of (questions,
knobs, seed).
"""

from __future__ import annotations

import bisect
import random
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from craft_rag.validation import check_number
from craft_rag_bench.datasets import Question

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


# --------------------------------------------------------------------------- schedule


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
        bad_value("requests", requests, "an int >= 1 (or None for the whole dataset)")
    check_trace_knobs(repeat, zipf, near_duplicates)
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


def check_trace_knobs(repeat: float, zipf: float, near_duplicates: float) -> None:
    """``ValueError`` naming the knob unless each is a finite number in its range (NaN would
    pass a bare range check and make every draw NaN)."""
    check_number(repeat, "repeat", minimum=0.0)
    if not repeat < 1.0:
        bad_value("repeat", repeat, "a probability in [0, 1)")
    check_number(zipf, "zipf (an exponent, 0 = uniform)", minimum=0.0)
    check_number(near_duplicates, "near_duplicates (a probability)", minimum=0.0, maximum=1.0)


def bad_value(field: str, value: object, expected: str) -> None:
    """Raise ``ValueError`` naming ``field``, what it must be and the value given."""
    msg = f"{field} must be {expected}, got {value!r}"
    raise ValueError(msg)
