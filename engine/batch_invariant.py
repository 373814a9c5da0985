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
`kernels.bi_matmul`, a Triton GEMM with one fixed tiling and no split-K. The quantized linears take
their `torch` reference (dequantize a block, matmul through the mode), since the Triton FP8/FP4
GEMMs choose split-K by M; softmax, log_softmax, sums and RMSNorm reduce by `tree_sum` (CUDA's reduction
kernels pick their thread split by the number of outputs). NOTE: the CUDA path is written but was not run
on a GPU yet (tests/engine/test_batch_invariance.py has the `gpu` tests that check it).

Cost: the mode is slower (every torch call of the forward passes through the mode; matmuls of fewer than
16 rows compute 16; attention copies each query's keys). The `MoE` backend reads the experts' token counts
on the host, so it is not CUDA-graph safe: decode steps run eagerly in the mode.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from deepinfer.engine.attention.base import (
    AttentionInputs,
    DecodeRows,
    LayerSpec,
    PrefillChunk,
)
from deepinfer.engine.attention.torch_backend import TorchAttentionBackend
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
from deepinfer.kernels.registry import op_impl_names

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


def _swap_attention(backend, cache: dict):
    if id(backend) in cache:
        return cache[id(backend)]
    if type(backend) is TorchAttentionBackend:
        new = BatchInvariantAttentionBackend()
    elif getattr(backend, "batch_invariant_safe", False):
        new = backend
    else:
        raise ValueError(
            f"batch_invariant=True: the attention backend {type(backend).__name__} ({backend.name!r}) is not batch "
            "invariant (it does not declare batch_invariant_safe = True); use attention_backend='torch' or turn "
            "batch_invariant off")
    cache[id(backend)] = new
    return new


def _swap_moe(backend: MoEBackend) -> MoEBackend:
    if type(backend) in (TorchMoEBackend, TorchLoopMoEBackend):
        return BatchInvariantMoEBackend()
    if getattr(backend, "batch_invariant_safe", False):
        return backend
    raise ValueError(
        f"batch_invariant=True: the MoE backend {type(backend).__name__} ({backend.name!r}) is not batch invariant "
        "(a token's result depends on how many tokens its experts received, or its combine order is not fixed); "
        "use moe_backend='torch' or turn batch_invariant off")


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
    # NOTE: every small op (mHC, Sinkhorn) takes its torch reference, which runs through the mode: the numpy
    # Sinkhorn hands large batches to torch (two implementations by batch size), the Triton ones are unchecked.
    for op in list(inner.ops.impl_names):
        if "torch" not in op_impl_names(op):
            raise ValueError(f"batch_invariant=True: the op {op!r} has no torch implementation to make invariant")
        inner.ops.overrides[op] = "torch"
    inner.ops.select(device)
    model.numerics = BatchInvariantMode
    model.is_batch_invariant = True


def check_config(attention_backend: str, moe_backend: str, device: str) -> None:
    """Refuse, before anything loads, a configuration whose backends or device cannot be batch invariant
    (a ValueError naming the op and saying how to fix it)."""
    from deepinfer.engine.attention import get_attention_backend
    from deepinfer.engine.moe import get_moe_backend

    attn = get_attention_backend(attention_backend)
    if attn is not TorchAttentionBackend and not getattr(attn, "batch_invariant_safe", False):
        raise ValueError(f"batch_invariant=True: attention backend {attention_backend!r} is not batch invariant (it "
                         "does not declare batch_invariant_safe = True); use attention_backend='torch'")
    moe = get_moe_backend(moe_backend)
    if moe not in (TorchMoEBackend, TorchLoopMoEBackend) and not getattr(moe, "batch_invariant_safe", False):
        raise ValueError(f"batch_invariant=True: MoE backend {moe_backend!r} is not batch invariant (it does not "
                         "declare batch_invariant_safe = True); use moe_backend='torch'")
    check_device(torch.device(device))
