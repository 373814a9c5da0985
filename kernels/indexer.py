"""The lightning indexer of CSA layers for decode rows: scores over the paged index keys, then top-k.

Module op `"indexer_topk"` (`register_op(..., in_op_table=False)`; the `triton` attention backend picks
it per device): `(q [B, IH, ID], weights [B, IH] float32, pool [N, epb, ID], pos [B], block_tables
[B, MB], rate, topk) -> [B, topk] int64`: the selected entry indices of each row, ascending, valid
ones first, -1 padded.

The scores are `Indexer.score_batched`'s (engine/models/deepseek_v4.py): entry `c` of row `b` scores
`sum_h weights[b, h] * relu(q[b, h] . key_c) * ID**-0.5` in float32, where `weights` is
`weights_proj(x) * IH**-0.5` (the caller's) and `key_c` is the index key at
`block_tables[b, c // epb] * epb + c % epb`. Entries `c < (pos + 1) // rate` are visible; the others
(and a padding row's, `V4KVCache.dummy_block`) are never read and score -inf.

The selection follows `topk_mask`'s rule: larger score first, then the lower entry index (ties are
frequent: an entry whose every head has relu = 0 scores exactly 0). Picks past the visible count
are -1. On CUDA the selection is `torch.topk` on the -inf padded scores, which keeps the lowest indices
among the values tied at the k-th place (measured on an H200, see `topk_mask`), elsewhere a stable
descending sort; either way the set is the rule's, then sorted ascending so the attention over it
sums in one order whatever the batch. A score of -0.0 is made +0.0 first (CUDA's topk orders the two
by their bits; the rule treats them as equal).

The Triton impl is three launches (a CSA layer's decode budget, issue 22): `_indexer_scores_kernel`
computes the scores: one program per row and `BLOCK_C` entries, all index heads as the M dim of one
`tl.dot` against the gathered key tile, ReLU, weights and the head sum in registers, a -0.0 sum stored as
+0.0; tiles past a row's visible entries only write -inf. Then `torch.topk` (CUDA; a stable sort on the
CPU under `TRITON_INTERPRET=1`), and `_topk_post_kernel` (`select_topk_triton`), one program per row:
drops picks at or past the row's visible count, sorts the k indices ascending (`tl.sort` over k padded
to a power of two) and writes the -1 padding — `select_topk`'s bits without its eight element-wise
launches. Grids `(B, MB * epb / BLOCK_C)` and `(B,)`: fixed for a batch size and cache geometry, no
host syncs (CUDA graphs).
"""

from __future__ import annotations

import os

import torch

from deepinfer.kernels.decode_attention import gather_entries
from deepinfer.kernels.registry import register_default_impl, register_op

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is optional on CPU-only installs
    triton = None


def select_topk(scores: torch.Tensor, num_visible: torch.Tensor, topk: int) -> torch.Tensor:
    """Indices [B, topk] of the rule's top-k of `scores` [B, C] (-inf where not visible): ascending, -1
    padded past `num_visible` [B]. torch.topk on CUDA, a stable sort elsewhere (same set, see above)."""
    B, C = scores.shape
    if C <= topk:
        idx = torch.arange(C, device=scores.device).expand(B, -1)
        idx = torch.cat([idx, idx.new_full((B, topk - C), C)], dim=1)
    else:
        scores = scores + 0.0  # -0.0 -> +0.0
        if scores.is_cuda:
            idx = torch.topk(scores, topk, dim=-1).indices
        else:
            idx = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :topk]
    big = torch.iinfo(torch.int64).max
    idx = torch.where(idx < num_visible[:, None], idx, torch.full_like(idx, big))
    idx = idx.sort(dim=-1).values
    return torch.where(idx == big, torch.full_like(idx, -1), idx)


def indexer_scores_torch(q, weights, pool, pos, block_tables, rate) -> torch.Tensor:
    """Reference scores [B, MB * epb] float32 (-inf where not visible), `Indexer.score_batched`'s arithmetic."""
    B, IH, ID = q.shape
    C = block_tables.shape[1] * pool.shape[1]
    c = torch.arange(C, device=q.device)[None, :].expand(B, -1)
    keys, valid = gather_entries(pool, block_tables, c, c < ((pos + 1) // rate)[:, None])
    s = torch.relu(torch.einsum("bhd,bcd->bhc", q.float(), keys.float())) * ID**-0.5
    s = (s * weights.float()[:, :, None]).sum(dim=1)
    return s.masked_fill(~valid, float("-inf"))


@register_op("indexer_topk", "torch", in_op_table=False)
def indexer_topk_torch(q, weights, pool, pos, block_tables, rate, topk) -> torch.Tensor:
    """Reference decode indexer (see the module docstring) -> [B, topk] int64."""
    scores = indexer_scores_torch(q, weights, pool, pos, block_tables, rate)
    return select_topk(scores, (pos + 1) // rate, topk)


@register_default_impl("indexer_topk")
def _default_indexer(device: torch.device) -> str:
    return "triton" if device.type == "cuda" and triton is not None else "torch"


if triton is not None:

    @triton.jit
    def _indexer_scores_kernel(q_ptr, w_ptr, pool_ptr, pos_ptr, bt_ptr, out_ptr, num_blocks, max_blocks, C, IH,
                               scale, ID: tl.constexpr, RATE: tl.constexpr, EPB: tl.constexpr,
                               BLOCK_C: tl.constexpr, BLOCK_IH: tl.constexpr, BLOCK_ID: tl.constexpr,
                               IEEE: tl.constexpr):
        b = tl.program_id(0)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        n_vis = (tl.load(pos_ptr + b) + 1) // RATE
        if tl.program_id(1) * BLOCK_C < n_vis:
            h = tl.arange(0, BLOCK_IH)
            d = tl.arange(0, BLOCK_ID)
            h_ok = h < IH
            d_ok = d < ID
            q = tl.load(q_ptr + (b * IH + h[:, None]) * ID + d[None, :], mask=h_ok[:, None] & d_ok[None, :],
                        other=0.0)
            w = tl.load(w_ptr + b * IH + h, mask=h_ok, other=0.0)
            vis = c < n_vis
            blk = tl.load(bt_ptr + b * max_blocks + c // EPB, mask=vis, other=num_blocks)
            vis = vis & (blk < num_blocks)
            k = tl.load(pool_ptr + ((blk * EPB + c % EPB) * ID)[:, None] + d[None, :],
                        mask=vis[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_C, BLOCK_ID]
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))  # bf16 / fp16 operands: exact products, float32 sums
            s = tl.maximum(s, 0.0) * scale * w[:, None]  # [BLOCK_IH, BLOCK_C]
            # + 0.0: a sum of -0.0 (relu 0 times negative weights only) is stored +0.0, select_topk's
            # `scores + 0.0` done here (torch.topk on CUDA orders -0.0 below +0.0; the rule ties them).
            # Not folded away: IEEE x + 0.0 is not x for x = -0.0 (only x + -0.0 folds; no fast-math).
            score = tl.sum(s, axis=0) + 0.0
            tl.store(out_ptr + b * C + c, tl.where(vis, score, float("-inf")))
        else:
            tl.store(out_ptr + b * C + c, tl.full([BLOCK_C], float("-inf"), tl.float32))

    @triton.jit
    def _topk_post_kernel(idx_ptr, pos_ptr, out_ptr, idx_stride, C, RATE: tl.constexpr, TOPK: tl.constexpr,
                          K_P2: tl.constexpr, FROM_IDX: tl.constexpr):
        # One row: its TOPK picks (FROM_IDX; else `arange(C)` then C, select_topk's C <= topk case) ->
        # those below the row's visible count ascending, then -1. int32 inside (C < 2**31 - 1, checked).
        b = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, K_P2)
        in_k = j < TOPK
        # Triton's // truncates, torch's floors: they differ only for pos < -1, where both counts are <= 0.
        n_vis = (tl.load(pos_ptr + b) + 1) // RATE
        if FROM_IDX:
            i = tl.load(idx_ptr + b * idx_stride + j, mask=in_k, other=0).to(tl.int32)
        else:
            i = tl.minimum(j, C)
        v = tl.where(in_k & (i < n_vis), i, 2147483647)
        v = tl.sort(v)
        tl.store(out_ptr + b * TOPK + j, tl.where(v == 2147483647, -1, v).to(tl.int64), mask=in_k)

    def select_topk_triton(scores: torch.Tensor, pos: torch.Tensor, rate: int, topk: int) -> torch.Tensor:
        """`select_topk(scores, (pos + 1) // rate, topk)` bit for bit in two launches (one when C <= topk):
        `torch.topk` on CUDA (a stable descending sort elsewhere, as `select_topk`), then `_topk_post_kernel`.

        scores [B, C] float32 (-inf where not visible) must hold no -0.0 (`_indexer_scores_kernel` stores
        +0.0): unlike `select_topk` this adds no 0.0, and CUDA's topk would order -0.0 below +0.0.
        pos [B] int64 contiguous. No host sync; the launch shapes depend on B, C and topk only.
        """
        if scores.dim() != 2 or scores.dtype != torch.float32:
            raise ValueError(f"select_topk_triton: scores must be float32 [B, C], got {scores.dtype} "
                             f"{list(scores.shape)}")
        B, C = scores.shape
        if pos.dtype != torch.int64 or pos.shape != (B,) or not pos.is_contiguous():
            raise ValueError(f"select_topk_triton: pos must be contiguous int64 [{B}], got {pos.dtype} "
                             f"{list(pos.shape)}")
        if C >= 2**31 - 1 or topk < 0 or rate < 1:
            raise ValueError(f"select_topk_triton: C = {C} < 2**31 - 1, topk = {topk} >= 0, rate = {rate} >= 1 "
                             "expected")
        out = torch.empty((B, topk), dtype=torch.int64, device=scores.device)
        if B == 0 or topk == 0:
            return out
        if C <= topk:
            idx = out  # not read
        elif scores.is_cuda:
            idx = torch.topk(scores, topk, dim=-1).indices
        else:
            idx = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :topk]
        if idx.stride(1) != 1:  # pragma: no cover - topk's and the sort's slices are row-contiguous
            idx = idx.contiguous()
        _topk_post_kernel[(B,)](idx, pos, out, idx.stride(0), C, RATE=rate, TOPK=topk,
                                K_P2=max(2, triton.next_power_of_2(topk)), FROM_IDX=C > topk, num_warps=4)
        return out

    @register_op("indexer_topk", "triton", in_op_table=False)
    def indexer_topk_triton(q, weights, pool, pos, block_tables, rate, topk, block_c: int = 64) -> torch.Tensor:
        """Triton decode indexer (see the module docstring) -> [B, topk] int64.

        q [B, IH, ID] in the pool's dtype, weights [B, IH] float32, pool [N, epb, ID], pos [B] and
        block_tables [B, MB] int64; all contiguous. `block_c` (a power of two >= 16) divides MB * epb
        when it is smaller, else is cut to it.
        """
        if q.dim() != 3 or pool.dim() != 3 or pool.shape[2] != q.shape[2]:
            raise ValueError(f"indexer_topk: q [B, IH, ID] and pool [N, epb, ID] expected, got {list(q.shape)} "
                             f"and {list(pool.shape)}")
        B, IH, ID = q.shape
        if q.dtype != pool.dtype:
            raise ValueError(f"indexer_topk: q is {q.dtype}, pool is {pool.dtype} (one dtype)")
        if weights.dtype != torch.float32 or tuple(weights.shape) != (B, IH):
            raise ValueError(f"indexer_topk: weights must be float32 [{B}, {IH}], got {weights.dtype} "
                             f"{list(weights.shape)}")
        for name, t in (("q", q), ("weights", weights), ("pool", pool), ("pos", pos), ("block_tables", block_tables)):
            if not t.is_contiguous():
                raise ValueError(f"indexer_topk: {name} must be contiguous (call .contiguous())")
        if pos.dtype != torch.int64 or block_tables.dtype != torch.int64 or block_tables.dim() != 2 \
                or pos.shape != (B,) or block_tables.shape[0] != B:
            raise ValueError("indexer_topk: pos [B] and block_tables [B, MB] must be int64")
        if q.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"indexer_topk needs CUDA tensors (or TRITON_INTERPRET=1), got {q.device}")
        N, epb = pool.shape[0], pool.shape[1]
        C = block_tables.shape[1] * epb
        scores = torch.empty((B, C), dtype=torch.float32, device=q.device)
        BLOCK_C = min(block_c, max(16, triton.next_power_of_2(C)))
        if B and C:
            Cp = triton.cdiv(C, BLOCK_C) * BLOCK_C
            if Cp != C:  # a last partial tile: score into a padded buffer
                scores = torch.empty((B, Cp), dtype=torch.float32, device=q.device)
            _indexer_scores_kernel[(B, Cp // BLOCK_C)](
                q, weights, pool, pos, block_tables, scores, N, block_tables.shape[1], Cp, IH, ID**-0.5,
                ID=ID, RATE=rate, EPB=epb, BLOCK_C=BLOCK_C, BLOCK_IH=max(16, triton.next_power_of_2(IH)),
                BLOCK_ID=max(16, triton.next_power_of_2(ID)), IEEE=q.dtype == torch.float32, num_warps=4,
            )
            scores = scores[:, :C]
        return select_topk_triton(scores, pos, rate, topk)
