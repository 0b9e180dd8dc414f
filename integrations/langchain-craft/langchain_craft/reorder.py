"""``CraftReorder``: CRAFT's chunk order as an LCEL step, a document transformer and a compressor.

When is the planner committed? A plan is a prediction; ``commit`` records what was served
(CA-Table counts, CP-Tree paths, the conversation's frozen turn). Two modes:

* ``commit=True`` (default, no engine in sight): the step commits each plan at once, without
  reuse information. Right when the documents go to any LLM (an OpenAI-compatible vLLM server,
  another provider): the order is all CRAFT can give there.
* ``commit=False``: the step only plans; the returned :class:`CraftDocuments` carry the pending
  plan, and whoever serves the request commits it with the engine's truth. ``ChatCraftVLLM``
  does this when it finds the plan in its input (see :func:`langchain_craft.craft_context`);
  a plan nobody commits changes nothing (the engine failed, the chain stopped).

Conversation dedup (a chunk sent in an earlier turn of the same conversation is removed) is only
correct when the prompt keeps earlier turns' documents, as the engine's append-only
conversations do. So it happens only when the caller says so: ``keeps_earlier_chunks=True``
(``ChatCraftVLLM.reorder_step()`` sets it: the engine serves its plans in append-only
conversations). Otherwise a conversation id (``session_id`` of ``RunnableWithMessageHistory``,
a LangGraph ``thread_id``, ``conversation_id=``) is ignored: the step reorders and never drops
a document, because a history of questions and answers does not carry earlier passages.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.callbacks import (
    AsyncCallbackManager,
    AsyncCallbackManagerForChainRun,
    CallbackManager,
    CallbackManagerForChainRun,
    Callbacks,
)
from langchain_core.documents import BaseDocumentCompressor, BaseDocumentTransformer, Document
from langchain_core.runnables import RunnableConfig, RunnableSerializable, ensure_config
from pydantic import ConfigDict, Field, ValidationInfo, field_validator

from craft_rag import CraftPlanner
from langchain_craft._documents import (
    CRAFT_PLAN_EVENT,
    DEFAULT_CONVERSATION_KEYS,
    CraftDocuments,
    apply_plan,
    conversation_id_from_config,
    materialise,
    plan_summary,
    split_documents,
    validate_conversation_id,
)


class CraftReorder(
    RunnableSerializable[Sequence[Document], list[Document]],
    BaseDocumentCompressor,
    BaseDocumentTransformer,
):
    """Reorder retrieved documents so shared chunks form shared prompt prefixes (CRAFT).

    Usable three ways, all through :meth:`plan_documents`:

    * LCEL: ``retriever | CraftReorder(planner=planner)``; the conversation id comes from
      ``config["configurable"]`` (``conversation_id``, ``session_id`` or ``thread_id``);
    * ``BaseDocumentTransformer``: ``transform_documents(docs, conversation_id=...)``, a drop-in
      for ``LongContextReorder``;
    * ``BaseDocumentCompressor`` inside ``ContextualCompressionRetriever``.

    Documents come back unchanged (same objects: metadata and ids kept); only duplicates the plan
    reports are left out. Every planned request fires the ``craft_plan`` custom callback event
    (when there is a run to attach it to) with :func:`plan_summary`. The planner is thread-safe
    and may be shared by several steps, retrievers and engines. Cost per call: the planner's
    O(k log k) plus hashing the text of documents without ids.
    """

    planner: CraftPlanner = Field(
        default_factory=CraftPlanner,
        exclude=True,
        description="The CRAFT planner (CA-Table, CP-Tree, conversations); share one per engine.",
    )
    commit: bool = Field(
        default=True,
        description=(
            "Commit each plan at once (no engine feedback). False: leave the pending plan on the "
            "returned CraftDocuments for the engine path (ChatCraftVLLM) to commit."
        ),
    )
    conversation_keys: tuple[str, ...] = Field(
        default=DEFAULT_CONVERSATION_KEYS,
        description='Keys of config["configurable"] read as the conversation id; () disables.',
    )
    conversation_id: str | None = Field(
        default=None,
        description="Fixed conversation id, used when the config names none.",
    )
    id_key: str | None = Field(
        default="id",
        description="Metadata key holding a chunk id for documents without Document.id.",
    )
    keeps_earlier_chunks: bool = Field(
        default=False,
        description=(
            "True only when the prompt downstream keeps every earlier turn's documents "
            "(append-only, e.g. the engine's conversations): then documents sent in an earlier "
            "turn of the conversation are removed. False: conversation ids are ignored and "
            "nothing is ever removed but exact duplicates."
        ),
    )

    model_config = ConfigDict(arbitrary_types_allowed=True)

    @field_validator("conversation_id", mode="before")
    @classmethod
    def _check_conversation(cls, value: object) -> str | None:
        return validate_conversation_id(value, "conversation_id")

    @field_validator("commit", "keeps_earlier_chunks", mode="before")
    @classmethod
    def _check_bool(cls, value: object, info: ValidationInfo) -> bool:
        if not isinstance(value, bool):
            msg = f"{info.field_name} must be True or False, got {value!r}"
            raise ValueError(msg)
        return value

    # ---- the one core function ---------------------------------------------------------------

    def plan_documents(
        self, documents: Sequence[Document], conversation_id: object = None
    ) -> CraftDocuments:
        """Plan (and with ``commit=True`` commit) one request's documents.

        The input is read once (a generator works) and fully checked before the planner is
        touched. Documents without text come back after the planned ones; an input without
        any text comes back as is with no plan and no planner state touched. The conversation
        id (this argument, else the field) is used only with ``keeps_earlier_chunks=True``.
        ``ValueError`` for non-documents, bad ``page_content``, one id with two texts (see
        :func:`langchain_craft._documents.split_documents`) or a bad conversation id.
        """
        conversation = validate_conversation_id(conversation_id) or self.conversation_id
        split = split_documents(documents, self.id_key)
        if not split.chunks:
            return CraftDocuments(split.passthrough, passthrough=split.passthrough)
        plan = self.planner.plan(
            list(split.chunks), conversation if self.keeps_earlier_chunks else None
        )
        if self.commit:
            self.planner.commit(plan)
        return apply_plan(split, plan, committed=self.commit)

    def _conversation(self, config: RunnableConfig | None) -> str | None:
        return conversation_id_from_config(config, self.conversation_keys)

    def _planned(
        self, documents: Sequence[Document], config: RunnableConfig | None
    ) -> tuple[CraftDocuments, dict[str, Any] | None]:
        """:meth:`plan_documents` with the config's conversation id, plus the ``craft_plan``
        event payload (``None`` when nothing was planned). Every hook below goes through this;
        they differ only in how they dispatch the event (sync or async manager)."""
        result = self.plan_documents(documents, self._conversation(config))
        if result.plan is None:
            return result, None
        return result, plan_summary(result.plan, committed=result.committed)

    # ---- Runnable ----------------------------------------------------------------------------

    def invoke(
        self,
        input: Sequence[Document],
        config: RunnableConfig | None = None,
        **kwargs: Any,
    ) -> list[Document]:
        # Read a one-shot iterable once, before callbacks or the planner see it.
        documents = list(materialise(input))
        return self._call_with_config(self._run, documents, config)

    async def ainvoke(
        self,
        input: Sequence[Document],
        config: RunnableConfig | None = None,
        **kwargs: Any,
    ) -> list[Document]:
        documents = list(materialise(input))
        return await self._acall_with_config(self._arun, documents, config)

    def _run(
        self,
        documents: Sequence[Document],
        run_manager: CallbackManagerForChainRun,
        config: RunnableConfig,
    ) -> list[Document]:
        result, event = self._planned(documents, config)
        if event is not None:
            run_manager.get_child().on_custom_event(
                CRAFT_PLAN_EVENT, event, run_id=run_manager.run_id
            )
        return result

    async def _arun(
        self,
        documents: Sequence[Document],
        run_manager: AsyncCallbackManagerForChainRun,
        config: RunnableConfig,
    ) -> list[Document]:
        result, event = self._planned(documents, config)
        if event is not None:
            await run_manager.get_child().on_custom_event(
                CRAFT_PLAN_EVENT, event, run_id=run_manager.run_id
            )
        return result

    # ---- BaseDocumentTransformer -------------------------------------------------------------

    def transform_documents(
        self, documents: Sequence[Document], **kwargs: Any
    ) -> Sequence[Document]:
        """Drop-in for ``LongContextReorder.transform_documents``; ``conversation_id=`` optional
        (else read from the enclosing runnable's config, if any)."""
        conversation_id = kwargs.get("conversation_id")
        if conversation_id is None:
            conversation_id = self._conversation(ensure_config())
        return self.plan_documents(documents, conversation_id)

    async def atransform_documents(
        self, documents: Sequence[Document], **kwargs: Any
    ) -> Sequence[Document]:
        return self.transform_documents(documents, **kwargs)

    # ---- BaseDocumentCompressor --------------------------------------------------------------

    def compress_documents(
        self,
        documents: Sequence[Document],
        query: str,
        callbacks: Callbacks | None = None,
    ) -> Sequence[Document]:
        """Compressor hook for ``ContextualCompressionRetriever``. The compressor API carries no
        config, so the conversation id comes from the enclosing chain's config (context
        variable) or the ``conversation_id`` field."""
        result, event = self._planned(documents, ensure_config())
        if event is not None and isinstance(callbacks, CallbackManager) and callbacks.parent_run_id:
            callbacks.on_custom_event(CRAFT_PLAN_EVENT, event, run_id=callbacks.parent_run_id)
        return result

    async def acompress_documents(
        self,
        documents: Sequence[Document],
        query: str,
        callbacks: Callbacks | None = None,
    ) -> Sequence[Document]:
        result, event = self._planned(documents, ensure_config())
        if (
            event is not None
            and isinstance(callbacks, AsyncCallbackManager)
            and callbacks.parent_run_id
        ):
            await callbacks.on_custom_event(CRAFT_PLAN_EVENT, event, run_id=callbacks.parent_run_id)
        return result
