"""approx_params: request parsing and validation, the request-scoped salt, the reuse report."""

from __future__ import annotations

from typing import Any

import pytest

from craft_rag.kvtiers.approx_params import (
    APPROX_PARAMS_KEY,
    REUSE_PARAMS_KEY,
    BlendParams,
    KVSpan,
    ReuseCounts,
    is_request_scoped,
    parse_approx,
    request_scoped_salt,
    reuse_counts_of,
    tenant_salt,
)

SOURCES = ("hf_prefill", "mine", "chunk")
NONCE = "0123456789abcdef0123456789abcdef"


def make_params(*spans: dict[str, Any], model: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"spans": list(spans)}
    if model is not None:
        body["model"] = model
    return {APPROX_PARAMS_KEY: body, "other_connector": 1}


def make_span(start: int, end: int, source: str = "mine", **spec: Any) -> dict[str, Any]:
    return {"start": start, "end": end, "source": source, **spec}


def test_parse_valid_request_keeps_source_fields() -> None:
    got = parse_approx(make_params(make_span(0, 10, variant="ab"), make_span(10, 30, "hf_prefill"),
                                   model="m"), 31, SOURCES)
    assert got is not None
    assert got.spans == (KVSpan(0, 10, "mine", {"variant": "ab"}), KVSpan(10, 30, "hf_prefill"))
    assert (got.start, got.end, got.model, got.blend) == (0, 30, "m", None)


def with_blend(blend: object, *spans: dict[str, Any]) -> dict[str, Any]:
    params = make_params(*spans)
    params[APPROX_PARAMS_KEY]["blend"] = blend
    return params


def test_parse_chunk_spans_get_blend_defaults() -> None:
    got = parse_approx(make_params(make_span(4, 10, "chunk"), make_span(10, 20, "chunk")), 21,
                       SOURCES)
    assert got is not None and got.blend == BlendParams("kv_deviation", 0.3, None)
    got = parse_approx(with_blend({"rule": "cci", "alpha": 2}, make_span(0, 5, "chunk")), 9,
                       SOURCES)
    assert got is not None and got.blend == BlendParams("cci", None, 2.0)
    got = parse_approx(with_blend({"fraction": 1}, make_span(0, 5, "chunk")), 9, SOURCES)
    assert got is not None and got.blend == BlendParams("kv_deviation", 1.0, None)


@pytest.mark.parametrize(
    ("params", "match"),
    [
        (make_params(make_span(0, 5, "chunk"), make_span(5, 8)), "cannot be mixed"),
        (make_params(make_span(0, 5, "chunk", variant="x")), "take no other fields"),
        (with_blend({"fraction": 0.3}, make_span(0, 5)), "chunk' spans only"),
        (with_blend([], make_span(0, 5, "chunk")), "blend must be a mapping"),
        (with_blend({"rule": "oracle"}, make_span(0, 5, "chunk")), "unknown; valid"),
        (with_blend({"fraction": 1.5}, make_span(0, 5, "chunk")), r"in \[0, 1.0\]"),
        (with_blend({"fraction": True}, make_span(0, 5, "chunk")), "fraction must be"),
        (with_blend({"alpha": float("nan")}, make_span(0, 5, "chunk")), "alpha must be"),
        (with_blend({"alpha": 1, "fraction": 0.1}, make_span(0, 5, "chunk")), "not both"),
    ],
)
def test_parse_rejects_bad_blend(params: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_approx(params, 10, SOURCES)


@pytest.mark.parametrize("params", [None, {}, {"other": 1}, "text", 3])
def test_parse_absent_is_none(params: object) -> None:
    assert parse_approx(params, 10, SOURCES) is None


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({APPROX_PARAMS_KEY: []}, "mapping"),
        ({APPROX_PARAMS_KEY: {"spans": [], "x": 1}}, "mapping"),
        (make_params(), "non-empty list"),
        ({APPROX_PARAMS_KEY: {"spans": "0-10"}}, "non-empty list"),
        (make_params(make_span(0, 5), model=3), "model must be a string"),  # type: ignore[arg-type]
        (make_params({"start": 0, "end": 5}), "mapping with"),
        (make_params(make_span(0, 5, "pickle")), "unknown source 'pickle'; valid"),
        (make_params(make_span(0, 5, 7)), "unknown source"),  # type: ignore[arg-type]
        (make_params(make_span(True, 5)), "must be an int"),
        (make_params(make_span(0, 5.0)), "must be an int"),  # type: ignore[arg-type]
        (make_params(make_span(5, 5)), "non-empty"),
        (make_params(make_span(-1, 5)), "non-empty"),
        (make_params(make_span(0, 5), make_span(6, 8)), "not where span 0 ends"),
        (make_params(make_span(0, 5), make_span(3, 8)), "not where span 0 ends"),
        (make_params(make_span(0, 10)), "before the last prompt token"),
    ],
)
def test_parse_rejects(params: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_approx(params, 10, SOURCES)


def test_parse_rejects_too_many_spans() -> None:
    spans = [make_span(i, i + 1) for i in range(5000)]
    with pytest.raises(ValueError, match="at most"):
        parse_approx(make_params(*spans), 6000, SOURCES)


def test_request_scoped_salt_round_trip() -> None:
    salt = request_scoped_salt("tenant|with|bars", nonce=NONCE)
    assert salt == f"craft-approx:{NONCE}|tenant|with|bars"
    assert is_request_scoped(salt) and tenant_salt(salt) == "tenant|with|bars"
    anon = request_scoped_salt()
    assert is_request_scoped(anon) and tenant_salt(anon) is None
    assert anon != request_scoped_salt()  # fresh nonce each time


@pytest.mark.parametrize(
    "salt",
    [None, "tenant", "craft-approx:", "craft-approx:abc|t", f"craft-approx:{NONCE}",
     f"craft-approx:{NONCE.upper()}|t", f"xcraft-approx:{NONCE}|t"],
)
def test_not_request_scoped(salt: str | None) -> None:
    assert not is_request_scoped(salt)
    assert tenant_salt(salt) == salt  # any other salt keys its own exact KV


@pytest.mark.parametrize("nonce", ["", "0" * 31, "g" * 32, NONCE.upper()])
def test_request_scoped_salt_rejects_bad_nonce(nonce: str) -> None:
    with pytest.raises(ValueError, match="lowercase hex"):
        request_scoped_salt(nonce=nonce)


def test_reuse_counts_round_trip_and_sum() -> None:
    counts = ReuseCounts(exact=64, fixed=100, recomputed=10, computed=26, refused=None)
    params = {REUSE_PARAMS_KEY: counts.to_params(), "craft_tiers": {}}
    assert reuse_counts_of(params, prompt_len=200) == counts
    assert reuse_counts_of(params) == counts
    assert reuse_counts_of(params, prompt_len=199) is None


@pytest.mark.parametrize(
    "raw",
    [None, [], {"exact": 1}, {"exact": -1, "fixed": 0, "recomputed": 0, "computed": 0,
                              "refused": None},
     {"exact": True, "fixed": 0, "recomputed": 0, "computed": 0, "refused": None},
     {"exact": 0, "fixed": 0, "recomputed": 0, "computed": 0, "refused": 3},
     {"exact": 0, "fixed": 0, "recomputed": 0, "computed": 0, "refused": None, "x": 0}],
)
def test_reuse_counts_malformed_is_none(raw: object) -> None:
    assert reuse_counts_of({REUSE_PARAMS_KEY: raw}) is None
    assert reuse_counts_of("not a mapping") is None
