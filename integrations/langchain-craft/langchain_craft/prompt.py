"""``CraftRAGPrompt``: documents + question -> a chat prompt any model can read, which
``ChatCraftVLLM`` serves token-exactly.

The prompt is one ``HumanMessage`` whose text is ``instructions + Document: ... + Question: ...``
(so the chain runs with any chat model), carrying a :class:`CraftContext` in
``additional_kwargs["craft"]``: the chunks in order, the question, the conversation id and the
pending plan, if any. ``ChatCraftVLLM`` reads that instead of the text and hands the chunks to
the engine as separately tokenized segments, so each chunk-prefix has the same token ids in
every prompt, and commits the pending plan with what vLLM actually reused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from langchain_core.callbacks import CallbackManagerForChainRun
from langchain_core.documents import Document
from langchain_core.messages import BaseMessage, HumanMessage
from langchain_core.prompt_values import ChatPromptValue
from langchain_core.runnables import RunnableConfig, RunnableSerializable
from pydantic import Field

from craft_rag import DEFAULT_INSTRUCTIONS, Chunk, Plan, check_text
from langchain_craft._documents import (
    DEFAULT_CONVERSATION_KEYS,
    CraftDocuments,
    conversation_id_from_config,
    documents_to_chunks,
    validate_conversation_id,
)

CRAFT_CONTEXT_KEY = "craft"
"""``additional_kwargs`` key of the :class:`CraftContext` on a prompt message."""


@dataclass(frozen=True, slots=True)
class CraftContext:
    """The structured RAG request behind a prompt message (in-process only).

    ``chunks`` are in render order. ``plan`` is the pending plan of a ``CraftReorder(commit=
    False)`` step (its ``ordered`` chunks are ``chunks``): when the engine's planner for the
    request's salt made it (``planner.made(plan)``: the plan's ``ref`` names its maker),
    ``ChatCraftVLLM`` hands the engine its ``ref`` and the engine claims, serves and commits
    that very plan; a plan of another planner is only an order. ``committed_by`` is the
    ``ref`` of the plan that already recorded these documents (``CraftReorder(commit=True)``):
    the engine refuses to record them again in the planner that made it.
    """

    chunks: tuple[Chunk, ...]
    question: str
    conversation_id: str | None = None
    plan: Plan | None = None
    committed_by: str | None = None


def craft_context(message: BaseMessage) -> CraftContext | None:
    """The :class:`CraftContext` attached to ``message``, or ``None``."""
    value = message.additional_kwargs.get(CRAFT_CONTEXT_KEY)
    return value if isinstance(value, CraftContext) else None


def build_context(
    documents: Sequence[Document],
    question: str,
    *,
    conversation_id: str | None = None,
    id_key: str | None = "id",
) -> CraftContext:
    """A :class:`CraftContext` for ``documents`` in their given order.

    A :class:`CraftDocuments` hands on its order, its conversation id, and either its pending
    plan or the ref of the plan it committed (see :class:`CraftContext`).
    ``ValueError`` for a blank question or bad documents.
    """
    if not isinstance(question, str) or not question.strip():
        msg = f"question must be a non-empty string, got {question!r}"
        raise ValueError(msg)
    check_text(question, "question")
    conversation_id = validate_conversation_id(conversation_id)
    if isinstance(documents, CraftDocuments) and documents.plan is not None:
        plan = documents.plan
        if conversation_id is None:
            conversation_id = plan.conversation_id
        if documents.committed:
            return CraftContext(plan.ordered, question, conversation_id, None, plan.ref)
        return CraftContext(plan.ordered, question, conversation_id, plan)
    # Exact duplicates stay in: the engine's planner keeps the first and reports the rest.
    # Documents without text have no chunk (nothing to render).
    chunks = tuple(documents_to_chunks(documents, id_key))
    return CraftContext(chunks, question, conversation_id, None)


def _first_per_key(context: CraftContext) -> list[Chunk]:
    unique: dict[str, Chunk] = {}
    for chunk in context.chunks:
        unique.setdefault(chunk.key, chunk)
    return list(unique.values())


class CraftRAGPrompt(RunnableSerializable[dict[str, Any], ChatPromptValue]):
    """``{"context": documents, "question": str}`` -> a one-message chat prompt with a
    :class:`CraftContext` attached. Cost: O(text) (rendering and hashing ids).

    ``documents`` in the order given (put ``CraftReorder`` or ``CraftRetriever`` before this,
    or let ``ChatCraftVLLM``'s engine order them). The conversation id is read from
    ``config["configurable"]`` like everywhere in this package.
    """

    documents_key: str = Field(default="context", description="Input key of the documents.")
    question_key: str = Field(default="question", description="Input key of the question.")
    instructions: str = Field(
        default=DEFAULT_INSTRUCTIONS, description="Text before the first document."
    )
    document_template: str = Field(
        default="Document: {text}\n\n", description="How a document renders; needs {text}."
    )
    question_template: str = Field(
        default="Question: {question}", description="How the question renders; needs {question}."
    )
    conversation_keys: tuple[str, ...] = Field(
        default=DEFAULT_CONVERSATION_KEYS,
        description='Keys of config["configurable"] read as the conversation id; () disables.',
    )
    id_key: str | None = Field(
        default="id", description="Metadata key holding a chunk id when Document.id is unset."
    )

    def _build(
        self,
        input: dict[str, Any],
        run_manager: CallbackManagerForChainRun,
        config: RunnableConfig,
    ) -> ChatPromptValue:
        if not isinstance(input, Mapping):
            msg = (
                f"CraftRAGPrompt takes a dict with {self.documents_key!r} and "
                f"{self.question_key!r}, got {type(input).__name__}"
            )
            raise ValueError(msg)
        missing = [k for k in (self.documents_key, self.question_key) if k not in input]
        if missing:
            msg = f"CraftRAGPrompt input is missing {missing}; got keys {sorted(input)}"
            raise ValueError(msg)
        context = build_context(
            input[self.documents_key],
            input[self.question_key],
            conversation_id=conversation_id_from_config(config, self.conversation_keys),
            id_key=self.id_key,
        )
        text = (
            self.instructions
            + "".join(self.document_template.format(text=c.text) for c in _first_per_key(context))
            + self.question_template.format(question=context.question)
        )
        message = HumanMessage(content=text, additional_kwargs={CRAFT_CONTEXT_KEY: context})
        return ChatPromptValue(messages=[message])

    def invoke(
        self, input: dict[str, Any], config: RunnableConfig | None = None, **kwargs: Any
    ) -> ChatPromptValue:
        return self._call_with_config(self._build, input, config, run_type="prompt")

    async def ainvoke(
        self, input: dict[str, Any], config: RunnableConfig | None = None, **kwargs: Any
    ) -> ChatPromptValue:
        return self.invoke(input, config, **kwargs)
