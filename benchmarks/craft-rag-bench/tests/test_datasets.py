"""Loaders for shared/data: counts documented in the data READMEs, id stability, bad input."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from craft_rag_bench.datasets import (
    CORPUS_DATASETS,
    LOADERS,
    Dataset,
    Passage,
    PassageId,
    load_dataset,
    load_hotpotqa,
    load_mtrag,
    load_sharegpt,
    load_squad,
    load_triviaqa,
    passage_corpus,
)
from craft_rag_bench.paths import shared_data_dir


@pytest.fixture(scope="module")
def squad() -> Dataset:
    return load_squad()


@pytest.fixture(scope="module")
def mtrag() -> Dataset:
    return load_mtrag()


def test_squad_counts_match_the_official_dev_set(squad: Dataset) -> None:
    # squad/README.md: 48 articles, 2,067 paragraphs, 10,570 questions.
    assert len(squad.passages) == 2067
    assert len(squad.questions) == 10570
    assert len({p.id.rsplit(":", 1)[0] for p in squad.passages}) == 48


def test_squad_gold_paragraph_contains_an_answer(squad: Dataset) -> None:
    passages = squad.passage_map()
    for q in squad.questions:
        (gold,) = q.gold_passage_ids
        assert any(a in passages[gold].text for a in q.answers), q.id


def test_squad_ids_are_stable_and_readable(squad: Dataset) -> None:
    first = squad.passages[0]
    assert first.id == "squad:Super_Bowl_50:0"
    assert first.title == "Super Bowl 50"
    assert first.content == f"Super Bowl 50\n{first.text}"
    assert squad.questions[0].id == "56be4db0acb8001400a502ec"
    assert squad.questions[0].answers == ("Denver Broncos",)


def test_hotpotqa_questions_have_their_paragraphs_and_two_gold() -> None:
    hotpot = load_hotpotqa()
    ids = {p.id for p in hotpot.passages}
    assert len(hotpot.passages) == 4858
    assert len(hotpot.questions) == 500
    sizes = Counter(len(q.passage_ids) for q in hotpot.questions)
    assert sizes[10] == 489
    for q in hotpot.questions:
        assert len(q.gold_passage_ids) == 2
        assert set(q.gold_passage_ids) <= set(q.passage_ids) <= ids
        assert q.answers and q.answers[0]


def test_2wiki_corpus_and_questions() -> None:
    wiki = load_dataset("2wiki")
    assert len(wiki.passages) == 6119
    assert len(wiki.questions) == 500
    assert wiki.passages[0].id == "2wiki:0"
    assert all(q.answers and not q.passage_ids for q in wiki.questions)
    assert wiki.notes  # the not-aligned warning travels with the data


def test_triviaqa_answers_start_with_the_gold_answer() -> None:
    trivia = load_triviaqa()
    assert len(trivia.questions) == 150
    assert not trivia.passages
    raw = json.loads((shared_data_dir() / "triviaqa" / "triviaqa_150.json").read_text("utf-8"))
    for q, obj in zip(trivia.questions, raw, strict=True):
        assert q.answers[0] == obj["gold_answer"].strip()
        assert len(q.answers) == len(set(q.answers))


def test_mtrag_turns_contexts_and_passages(mtrag: Dataset) -> None:
    # mtrag/README.md: 110 conversations, 842 agent turns, 3,156 context entries, 2,021 passages,
    # 1,063 entries repeat a passage already shown earlier in the same conversation.
    assert len(mtrag.conversations) == 110
    assert len(mtrag.passages) == 2021
    turns = [t for c in mtrag.conversations for t in c.turns]
    assert len(turns) == 842
    assert sum(len(t.contexts) for t in turns) == 3156
    repeated = 0
    for conversation in mtrag.conversations:
        assert [t.turn for t in conversation.turns] == list(range(1, len(conversation.turns) + 1))
        seen: set[str] = set()
        for turn in conversation.turns:
            keys = [s.passage.id for s in turn.contexts]
            assert len(keys) == len(set(keys))
            repeated += sum(k in seen for k in keys)
            seen.update(keys)
            assert turn.answer is not None and turn.question
    assert repeated == 1063
    assert {c.domain for c in mtrag.conversations} == {"clapnq", "fiqa", "govt", "ibmcloud"}


def test_mtrag_content_does_not_repeat_a_title_the_text_starts_with(mtrag: Dataset) -> None:
    clapnq = next(p for p in mtrag.passages if p.title and p.text.startswith(p.title + "\n"))
    assert clapnq.content == clapnq.text


def test_sharegpt_turns_pair_human_with_the_next_reply() -> None:
    sharegpt = load_sharegpt()
    raw = [
        json.loads(line)
        for line in (shared_data_dir() / "sharegpt" / "sharegpt_v3_sample_1000.jsonl").open()
    ]
    human = sum(1 for c in raw for m in c["conversations"] if m["from"] == "human")
    empty = sum(
        1
        for c in raw
        for m in c["conversations"]
        if m["from"] == "human" and not m["value"].strip()
    )
    assert sum(len(c.turns) for c in sharegpt.conversations) == human - empty
    by_id = {f"sharegpt:{c['id']}": c for c in raw}
    conversation = next(c for c in sharegpt.conversations if len(c.turns) >= 2)
    messages = by_id[conversation.id]["conversations"]
    first_human = next(i for i, m in enumerate(messages) if m["from"] == "human")
    assert conversation.turns[0].question == messages[first_human]["value"]
    assert conversation.turns[0].answer == messages[first_human + 1]["value"]


def test_passage_corpus_is_the_union_with_unique_ids() -> None:
    corpus = passage_corpus()
    assert len(corpus) == 2067 + 4858 + 6119 + 2021
    assert len({p.id for p in corpus}) == len(corpus)
    for p in corpus:
        assert p.id.startswith(p.dataset + ":")
        assert p.dataset in CORPUS_DATASETS
    assert passage_corpus(["squad", "squad"]) == passage_corpus(["squad"])


def test_unknown_dataset_name_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="valid names: " + ", ".join(LOADERS)):
        load_dataset("nq")
    with pytest.raises(ValueError, match="valid names"):
        passage_corpus(["squad", "msmarco"])


def test_a_dataset_without_passages_is_not_a_corpus() -> None:
    with pytest.raises(ValueError, match=r"triviaqa.*no passages"):
        passage_corpus(["triviaqa"])


def test_missing_data_folder_names_the_variable(tmp_path: Path) -> None:
    for name in LOADERS:
        with pytest.raises(FileNotFoundError, match="CRAFT_RAG_DATA"):
            load_dataset(name, data_dir=tmp_path)


def test_missing_file_in_a_present_folder_is_reported(tmp_path: Path) -> None:
    (tmp_path / "squad").mkdir()
    with pytest.raises(FileNotFoundError, match=r"dev-v1\.1\.part1\.json"):
        load_squad(tmp_path)


def test_two_texts_under_one_id_is_an_error(tmp_path: Path) -> None:
    folder = tmp_path / "hotpotqa"
    folder.mkdir()

    def ctx(text: str) -> dict[str, object]:
        return {"id": "0", "title": "Same", "paragraph_text": text, "is_supporting": True}

    rows = [
        {"question_id": "a", "question_text": "q?", "answers_objects": [{"spans": ["x"]}],
         "contexts": [ctx("one")]},
        {"question_id": "b", "question_text": "q?", "answers_objects": [{"spans": ["x"]}],
         "contexts": [ctx("two")]},
    ]  # fmt: skip
    (folder / "hotpotqa_dev_distractor_500.ircot.jsonl").write_text(
        "\n".join(json.dumps(r) for r in rows), encoding="utf-8"
    )
    with pytest.raises(ValueError, match="two different passages"):
        load_hotpotqa(tmp_path)


def test_identical_passages_are_deduplicated(tmp_path: Path) -> None:
    folder = tmp_path / "hotpotqa"
    folder.mkdir()
    ctx = {"id": "0", "title": "Same", "paragraph_text": "text", "is_supporting": True}
    rows = [
        {"question_id": q, "question_text": "q?", "answers_objects": [{"spans": ["x"]}],
         "contexts": [ctx]}
        for q in ("a", "b")
    ]  # fmt: skip
    (folder / "hotpotqa_dev_distractor_500.ircot.jsonl").write_text(
        "\n".join(json.dumps(r) for r in rows), encoding="utf-8"
    )
    hotpot = load_hotpotqa(tmp_path)
    assert len(hotpot.passages) == 1
    assert hotpot.questions[0].passage_ids == hotpot.questions[1].passage_ids


def test_malformed_jsonl_names_the_line(tmp_path: Path) -> None:
    folder = tmp_path / "hotpotqa"
    folder.mkdir()
    (folder / "hotpotqa_dev_distractor_500.ircot.jsonl").write_text("{}\n{oops\n", "utf-8")
    with pytest.raises((ValueError, KeyError)):
        load_hotpotqa(tmp_path)
    (folder / "hotpotqa_dev_distractor_500.ircot.jsonl").write_text("\n{oops\n", "utf-8")
    with pytest.raises(ValueError, match=r"jsonl:2: invalid JSON"):
        load_hotpotqa(tmp_path)


def test_passage_content_rules() -> None:
    assert Passage(PassageId("x:1"), "T", "body", "x").content == "T\nbody"
    assert Passage(PassageId("x:1"), "", "body", "x").content == "body"
    assert Passage(PassageId("x:1"), "T", "T\nbody", "x").content == "T\nbody"
    # A text that merely begins with the title's words still gets the title line.
    assert Passage(PassageId("x:1"), "T", "T is", "x").content == "T\nT is"
