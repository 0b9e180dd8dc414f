"""A call's input as the engine takes it: LlamaIndex chat messages as plain chat turns, a
completion prompt as token ids, and RAG chunks read and checked once.

``CraftVLLM.chat`` sends a message list through ``CraftEngine.generate_messages``: the engine
renders it with the model's chat template and tokenizes each message on its own, so a chat
re-sent with one more message has the earlier messages' token ids unchanged and vLLM reuses
their KV. Nothing is planned or committed for such prompts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from llama_index.core.base.llms.types import ChatMessage, MessageRole, TextBlock

from craft_rag import Chunk, Tokenizer, check_text, encode_pieces
from craft_rag.engine import ChatTurn

_PROMPT_SENTINEL = "CRAFTPROMPTSENTINEL"


def message_text(message: ChatMessage, index: int) -> str:
    """The text of ``message`` (its text blocks joined). ``ValueError`` naming the message for
    an image, audio or other non-text block: the engine serves text-only models. O(text)."""
    parts: list[str] = []
    for block in message.blocks:
        if not isinstance(block, TextBlock):
            msg = (
                f"messages[{index}] holds a {type(block).__name__}; CraftVLLM serves text-only "
                "models, so send text blocks only"
            )
            raise ValueError(msg)
        parts.append(block.text)
    return check_text("".join(parts), f"messages[{index}] content")


def chat_turns(messages: Sequence[ChatMessage], system_prompt: str | None = None) -> list[ChatTurn]:
    """``messages`` as ``(role, text)`` turns, led by ``system_prompt`` as a system message
    unless the first message is one already. ``ValueError`` for an empty list or non-text
    blocks. O(total text)."""
    if not messages:
        msg = "chat() needs at least one message"
        raise ValueError(msg)
    turns: list[ChatTurn] = []
    if system_prompt and messages[0].role != MessageRole.SYSTEM:
        turns.append((MessageRole.SYSTEM.value, system_prompt))
    turns.extend((m.role.value, message_text(m, i)) for i, m in enumerate(messages))
    return turns


def completion_ids(
    tokenizer: Tokenizer, prompt: str, to_prompt: Callable[[str], str] | None = None
) -> list[int]:
    """Token ids of a completion prompt. ``prompt`` is caller text (a formatted prompt holds
    retrieved passages): plain text, never control ids. ``to_prompt`` (an LLM's
    ``completion_to_prompt``) is trusted: the text it wraps around the prompt may hold the
    template's control tokens, found by calling it once with a sentinel; when the wrapping
    cannot be isolated that way, the whole result is tokenized as plain text. ``ValueError``
    naming ``prompt`` for text that is not valid Unicode. O(len(prompt))."""
    check_text(prompt, "prompt")
    if to_prompt is None:
        return encode_pieces(tokenizer, [(prompt, False)])
    text = to_prompt(prompt)
    before, found, after = to_prompt(_PROMPT_SENTINEL).partition(_PROMPT_SENTINEL)
    if found and _PROMPT_SENTINEL not in after and text == before + prompt + after:
        return encode_pieces(tokenizer, [(before, True), (prompt, False), (after, True)])
    return encode_pieces(tokenizer, [(check_text(text, "completion_to_prompt(prompt)"), False)])


def chunk_list(chunks: object) -> list[Chunk]:
    """``chunks`` read once into a list; ``ValueError`` for a string, a non-iterable or an
    item that is not a ``craft_rag.Chunk`` (naming its index), before any state changes.
    O(len(chunks))."""
    if isinstance(chunks, str | bytes | Chunk) or not isinstance(chunks, Iterable):
        msg = f"chunks must be a sequence of craft_rag.Chunk, got {type(chunks).__name__}"
        raise ValueError(msg)
    out = list(chunks)
    for i, chunk in enumerate(out):
        if not isinstance(chunk, Chunk):
            msg = f"chunks[{i}] is a {type(chunk).__name__}, not a craft_rag.Chunk (make_chunk)"
            raise ValueError(msg)
    return out
