"""Blocks and state slots kept out of circulation while a KV connector (or the caller) still uses them.

A hold outlives the request that owned the blocks: a prefill request finishes right after its
first token while its KV is still being sent, and an aborted load's blocks may still receive a
WRITE. Each hold has a key (the request id for a save, a connector-chosen key for a quarantine)
and is dropped exactly once, by `release`.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.engine.cache.block_pool import BlockPool, StateSlotPool


@dataclass
class KVHold:
    """One hold: the block ids it references and the state slot it owns, if any."""

    block_ids: list[int]
    state_slot: int | None = None


class KVHolds:
    """Holds on blocks (one extra reference each) and state slots (ownership moved to the hold), by key."""

    def __init__(self, block_pool: BlockPool, slots: StateSlotPool) -> None:
        self.block_pool = block_pool
        self.slots = slots
        self._holds: dict[str, KVHold] = {}

    @staticmethod
    def slot_owner(key: str) -> str:
        """State-slot owner name of a hold's slot (the slot pool keys slots by owner)."""
        return f"held-state:{key}"

    def hold(self, key: str, block_ids: list[int], slot_owner: str | None = None) -> KVHold:
        """Reference `block_ids` under `key` and, with `slot_owner`, move that owner's slot to the hold."""
        if key in self._holds:
            raise ValueError(f"KV hold {key!r} already exists")
        ids = list(block_ids)
        if ids:
            self.block_pool.touch(ids)
        slot = None
        if slot_owner is not None and self.slots.get_slot_id(slot_owner) is not None:
            slot = self.slots.transfer(slot_owner, self.slot_owner(key))
        held = self._holds[key] = KVHold(ids, slot)
        return held

    def release(self, key: str) -> bool:
        """Drop a hold: its blocks lose the reference, its slot returns to the pool. False if none."""
        held = self._holds.pop(key, None)
        if held is None:
            return False
        if held.block_ids:
            self.block_pool.free(held.block_ids)
        if held.state_slot is not None:
            self.slots.free(self.slot_owner(key))
        return True

    def get(self, key: str) -> KVHold | None:
        return self._holds.get(key)

    def __contains__(self, key: str) -> bool:
        return key in self._holds

    def __len__(self) -> int:
        return len(self._holds)
