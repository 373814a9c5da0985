"""Batch-invariant numerics (`EngineConfig.batch_invariant`): a token's numbers do not depend on its batch.

With the mode on, every reduction that produces a request's logits has an order fixed by that request
alone: not by how many other tokens share the step, how its prompt was chunked, whether its prefix
came from the cache, or whether a position ran as a prefill row or as a decode row. Greedy tokens,
logprobs and seeded samples are then bit-identical alone, in any batch, across chunkings, prefix hits,
preemption and the prefill/decode split.

What was measured (CPU, torch 2.13, float32; `tests/engine/test_batch_invariance.py` pins the
end-to-end result):

* matmuls: a row of `F.linear(X, W)` depends on M, the number of rows (BLAS takes other kernels for
  M < 12: gemv for M = 1, small-M paths up to 11); from 12 rows on, every M tried (12 .. 1200, any
  row offset, 1 or 2 threads) gives the same bits per row. So the mode pads the rows of every matmul
  to a multiple of `ROW_TILE` (16): every call then takes the large-M kernel.
* last-dim softmax / log_softmax / RMSNorm / sum over up to 32768 channels: invariant to the number
  of rows; over a *middle* dimension they are not (the kernel's vectorisation follows the outer
  size). The mode moves such a dim last (a contiguous copy) before reducing.
* elementwise sigmoid / SiLU / softplus: an element's bits depend on whether it falls in a vectorised
  body or in a scalar tail, i.e. on the tensor's length and the element's offset; exp and log1p (VML)
  do not. The mode computes the three from exp / log1p (`_sigmoid`, `_silu`, `_softplus`).
* attention: the `torch` backend's decode rows (`bhd,bwd->bhw`, keys in ring order) and prefill
  chunks (`nhd,ndw->nhw` over an `unfold`, keys in position order; entries shared by the chunk)
  reduce in different orders, and the number of compressed entries in a reduction depends on the
  batch (decode pads to the longest row) and on the chunk. `BatchInvariantAttentionBackend` gives
  both paths one per-query function with fixed tiles (`attend_tiled`). Speculative decoding's verify chunks take
  the per-query prefill path too (the backend does not offer the torch backend's batched verify rows).
* MoE: an expert's matmul sees as many rows as tokens routed to it (fixed by the row padding), and
  `index_add_` adds a token's experts in an order that is not defined on CUDA; the mode's backend
  (`BatchInvariantMoEBackend`) adds each token's experts in ascending expert id, one add at a time.
* mHC ops and Sinkhorn: the CPU Sinkhorn switches from numpy to torch above a row count; the mode pins
  every small op of the model's `OpTable` to its torch reference.

How it is wired: `enable_batch_invariant(model)` (the engine calls it once after loading, when the
config asks) swaps the `torch` attention / MoE backends for their batch-invariant variants, refuses
any other backend that does not declare `batch_invariant_safe = True`, and sets the model's
`numerics` context to `BatchInvariantMode`, a `TorchFunctionMode` entered around each forward
that routes matmuls and middle-dim reductions through the fixed-tiling versions above. Nothing in a
hot loop tests the mode: it is all decided here, once.

DeepSeek-V4.1 (`_enable_v41`): its paged attention is not an `AttentionBackend`; the mode swaps the model's
`PagedAttention` for `BatchInvariantPagedAttention` (the same per-query tiles for decode rows and prefill chunks,
the indexer's scores tiled, the grouped `wo_a` without einsum, a chunk's compressor projections rounded to the
buffer's dtype as a decode row's are), the MoE backends of the backbone and the DSpark stages as above, and sets
the model's `numerics` (entered around its paged `forward` and `compute_logits`). docs/V4_1.md §15 says what the
guarantee means under decoder-side bounded replay.

On CUDA the row padding is not enough (cuBLAS picks split-K and kernels by shape): matmuls go through
`kernels.bi_matmul`, a Triton GEMM with one fixed tiling and a K split fixed by (K, N) alone, never by M. The
quantized linears take their `torch` reference (dequantize a block, matmul through the mode), since the Triton
FP8/FP4 GEMMs choose split-K by M; softmax, log_softmax, sums and RMSNorm reduce by `tree_sum` (CUDA's reduction
kernels pick their thread split by the number of outputs). That is the mode on the torch backends (explicit
"torch" on CUDA; what "auto" resolves to on the CPU and for V4.1). On CUDA "auto" (or "triton") runs the Triton path
(next paragraph), the default since its `gpu` tests passed on an H100 (2026-12-05).

The Triton fast path (CUDA: `attention_backend` / `moe_backend` "triton" or "auto", swapped by the mode):

* attention: `BatchInvariantTritonAttentionBackend` runs every position, decode row or query of a prefill chunk,
  through one kernel (`kernels.bi_attention.bi_rows_attention`: the decode kernel, keys in a fixed order, split by
  a fixed count, the splits combined in order, the window's newest keys read from the step's own K=V rows), with
  every block table padded to one width so each launch compiles the same kernel; the indexer's top-k per row by
  `indexer_topk` (a chunk's queries as rows at their positions); every compressor entry by the `compressor_decode`
  kernel (a chunk's windows over a ring of their own). The prefill kernel is not used.
* MoE: `BatchInvariantTritonMoEBackend`, the grouped kernels with one tile config for every batch
  (`BI_MOE_UP_CONFIG`, `BI_MOE_DOWN_CONFIG`; no split-K anywhere, a token's experts combined in ascending id),
  never the `_grouped_mm` route; the Triton router (one program per 4 tokens, a token's reductions alone).
* small ops: those of `TRITON_INVARIANT_OPS` keep their Triton kernels (per-row tiling); the rest take the torch
  references through the mode.
* matmuls and the remaining torch reductions: `kernels.bi_matmul` and `tree_sum`, as above.

Nothing on that path reads a device value on the host, so decode steps run as CUDA graphs in the mode too. The
premise (NOTE): a tensor-core MMA computes every output element with one reduction over K in a fixed order wherever
its row sits in the tile, so a token's row in an expert's tile or a matmul's M tile gives the same bits beside any
companions (tests/engine/test_batch_invariance_triton.py checks the structure under the interpreter with a dot of
that property, and the bits on CUDA in its `gpu` tests).

Cost: the torch path is slower (every torch call of the forward passes through the mode; matmuls of fewer than
16 rows compute 16; attention copies each query's keys). Its `MoE` backend reads the experts' token counts
on the host, so it is not CUDA-graph safe: decode steps run eagerly there.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from deepinfer.engine.attention.base import (
    AttentionInputs,
    AttentionMetadata,
    DecodeRows,
    LayerSpec,
    PrefillChunk,
)
from deepinfer.engine.attention.torch_backend import TorchAttentionBackend, _pools
from deepinfer.engine.attention.triton_backend import TritonAttentionBackend
from deepinfer.engine.cache.kv_cache import V4KVCache
from deepinfer.engine.models.deepseek_v4 import apply_rope
from deepinfer.engine.models.deepseek_v41 import PagedAttention
from deepinfer.engine.moe.base import MoEBackend
from deepinfer.engine.moe.torch_backend import (
    ExpertFn,
    TorchLoopMoEBackend,
    TorchMoEBackend,
    call_expert,
    expert_fn_for,
)
from deepinfer.engine.moe.triton_backend import TritonMoEBackend
from deepinfer.kernels import bi_attention as _bi_attention  # noqa: F401  (registers the op)
from deepinfer.kernels.registry import default_impl, get_op, op_impl_names

ROW_TILE = 16
"""Rows of a matmul are padded to a multiple of this (the measured large-M BLAS kernel from 12 rows on)."""
KEY_TILE = 16
"""Keys (window keys, compressed entries) per attention tile; tile boundaries sit on fixed key indices."""
QUERY_BLOCK = 64
"""Queries attended per pass in `attend_tiled` (bounds memory; per-query results do not depend on it)."""


# --------------------------------------------------------------------------- matmuls and reductions


def _pad_rows(x: torch.Tensor, dim: int = -2) -> tuple[torch.Tensor, int]:
    """`x` with dim `dim` zero-padded to a multiple of ROW_TILE (at least ROW_TILE), and its old size."""
    m = x.shape[dim]
    pad = -m % ROW_TILE if m >= ROW_TILE else ROW_TILE - m
    if pad == 0:
        return x, m
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat([x, x.new_zeros(shape)], dim=dim), m


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., M, K] @ b [..., K, N] with a fixed per-row reduction (see the module docstring)."""
    if a.is_cuda:
        from deepinfer.kernels.bi_matmul import bi_matmul

        return bi_matmul(a, b)
    ap, m = _pad_rows(a)
    out = torch.matmul(ap, b)
    return out if out.shape[-2] == m else out[..., :m, :]


def bi_matmul_any(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`torch.matmul(a, b)` semantics (1-D operands included) through `_mm`."""
    if b.dim() == 1:
        return bi_matmul_any(a, b.unsqueeze(-1)).squeeze(-1)
    if a.dim() == 1:
        return _mm(a.unsqueeze(0), b).squeeze(-2)
    return _mm(a, b)


def bi_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` with rows padded to the fixed tiling: x [..., K], weight [N, K] -> [..., N]."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    y = _mm(x2, weight.t())
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


def _dim_arg(args, kwargs, pos: int):
    if "dim" in kwargs:
        return kwargs["dim"]
    return args[pos] if len(args) > pos else None


def _last_dim_softmax(fn):
    """`fn` (a softmax) run along a contiguous last dim when asked for another dim (dim given first or by name)."""
    def run(x, *args, **kwargs):
        dim = _dim_arg(args, kwargs, 0)
        if x.is_cuda and isinstance(dim, int) and len(args) <= 1 and x.is_floating_point():
            return _tree_softmax(x, dim, log=fn in (torch.log_softmax, F.log_softmax), dtype=kwargs.get("dtype"))
        if (not isinstance(dim, int) or len(args) > 1 or x.dim() < 2 or dim % x.dim() == x.dim() - 1):
            return fn(x, *args, **kwargs)
        rest = {k: v for k, v in kwargs.items() if k not in ("dim", "_stacklevel")}
        return fn(x.movedim(dim, -1).contiguous(), -1, **rest).movedim(-1, dim)
    return run


def _last_dim_sum(x, *args, **kwargs):
    dim = _dim_arg(args, kwargs, 0)
    if isinstance(dim, (tuple, list)) and len(dim) == 1:
        dim = dim[0]
    if x.is_cuda and isinstance(dim, int) and x.is_floating_point():
        # NOTE: CUDA's reduction splits a row over threads by the number of outputs: a fixed tree instead
        keepdim = kwargs.get("keepdim", args[1] if len(args) > 1 else False)
        dtype = kwargs.get("dtype")
        y = tree_sum(x.to(dtype) if dtype is not None else x, dim)
        return y.unsqueeze(dim % x.dim()) if keepdim else y
    if not isinstance(dim, int) or x.dim() < 2 or dim % x.dim() == x.dim() - 1:
        return torch.sum(x, *args, **kwargs)
    keepdim = kwargs.get("keepdim", args[1] if len(args) > 1 else False)
    dtype = kwargs.get("dtype")
    moved = x.movedim(dim, -1).contiguous()
    y = moved.sum(-1, keepdim=True, dtype=dtype) if dtype is not None else moved.sum(-1, keepdim=True)
    y = y.movedim(-1, dim)
    return y if keepdim else y.squeeze(dim)


def _last_dim_mean(x, *args, **kwargs):
    """`mean` through `_last_dim_sum` (a fixed order for a middle dim, a `tree_sum` on CUDA), divided by the count.
    NOTE: V4 calls no mean; V4.1's Engram gate and DSpark features do."""
    dim = _dim_arg(args, kwargs, 0)
    if isinstance(dim, (tuple, list)) and len(dim) == 1:
        dim = dim[0]
    if not isinstance(dim, int) or not x.is_floating_point() or (not x.is_cuda and dim % x.dim() == x.dim() - 1):
        return torch.mean(x, *args, **kwargs)
    keepdim = kwargs.get("keepdim", args[1] if len(args) > 1 else False)
    dtype = kwargs.get("dtype")
    x = x.to(dtype) if dtype is not None else x
    return _last_dim_sum(x, dim, keepdim=keepdim) / x.shape[dim]


def _refuse_einsum(*args, **kwargs):
    raise RuntimeError(
        "batch_invariant=True: torch.einsum is not batch invariant (its contraction order follows the shapes); "
        "the code calling it needs a batch-invariant path (engine/batch_invariant.py)")


def _tree_softmax(x: torch.Tensor, dim: int, log: bool, dtype=None) -> torch.Tensor:
    """(log_)softmax along `dim` with the max (exact) and a `tree_sum` of the exponentials."""
    x = x.to(dtype) if dtype is not None else x
    xf = x.float()
    m = xf.amax(dim, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(xf - m)
    s = tree_sum(e, dim).unsqueeze(dim % x.dim())
    y = (xf - m - torch.log(s)) if log else e / s
    return y.to(x.dtype)


def _rms_norm(x: torch.Tensor, normalized_shape, weight=None, eps=None) -> torch.Tensor:
    """RMSNorm over the last dim with a `tree_sum` (CUDA; elsewhere the fused op, measured invariant)."""
    if not x.is_cuda or len(normalized_shape) != 1:
        return F.rms_norm(x, normalized_shape, weight, eps)
    xf = x.float()
    eps = torch.finfo(xf.dtype).eps if eps is None else eps
    y = xf * torch.rsqrt(tree_sum(xf * xf, -1).unsqueeze(-1) / x.shape[-1] + eps)
    if weight is not None:
        y = y * weight
    return y.to(x.dtype)


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


def _silu(x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    return x / (1.0 + torch.exp(-x))


def _softplus(x: torch.Tensor, beta: float = 1.0, threshold: float = 20.0) -> torch.Tensor:
    bx = x * beta if beta != 1.0 else x
    y = torch.log1p(torch.exp(bx))
    return torch.where(bx > threshold, x, y / beta if beta != 1.0 else y)


_OVERRIDES = {
    F.linear: bi_linear,
    torch.matmul: bi_matmul_any,
    torch.Tensor.matmul: bi_matmul_any,
    torch.Tensor.__matmul__: bi_matmul_any,
    torch.mm: _mm,
    torch.Tensor.mm: _mm,
    torch.bmm: _mm,
    torch.Tensor.bmm: _mm,
    torch.einsum: _refuse_einsum,
    torch.softmax: _last_dim_softmax(torch.softmax),
    torch.Tensor.softmax: _last_dim_softmax(torch.softmax),
    F.softmax: _last_dim_softmax(F.softmax),
    torch.log_softmax: _last_dim_softmax(torch.log_softmax),
    torch.Tensor.log_softmax: _last_dim_softmax(torch.log_softmax),
    F.log_softmax: _last_dim_softmax(F.log_softmax),
    torch.sum: _last_dim_sum,
    torch.Tensor.sum: _last_dim_sum,
    torch.mean: _last_dim_mean,
    torch.Tensor.mean: _last_dim_mean,
    torch.sigmoid: _sigmoid,
    torch.Tensor.sigmoid: _sigmoid,
    F.silu: _silu,
    F.softplus: _softplus,
    F.rms_norm: _rms_norm,
}


class BatchInvariantMode(TorchFunctionMode):
    """Within it, matmuls take the fixed row tiling and middle-dim softmax / sum reduce along a contiguous
    last dim (`_OVERRIDES`); `torch.einsum` raises. Entered around each model forward (the model's
    `numerics`); thread-local, so a threaded executor's worker enters it itself (the forward does)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        impl = _OVERRIDES.get(func)
        return (impl or func)(*args, **(kwargs or {}))


# --------------------------------------------------------------------------- fixed-order sums


def tree_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over `dim` by a fixed pairwise tree (halves added elementwise), zero-padded to a power of two.

    NOTE: trailing zeros do not change the result: padding from 2^a to 2^b elements adds exact zeros in
    the first steps, so the sum equals the tree over the smallest power of two holding the last
    non-zero. Attention tiles past a query's last visible key are exact zeros, hence a query's sum is
    the same however many tiles its batch carries. Elementwise adds only: the same bits on any device.
    """
    x = x.movedim(dim, -1)
    n = x.shape[-1]
    p = 1 << max(n - 1, 0).bit_length()
    if p != n:
        x = F.pad(x, (0, p - n))
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x.squeeze(-1)


def _pad_keys(keys: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """keys [n, L, D], valid [n, L] -> both padded on L to a multiple of KEY_TILE (padding invalid), with
    invalid keys zeroed (so a masked key never turns 0 * garbage into NaN)."""
    keys = keys.masked_fill(~valid[..., None], 0)
    pad = -keys.shape[1] % KEY_TILE
    if pad:
        keys = F.pad(keys, (0, 0, 0, pad))
        valid = F.pad(valid, (0, pad), value=False)
    return keys, valid


def _tile_logits(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q [n, H, D] . keys [n, L, D] (L a multiple of KEY_TILE) -> [n, T, H, KEY_TILE]: one fixed-shape
    [H, D] x [D, KEY_TILE] product per (query, tile)."""
    n, L, D = keys.shape
    kt = keys.reshape(n, L // KEY_TILE, KEY_TILE, D).transpose(-1, -2)  # [n, T, D, KT]
    return _mm(q[:, None].expand(-1, L // KEY_TILE, -1, -1).contiguous(), kt.contiguous())


def attend_tiled(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """Attention of each query over its own keys (K = V) plus the per-head sink -> [n, H, D] in q's dtype.

    q [n, H, D]; keys [n, L, D] in a fixed order per query (window keys oldest first, padded to a tile
    boundary, then compressed entries by entry index); valid [n, L]. Tiles of KEY_TILE keys: logits
    per tile by a fixed-shape product, max over all (exact), exp, per-tile sums and per-tile P·V by
    fixed shapes, tiles combined by `tree_sum`, the sink added last, then one division.
    """
    keys, valid = _pad_keys(keys, valid)
    scale = q.shape[-1] ** -0.5
    qf, kf = q.float(), keys.float()
    n, L, D = kf.shape
    T = L // KEY_TILE
    logits = _tile_logits(qf, kf) * scale  # [n, T, H, KT]
    vt = valid.view(n, T, 1, KEY_TILE)
    logits = logits.masked_fill(~vt, float("-inf"))
    sink = sink.float()
    m = torch.maximum(logits.amax(dim=(1, 3)), sink[None, :])  # [n, H]
    p = torch.exp(logits - m[:, None, :, None])  # [n, T, H, KT]; 0 where masked
    denom = tree_sum(tree_sum(p, -1), 1) + torch.exp(sink[None, :] - m)  # [n, H]
    pv = _mm(p, kf.view(n, T, KEY_TILE, D))  # [n, T, H, D]
    out = tree_sum(pv, 1) / denom[..., None]
    return out.to(q.dtype)


def attend_blocks(q, keys_fn, sink) -> torch.Tensor:
    """`attend_tiled` over queries in blocks of QUERY_BLOCK; `keys_fn(a, b)` -> (keys, valid) of queries a..b-1."""
    n = q.shape[0]
    outs = []
    for a in range(0, n, QUERY_BLOCK):
        b = min(n, a + QUERY_BLOCK)
        keys, valid = keys_fn(a, b)
        outs.append(attend_tiled(q[a:b], keys, valid, sink))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def indexer_scores_tiled(indexer, q_res: torch.Tensor, x: torch.Tensor, keys: torch.Tensor, cos, sin) -> torch.Tensor:
    """The lightning indexer's scores [n, C] with a fixed order per query: keys [n, C, index_head_dim] per
    query; each (query, tile) product has one shape; the heads are summed by `tree_sum`."""
    q = indexer._queries(q_res, cos, sin).float()  # [n, h, d]
    C = keys.shape[1]
    kp, _ = _pad_keys(keys.float(), torch.ones(keys.shape[:2], dtype=torch.bool, device=keys.device))
    s = torch.relu(_tile_logits(q, kp)) * (indexer.head_dim ** -0.5)  # [n, T, h, KT]
    w = bi_linear(x, indexer.weights_proj.weight).float() * (indexer.num_heads ** -0.5)  # [n, h]
    s = tree_sum(s * w[:, None, :, None], 2)  # [n, T, KT]
    return s.reshape(s.shape[0], -1)[:, :C]


# --------------------------------------------------------------------------- attention


class BatchInvariantAttentionBackend(TorchAttentionBackend):
    """The `torch` backend's cache I/O with one per-query attention (`attend_tiled`) for decode rows and
    prefill chunks alike: window keys in position order, compressed entries by entry index, the indexer
    scored per query with fixed tiles. Slower than `torch` (per-query key copies), exact the same way
    for a position whatever path, batch or chunk computes it."""

    batch_invariant_safe = True
    supports_verify_rows = False
    """NOTE: speculative decoding's verify chunks then run as prefill chunks (`_attend_one`, per-query tiles), so a
    verified position gets the bits a plain decode step gives it; the torch backend's batched verify path
    (`_verify_batched`) reduces over [B, N] queries by einsum, whose order follows the batch."""

    def _decode_batched(self, spec: LayerSpec, dm: DecodeRows, inputs: AttentionInputs, r,
                        cache: V4KVCache) -> torch.Tensor:
        q, kv = inputs.q[r], inputs.kv[r]
        W = spec.window
        ring = cache.window_kv[spec.layer_idx]  # [slots, W, D]
        ring[dm.slots, dm.window_rows[W]] = kv.to(ring.dtype)
        j = torch.arange(W, device=q.device)
        key_pos = dm.pos[:, None] - (W - 1) + j[None, :]  # [B, W] oldest first
        win = ring[dm.slots[:, None], key_pos % W].to(q.dtype)  # [B, W, D]
        win_valid = key_pos >= dm.state_start[:, None]
        entries = mask = None
        if spec.is_compressed:
            entries, mask = self._decode_compressed(spec, dm, inputs, r, cache)
        win, win_valid = _pad_keys(win, win_valid)
        if entries is not None:
            keys = torch.cat([win, entries.to(q.dtype)], dim=1)
            valid = torch.cat([win_valid, mask], dim=1)
        else:
            keys, valid = win, win_valid
        return attend_blocks(q, lambda a, b: (keys[a:b], valid[a:b]), inputs.sink)

    @staticmethod
    def _decode_index_scores(indexer, q_res, x, keys, cos, sin) -> torch.Tensor:
        return indexer_scores_tiled(indexer, q_res, x, keys, cos, sin)

    @staticmethod
    def _attend_one(spec: LayerSpec, chunk: PrefillChunk, q, kv, sink, cache: V4KVCache, extra) -> torch.Tensor:
        W = spec.window
        geo = chunk.windows[W]
        ring = cache.window_kv[spec.layer_idx, chunk.slot]  # [W, D]
        hist = ring[geo.hist_rows].to(kv.dtype)
        keys = torch.cat([hist, kv], dim=0)  # [W - 1 + n, D]
        windows = keys.unfold(0, W, 1).transpose(1, 2)  # [n, W, D] oldest first

        def keys_fn(a: int, b: int):
            win, valid = _pad_keys(windows[a:b], geo.allowed[a:b])
            if extra is None:
                return win, valid
            entries, mask = extra  # [C, D], [n, C]
            ent = entries.to(q.dtype)[None].expand(b - a, -1, -1)
            return torch.cat([win, ent], dim=1), torch.cat([valid, mask[a:b]], dim=1)

        o = attend_blocks(q, keys_fn, sink)
        ring[geo.tail_rows] = kv[-geo.tail_rows.shape[0]:]
        return o

    @staticmethod
    def _prefill_index_mask(indexer, q_res, x, keys, visible, cos, sin) -> torch.Tensor:
        n = q_res.shape[0]
        return indexer.select_topk(indexer_scores_tiled(indexer, q_res, x, keys[None].expand(n, -1, -1), cos, sin),
                                   visible)


# --------------------------------------------------------------------------- MoE


class BatchInvariantMoEBackend(MoEBackend):
    """Routed experts with a per-token order fixed by the token alone: each expert runs over its tokens
    (rows padded by the mode's matmul), each (token, slot) result lands in its own row, and a token's
    experts are added in ascending expert id, one elementwise add at a time (no `index_add_`)."""

    batch_invariant_safe = True
    name = "torch_batch_invariant"

    def __init__(self) -> None:
        self.experts: Sequence[nn.Module] = ()
        self.expert_fn: ExpertFn = call_expert

    def prepare(self, experts: Sequence[nn.Module]) -> None:
        self.experts, self.expert_fn = experts, expert_fn_for(experts)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        T, k = topk_ids.shape
        order = torch.argsort(topk_ids, dim=1, stable=True)  # a token's slots in ascending expert id
        ids = topk_ids.gather(1, order).reshape(-1)  # [T*k]
        w = topk_weights.gather(1, order).reshape(-1).to(x.dtype)
        y = x.new_zeros(T * k, x.shape[-1])
        perm = torch.argsort(ids, stable=True)
        counts = torch.bincount(ids, minlength=len(self.experts)).tolist()
        off = 0
        for e, c in enumerate(counts):
            if c == 0:
                continue
            pairs = perm[off:off + c]
            y[pairs] = self.expert_fn(self.experts[e], x[pairs // k]) * w[pairs, None]
            off += c
        y = y.view(T, k, -1)
        out = y[:, 0]
        for j in range(1, k):
            out = out + y[:, j]
        return out


# --------------------------------------------------------------------------- the Triton fast path in the mode


@dataclass
class _ChunkRows:
    """A step's prefill chunks as rows of `bi_rows_attention` (every query a row at its own position), shared by
    the layers of one compressor geometry (built once per step)."""

    idx: torch.Tensor  # [n] the queries' rows in the step's flat batch, chunk after chunk
    pos: torch.Tensor  # [n] their positions
    slots: torch.Tensor  # [n] their requests' slots
    state_start: torch.Tensor  # [n] their requests' state starts
    new_start: torch.Tensor  # [n] their chunk's first position (keys from there on are the step's own)
    chunk: torch.Tensor  # [n] their chunk's index in the step
    chunk_tables: torch.Tensor  # [num_chunks, max_blocks_per_seq] each request's entry blocks, dummy-padded

    def tables(self, a: int, b: int) -> torch.Tensor:
        """[b - a, max_blocks_per_seq] the block tables of rows a .. b - 1 (contiguous, as the kernels read them)."""
        return self.chunk_tables[self.chunk[a:b]]


@dataclass
class _WindowRows:
    """A prefill chunk's completed windows as the `compressor_decode` kernel's rows (what `_compress` reads of a
    `DecodeRows`): window w's row ends it at position (w + 1) * rate - 1, in slot j of a per-window ring."""

    slots: torch.Tensor  # [nw] 0 .. nw - 1
    pos: torch.Tensor  # [nw]
    frozen: torch.Tensor  # [nw] zeros: the chunk's windows exclude frozen ones already
    block_tables: torch.Tensor  # [nw, max_blocks_per_seq] the request's
    entry_rope: dict[int, tuple[torch.Tensor, torch.Tensor]]  # rate -> cos, sin at each window's first position


ROWS_BUDGET_BYTES = 256 << 20
"""Transient bytes one `bi_rows_attention` / `indexer_topk` launch over prefill rows may take (block tables, index
scores, split partials): a step's prefill rows run in slices that fit. A row's result does not depend on its slice."""


class BatchInvariantTritonAttentionBackend(TritonAttentionBackend):
    """The `triton` backend's kernels with one attention path per position: decode rows and every query of every
    prefill chunk are rows of `bi_rows_attention` (`kernels.bi_attention`: the decode kernel, keys split by a fixed
    count, splits combined in order, the window's newest keys read from the step's own K=V rows), each row's block
    table padded to `max_blocks_per_seq` so every launch compiles the same kernel; the indexer's top-k per row with
    `indexer_topk` over the same padded tables (decode and prefill alike); every compressor entry from the
    `compressor_decode` kernel, one program an entry (decode rows over the compressor rings, as the `triton` backend;
    a prefill chunk's windows over a ring built per window, `_chunk_compress`). CUDA-graph safe (decode rows are the
    `triton` backend's but for the attention launch: static metadata, no host sync).

    Not used: the prefill kernel (`prefill_attention`: another reduction order) and the torch compressor path
    (`compress_gathered`: its bf16 roundings differ from the kernel's float32 sums).
    Verify chunks of speculative decoding run as prefill chunks (`supports_verify_rows = False`), so a verified
    position gets the bits of a decode step; decode rows of host-built metadata (the MTP layer's builder) take the
    torch per-query tiles of `BatchInvariantAttentionBackend` (only the drafts depend on them)."""

    batch_invariant_safe = True
    supports_verify_rows = False
    name = "triton_batch_invariant"

    def __init__(self, impl: str | None = None) -> None:
        # NOTE: under TRITON_INTERPRET=1 the kernels (the CPU default is the torch references, whose einsums the mode
        # refuses); on CUDA they are the default
        super().__init__(impl or ("triton" if os.environ.get("TRITON_INTERPRET") == "1" else None))
        self._rows_ops: dict[torch.device, object] = {}
        self._rows_meta: AttentionMetadata | None = None
        self._rows: dict[tuple[int, bool], _ChunkRows] = {}

    def rows_op(self, device: torch.device):
        """`bi_rows_attention`'s implementation for tensors on `device` (picked once per device)."""
        op = self._rows_ops.get(device)
        if op is None:
            op = get_op("bi_rows_attention", self.impl or default_impl("bi_rows_attention", device))
            self._rows_ops[device] = op
        return op

    _decode_index_scores = staticmethod(indexer_scores_tiled)  # host-built decode rows (the MTP layer's)

    def _decode_batched(self, spec: LayerSpec, dm: DecodeRows, inputs: AttentionInputs, r,
                        cache: V4KVCache) -> torch.Tensor:
        if not dm.is_static:
            return BatchInvariantAttentionBackend._decode_batched(self, spec, dm, inputs, r, cache)
        ops = self.ops_for(inputs.q.device)
        ring = cache.window_kv[spec.layer_idx]  # [slots, W, D]
        q = inputs.q[r].to(ring.dtype).contiguous()  # [B, NH, D]
        kv = inputs.kv[r].to(ring.dtype).contiguous()  # [B, D]
        ops.ring_write(ring, dm.slots, dm.pos, kv)
        pool = entries = None
        if spec.is_compressed:
            rate = spec.compress_rate
            pool, buf_kv, buf_gate, ipool, ibuf_kv, ibuf_gate = _pools(spec, cache)
            self._compress(ops, spec, dm, inputs.compressor, inputs.compressor_kv[r], inputs.compressor_gate[r],
                           buf_kv, buf_gate, pool)
            if spec.has_indexer:
                indexer = inputs.indexer
                self._compress(ops, spec, dm, indexer.compressor, inputs.index_kv[r], inputs.index_gate[r], ibuf_kv,
                               ibuf_gate, ipool)
                cos, sin = dm.rope[spec.rope]
                entries = self._select(ops, indexer, inputs.q_res[r], inputs.x[r], cos, sin, ipool, dm.pos,
                                       dm.block_tables, rate)
        out = self.rows_op(q.device)(q, ring, pool, dm.slots, dm.pos, dm.state_start, dm.block_tables, entries,
                                     spec.compress_rate if pool is not None else 0, inputs.sink.float(), kv, dm.pos,
                                     self.split_size)
        return out.to(inputs.q.dtype)

    @staticmethod
    def _select(ops, indexer, q_res, x, cos, sin, ipool, pos, tables, rate) -> torch.Tensor:
        """The indexer's top-k entry indices [n, topk] of n rows (`indexer_topk`, each row at its own position)."""
        qi = indexer._queries(q_res, cos, sin).to(ipool.dtype).contiguous()  # [n, IH, ID]
        weights = (indexer.weights_proj(x).float() * indexer.num_heads**-0.5).contiguous()
        return ops.indexer_topk(qi, weights, ipool, pos, tables, rate, indexer.topk)

    def forward(self, spec: LayerSpec, inputs: AttentionInputs, cache: V4KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        """Decode rows as `_decode_batched`; then every prefill chunk's compressors (entries written first), and
        over every chunk's queries (in slices of `ROWS_BUDGET_BYTES`, usually one) the indexer's selection and one
        `bi_rows_attention` launch; then the chunks' last keys into their rings."""
        if not meta.prefill:
            return TorchAttentionBackend.forward(self, spec, inputs, cache, meta)
        out = TorchAttentionBackend.forward(self, spec, inputs, cache, dataclasses.replace(meta, prefill=[]))
        rows = self._chunk_rows(spec, meta, cache)
        ring = cache.window_kv[spec.layer_idx]  # [slots, W, D]
        dt = ring.dtype
        ops, attend = self.ops_for(inputs.q.device), self.rows_op(inputs.q.device)
        pool = ipool = None
        rate = spec.compress_rate if spec.is_compressed else 0
        if spec.is_compressed:
            key = (rate, spec.is_overlap)
            pool, buf_kv, buf_gate, ipool, ibuf_kv, ibuf_gate = _pools(spec, cache)
            for k, c in enumerate(meta.prefill):  # every chunk's new entries into the pools first
                geo, sl, table = c.compressors[key], c.rows, rows.chunk_tables[k]
                self._chunk_compress(ops, spec, c.slot, geo, table, inputs.compressor, inputs.compressor_kv[sl],
                                     inputs.compressor_gate[sl], buf_kv, buf_gate, pool)
                if spec.has_indexer:
                    self._chunk_compress(ops, spec, c.slot, geo, table, inputs.indexer.compressor,
                                         inputs.index_kv[sl], inputs.index_gate[sl], ibuf_kv, ibuf_gate, ipool)
        n, NH, D = rows.idx.shape[0], inputs.q.shape[1], inputs.q.shape[2]
        MB = rows.chunk_tables.shape[1]
        epb = pool.shape[1] if pool is not None else 1
        max_comp = (inputs.indexer.topk if ipool is not None else MB * epb) if pool is not None else 0
        splits = -(-(spec.window + max_comp) // self.split_size)
        # a row's block table, index scores (CSA) and split partials (rows of several splits)
        per_row = MB * 8 + (MB * epb * 4 if ipool is not None else 0) + (splits * NH * (D + 2) * 4 if splits > 1 else 0)
        step = max(1, min(n, ROWS_BUDGET_BYTES // per_row))
        kv = inputs.kv[rows.idx].to(dt).contiguous()  # [n, D] every prefill row's K=V (a slice reads earlier ones)
        for a in range(0, n, step):
            b = min(n, a + step)
            i, tables = rows.idx[a:b], rows.tables(a, b)
            entries = None
            if ipool is not None:
                cos, sin = meta.rope[spec.rope]
                entries = self._select(ops, inputs.indexer, inputs.q_res[i], inputs.x[i], cos[i], sin[i], ipool,
                                       rows.pos[a:b], tables, rate)
            o = attend(inputs.q[i].to(dt).contiguous(), ring, pool, rows.slots[a:b], rows.pos[a:b],
                       rows.state_start[a:b], tables, entries, rate, inputs.sink.float(), kv, rows.new_start[a:b],
                       self.split_size, new_off=a)
            out[i] = o.to(out.dtype)
        for c in meta.prefill:  # after the kernel has read the history
            tail = c.windows[spec.window].tail_rows
            ring[c.slot, tail] = inputs.kv[c.rows][-tail.shape[0]:].to(dt)
        return out

    def _chunk_compress(self, ops, spec: LayerSpec, slot: int, geo, table: torch.Tensor, comp, kv: torch.Tensor,
                        gate: torch.Tensor, buf_kv: torch.Tensor, buf_gate: torch.Tensor, pool: torch.Tensor) -> None:
        """A prefill chunk's compressor (`ChunkCompressor` `geo`): each window it completes is emitted by the
        `compressor_decode` kernel as the decode row of the window's last token would emit it, over a ring of its own
        (`[nw, ring_len, width]`: the window's tokens, and the previous window's with overlap, at their ring rows,
        rounded to the ring's dtype as a decode row's are); then the chunk's last tokens into the slot's ring.
        `table`: the request's block table (padded), so the kernel finds each window's pool row."""
        kv, gate = kv.to(buf_kv.dtype), gate.to(buf_gate.dtype)
        nw = geo.windows.numel()
        if nw:
            if geo.hist_rows is not None:  # the buffered tokens before the chunk, then the chunk's
                span_kv = torch.cat([buf_kv[slot, geo.hist_rows], kv])
                span_gate = torch.cat([buf_gate[slot, geo.hist_rows], gate])
            else:
                span_kv, span_gate = kv, gate
            rate, ring_len, width = spec.compress_rate, buf_kv.shape[1], buf_kv.shape[2]
            w = geo.windows  # [nw]
            cur = w[:, None] * rate + torch.arange(rate, device=w.device)[None, :]  # [nw, rate] positions
            j = torch.arange(nw, device=w.device)[:, None]
            ring_kv = buf_kv.new_zeros((nw, ring_len, width))
            ring_gate = buf_gate.new_zeros((nw, ring_len, width))
            ring_kv[j, cur % ring_len], ring_gate[j, cur % ring_len] = span_kv[geo.cur_rows], span_gate[geo.cur_rows]
            if comp.overlap:  # window w - 1's tokens (window -1's are masked by the kernel)
                prev = (cur - rate) % ring_len
                ring_kv[j, prev], ring_gate[j, prev] = span_kv[geo.prev_rows], span_gate[geo.prev_rows]
            last = (w + 1) * rate - 1
            rows = _WindowRows(slots=j[:, 0].contiguous(), pos=last.contiguous(), frozen=torch.zeros_like(last),
                               block_tables=table[None].expand(nw, -1).contiguous(), entry_rope={rate: geo.entry_rope})
            i = j[:, 0]
            self._compress(ops, spec, rows, comp, ring_kv[i, last % ring_len], ring_gate[i, last % ring_len], ring_kv,
                           ring_gate, pool)
        keep = geo.tail_rows.shape[0]
        buf_kv[slot, geo.tail_rows] = kv[-keep:]
        buf_gate[slot, geo.tail_rows] = gate[-keep:]

    def _chunk_rows(self, spec: LayerSpec, meta: AttentionMetadata, cache: V4KVCache) -> _ChunkRows:
        """The step's `_ChunkRows` for the layer's compressor geometry (sliding layers: any; their tables are never
        read), built once per step and geometry."""
        if self._rows_meta is not meta:
            self._rows_meta, self._rows = meta, {}
        key = (spec.compress_rate, spec.is_overlap) if spec.is_compressed else (0, False)
        rows = self._rows.get(key)
        if rows is not None:
            return rows
        device, chunks = meta.positions.device, meta.prefill
        MB, dummy = cache.max_blocks_per_seq, cache.dummy_block
        idx = torch.cat([torch.arange(c.start, c.start + c.num_tokens, device=device) for c in chunks])
        counts = torch.tensor([c.num_tokens for c in chunks], device=device)

        def per_row(values) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device).repeat_interleave(counts)

        tables = []
        for c in chunks:
            geo = c.compressors.get(key)
            blocks = (geo.entry_rows[::cache.block_size // key[0]] // (cache.block_size // key[0])
                      if geo is not None and geo.entry_rows is not None else idx.new_zeros(0))
            tables.append(torch.cat([blocks, blocks.new_full((MB - blocks.shape[0],), dummy)]))  # [MB]
        rows = _ChunkRows(idx=idx, pos=meta.positions[idx].contiguous(), slots=per_row([c.slot for c in chunks]),
                          state_start=per_row([c.state_start for c in chunks]),
                          new_start=per_row([c.num_computed_tokens for c in chunks]),
                          chunk=per_row(list(range(len(chunks)))), chunk_tables=torch.stack(tables))
        self._rows[key] = rows
        return rows


BI_MOE_UP_CONFIG = (32, 32, 128, 4, 4, 0)
"""The batch-invariant MoE's one tile config of `moe_up` (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, swap): never
chosen by the rows per expert (the `triton` backend's tuned pick is, and another tile is another reduction)."""
BI_MOE_DOWN_CONFIG = (32, 64, 128, 4, 4, 0)
"""Likewise for `moe_down`."""


class BatchInvariantTritonMoEBackend(TritonMoEBackend):
    """The `triton` MoE backend with one tile config for every batch (`BI_MOE_UP_CONFIG`, `BI_MOE_DOWN_CONFIG`) and
    never the `_grouped_mm` route: a (token, expert) row's projections are the same `tl.dot` steps over K whatever
    rows share its expert's tile (no split-K; rows are independent in the MMA), and the combine adds a token's experts
    in ascending expert id (`moe_combine`). No host sync: CUDA-graph safe. Needs the Triton kernels (CUDA, or the CPU
    under `TRITON_INTERPRET=1`)."""

    batch_invariant_safe = True
    name = "triton_batch_invariant"

    def __init__(self) -> None:
        super().__init__()
        self.grouped_mm_min_rows = 0

    def prepare(self, experts: Sequence[nn.Module]) -> None:
        super().prepare(experts)
        if self.impl_name != "triton":
            raise ValueError("batch_invariant=True: the 'triton' MoE backend's kernels do not run on "
                             f"{self.w13[0].device} (CUDA, or the CPU under TRITON_INTERPRET=1); use moe_backend='torch'")
        self.grouped_mm_usable = self.fp4_route_usable = False

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        dtype, topk_ids = x.dtype, topk_ids.contiguous()
        x = self.prepare_input(x).contiguous()
        sorted_pairs, counts = self._align(topk_ids, self.w13[0].shape[0])  # [T*k], [E] on the device
        act = self._up(x, self.w13, sorted_pairs, counts, topk_ids.shape[1], self.limit, self.wfmt, self.block,
                       config=BI_MOE_UP_CONFIG)
        act = self.prepare_input(act.to(dtype)).contiguous()
        y = self._down(act, self.w2, sorted_pairs, counts, topk_weights.contiguous(), self.wfmt, self.block,
                       config=BI_MOE_DOWN_CONFIG).to(dtype)
        return self._combine(y, topk_ids)  # [T, H]


# --------------------------------------------------------------------------- DeepSeek-V4.1's paged attention


def v41_index_scores_tiled(indexer, x: torch.Tensor, qr: torch.Tensor, keys: torch.Tensor, cos, sin) -> torch.Tensor:
    """V4.1's indexer scores [n, C] (`deepseek_v41.Indexer.scores`' math) with an order fixed per query: keys [C, d]
    (a prefill chunk's, shared) or [n, C, d] (decode rows', each its own). Each (query, key tile) product has one
    shape, the heads are weighted then summed by `tree_sum`; queries go QUERY_BLOCK at a time (each block copies
    its keys per query: a chunk's shared keys are not broadcast into the product, whose path could differ)."""
    n = x.shape[0]
    q = apply_rope(indexer.wq_b(qr).view(n, indexer.num_heads, indexer.head_dim), cos, sin).float()  # [n, h, d]
    w = indexer.weights_proj(x).float() * (indexer.head_dim ** -0.5 * indexer.num_heads ** -0.5)  # [n, h]
    C = keys.shape[-2]
    outs = []
    for a in range(0, n, QUERY_BLOCK):
        b = min(n, a + QUERY_BLOCK)
        k = keys[a:b] if keys.dim() == 3 else keys[None].expand(b - a, -1, -1)
        kp, _ = _pad_keys(k.float(), torch.ones(k.shape[:2], dtype=torch.bool, device=k.device))
        s = torch.relu(_tile_logits(q[a:b], kp))  # [b - a, T, h, KT]
        s = tree_sum(s * w[a:b, None, :, None], 2)  # [b - a, T, KT]
        outs.append(s.reshape(b - a, -1)[:, :C])
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def v41_attn_output(attn, out: torch.Tensor, cos, sin) -> torch.Tensor:
    """`deepseek_v41.Attention.output` without its einsum: rotate back, the grouped `wo_a` as one batched matmul over
    the groups ([G, T, NH*D/G] @ [G, NH*D/G, R]: rows padded by the mode), then `wo_b`."""
    T = out.shape[0]
    grouped = apply_rope(out, cos, -sin).reshape(T, attn.groups, -1).transpose(0, 1)  # [G, T, NH*D/G]
    w = attn.wo_a.weight.view(attn.groups, -1, grouped.shape[-1])  # [G, R, NH*D/G]
    y = _mm(grouped.contiguous(), w.transpose(1, 2).contiguous())  # [G, T, R]
    return attn.wo_b(y.transpose(0, 1).reshape(T, -1))


class BatchInvariantPagedAttention(PagedAttention):
    """DeepSeek-V4.1's paged attention (`deepseek_v41.PagedAttention`: its cache I/O, KV-source ownership, published
    selections and candidate masks unchanged) with one per-query computation for decode rows and prefill chunks
    alike, so a position's bits do not depend on which path, batch or chunk computes it:

    * attention: `attend_tiled` over the window keys oldest first (padded to a tile boundary) then the KV source's
      entries by entry index; a decode row reads its ring in position order (the `torch` path reads ring order)
      and attends in the cache's dtype, as a prefill chunk does;
    * the indexer: `v41_index_scores_tiled` (fixed tiles; a decode row's width, the most entries any row of the
      batch sees, only adds masked columns, which neither the top-k nor the candidate filter picks);
    * the grouped output projection: `v41_attn_output` (no einsum);
    * a KV source's compressor: a prefill chunk's projections are rounded to the buffer's dtype before its groups
      pool them, as a decode row's (written to the buffer, read back) are; a no-op in float32.
    """

    name = "v41-torch-batch-invariant"
    batch_invariant_safe = True

    @staticmethod
    def _decode_attend(q, kv, sink, ring, dm, W: int, extra) -> torch.Tensor:
        dt = ring.dtype
        ring[dm.slots, dm.window_rows[W]] = kv.to(dt)
        j = torch.arange(W, device=q.device)
        key_pos = dm.pos[:, None] - (W - 1) + j[None, :]  # [B, W] oldest first
        win, valid = _pad_keys(ring[dm.slots[:, None], key_pos % W], key_pos >= dm.state_start[:, None])
        if extra is not None:
            entries, mask = extra  # [B, C, D], [B, C]
            keys, valid = torch.cat([win, entries.to(dt)], dim=1), torch.cat([valid, mask], dim=1)
        else:
            keys = win
        # NOTE: q in the cache's dtype, as `PagedAttention.__call__` hands a prefill chunk's queries over (the
        # result is in that dtype too, cast back exactly)
        return attend_blocks(q.to(dt), lambda a, b: (keys[a:b], valid[a:b]), sink).to(q.dtype)

    _attend_chunk = staticmethod(BatchInvariantAttentionBackend._attend_one)

    @staticmethod
    def _output(attn, out: torch.Tensor, cos, sin) -> torch.Tensor:
        return v41_attn_output(attn, out, cos, sin)

    @staticmethod
    def _index_scores(indexer, x, qr, keys, cos, sin) -> torch.Tensor:
        return v41_index_scores_tiled(indexer, x, qr, keys, cos, sin)

    @staticmethod
    def _chunk_projections(kvp: torch.Tensor, gp: torch.Tensor | None, dtype: torch.dtype):
        rounded = [None if t is None else t.to(dtype).to(t.dtype) for t in (kvp, gp)]
        return rounded[0], rounded[1]


def _enable_v41(model: nn.Module, device: torch.device) -> None:
    """`enable_batch_invariant` for a `DeepseekV41ForCausalLM` (its paged step; `forward_full` is the test reference
    and keeps its einsums): the invariant paged attention, invariant MoE backends (backbone and DSpark stages), the
    quantized linears' torch references on CUDA, and the mode around `forward` / `compute_logits`."""
    from deepinfer.engine.quant.linear import _QuantLinear

    for i, layer in enumerate(model.layers):
        if type(layer.attn.wo_a) is not nn.Linear:
            raise ValueError(f"batch_invariant=True: layer {i}'s attn.wo_a is a {type(layer.attn.wo_a).__name__}; the "
                             "mode's grouped output projection needs its float weight (v41_attn_output)")
    for layer in list(model.layers) + list(model.mtp or ()):
        ffn = layer.ffn
        ffn.backend = _swap_moe(ffn.backend)
        ffn.backend.prepare(ffn.experts)
        ffn._prepared_ptr = ffn.experts[0].w1.weight.data_ptr()
    if device.type == "cuda":
        for mod in model.modules():
            if isinstance(mod, _QuantLinear):
                # NOTE: as for V4: the Triton FP8/FP4 GEMMs choose split-K by M; the torch references go through
                # the mode's fixed-tile matmul
                mod.select_impl("torch")
    model.backend = BatchInvariantPagedAttention()
    model.numerics = BatchInvariantMode
    model.is_batch_invariant = True


# --------------------------------------------------------------------------- enabling the mode


TRITON_INVARIANT_OPS = frozenset({"rms_norm", "rope", "swiglu", "sinkhorn", "attn_norm_rope", "mhc_pre", "mhc_post",
                                  "mhc_head"})
"""`OpTable` ops whose `"triton"` kernel the mode keeps (where the device picked it): each computes a row (token,
or token x head) with a tiling fixed by the row's width alone, never by the number of rows, so a row's bits do not
depend on its batch. `rms_norm`: one program a row; `rope`, `swiglu`: elementwise; `sinkhorn`: `BLOCK_T` rows a
program, each row's iterations in registers; `attn_norm_rope`: 4 rows a program, a row's sum of squares alone (its
ring write is a plain store); `mhc_pre` / `mhc_head` / `mhc_post`: a fixed split of the hc*H columns (`K_SLICE`),
the partials added in split order, float32 IEEE dots (FMA chains in k order on the GPU), a token's mix in registers;
the cuBLAS projection route (T >= MATMUL_MIN_T) is never taken inside `BatchInvariantMode` (`kernels.mhc._proj_route`).
Not here: `attn_out_proj`'s kernel (tiles chosen by T, a torch fallback past a size); see `KEPT_OP_IMPLS`."""

KEPT_OP_IMPLS = {**{op: "triton" for op in TRITON_INVARIANT_OPS}, "attn_out_proj": "rope_bmm"}
"""op -> the implementation the mode keeps where the device picked it (every other op, or another implementation,
takes the torch reference through the mode): the Triton kernels above, and `attn_out_proj`'s "rope_bmm" (the inverse
RoPE as an elementwise Triton launch, then a `torch.bmm` that the mode routes through its fixed-tile matmul)."""


def _swap_attention(backend, cache: dict):
    if id(backend) in cache:
        return cache[id(backend)]
    if type(backend) is TorchAttentionBackend:
        new = BatchInvariantAttentionBackend()
    elif type(backend) is TritonAttentionBackend:
        new = BatchInvariantTritonAttentionBackend(backend.impl)
    elif getattr(backend, "batch_invariant_safe", False):
        new = backend
    else:
        raise ValueError(
            f"batch_invariant=True: the attention backend {type(backend).__name__} ({backend.name!r}) is not batch "
            "invariant (it does not declare batch_invariant_safe = True); use attention_backend='triton' (CUDA) or "
            "'torch', or turn batch_invariant off")
    cache[id(backend)] = new
    return new


def _swap_moe(backend: MoEBackend) -> MoEBackend:
    if type(backend) in (TorchMoEBackend, TorchLoopMoEBackend):
        return BatchInvariantMoEBackend()
    if type(backend) is TritonMoEBackend:
        return BatchInvariantTritonMoEBackend()
    if getattr(backend, "batch_invariant_safe", False):
        return backend
    raise ValueError(
        f"batch_invariant=True: the MoE backend {type(backend).__name__} ({backend.name!r}) is not batch invariant "
        "(a token's result depends on how many tokens its experts received, or its combine order is not fixed); "
        "use moe_backend='triton' (CUDA) or 'torch', or turn batch_invariant off")


def check_device(device: torch.device) -> None:
    """Refuse a device without a batch-invariant matmul (CUDA needs Triton for `kernels.bi_matmul`)."""
    if device.type == "cpu":
        return
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            raise ValueError("batch_invariant=True on CUDA needs Triton (kernels/bi_matmul.py: the fixed-tile "
                             "matmul); install triton or turn batch_invariant off") from None
        return
    raise ValueError(f"batch_invariant=True is implemented for cpu and cuda, not {device.type}")


def enable_batch_invariant(model: nn.Module) -> None:
    """Switch a loaded `DeepseekV4ForCausalLM` (or `DeepseekV41ForCausalLM`: `_enable_v41`) to batch-invariant
    numerics, in place (once, after loading).

    Raises ValueError naming the op when a part cannot be made invariant: an attention or MoE backend
    other than `torch` that does not declare `batch_invariant_safe = True`, or a device without an
    invariant matmul.
    """
    from deepinfer.engine.models.deepseek_v4 import MoE
    from deepinfer.engine.quant.linear import _QuantLinear

    device = next(model.parameters()).device
    check_device(device)
    if hasattr(model, "decoder_replay"):  # DeepSeek-V4.1 (`deepseek_v41.DeepseekV41ForCausalLM`)
        _enable_v41(model, device)
        return
    swapped: dict = {}
    for mod in model.modules():
        if isinstance(mod, MoE):
            mod.backend = _swap_moe(mod.backend)
            mod.prepare()
        elif hasattr(mod, "backend") and hasattr(mod, "spec"):  # an attention layer
            mod.backend = _swap_attention(mod.backend, swapped)
        elif isinstance(mod, _QuantLinear) and device.type == "cuda":
            # NOTE: the Triton FP8/FP4 GEMMs choose split-K by M; the torch reference dequantizes a block
            # and multiplies through the mode's fixed-tile matmul.
            mod.select_impl("torch")
    inner = model.model
    inner.attention_backend = _swap_attention(inner.attention_backend, swapped)
    # NOTE: a small op keeps its Triton kernel where that kernel's tiling is fixed per row (`KEPT_OP_IMPLS`); every
    # other one takes its torch reference, which runs through the mode (the numpy Sinkhorn hands large batches to
    # torch: two implementations by batch size; `attn_out_proj`'s kernel picks its tiles by T).
    for op, impl in list(inner.ops.impl_names.items()):
        if KEPT_OP_IMPLS.get(op) == impl:
            inner.ops.overrides[op] = impl
            continue
        if "torch" not in op_impl_names(op):
            raise ValueError(f"batch_invariant=True: the op {op!r} has no torch implementation to make invariant")
        inner.ops.overrides[op] = "torch"
    inner.ops.select(device)
    model.numerics = BatchInvariantMode
    model.is_batch_invariant = True


def check_config(attention_backend: str, moe_backend: str, device: str) -> None:
    """Refuse, before anything loads, a configuration whose backends or device cannot be batch invariant
    (a ValueError naming the op and saying how to fix it). The `triton` backends are accepted where their kernels
    run (CUDA, or the CPU under TRITON_INTERPRET=1): the mode swaps them for their invariant variants."""
    from deepinfer.engine.attention import get_attention_backend
    from deepinfer.engine.moe import get_moe_backend

    kernels_run = torch.device(device).type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    attn = get_attention_backend(attention_backend)
    if attn is TritonAttentionBackend and not kernels_run:
        raise ValueError(f"batch_invariant=True: attention backend 'triton' runs its invariant kernels on CUDA only "
                         f"(device {device!r}); use attention_backend='torch'")
    if (attn not in (TorchAttentionBackend, TritonAttentionBackend)
            and not getattr(attn, "batch_invariant_safe", False)):
        raise ValueError(f"batch_invariant=True: attention backend {attention_backend!r} is not batch invariant (it "
                         "does not declare batch_invariant_safe = True); use attention_backend='triton' (CUDA) or "
                         "'torch'")
    moe = get_moe_backend(moe_backend)
    if moe is TritonMoEBackend and not kernels_run:
        raise ValueError(f"batch_invariant=True: MoE backend 'triton' runs its invariant kernels on CUDA only (device "
                         f"{device!r}); use moe_backend='torch'")
    if (moe not in (TorchMoEBackend, TorchLoopMoEBackend, TritonMoEBackend)
            and not getattr(moe, "batch_invariant_safe", False)):
        raise ValueError(f"batch_invariant=True: MoE backend {moe_backend!r} is not batch invariant (it does not "
                         "declare batch_invariant_safe = True); use moe_backend='triton' (CUDA) or 'torch'")
    check_device(torch.device(device))
