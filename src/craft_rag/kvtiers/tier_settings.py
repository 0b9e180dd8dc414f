"""The KV tiers' switches: sizes, directory and policy, and the vLLM config that loads them.

Framework-free (no vLLM, no torch): ``EngineSettings.kv_tiers`` holds one, and
:class:`craft_rag.kvtiers.connector.CraftTierConnector` parses its ``kv_connector_extra_config``
back with :meth:`KVTierSettings.from_extra`, so the two sides cannot drift.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from craft_rag.kvtiers.policies import TIER_POLICIES

__all__ = ["CONNECTOR_MODULE", "CONNECTOR_NAME", "DEFAULT_RAM_BYTES", "KVTierSettings"]

CONNECTOR_NAME = "CraftTierConnector"
CONNECTOR_MODULE = "craft_rag.kvtiers.connector"
DEFAULT_RAM_BYTES = 1 << 30
_KEYS = ("ram_bytes", "disk_bytes", "disk_dir", "policy", "disk_write_through")


@dataclass(frozen=True, slots=True)
class KVTierSettings:
    """Tier sizes in payload bytes (``ram_bytes=0``: no RAM tier), a disk tier when both
    ``disk_bytes > 0`` and ``disk_dir`` are given (validated and created, mode 0700, when the
    engine opens the store), and a :data:`~craft_rag.kvtiers.policies.TIER_POLICIES` name.

    ``disk_write_through`` (no effect without a disk tier): every block entering RAM is also
    queued for disk on the store's writer thread (bounded queue, never waited on), so a crash
    loses at most that queue; off, RAM blocks reach disk only when evicted or at a clean
    shutdown. On by default: the disk tier is there to survive restarts, and without it a
    crash loses everything the RAM tier held, which with the default sizes is most of the
    reusable KV; the cost is one file write per block, off the critical path, and disk space
    for blocks RAM still holds (a disk tier at least as large as RAM keeps them all).

    ``ValueError`` (naming the fix) for negative or non-integer sizes, an unknown policy, a
    non-bool switch, or a disk size without a directory (or the reverse).
    """

    ram_bytes: int = DEFAULT_RAM_BYTES
    disk_bytes: int = 0
    disk_dir: str | Path | None = None
    policy: str = "pgdsf"
    disk_write_through: bool = True

    def __post_init__(self) -> None:
        for name in ("ram_bytes", "disk_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                msg = f"{name} must be a non-negative integer (bytes), got {value!r}"
                raise ValueError(msg)
        if not isinstance(self.disk_write_through, bool):
            msg = f"disk_write_through must be true or false, got {self.disk_write_through!r}"
            raise ValueError(msg)
        if self.policy not in TIER_POLICIES:
            msg = f"unknown tier policy {self.policy!r}; valid: {', '.join(sorted(TIER_POLICIES))}"
            raise ValueError(msg)
        if self.disk_dir is not None and not isinstance(self.disk_dir, str | Path):
            msg = f"disk_dir must be a path, got {self.disk_dir!r}"
            raise ValueError(msg)
        if (self.disk_dir is None) != (self.disk_bytes == 0):
            msg = "give both disk_bytes > 0 and disk_dir for a disk tier, or neither"
            raise ValueError(msg)
        if self.ram_bytes == 0 and self.disk_bytes == 0:
            msg = "both tiers are empty; give ram_bytes and/or disk_bytes, or kv_tiers=None"
            raise ValueError(msg)

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> KVTierSettings:
        """Parse a connector's ``kv_connector_extra_config`` (``ValueError`` naming the valid
        keys for an unknown one)."""
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(_KEYS))
        if unknown:
            msg = f"unknown kv_connector_extra_config key(s) {unknown}; valid: {list(_KEYS)}"
            raise ValueError(msg)
        return cls(**extra)

    def extra_config(self) -> dict[str, Any]:
        """The ``kv_connector_extra_config`` (JSON-able) that :meth:`from_extra` reads back."""
        return {
            "ram_bytes": self.ram_bytes,
            "disk_bytes": self.disk_bytes,
            "disk_dir": str(self.disk_dir) if self.disk_dir is not None else None,
            "policy": self.policy,
            "disk_write_through": self.disk_write_through,
        }

    def transfer_config(self) -> dict[str, Any]:
        """Keyword arguments of ``vllm.config.KVTransferConfig`` (also the JSON of
        ``--kv-transfer-config``) that load the connector by module path."""
        return {
            "kv_connector": CONNECTOR_NAME,
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_both",
            "kv_connector_extra_config": self.extra_config(),
        }
