"""JSON state of a :class:`craft_rag.planner.CraftPlanner`: the codec behind ``to_json`` /
``from_json`` / ``save`` / ``load`` (``to_json`` and ``save`` are :class:`PlannerFiles`, a base
of the planner). Every field is validated before anything is built; a violation is one
``ValueError`` naming the field's JSON path. The format is unchanged since
``craft-rag/planner/v1`` (``tests/test_saved_state_compat.py`` loads a file saved before the
planner became a package)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from craft_rag.access_table import ChunkAccessTable
from craft_rag.conversation import ConversationRegistry
from craft_rag.files import check_writable, write_atomic
from craft_rag.planner.plans import PlannerConfig, config_from_json
from craft_rag.tree import ChunkPrefixTree
from craft_rag.validation import state_dict, state_error, state_format

FORMAT = "craft-rag/planner/v1"


@dataclass(frozen=True, slots=True)
class PlannerState:
    """The saved parts of a planner (what :func:`state_from_json` rebuilds)."""

    config: PlannerConfig
    access_table: ChunkAccessTable
    prefix_tree: ChunkPrefixTree
    conversations: ConversationRegistry

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "config": asdict(self.config),
            "access_table": self.access_table.to_json(),
            "prefix_tree": self.prefix_tree.to_json(),
            "conversations": self.conversations.to_json(),
        }


def state_from_json(data: dict[str, Any], clock: Callable[[], float]) -> PlannerState:
    """Validate and rebuild a planner's state (see ``CraftPlanner.from_json``). O(size)."""
    state_format(data, "", FORMAT, "planner state")
    state_dict(
        data, "", required=("format", "config", "access_table", "prefix_tree", "conversations")
    )
    config = config_from_json(data["config"])
    table = ChunkAccessTable.from_json(data["access_table"], path="access_table")
    if table.window != config.window:
        raise state_error(
            "access_table.window", f"{table.window} differs from config.window {config.window}"
        )
    tree = ChunkPrefixTree.from_json(data["prefix_tree"], clock=clock, path="prefix_tree")
    if tree.max_nodes != config.max_tree_nodes:
        raise state_error(
            "prefix_tree.max_nodes",
            f"{tree.max_nodes} differs from config.max_tree_nodes {config.max_tree_nodes}",
        )
    conversations = ConversationRegistry.from_json(
        data["conversations"], clock=clock, path="conversations"
    )
    if conversations.max_conversations != config.max_conversations:
        raise state_error(
            "conversations.max_conversations",
            f"{conversations.max_conversations} differs from config.max_conversations "
            f"{config.max_conversations}",
        )
    if conversations.ttl_s != config.conversation_ttl_s:
        raise state_error(
            "conversations.ttl_s",
            f"{conversations.ttl_s} differs from config.conversation_ttl_s "
            f"{config.conversation_ttl_s}",
        )
    return PlannerState(config, table, tree, conversations)


def read_state_file(path: str | Path) -> dict[str, Any]:
    """The JSON object in a file written by ``CraftPlanner.save``; ``ValueError`` naming the
    file for text that is not JSON; ``OSError`` for a missing or unreadable file."""
    raw = Path(path).read_bytes()
    try:
        data: dict[str, Any] = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        msg = f"{path}: not a craft-rag planner state file (not UTF-8 JSON: {exc})"
        raise ValueError(msg) from None
    except ValueError as exc:  # e.g. an integer literal longer than Python reads
        msg = f"{path}: not a craft-rag planner state file ({exc})"
        raise ValueError(msg) from None
    return data


class PlannerFiles:
    """``to_json`` / ``save`` of :class:`~craft_rag.planner.CraftPlanner` (a base of it; the
    constructors ``from_json`` / ``load`` are the planner's own)."""

    config: PlannerConfig
    access_table: ChunkAccessTable
    prefix_tree: ChunkPrefixTree
    conversations: ConversationRegistry
    _lock: threading.Lock

    def to_json(self) -> dict[str, Any]:
        """All state as plain JSON (``craft-rag/planner/v1``), copied under the planner's
        lock. O(size of the state)."""
        with self._lock:
            return PlannerState(
                self.config, self.access_table, self.prefix_tree, self.conversations
            ).to_json()

    def save(self, path: str | Path) -> None:
        """Write all state as JSON through :func:`craft_rag.files.write_atomic`: a private
        (0600) temp file in the same folder, never through a symlink, fsync-ed, then renamed
        over ``path``; concurrent saves each install a whole file. ``IsADirectoryError`` /
        ``FileNotFoundError`` / ``PermissionError`` before any work. O(size of the state)."""
        check_writable(path)
        write_atomic(path, json.dumps(self.to_json()))
