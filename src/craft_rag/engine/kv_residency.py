"""Which media hold a block the KV tiers also hold: the filter between KV events and the CP-Tree.

vLLM publishes its pool's events with ``medium="GPU"`` (on CPU too), and a KV connector's
events with its own medium: craft-rag's tier connector says ``"CPU"`` for its RAM tier and
``"STORAGE"`` for its disk tier (:mod:`craft_rag.kvtiers.tier_events`). A chunk-prefix whose
blocks left the pool but sit in a tier is still cheap to serve (the connector loads them), so
the CP-Tree must keep its node: :class:`TierResidency` passes a removal on only when the block
is gone from every medium.

Model: only blocks some tier holds are tracked (bits ``GPU | CPU | STORAGE``); a block first
reported by a tier is taken to be in the pool as well (the connector reports a block when it
copied it out of the pool, or when it is loading it into the pool). So:

- a pool removal of an untracked hash passes through (as without tiers);
- a pool removal of a tracked hash clears its GPU bit and is held back;
- a tier removal that leaves no tier bit drops the entry, and passes the hash on iff the GPU
  bit was clear (the pool had evicted it too); with the GPU bit set, the pool's own removal
  passes through later (the hash is then untracked).

Moves: a tracked hash's *cheapest* medium (the pool, else RAM, else disk) is what the router's
cost reads (:mod:`craft_rag.routing.tier_costs`). Whenever it changes (a pool removal held back:
the RAM or disk tier; RAM evicting a block disk keeps: disk; the pool storing it again: the
pool) the hash is queued; :meth:`TierResidency.flush_moves` hands each queued hash's latest
medium to the listener's ``on_blocks_moved`` as a :class:`~craft_rag.tree.KVLocation` (the
pool: ``KVLocation()``, as commits set it). A forgotten entry (the cap below) keeps the
location it had.

Bounds: at most :data:`MAX_TRACKED` hashes (the tiers bound what the connector reports; the
cap guards against a peer). Past it the oldest entry is forgotten: its hash is untracked, so a
later pool removal passes through, the side that loses a planning hint, never keeps a node
whose KV is gone. A node kept by a stale entry (a lost tier removal) is removed by the commit
feedback (fewer reused chunks than predicted). Owner: :class:`~craft_rag.engine.kv_events.
KVEventSync`'s thread; not thread-safe. Cost: O(1) per hash.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from craft_rag.engine.kv_event_wire import MEDIUM_GPU
from craft_rag.routing.tier_costs import DISK_MEDIUM, RAM_MEDIUM
from craft_rag.tree import KVLocation
from craft_rag.types import BlockHash

__all__ = ["MAX_TRACKED", "EvictionListener", "TierResidency"]

MAX_TRACKED = 1 << 18
"""Hashes tracked at most (~30 MB): far above what 5 GiB of tiers hold of a small model."""

_GPU = 1
_RAM = 2
_DISK = 4
_BITS = {MEDIUM_GPU: _GPU, RAM_MEDIUM: _RAM, DISK_MEDIUM: _DISK}
_TIERS = _RAM | _DISK
_POOL = KVLocation()  # where commits put a node: the engine's pool
_LOCATIONS = {_RAM: KVLocation(tier=RAM_MEDIUM), _DISK: KVLocation(tier=DISK_MEDIUM)}


def _cheapest(bits: int) -> int:
    """The cheapest medium's bit among ``bits`` (0: none)."""
    return _GPU if bits & _GPU else _RAM if bits & _RAM else bits & _DISK


class EvictionListener(Protocol):
    """What :class:`~craft_rag.engine.kv_events.KVEventSync` drives: the planner's
    engine-feedback half (re-exported there). ``on_blocks_moved``: the KV of these blocks now
    lives (cheapest) at ``location``: the pool (``KVLocation()``) or a tier; optional at run
    time (a listener without it is not told of moves)."""

    def on_blocks_removed(self, hashes: Iterable[BlockHash]) -> int: ...

    def on_blocks_moved(self, hashes: Iterable[BlockHash], location: KVLocation) -> int: ...

    def on_all_blocks_cleared(self) -> None: ...


class TierResidency:
    """Media bits of the blocks the KV tiers hold (see the module).

    Invariants: every entry has a tier bit; at most ``max_tracked`` entries, oldest first in
    insertion order.
    """

    __slots__ = ("_bits", "_moves", "held", "max_tracked")

    def __init__(self, max_tracked: int = MAX_TRACKED) -> None:
        if type(max_tracked) is not int or max_tracked < 1:
            msg = f"max_tracked must be an int >= 1, got {max_tracked!r}"
            raise ValueError(msg)
        self.max_tracked = max_tracked
        self._bits: dict[BlockHash, int] = {}
        self._moves: dict[BlockHash, int] = {}  # hash -> its new cheapest medium's bit
        self.held = 0
        """Pool removals held back because a tier still held the block (a counter)."""

    def __len__(self) -> int:
        return len(self._bits)

    def media(self, block: BlockHash) -> frozenset[str]:
        """The media ``block`` is known in (empty: untracked). O(1)."""
        bits = self._bits.get(block, 0)
        return frozenset(m for m, bit in _BITS.items() if bits & bit)

    def stored(self, hashes: Iterable[BlockHash], medium: str | None) -> None:
        """``hashes`` entered ``medium`` (``None``: the pool). O(len(hashes))."""
        bit = _BITS[medium or MEDIUM_GPU]
        table = self._bits
        for h in hashes:
            old = table.get(h)
            if old is not None:
                table[h] = new = old | bit
                if _cheapest(new) != _cheapest(old):
                    self._moves[h] = _cheapest(new)
            elif bit & _TIERS:  # a tier's first report: the block is in the pool too
                table[h] = bit | _GPU
                if len(table) > self.max_tracked:
                    del table[next(iter(table))]

    def removed(self, hashes: Iterable[BlockHash], medium: str | None) -> list[BlockHash]:
        """``hashes`` left ``medium``; returns those now gone from every medium (pass them to
        the CP-Tree). O(len(hashes))."""
        bit = _BITS[medium or MEDIUM_GPU]
        table = self._bits
        gone: list[BlockHash] = []
        for h in hashes:
            old = table.get(h)
            if old is None:
                if bit == _GPU:
                    gone.append(h)  # untracked: as without tiers
                continue
            new = old & ~bit
            if new & _TIERS:
                table[h] = new
                if bit == _GPU:
                    self.held += 1
                if _cheapest(new) != _cheapest(old):
                    self._moves[h] = _cheapest(new)
            else:
                del table[h]
                if not new & _GPU:
                    gone.append(h)
        return gone

    def flush_moves(self, listener: EvictionListener | None) -> int:
        """Hand the queued moves to ``listener`` (None: drop them), one call per medium;
        returns the nodes it moved. O(queued)."""
        moves, self._moves = self._moves, {}
        # A listener written before tiers existed has no on_blocks_moved: it keeps working
        # (its nodes keep their pool location), as before this hook.
        move = getattr(listener, "on_blocks_moved", None)
        if move is None or not moves:
            return 0
        by_bit: dict[int, list[BlockHash]] = {}
        for h, bit in moves.items():
            by_bit.setdefault(bit, []).append(h)
        return sum(move(hashes, _LOCATIONS.get(bit, _POOL)) for bit, hashes in by_bit.items())

    def pool_cleared(self) -> None:
        """The pool dropped everything (``AllBlocksCleared``): tier bits stay; queued moves are
        dropped (the clear empties the CP-Tree, and a node committed after it is not theirs).
        O(n)."""
        self._moves.clear()
        table = self._bits
        for h, bits in table.items():
            table[h] = bits & ~_GPU

    def clear(self) -> None:
        """Forget everything (a lost batch: nothing known can be trusted). O(n)."""
        self._bits.clear()
        self._moves.clear()

    def _check_invariants(self) -> None:
        assert len(self._bits) <= self.max_tracked
        assert all(bits & _TIERS and not bits & ~(_GPU | _TIERS) for bits in self._bits.values())
        assert set(self._moves.values()) <= {_GPU, _RAM, _DISK}
