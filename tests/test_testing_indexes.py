"""``craft_rag.testing.indexes.make_faiss_index``: the one IVF/flat index builder the
retriever integrations' pipelining tests share."""

from __future__ import annotations

import pytest

from craft_rag.testing.indexes import make_faiss_index

faiss = pytest.importorskip("faiss")
np = pytest.importorskip("numpy")


def test_ivf_index_is_trained_empty_and_searches_every_list() -> None:
    x = np.random.default_rng(0).standard_normal((64, 8)).astype("float32")
    index = make_faiss_index(x, ivf=True, nlist=4)
    assert isinstance(index, faiss.IndexIVFFlat)
    assert index.is_trained and index.ntotal == 0
    assert (index.d, index.nlist, index.nprobe) == (8, 4, 4)
    index.add(x)
    _, found = index.search(x[:5], 1)
    assert found[:, 0].tolist() == [0, 1, 2, 3, 4]  # every list searched: exact


def test_flat_index_and_bad_nlist() -> None:
    x = np.zeros((4, 3), dtype="float32")
    index = make_faiss_index(x, ivf=False, nlist=1)
    assert type(index) is faiss.IndexFlatL2 and index.d == 3 and index.ntotal == 0
    with pytest.raises(ValueError, match="nlist"):
        make_faiss_index(x, ivf=True, nlist=0)
