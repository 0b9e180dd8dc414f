"""Moved to craft_rag.tree.removal; alias kept for one release."""

from craft_rag.tree.removal import PrefixRemoval

__all__ = ["PrefixRemoval"]
