"""The planner's value types: :class:`PlannerConfig`, :class:`Plan`, :class:`CommitResult`,
:class:`PlannerStats` (re-exported by :mod:`craft_rag.planner`), and the checks that turn a
commit's arguments into CP-Tree spans and hashes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from itertools import accumulate, pairwise
from typing import Any

from craft_rag.access_table import DEFAULT_WINDOW
from craft_rag.chunk import Chunk
from craft_rag.conversation import DEFAULT_MAX_CONVERSATIONS, DEFAULT_TTL_S
from craft_rag.ordering import DEFAULT_POLICY, ORDERING_POLICIES
from craft_rag.promotion import PROMOTION_RULES
from craft_rag.tree import DEFAULT_MAX_NODES, KVLocation, NodeMetadata
from craft_rag.types import BlockHash, ChunkKey, ConversationId, as_block_hash
from craft_rag.validation import (
    MAX_INT,
    check_bool,
    check_int,
    check_number,
    check_optional_int,
    materialise,
    state_dict,
)

# The promotion rule each policy uses unless configured: the paper's threshold rule for the
# paper's policies; `served` for `tree`, whose set match needs every served order in the tree.
_DEFAULT_PROMOTION = {"retriever": "threshold", "frequency": "threshold", "tree": "served"}


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    """Planner settings. ``window=None`` is an unlimited CA-Table window; ``promotion=None``
    picks the policy's default rule (see :mod:`craft_rag.promotion`)."""

    policy: str = DEFAULT_POLICY
    window: int | None = DEFAULT_WINDOW
    threshold: int = 2
    promotion: str | None = None
    max_tree_nodes: int = DEFAULT_MAX_NODES
    dedup: bool = True
    max_conversations: int = DEFAULT_MAX_CONVERSATIONS
    conversation_ttl_s: float | None = DEFAULT_TTL_S

    def __post_init__(self) -> None:
        """``ValueError`` naming the field (``"window: must be ..."``) for any bad setting;
        bools are refused where ints are meant and non-bools where bools are meant."""
        if not isinstance(self.policy, str) or self.policy not in ORDERING_POLICIES:
            msg = (
                f"policy: unknown policy {self.policy!r}; "
                f"choose one of {sorted(ORDERING_POLICIES)}"
            )
            raise ValueError(msg)
        if self.promotion is not None and (
            not isinstance(self.promotion, str) or self.promotion not in PROMOTION_RULES
        ):
            msg = (
                f"promotion: unknown promotion rule {self.promotion!r}; "
                f"choose one of {sorted(PROMOTION_RULES)} or None (the policy's default)"
            )
            raise ValueError(msg)
        check_optional_int(self.window, "window", minimum=1, none_means="unlimited window")
        check_int(self.threshold, "threshold", minimum=1)
        check_int(self.max_tree_nodes, "max_tree_nodes", minimum=1)
        check_bool(self.dedup, "dedup")
        check_int(self.max_conversations, "max_conversations", minimum=1)
        if self.conversation_ttl_s is not None:
            try:
                check_number(self.conversation_ttl_s, "conversation_ttl_s", positive=True)
            except ValueError as exc:
                msg = f"{exc} (or None: no expiry); pass seconds, e.g. 3600.0 for an hour"
                raise ValueError(msg) from None

    @property
    def promotion_rule(self) -> str:
        return self.promotion or _DEFAULT_PROMOTION.get(self.policy, "threshold")


@dataclass(frozen=True, slots=True)
class Plan:
    """What to send for one request.

    ``ordered`` is this turn's chunks in render order. ``removed_duplicates`` were sent in an
    earlier turn of the conversation and are left out; ``repeated_in_request`` repeated a key
    within this request (the first occurrence is kept). Every input chunk is in exactly one of
    the three. ``matched_chunks``/``matched_tokens`` is the CP-Tree's predicted reusable prefix
    (tokens counted from the start of the prompt; None when spans are unknown).
    ``planner_token`` names the planner instance that made the plan: plan ids count per
    instance, so only the maker may commit it.
    """

    plan_id: int
    ordered: tuple[Chunk, ...]
    removed_duplicates: tuple[Chunk, ...]
    repeated_in_request: tuple[Chunk, ...]
    matched_chunks: int
    matched_tokens: int | None
    conversation_id: ConversationId | None
    turn: int
    policy: str
    planner_token: int = 0
    # ``ordered``'s keys, computed once (commit reads them several times per
    # request). A plan altered after planning is refused by its fingerprint, which reads
    # ``ordered`` itself, so this copy is never trusted over it.
    _keys: tuple[ChunkKey, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_keys", tuple([c.key for c in self.ordered]))

    @property
    def keys(self) -> tuple[ChunkKey, ...]:
        return self._keys

    @property
    def retrieved_count(self) -> int:
        return len(self.ordered) + len(self.removed_duplicates) + len(self.repeated_in_request)

    @property
    def ref(self) -> str:
        """The plan's name across planners (``"<planner token>.<plan id>"``): what a framework
        adapter hands to the LLM side, which claims the plan by it
        (:meth:`craft_rag.planner.CraftPlanner.claim`). Plain text: fits node metadata and
        message kwargs."""
        return f"{self.planner_token:x}.{self.plan_id}"


@dataclass(frozen=True, slots=True)
class CommitResult:
    """What a commit changed in the CP-Tree."""

    reused_chunks: int
    inserted_path: int
    stale_nodes_removed: int
    turn: int


# Frozen dataclasses set each field through ``object.__setattr__`` in ``__init__``: ~3x the
# cost of setting the slots directly, and plan() / commit() build one Plan and one
# CommitResult per request, on the planner's hot path. The planner builds them from values it
# made and checked with these makers; the public constructors stay.
_new = object.__new__
_RESULT_SET = tuple(CommitResult.__dict__[f.name].__set__ for f in fields(CommitResult))
assert [f.name for f in fields(CommitResult)] == [
    "reused_chunks", "inserted_path", "stale_nodes_removed", "turn"
]


class _PlanDraft:
    """A :class:`Plan` under construction: the same slots, not frozen, so its fields are
    plain (fast) slot stores; :func:`made_plan` then makes it a Plan (``__class__``
    assignment: allowed between classes with the same slot layout, nothing copied)."""

    __slots__ = Plan.__slots__  # set by dataclass(slots=True)


assert set(_PlanDraft.__slots__) == {f.name for f in fields(Plan)}  # every field, no other


def made_plan(
    plan_id: int,
    ordered: tuple[Chunk, ...],
    removed_duplicates: tuple[Chunk, ...],
    repeated_in_request: tuple[Chunk, ...],
    matched_chunks: int,
    matched_tokens: int | None,
    conversation_id: ConversationId | None,
    turn: int,
    policy: str,
    planner_token: int,
    keys: tuple[ChunkKey, ...],
) -> Plan:
    """The :class:`Plan` ``Plan(...)`` would build, ``keys`` being ``ordered``'s keys (for
    :meth:`craft_rag.planner.CraftPlanner.plan` only). O(1)."""
    draft: Any = _new(_PlanDraft)
    draft.plan_id = plan_id
    draft.ordered = ordered
    draft.removed_duplicates = removed_duplicates
    draft.repeated_in_request = repeated_in_request
    draft.matched_chunks = matched_chunks
    draft.matched_tokens = matched_tokens
    draft.conversation_id = conversation_id
    draft.turn = turn
    draft.policy = policy
    draft.planner_token = planner_token
    draft._keys = keys
    draft.__class__ = Plan
    plan: Plan = draft
    return plan


_RESULTS: dict[tuple[int, int, int, int], CommitResult] = {}
_MAX_RESULTS = 4096


def made_result(reused: int, inserted: int, stale: int, turn: int) -> CommitResult:
    """``CommitResult(reused, inserted, stale, turn)`` for the planner's commit. O(1).

    A result is immutable, so equal ones are shared: the few thousand small value tuples a
    planner meets are built once (no object per commit)."""
    key = (reused, inserted, stale, turn)
    result = _RESULTS.get(key)
    if result is None:
        result = _new(CommitResult)
        s = _RESULT_SET
        s[0](result, reused)
        s[1](result, inserted)
        s[2](result, stale)
        s[3](result, turn)
        if len(_RESULTS) < _MAX_RESULTS:
            _RESULTS[key] = result
    return result


@dataclass(slots=True)
class PlannerStats:
    """Running totals since creation (or load). Owner: :class:`CraftPlanner`."""

    plans: int = 0
    commits: int = 0
    chunks_retrieved: int = 0
    chunks_removed_by_dedup: int = 0
    chunks_repeated_in_request: int = 0
    predicted_chunks: int = 0
    reused_chunks: int = 0


Spans = tuple[int, Sequence[int]]
"""Contiguous token spans as ``(first token, each chunk's token count)``: chunk ``i`` spans
``[first + sum(counts[:i]), first + sum(counts[:i + 1]))``; the tree adds them up as it walks
(no pair or boundary list per commit; :func:`span_pairs` for the pairs)."""
Hashes = list[tuple[BlockHash, ...]]
"""Each chunk's engine block hashes (normalised)."""


def commit_spans(
    plan: Plan,
    prefix_tokens: int | None,
    chunk_token_counts: Sequence[int] | None,
    reused_chunks: int | None,
    block_hashes: Sequence[Sequence[BlockHash | int]] | None,
    location: KVLocation | None,
    *,
    made_here: bool = False,
) -> tuple[Spans | None, Hashes | None]:
    """Check every argument of :meth:`craft_rag.planner.CraftPlanner.commit` (``ValueError``
    naming the argument; nothing has changed yet) and build each chunk's CP-Tree token span
    (from ``prefix_tokens`` and the counts, default the chunks' ``num_tokens``) and block
    hashes; None where unknown. ``made_here``: ``plan`` is the very object the planner's
    ``plan()`` returned (distinct keys by construction; the repeat check is skipped). O(k)."""
    if type(plan) is not Plan and not isinstance(plan, Plan):
        msg = (
            f"plan: must be the craft_rag.planner.Plan that plan() returned, "
            f"got {type(plan).__name__}"
        )
        raise ValueError(msg)
    ordered = plan.ordered
    k = len(ordered)
    if not made_here and len(set(plan.keys)) != k:
        msg = "plan: its ordered chunks repeat a key; commit the Plan that plan() returned"
        raise ValueError(msg)
    if prefix_tokens is not None and not (
        type(prefix_tokens) is int and 0 <= prefix_tokens <= MAX_INT
    ):
        check_int(prefix_tokens, "prefix_tokens", minimum=0)  # int subclasses pass; else why
    counts: Sequence[int] | None = None
    if chunk_token_counts is not None:
        counts = materialise(chunk_token_counts, "chunk_token_counts")
        if len(counts) != k:
            msg = f"chunk_token_counts: has {len(counts)} entries for {k} chunks"
            raise ValueError(msg)
        if not all(type(count) is int and 0 <= count <= MAX_INT for count in counts):
            for i, count in enumerate(counts):  # int subclasses pass; the error names one
                check_int(count, f"chunk_token_counts[{i}]", minimum=0)
    hashes = None
    if block_hashes is not None:
        rows = materialise(block_hashes, "block_hashes")
        if len(rows) != k:
            msg = f"block_hashes: has {len(rows)} entries for {k} chunks"
            raise ValueError(msg)
        hashes = [
            tuple(
                as_block_hash(h, f"block_hashes[{i}][{j}]")
                for j, h in enumerate(materialise(row, f"block_hashes[{i}]"))
            )
            for i, row in enumerate(rows)
        ]
    if reused_chunks is not None:
        check_int(reused_chunks, "reused_chunks", minimum=0, maximum=k)
    if location is not None and not isinstance(location, KVLocation):
        msg = f"location: must be a KVLocation or None, got {type(location).__name__}"
        raise ValueError(msg)
    if counts is None:  # the chunks' own counts (each checked when its Chunk was built)
        counts = [c.num_tokens for c in ordered]  # type: ignore[misc]  # None: see below
    first = prefix_tokens or 0
    try:
        end = first + sum(counts)
    except TypeError:  # a chunk of unknown size (None): spans unknown
        return None, hashes
    if end > MAX_INT:
        msg = f"chunk_token_counts: spans past token {MAX_INT}; pass real token counts"
        raise ValueError(msg)
    return (first, counts), hashes


def span_pairs(spans: Spans) -> list[tuple[int, int]]:
    """Each chunk's ``(start, end)`` span of ``spans``; consecutive spans share their
    boundary int. O(k)."""
    first, counts = spans
    return list(pairwise(accumulate(counts, initial=first)))


def node_metadata(spans: Spans | None, hashes: Hashes | None, k: int) -> list[NodeMetadata] | None:
    """Each chunk's :class:`NodeMetadata` from values :func:`commit_spans` checked (no
    re-check). O(k)."""
    if spans is None and hashes is None:
        return None
    trusted = NodeMetadata.trusted
    pairs = span_pairs(spans) if spans is not None else None
    return [
        trusted(
            pairs[i] if pairs is not None else None, hashes[i] if hashes is not None else None
        )
        for i in range(k)
    ]


def parse_plan_ref(ref: object) -> tuple[int | None, int]:
    """``(planner token, plan id)`` of a :attr:`Plan.ref`, or ``(None, plan id)`` for a bare
    int id (a :class:`Plan` gives its own). ``ValueError`` naming ``plan`` for anything else."""
    if isinstance(ref, Plan):
        return ref.planner_token, ref.plan_id
    if isinstance(ref, int) and not isinstance(ref, bool) and ref > 0:
        return None, ref
    if isinstance(ref, str):
        token, _, plan_id = ref.partition(".")
        try:
            return int(token, 16), int(plan_id, 10)
        except ValueError:
            pass
    msg = (
        f"plan: must be a craft_rag.planner.Plan, its plan.ref (\"<token>.<id>\") or its "
        f"plan_id, got {ref!r}"
    )
    raise ValueError(msg)


def config_from_json(value: object) -> PlannerConfig:
    """The saved ``config`` object as a :class:`PlannerConfig`; a missing field takes its
    default, an unknown one is refused. ``ValueError`` naming ``config.<field>``."""
    data = state_dict(value, "config", optional=[f.name for f in fields(PlannerConfig)])
    try:
        return PlannerConfig(**data)
    except ValueError as exc:
        raise ValueError(f"config.{exc}") from None


def check_tokens(tokens: Sequence[int] | None) -> tuple[int, ...] | None:
    """A turn's token ids as a tuple (None stays None); ``ValueError`` naming ``turn_tokens``
    unless they are ints >= 0. O(tokens)."""
    if tokens is None:
        return None
    ids = tuple(tokens)
    if not all(type(t) is int and t >= 0 for t in ids):
        msg = f"turn_tokens: must be token ids (ints >= 0), got {list(ids)[:5]!r}"
        raise ValueError(msg)
    return ids


def split_repeats(chunks: Sequence[Chunk]) -> tuple[dict[ChunkKey, Chunk], list[Chunk]]:
    """``({key: first chunk of that key}, the later repeats)``; ``ValueError`` naming the
    first item that is not a :class:`Chunk`. O(k)."""
    unique: dict[ChunkKey, Chunk] = {}
    repeated: list[Chunk] = []
    for chunk in chunks:
        if type(chunk) is not Chunk and not isinstance(chunk, Chunk):
            raise _not_a_chunk(chunks)
        if chunk.key in unique:
            repeated.append(chunk)
        else:
            unique[chunk.key] = chunk
    return unique, repeated


def _not_a_chunk(chunks: Sequence[object]) -> ValueError:
    """The error for the first item of ``chunks`` that is not a :class:`Chunk`."""
    for i, chunk in enumerate(chunks):
        if not isinstance(chunk, Chunk):
            msg = (
                f"chunks[{i}] is a {type(chunk).__name__}, not a craft_rag.Chunk; "
                "build chunks with craft_rag.make_chunk(text, id=...)"
            )
            return ValueError(msg)
    return ValueError("chunks: every item must be a craft_rag.Chunk")
