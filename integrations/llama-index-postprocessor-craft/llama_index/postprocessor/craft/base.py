"""CraftReorderPostprocessor: CRAFT's chunk order (and conversation dedup) as a node postprocessor.

When does the planner commit?
    A plan only changes planner state (CA-Table counts, CP-Tree paths, the conversation's sent
    chunks) when it is committed. The postprocessor cannot know what an engine reused, so:

    * ``commit_mode="postprocess"`` (default): commit right after planning, with no reuse
      information. Any pipeline, with any LLM, keeps CA-Table and CP-Tree up to date; the
      CP-Tree then trusts its own prediction (it never learns of evictions).
    * ``commit_mode="engine"``: leave the plan pending in the planner (its lease, see
      :mod:`craft_rag.plan_lease`); ``CraftVLLM.complete_chunks`` (behind
      :class:`~llama_index.llms.craft_vllm.CraftSynthesizer`) finds it by the nodes' chunk keys
      and conversation (:meth:`CraftReorderPostprocessor.claim_plan`, which reserves it) and
      hands its id to ``CraftEngine.generate(..., plan=plan.ref)``; the engine claims it from
      the planner, renders exactly that order and commits that plan with the engine's truth
      (cached tokens, chunk token spans, block hashes). A plan the engine never serves is never
      committed, so a failed request changes nothing. Use this mode only with a consumer that
      claims plans; otherwise nothing is learned. The planner must be the engine's
      (``engine.planner_for(cache_salt)``): the engine refuses plans made by another planner.

When are chunks dropped as "sent in an earlier turn"?
    Only when the prompt downstream keeps every earlier turn's chunks (append-only, as the
    engine's conversations behind ``CraftSynthesizer``/``CraftChatEngine`` are):
    ``keeps_earlier_chunks=True``, or ``None`` (default) with ``commit_mode="engine"`` (the
    engine commits only plans it served in such a conversation). With the default
    ``commit_mode="postprocess"`` a conversation id alone never drops a node: a standard
    synthesizer's prompt holds this turn's nodes only (and a chat memory only questions and
    answers), so a dropped node would be context silently lost.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from llama_index.core.bridge.pydantic import Field, PrivateAttr, ValidationInfo, field_validator
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import NodeWithScore, QueryBundle, QueryType
from llama_index.postprocessor.craft.events import (
    CraftCommitEvent,
    CraftReorderEndEvent,
    CraftReorderStartEvent,
)
from llama_index.postprocessor.craft.nodes import (
    KEY_SOURCES,
    KeySource,
    default_key_source,
    split_nodes,
    validate_conversation_id,
)
from llama_index_instrumentation import get_dispatcher  # = llama_index.core.instrumentation's

from craft_rag import (
    DEFAULT_POLICY,
    DEFAULT_WINDOW,
    ORDERING_POLICIES,
    Chunk,
    CraftPlanner,
    Plan,
    PlannerConfig,
)

dispatcher = get_dispatcher(__name__)

CommitMode = Literal["postprocess", "engine"]
COMMIT_MODES: tuple[CommitMode, ...] = ("postprocess", "engine")

_CONFIG_FIELDS = ("policy", "window", "threshold")
_CHOICES: dict[str, list[str]] = {
    "policy": sorted(ORDERING_POLICIES),
    "key_source": list(KEY_SOURCES),
}


@dataclass(frozen=True, slots=True)
class CraftReorderResult:
    """Outcome of one reorder.

    ``nodes`` is what the pipeline continues with: the planned nodes in CRAFT order, then the
    pass-through nodes in input order. Every input node is in exactly one of ``nodes``,
    ``removed_duplicates`` and ``repeated_in_request``. ``plan`` is ``None`` when no node was
    plannable (then nothing was planned or committed).
    """

    nodes: list[NodeWithScore]
    plan: Plan | None
    removed_duplicates: tuple[NodeWithScore, ...]
    repeated_in_request: tuple[NodeWithScore, ...]
    passthrough: tuple[NodeWithScore, ...]
    committed: bool


class CraftReorderPostprocessor(BaseNodePostprocessor):
    """Reorder retrieved nodes so chunks shared across requests form identical prompt prefixes.

    Nodes become ``craft_rag.Chunk`` s (see :mod:`llama_index.postprocessor.craft.nodes`), the
    shared :class:`craft_rag.CraftPlanner` orders them (and, with a conversation id, drops the
    chunks an earlier turn already sent), and the same ``NodeWithScore`` objects come back in
    that order; nodes are never copied or mutated. Non-text and empty nodes pass through after
    the planned ones. Dropped duplicates are reported on :class:`CraftReorderResult` and on the
    :class:`~llama_index.postprocessor.craft.events.CraftReorderEndEvent`.

    Pass ``planner=`` to share one planner (and its CA-Table/CP-Tree) between postprocessors,
    retrievers, the synthesizer and the chat engine; ``policy``/``window``/``threshold`` then
    default to the planner's settings and must agree with them; ``commit_mode="engine"``
    leaves plans pending in that planner (``CraftVLLM.reorderer()`` passes the engine's).

    Cost per call: O(total node text) to build chunks (text hashing only with
    ``key_source="content_hash"``) plus the planner's O(k log k).
    """

    policy: str = Field(
        default=DEFAULT_POLICY,
        description=f"Ordering policy, one of {sorted(ORDERING_POLICIES)}.",
    )
    window: int | None = Field(
        default=DEFAULT_WINDOW,
        description="CA-Table sliding window in requests (None: unlimited).",
    )
    threshold: int = Field(
        default=2,
        description="Accesses within the window before a chunk prefix is promoted to the CP-Tree.",
    )
    key_source: KeySource = Field(
        default="node_id",
        description=(
            "Chunk identity: the node id, or a sha256 of the node's LLM-visible text. Not "
            "given (or None): 'content_hash' when the planner shares a store with other "
            "workers (their nodes carry other random ids), else 'node_id'."
        ),
    )
    conversation_id: str | None = Field(
        default=None,
        description=(
            "The conversation (str, int or UUID; None: none). Nodes sent in its earlier turns "
            "are dropped only when the prompt keeps them (see keeps_earlier_chunks)."
        ),
    )
    keeps_earlier_chunks: bool | None = Field(
        default=None,
        description=(
            "True only when the prompt downstream keeps every earlier turn's chunks "
            "(append-only): then nodes sent earlier in the conversation are dropped. None: "
            "True with commit_mode='engine', False with 'postprocess' (reorder, never drop)."
        ),
    )
    commit_mode: CommitMode = Field(
        default="postprocess",
        description=(
            "'postprocess': commit each plan at once (no engine feedback); 'engine': leave plans "
            "for the CRAFT engine path to commit with what the engine actually reused."
        ),
    )

    _planner: CraftPlanner = PrivateAttr()

    def __init__(self, planner: CraftPlanner | None = None, **data: Any) -> None:
        if planner is not None:
            if not isinstance(planner, CraftPlanner):
                msg = f"planner must be a craft_rag.CraftPlanner, got {type(planner).__name__}"
                raise ValueError(msg)
            config = asdict(planner.config)
            for name in _CONFIG_FIELDS:
                mine = config[name]
                if name in data and data[name] != mine:
                    msg = (
                        f"{name}={data[name]!r} disagrees with the shared planner's {name}="
                        f"{mine!r}; drop the argument or pass a planner configured that way"
                    )
                    raise ValueError(msg)
                data[name] = mine
        if data.get("key_source") is None:
            data["key_source"] = default_key_source(planner)
        super().__init__(**data)
        self._planner = planner or CraftPlanner(
            PlannerConfig(policy=self.policy, window=self.window, threshold=self.threshold)
        )

    @field_validator("policy", "key_source")
    @classmethod
    def _check_choice(cls, value: str, info: ValidationInfo) -> str:
        options = _CHOICES[info.field_name or ""]
        if value not in options:
            msg = f"unknown {info.field_name} {value!r}; choose one of {options}"
            raise ValueError(msg)
        return value

    @field_validator("conversation_id", mode="before")
    @classmethod
    def _check_conversation(cls, value: object) -> str | None:
        return validate_conversation_id(value, "conversation_id")

    @field_validator("keeps_earlier_chunks", mode="before")
    @classmethod
    def _check_keeps(cls, value: object) -> bool | None:
        if value is not None and not isinstance(value, bool):
            msg = f"keeps_earlier_chunks must be True, False or None, got {value!r}"
            raise ValueError(msg)
        return value

    @property
    def deduplicates(self) -> bool:
        """Whether a conversation id drops chunks sent in earlier turns (see the module)."""
        if self.keeps_earlier_chunks is not None:
            return self.keeps_earlier_chunks
        return self.commit_mode == "engine"

    def _conversation(self, conversation_id: object) -> str | None:
        """The conversation to plan with: ``None`` unless :attr:`deduplicates`."""
        conv: str | None = validate_conversation_id(conversation_id)
        if conv is None:
            conv = self.conversation_id
        return conv if self.deduplicates else None

    @field_validator("window", "threshold")
    @classmethod
    def _check_at_least_one(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and value < 1:
            unlimited = "None (unlimited) or " if info.field_name == "window" else ""
            msg = f"{info.field_name} must be {unlimited}>= 1, got {value}"
            raise ValueError(msg)
        return value

    @classmethod
    def class_name(cls) -> str:
        return "CraftReorderPostprocessor"

    @property
    def planner(self) -> CraftPlanner:
        """The (possibly shared) planner holding CA-Table, CP-Tree and conversations."""
        return self._planner

    # ---- the one core call --------------------------------------------------------------------

    def reorder(
        self,
        nodes: Iterable[NodeWithScore],
        query: QueryType | None = None,
        *,
        conversation_id: object = None,
        park: bool = True,
    ) -> CraftReorderResult:
        """Plan ``nodes`` and return them in CRAFT order (see :class:`CraftReorderResult`).

        ``conversation_id`` overrides the field for this call. Side effects: emits
        ``CraftReorderStartEvent``/``CraftReorderEndEvent``; commits the plan
        (``commit_mode="postprocess"``, plus a ``CraftCommitEvent``) or leaves it pending in the
        planner for :meth:`claim_plan` (``"engine"``). ``park=False`` (engine mode only)
        reserves it at once (no :meth:`claim_plan` finds it), for a caller that serves it
        itself with ``plan=`` (the chat engine does). Raises ``ValueError`` for items that are not
        ``NodeWithScore`` and for two nodes with one id but different text.
        """
        conv = self._conversation(conversation_id)
        nodes = list(nodes)  # read once: a generator works
        dispatcher.event(
            CraftReorderStartEvent(
                query=query, nodes=nodes, conversation_id=conv, policy=self.policy
            )
        )
        split = split_nodes(nodes, self.key_source)
        plan: Plan | None = None
        committed = False
        ordered: list[NodeWithScore] = []
        removed: tuple[NodeWithScore, ...] = ()
        repeated: tuple[NodeWithScore, ...] = ()
        if split.chunks:
            plan = self._planner.plan(split.chunks, conv)
            by_chunk = {id(c): n for c, n in zip(split.chunks, split.plannable, strict=True)}

            def back(chunks: Sequence[Chunk]) -> list[NodeWithScore]:
                return [by_chunk[id(c)] for c in chunks]

            ordered = back(plan.ordered)
            removed = tuple(back(plan.removed_duplicates))
            repeated = tuple(back(plan.repeated_in_request))
            if self.commit_mode == "postprocess":
                result = self._planner.commit(plan)
                committed = True
                dispatcher.event(CraftCommitEvent(plan=plan, result=result, source="postprocess"))
            elif not park:
                self._planner.reserve(plan.conversation_id, plan.keys)
        out = ordered + list(split.passthrough)
        assert len(out) + len(removed) + len(repeated) == len(nodes), "a node was lost"
        dispatcher.event(
            CraftReorderEndEvent(
                nodes=out,
                removed_duplicates=list(removed),
                repeated_in_request=list(repeated),
                passthrough=list(split.passthrough),
                plan=plan,
                committed=committed,
            )
        )
        return CraftReorderResult(
            nodes=out,
            plan=plan,
            removed_duplicates=removed,
            repeated_in_request=repeated,
            passthrough=split.passthrough,
            committed=committed,
        )

    def claim_plan(
        self, nodes: Sequence[NodeWithScore], conversation_id: object = None
    ) -> Plan | None:
        """Reserve the pending plan whose planned nodes are the plannable prefix of ``nodes``
        (:meth:`craft_rag.CraftPlanner.reserve`); serve it by its ``ref``.

        For the engine path with ``commit_mode="engine"``: returns ``None`` when no such plan
        waits (postprocess mode, or a later postprocessor changed the nodes). O(k).
        """
        conv = self._conversation(conversation_id)
        split = split_nodes(list(nodes), self.key_source)
        return self._planner.reserve(conv, [c.key for c in split.chunks])

    # ---- LlamaIndex hooks: sync and async share reorder() --------------------------------------

    def _postprocess_nodes(
        self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None
    ) -> list[NodeWithScore]:
        return self.reorder(nodes, query_bundle).nodes

    async def _apostprocess_nodes(
        self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None
    ) -> list[NodeWithScore]:
        # Planning is microseconds of CPU under a lock: no thread hop (the base class's default).
        return self.reorder(nodes, query_bundle).nodes
