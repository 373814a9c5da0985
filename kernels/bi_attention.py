"""Batch-invariant attention rows: one kernel path for a position whether it is a decode row or a prefill row.

Module op `"bi_rows_attention"` (`register_op(..., in_op_table=False)`; the batch-invariant Triton attention backend,
`engine.batch_invariant.BatchInvariantTritonAttentionBackend`, calls it for decode rows and for every query of
every prefill chunk alike):

    bi_rows_attention(q [B, NH, D], ring [S, W, D], pool [N, epb, D] | None, slots [B], pos [B], state_start [B],
                      block_tables [B, MB], entries [B, K] | None, rate, sink [NH], new_kv [M, D], new_start [B],
                      split_size, new_off=0) -> [B, NH, D]

Each row is a query at position `pos[b]` of the request in slot `slots[b]`; its keys are `decode_attention`'s (the
window, the visible or selected compressed entries, the sink: `kernels.decode_attention`), except that the window
keys at positions `>= new_start[b]` come from `new_kv` rows (the key of position `p` is row `new_off + b - (pos[b] -
p)`: the rows of one request are consecutive positions in consecutive rows, row b's own key is row `new_off + b`),
the older ones from the ring, which holds positions before `new_start[b]`. A decode row passes its own key and
`new_start = pos`; a prefill chunk's rows pass the chunk's keys and the chunk's first position; a launch over a
slice of a step's prefill rows (rows `new_off ..` of them) passes all their keys and the slice's offset.

Why (the batch-invariant mode, `engine.batch_invariant`): a row's arithmetic is `decode_attention`'s, which depends
on the row alone: the same key order (window in ring order, then entries by index), splits of a fixed number of
keys (`split_size`, never chosen by the batch), the splits combined in split order by the reduce kernel. Decode
rows and prefill rows take the same compiled kernel (the `ROW_START` variant of `_decode_attn_kernel`) with the
same constexprs when the caller pads every row's block table to one width (`V4KVCache.max_blocks_per_seq`), so a
position gets the same bits whether a decode step, a chunk of any size, a prefix hit or a recompute computes it.
The prefill kernel (`kernels.prefill_attention`) reduces over another order and is not used in the mode.

Reference: `bi_rows_attention_torch` (float32 einsum attention over the same keys).
"""

from __future__ import annotations

import torch

from deepinfer.kernels.decode_attention import (
    DEFAULT_SPLIT_SIZE,
    _attend_rows,
    _check_decode_args,
    _check_index,
    _window_keys,
)
from deepinfer.kernels.decode_attention import triton as _triton
from deepinfer.kernels.registry import register_default_impl, register_op


def _rows_window_keys(ring, slots, pos, state_start, new_kv, new_start, new_off=0):
    """`_window_keys` with the keys at positions `>= new_start` taken from `new_kv` rows (see the module docstring)."""
    keys, valid = _window_keys(ring, slots, pos, state_start)
    B, W = keys.shape[0], keys.shape[1]
    j = torch.arange(W, device=ring.device)
    key_pos = pos[:, None] - ((pos[:, None] - j[None, :]) % W)  # [B, W]
    b = torch.arange(B, device=ring.device)[:, None]
    is_new = key_pos >= new_start[:, None]
    src = (new_off + b - (pos[:, None] - key_pos)).clamp(0, max(new_kv.shape[0] - 1, 0))
    return torch.where(is_new[..., None], new_kv[src].to(keys.dtype), keys), valid


@register_op("bi_rows_attention", "torch", in_op_table=False)
def bi_rows_attention_torch(q, ring, pool, slots, pos, state_start, block_tables, entries, rate, sink, new_kv,
                            new_start, split_size=DEFAULT_SPLIT_SIZE, new_off: int = 0) -> torch.Tensor:
    """Reference rows attention (see the module docstring); float32 arithmetic, any device. `split_size` is
    accepted for a common signature and changes nothing here."""
    keys, valid = _rows_window_keys(ring, slots, pos, state_start, new_kv, new_start, new_off)
    return _attend_rows(q, keys, valid, pool, pos, block_tables, entries, rate, sink)


@register_default_impl("bi_rows_attention")
def _pick(device: torch.device) -> str:
    return "triton" if device.type == "cuda" and _triton is not None else "torch"


def _check_rows_args(q, ring, pool, slots, pos, state_start, block_tables, entries, sink, new_kv, new_start,
                     new_off) -> None:
    _check_decode_args("bi_rows_attention", q, ring, pool, slots, pos, state_start, block_tables, entries, sink)
    B, D = q.shape[0], q.shape[2]
    if (new_kv.dim() != 2 or new_kv.shape[1] != D or new_kv.shape[0] < new_off + B or new_off < 0
            or new_kv.dtype != q.dtype or not new_kv.is_contiguous()):
        raise ValueError(f"bi_rows_attention: new_kv must be a contiguous {q.dtype} [M >= new_off + {B}, {D}] tensor "
                         f"(new_off {new_off} >= 0), got {new_kv.dtype} {list(new_kv.shape)}")
    _check_index("bi_rows_attention", "new_start", new_start, (B,))


if _triton is not None:
    from deepinfer.kernels.decode_attention import _launch

    @register_op("bi_rows_attention", "triton", in_op_table=False)
    def bi_rows_attention_triton(q, ring, pool, slots, pos, state_start, block_tables, entries, rate, sink, new_kv,
                                 new_start, split_size=DEFAULT_SPLIT_SIZE, new_off: int = 0) -> torch.Tensor:
        """Triton rows attention: `decode_attention_triton`'s kernel with its window reads of positions
        `>= new_start` switched to `new_kv` -> [B, NH, D] in q's dtype. The tile sizes are `decode_attention`'s
        defaults (32 heads, 32 keys a tile), never chosen per call. Arguments as `decode_attention_triton`, plus
        new_kv [M >= new_off + B, D] (q's dtype, contiguous), new_start [B] int64 and new_off (a runtime int: one
        compiled kernel for every offset)."""
        _check_rows_args(q, ring, pool, slots, pos, state_start, block_tables, entries, sink, new_kv, new_start,
                         new_off)
        return _launch(q, ring, pool, slots, pos, state_start, block_tables, entries, rate, sink, new_kv, 1,
                       split_size, 32, None, None, new_start=new_start, new_off=int(new_off))
