"""Rolling back the bounded state that rejected draft positions wrote (see the package docstring).

Every per-slot state tensor of a `V4KVCache` is a ring: `[num_layers, num_slots, ring_len, dim]`, the
token at position `p` in row `p % ring_len` (the window ring, `ring_len = sliding_window`; the
compressor buffers, `ring_len = (1 + overlap) * rate`). `RingRollback.snapshot` copies, before a
verification forward, the rows the draft positions are about to overwrite; `restore` writes back the
rows of the positions that were rejected.

NOTE: why that restores exactly the non-speculative state. A verify chunk computes positions
`p .. p + L` (the last known token, then `L` drafts); with `L + 1 <= ring_len` these positions fall on
distinct rows. After accepting `m` drafts the non-speculative state holds, in the row of a rejected
position `p + j` (`j > m`), the newest position `<= p + m` with that residue, i.e. `p + j - ring_len`
(`<= p`): exactly what the row held before the forward, which is what `restore` puts back. Rows of
accepted positions hold what the non-speculative run writes (causality: a position's state depends on
earlier tokens only). `max_draft_tokens` is the largest `L` this argument covers for a cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.engine.cache.kv_cache import V4KVCache
from deepinfer.engine.forward_batch import host_to_device


def max_draft_tokens(cache: V4KVCache) -> int:
    """The most drafts one verification may carry so that its positions hit distinct rows of every ring."""
    rings = [t.shape[2] for t in cache.state_tensors().values() if t.numel()]
    return min(rings) - 1 if rings else 0


@dataclass
class RingSnapshot:
    """Saved ring rows for `(slot, position)` pairs, in the order they were given."""

    slots: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    saved: list[torch.Tensor]
    """Per state tensor (non-empty ones, in `RingRollback.tensors` order): [num_layers, N, dim]."""


class RingRollback:
    """Snapshot / restore of the rows that given positions occupy in every state ring of one cache."""

    def __init__(self, cache: V4KVCache) -> None:
        self.tensors = [t for t in cache.state_tensors().values() if t.numel()]
        """The non-empty per-slot rings: [num_layers, num_slots, ring_len, dim] each."""
        self.device = cache.device
        self.max_positions_per_slot = max_draft_tokens(cache)
        """At most this many positions of one slot per snapshot (they must hit distinct rows)."""

    def snapshot(self, slots: list[int], positions: list[int], batch=None) -> RingSnapshot:
        """Copy the rows the `(slots[i], positions[i])` pairs map to (before they are overwritten). `batch` (the
        step's, unused here) is `dspark_drafter.V41Rollback`'s, which shares this interface."""
        del batch
        if len(slots) != len(positions):
            raise ValueError(f"got {len(slots)} slots for {len(positions)} positions; pass one slot per position")
        # NOTE: one non-blocking copy (a plain `torch.tensor(..., device=cuda)` waits for the queued kernels)
        s, p = host_to_device(torch.tensor([slots, positions], dtype=torch.long).view(2, -1), self.device)
        saved = [t[:, s, p % t.shape[2]].clone() for t in self.tensors] if slots else []
        return RingSnapshot(s, p, saved)

    def restore(self, snap: RingSnapshot, is_rejected: list[bool]) -> None:
        """Write back the saved rows of the pairs flagged in `is_rejected` (one flag per snapshot pair)."""
        if len(is_rejected) != snap.slots.numel():
            raise ValueError(f"got {len(is_rejected)} flags for a snapshot of {snap.slots.numel()} rows")
        if not any(is_rejected):
            return
        idx = host_to_device(torch.tensor([i for i, r in enumerate(is_rejected) if r], dtype=torch.long), self.device)
        s, p = snap.slots[idx], snap.positions[idx]
        for t, saved in zip(self.tensors, snap.saved):
            t[:, s, p % t.shape[2]] = saved[:, idx]
