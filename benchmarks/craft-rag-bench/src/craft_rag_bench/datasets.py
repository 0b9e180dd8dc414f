"""Typed loaders for the evaluation data in shared/data (see its README for sources and licences).

Each loader reads one folder and returns a :class:`Dataset`: passages for retrieval, single-turn
questions with gold answers, and/or multi-turn conversations. Loaders are pure functions of the
files (no caching, no network); each takes an optional ``data_dir`` and otherwise uses
:func:`craft_rag_bench.paths.shared_data_dir` (env ``CRAFT_RAG_DATA``).

Passage ids are stable, globally unique and namespaced by dataset, so they can be used directly as
chunk keys:

========== ==================================== ===========================================
dataset    passage id                           source
========== ==================================== ===========================================
squad      ``squad:<article title>:<para idx>`` SQuAD v1.1 dev paragraphs (both halves)
hotpotqa   ``hotpotqa:<sha256(title)[:16]>``    the 10 distractor-setting paragraphs per question
2wiki      ``2wiki:<index in corpus file>``     HippoRAG 2Wiki corpus (6,119 passages)
mtrag      ``mtrag:<document_id>``              passages shown in MTRAG conversations (2,021)
========== ==================================== ===========================================

The same Wikipedia paragraph appearing in two datasets is two passages (two ids), in line with
:mod:`craft_rag.chunk`: the caller's id is authoritative. Within a dataset, passages are
deduplicated by id; two different texts under one id is a data error and raises ``ValueError``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NewType

from craft_rag.types import ConversationId
from craft_rag_bench.paths import shared_data_dir

PassageId = NewType("PassageId", str)
"""``<dataset>:<local id>``; doubles as the chunk key of the passage."""

CORPUS_DATASETS: tuple[str, ...] = ("squad", "hotpotqa", "2wiki", "mtrag")
"""Datasets that contribute passages to :func:`passage_corpus` (their union is the default)."""


@dataclass(frozen=True, slots=True)
class Passage:
    """One retrievable paragraph. Invariant: ``id`` starts with ``dataset + ":"``."""

    id: PassageId
    title: str
    text: str
    dataset: str

    @property
    def content(self) -> str:
        """What the embedder sees and the LLM reads: ``"title\\ntext"`` (the paper concatenates
        title and passage), or ``text`` alone when there is no title or the text already opens
        with the title on its own line (MTRAG's ClapNQ passages do)."""
        if not self.title or self.text.startswith(self.title + "\n"):
            return self.text
        return f"{self.title}\n{self.text}"


@dataclass(frozen=True, slots=True)
class Question:
    """One single-turn question.

    ``answers`` holds every accepted gold answer (SQuAD's annotator spans deduplicated in order,
    TriviaQA's gold answer then its aliases); ``answers[0]`` is the canonical one and always exists.
    ``passage_ids`` are the passages the dataset attaches to the question (SQuAD: its paragraph;
    HotpotQA: its 10 paragraphs), ``gold_passage_ids`` the subset that supports the answer.
    """

    id: str
    question: str
    answers: tuple[str, ...]
    dataset: str
    passage_ids: tuple[PassageId, ...] = ()
    gold_passage_ids: tuple[PassageId, ...] = ()


@dataclass(frozen=True, slots=True)
class ShownPassage:
    """A passage as shown in one conversation turn, with the score its retriever gave it."""

    passage: Passage
    score: float | None


@dataclass(frozen=True, slots=True)
class Turn:
    """One user turn and the reply to it. ``turn`` is 1-based within the conversation;
    ``contexts`` are the passages shown for this turn in the given order (MTRAG only)."""

    turn: int
    question: str
    answer: str | None
    contexts: tuple[ShownPassage, ...] = ()


@dataclass(frozen=True, slots=True)
class Conversation:
    """A multi-turn conversation. Invariant: ``turns[i].turn == i + 1``."""

    id: ConversationId
    dataset: str
    turns: tuple[Turn, ...]
    domain: str | None = None


@dataclass(frozen=True, slots=True)
class Dataset:
    """Everything one shared/data folder provides; fields a dataset lacks are empty."""

    name: str
    passages: tuple[Passage, ...] = ()
    questions: tuple[Question, ...] = ()
    conversations: tuple[Conversation, ...] = ()
    licence: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)

    def passage_map(self) -> dict[PassageId, Passage]:
        """Passages by id. O(number of passages)."""
        return {p.id: p for p in self.passages}


# --------------------------------------------------------------------------- helpers


def _folder(data_dir: Path | None, name: str) -> Path:
    if data_dir is not None:
        root, source = Path(data_dir), f"data_dir/--data-dir {data_dir} (or CRAFT_RAG_DATA)"
        if not root.is_dir():
            msg = f"{source} is not an existing folder; pass the shared/data folder"
            raise FileNotFoundError(msg)
    else:
        root = shared_data_dir()
        source = f"CRAFT_RAG_DATA (currently {root})"
    folder = root / name
    if not folder.is_dir():
        msg = f"dataset folder {folder} not found; point {source} at the folder holding {name}/"
        raise FileNotFoundError(msg)
    return folder


def _file(folder: Path, name: str) -> Path:
    path = folder / name
    if not path.is_file():
        msg = f"{path} not found; CRAFT_RAG_DATA must point at an unmodified shared/data copy"
        raise FileNotFoundError(msg)
    return path


def _read_json(path: Path) -> Any:
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def _read_jsonl(path: Path) -> Iterator[Any]:
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                msg = f"{path}:{number}: invalid JSON ({e.msg})"
                raise ValueError(msg) from e


def _dedupe_answers(answers: Iterable[str]) -> tuple[str, ...]:
    seen: dict[str, None] = {}
    for a in answers:
        a = a.strip()
        if a and a not in seen:
            seen[a] = None
    return tuple(seen)


class _PassageSet:
    """Insertion-ordered passages, deduplicated by id; a conflicting duplicate raises."""

    def __init__(self) -> None:
        self._by_id: dict[PassageId, Passage] = {}

    def add(self, passage: Passage) -> Passage:
        old = self._by_id.get(passage.id)
        if old is None:
            self._by_id[passage.id] = passage
            return passage
        if old != passage:
            msg = f"passage id {passage.id!r} names two different passages; the data is corrupt"
            raise ValueError(msg)
        return old

    def freeze(self) -> tuple[Passage, ...]:
        return tuple(self._by_id.values())


def _title_hash(title: str) -> str:
    return hashlib.sha256(title.encode("utf-8")).hexdigest()[:16]


# --------------------------------------------------------------------------- loaders


def load_squad(data_dir: Path | None = None) -> Dataset:
    """SQuAD v1.1 dev, both halves (48 articles, 2,067 paragraphs, 10,570 questions), in file
    order (part1 then part2). Titles keep SQuAD's underscores in ids, spaces in ``title``.
    Cost: ~0.2 s (parses 4.9 MB of JSON)."""
    folder = _folder(data_dir, "squad")
    passages = _PassageSet()
    questions: list[Question] = []
    for part in ("dev-v1.1.part1.json", "dev-v1.1.part2.json"):
        for article in _read_json(_file(folder, part))["data"]:
            raw_title: str = article["title"]
            for index, paragraph in enumerate(article["paragraphs"]):
                passage = passages.add(
                    Passage(
                        id=PassageId(f"squad:{raw_title}:{index}"),
                        title=raw_title.replace("_", " "),
                        text=paragraph["context"],
                        dataset="squad",
                    )
                )
                for qa in paragraph["qas"]:
                    answers = _dedupe_answers(a["text"] for a in qa["answers"])
                    if not answers:
                        msg = f"SQuAD question {qa['id']} has no answer"
                        raise ValueError(msg)
                    questions.append(
                        Question(
                            id=qa["id"],
                            question=qa["question"].strip(),
                            answers=answers,
                            dataset="squad",
                            passage_ids=(passage.id,),
                            gold_passage_ids=(passage.id,),
                        )
                    )
    return Dataset(
        name="squad",
        passages=passages.freeze(),
        questions=tuple(questions),
        licence="CC BY-SA 4.0",
    )


def load_hotpotqa(data_dir: Path | None = None) -> Dataset:
    """HotpotQA dev distractor, 500 questions (IRCoT format) with their up-to-10 paragraphs
    (4,858 unique). Paragraph ids hash the title: titles are unique in this file."""
    folder = _folder(data_dir, "hotpotqa")
    passages = _PassageSet()
    questions: list[Question] = []
    for obj in _read_jsonl(_file(folder, "hotpotqa_dev_distractor_500.ircot.jsonl")):
        ids: list[PassageId] = []
        gold: list[PassageId] = []
        for ctx in obj["contexts"]:
            passage = passages.add(
                Passage(
                    id=PassageId(f"hotpotqa:{_title_hash(ctx['title'])}"),
                    title=ctx["title"],
                    text=ctx["paragraph_text"],
                    dataset="hotpotqa",
                )
            )
            ids.append(passage.id)
            if ctx.get("is_supporting"):
                gold.append(passage.id)
        answers = _dedupe_answers(
            span for answer in obj["answers_objects"] for span in answer.get("spans", [])
        )
        if not answers:
            msg = f"HotpotQA question {obj['question_id']} has no answer span"
            raise ValueError(msg)
        questions.append(
            Question(
                id=obj["question_id"],
                question=obj["question_text"].strip(),
                answers=answers,
                dataset="hotpotqa",
                passage_ids=tuple(ids),
                gold_passage_ids=tuple(gold),
            )
        )
    return Dataset(
        name="hotpotqa",
        passages=passages.freeze(),
        questions=tuple(questions),
        licence="CC BY-SA 4.0",
    )


def load_2wiki(data_dir: Path | None = None) -> Dataset:
    """2WikiMultihopQA: the HippoRAG 6,119-passage corpus and 500 R1-Searcher dev Q/A.

    The two are NOT aligned (different samples), so questions carry no passage ids and retrieval
    quality on them says nothing about chunk order; use them for overlap/TTFT workloads."""
    folder = _folder(data_dir, "2wikimultihopqa")
    passages = _PassageSet()
    for index, obj in enumerate(_read_json(_file(folder, "2wikimultihopqa_corpus.hipporag.json"))):
        passages.add(
            Passage(
                id=PassageId(f"2wiki:{index}"),
                title=obj["title"],
                text=obj["text"],
                dataset="2wiki",
            )
        )
    questions = tuple(
        Question(
            id=str(obj["idx"]),
            question=obj["question"].strip(),
            answers=_dedupe_answers([str(obj["answer"])]),
            dataset="2wiki",
        )
        for obj in _read_jsonl(_file(folder, "2wiki_500.r1searcher.jsonl"))
    )
    return Dataset(
        name="2wiki",
        passages=passages.freeze(),
        questions=questions,
        licence="Apache-2.0 (2WikiMultihopQA); MIT (HippoRAG, R1-Searcher)",
        notes=("questions and corpus are different samples: gold passages mostly absent",),
    )


def load_triviaqa(data_dir: Path | None = None) -> Dataset:
    """TriviaQA, 150 questions; ``answers`` = gold answer then its aliases. No passages:
    retrieve from :func:`passage_corpus`."""
    folder = _folder(data_dir, "triviaqa")
    questions = tuple(
        Question(
            id=obj["qid"],
            question=obj["question"].strip(),
            answers=_dedupe_answers([obj["gold_answer"], *obj.get("aliases", [])]),
            dataset="triviaqa",
        )
        for obj in _read_json(_file(folder, "triviaqa_150.json"))
    )
    return Dataset(name="triviaqa", questions=questions, licence="Apache-2.0; repo MIT")


def _mtrag_domain(raw: str | None) -> str | None:
    # "mt-rag-clapnq-elser-512-100-20240503" -> "clapnq"
    if raw and raw.startswith("mt-rag-"):
        return raw.removeprefix("mt-rag-").split("-", 1)[0]
    return raw


def load_mtrag(data_dir: Path | None = None) -> Dataset:
    """MTRAG human conversations: 110 conversations, 842 user turns, and the 2,021 passages
    shown in them (``passages_referenced.jsonl``, first-occurrence order).

    Per turn: the user's question, the agent's reference answer and the passages shown for that
    turn in the given order with their retriever scores. Conversation ids are
    ``mtrag:<IBM conversation id>``. Raises ``ValueError`` when a shown passage is missing from
    ``passages_referenced.jsonl`` or when user and agent messages do not alternate."""
    folder = _folder(data_dir, "mtrag")
    passages = _PassageSet()
    for obj in _read_jsonl(_file(folder, "passages_referenced.jsonl")):
        passages.add(
            Passage(
                id=PassageId(f"mtrag:{obj['document_id']}"),
                title=obj.get("title") or "",
                text=obj["text"],
                dataset="mtrag",
            )
        )
    frozen = passages.freeze()
    by_id = {p.id: p for p in frozen}
    conversations: list[Conversation] = []
    for obj in _read_jsonl(_file(folder, "conversations.jsonl")):
        conversation_id = ConversationId(f"mtrag:{obj['conversation_id']}")
        messages: Sequence[Mapping[str, Any]] = obj["messages"]
        turns: list[Turn] = []
        for i in range(0, len(messages), 2):
            user = messages[i]
            agent = messages[i + 1] if i + 1 < len(messages) else None
            if user["speaker"] != "user" or (agent is not None and agent["speaker"] != "agent"):
                msg = f"MTRAG {conversation_id}: messages {i}, {i + 1} are not a user/agent pair"
                raise ValueError(msg)
            shown: list[ShownPassage] = []
            for ctx in agent.get("contexts", []) if agent is not None else []:
                pid = PassageId(f"mtrag:{ctx['document_id']}")
                if pid not in by_id:
                    msg = f"MTRAG {conversation_id}: passage {pid} not in passages_referenced.jsonl"
                    raise ValueError(msg)
                score = ctx.get("score")
                shown.append(ShownPassage(by_id[pid], float(score) if score is not None else None))
            turns.append(
                Turn(
                    turn=len(turns) + 1,
                    question=user["text"],
                    answer=agent["text"] if agent is not None else None,
                    contexts=tuple(shown),
                )
            )
        conversations.append(
            Conversation(
                id=conversation_id,
                dataset="mtrag",
                turns=tuple(turns),
                domain=_mtrag_domain(obj.get("domain")),
            )
        )
    return Dataset(
        name="mtrag",
        passages=frozen,
        conversations=tuple(conversations),
        licence="Apache-2.0; ClapNQ passages CC BY-SA",
    )


def load_sharegpt(data_dir: Path | None = None) -> Dataset:
    """ShareGPT V3 sample, 1,000 conversations. A turn is a non-empty human message and the
    next gpt message (``answer``, ``None`` when the conversation ends first). Leading gpt
    messages (V3 splits long chats), system messages and the 4 empty human messages are not
    turns; conversations with no turn are left out (``notes`` counts them). Ids are
    ``sharegpt:<id>``."""
    folder = _folder(data_dir, "sharegpt")
    conversations: list[Conversation] = []
    empty_messages = 0
    no_turn = 0
    for obj in _read_jsonl(_file(folder, "sharegpt_v3_sample_1000.jsonl")):
        messages: Sequence[Mapping[str, Any]] = obj["conversations"]
        turns: list[Turn] = []
        for i, message in enumerate(messages):
            if message["from"] != "human":
                continue
            text: str = message["value"]
            if not text.strip():
                empty_messages += 1
                continue
            following = messages[i + 1] if i + 1 < len(messages) else None
            answer = following["value"] if following and following["from"] == "gpt" else None
            turns.append(Turn(turn=len(turns) + 1, question=text, answer=answer))
        if not turns:
            no_turn += 1
            continue
        conversations.append(
            Conversation(
                id=ConversationId(f"sharegpt:{obj['id']}"), dataset="sharegpt", turns=tuple(turns)
            )
        )
    return Dataset(
        name="sharegpt",
        conversations=tuple(conversations),
        licence="unclear (user-shared ChatGPT output); research benchmarking only",
        notes=(
            f"{empty_messages} empty human messages skipped",
            f"{no_turn} conversations without a human turn left out",
        ),
    )


LOADERS: Mapping[str, Callable[[Path | None], Dataset]] = {
    "squad": load_squad,
    "hotpotqa": load_hotpotqa,
    "2wiki": load_2wiki,
    "triviaqa": load_triviaqa,
    "mtrag": load_mtrag,
    "sharegpt": load_sharegpt,
}
"""Dataset name -> loader. The names are the CLI's ``--dataset`` choices."""


def check_dataset_name(name: str) -> str:
    """Return ``name`` if it is a known dataset, else raise ``ValueError`` listing the names."""
    if name not in LOADERS:
        msg = f"unknown dataset {name!r}; valid names: {', '.join(LOADERS)}"
        raise ValueError(msg)
    return name


def load_dataset(name: str, data_dir: Path | None = None) -> Dataset:
    """Load one dataset by name (see :data:`LOADERS`). ``ValueError`` for an unknown name,
    ``FileNotFoundError`` naming ``CRAFT_RAG_DATA`` when its folder is missing."""
    return LOADERS[check_dataset_name(name)](data_dir)


def passage_corpus(
    names: Sequence[str] = CORPUS_DATASETS, data_dir: Path | None = None
) -> tuple[Passage, ...]:
    """The union of the named datasets' passages, in the order of ``names`` then file order.

    Default: SQuAD + HotpotQA + 2Wiki + MTRAG = 2,067 + 4,858 + 6,119 + 2,021 = 15,065 passages.
    Ids are namespaced, so the union needs no cross-dataset dedup; a name repeated in ``names``
    is loaded once. Raises ``ValueError`` for an unknown name or a dataset without passages."""
    if isinstance(names, str):
        names = (names,)
    out: list[Passage] = []
    for name in dict.fromkeys(names):
        dataset = load_dataset(name, data_dir)
        if not dataset.passages:
            msg = f"dataset {name!r} has no passages; corpus datasets are: " + ", ".join(
                CORPUS_DATASETS
            )
            raise ValueError(msg)
        out.extend(dataset.passages)
    return tuple(out)
