"""Fused mHC (hyper-connection) mixing: ops `"mhc_pre"`, `"mhc_post"` and `"mhc_head"`.

A V4 layer keeps `hc` residual streams per token, [T, hc, H]. Around each block (attention, MoE):

  * pre-mix (`mhc_pre`): the streams, flattened to [T, hc*H] and RMS-normalised (no weight), are
    projected by `fn` [(2+hc)*hc, hc*H] to the mixing logits; with `scale` [3] and `base`:
    pre = sigmoid(.) + eps [T, hc], post = 2 * sigmoid(.) [T, hc], comb = Sinkhorn(softmax(.) + eps)
    [T, hc, hc]; the block's input is collapsed = sum_j pre_j * stream_j [T, H] (streams' dtype);
  * post-mix (`mhc_post`): new stream k = post_k * y + sum_j comb[j, k] * stream_j, y the block's output;
  * head (`mhc_head`, the model's final `HyperHead`): only `pre` (fn [hc, hc*H], scale [1]), collapsed.

Implementations:
  * `"torch"`: the reference, exactly the model's code before it called these ops (`hc_weights_torch`,
    `hc_collapse_torch`, and the two lines of `DecoderLayer._mix`): the CPU path is unchanged bit for bit,
    with the Sinkhorn implementation of the model's `OpTable` passed in. Autograd.
  * `"triton"`: `mhc_pre` / `mhc_head` in two launches: `_mhc_proj_kernel` splits the hc*H columns across
    programs (`K_SLICE` each: decode's few tokens still spread the 1.5 MB `fn` of V4-Flash over SMs),
    each writing its partial sum of squares and partial projection (float32, IEEE dot); `_mhc_mix_kernel`
    adds the partials in split order (deterministic), scales by the RMS, applies sigmoid / softmax, runs
    the Sinkhorn iterations in registers (`kernels.sinkhorn._ordered_sum`, the order of the "triton"
    Sinkhorn) and collapses the streams. `mhc_post` is one launch. CUDA, or the CPU under
    `TRITON_INTERPRET=1`; a call that needs a gradient takes the torch reference.

NOTE (numerics): the Triton path computes rsqrt(mean(x^2) + eps) * (x @ fn.T) where the reference
computes (x * rsqrt(...)) @ fn.T, and sums in another order: equal within float32 rounding (the tests
bound it), not bit for bit; "torch" is the default on every device for now (see `_default`), "triton"
is chosen with `op_impls={"mhc_pre": "triton", ...}`. Where the reference rounds to the
streams' dtype (the collapse, post * y, the comb matmul, their sum) the kernels round at the same points.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from deepinfer.kernels.registry import register_default_impl, register_op
from deepinfer.kernels.sinkhorn import sinkhorn_torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is optional on CPU-only installs
    triton = None

# ---------------------------------------------------------------------------- torch references


def hc_weights_torch(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int,
                     iters: int, eps: float, norm_eps: float, sinkhorn: Callable = sinkhorn_torch):
    """mHC mixing weights from the streams [T, hc, H] -> pre [T, hc], post [T, hc], comb [T, hc, hc] (float32).

    `sinkhorn` is an implementation of the `kernels` op "sinkhorn" (the model's `OpTable` picks it).
    """
    T = streams.shape[0]
    flat = streams.reshape(T, -1).float()
    flat = F.rms_norm(flat, (flat.shape[-1],), None, norm_eps)
    mix = F.linear(flat, fn.float())
    pre_w, post_w, comb_w = mix.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.float().split([hc, hc, hc * hc])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(T, hc, hc) * scale[2] + comb_b.view(hc, hc), dim=-1) + eps
    return pre, post, sinkhorn(comb, iters, eps)


def hc_collapse_torch(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, eps: float,
                      norm_eps: float) -> torch.Tensor:
    """Collapse the hc streams [T, hc, H] into one hidden vector [T, H] (a hyper head's math; the MTP
    layer's `hc_head_*` use it too). fn: [hc, hc*H], base: [hc], scale: [1]."""
    T = streams.shape[0]
    flat = streams.reshape(T, -1).float()
    flat = F.rms_norm(flat, (flat.shape[-1],), None, norm_eps)
    pre = torch.sigmoid(F.linear(flat, fn.float()) * scale.float() + base.float()) + eps  # [T, hc]
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


@register_op("mhc_pre", "torch")
def mhc_pre_torch(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int,
                  iters: int, eps: float, norm_eps: float,
                  sinkhorn: Callable = sinkhorn_torch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference pre-mix: (collapsed [T, H] in streams' dtype, post [T, hc], comb [T, hc, hc] float32)."""
    pre, post, comb = hc_weights_torch(streams, fn, base, scale, hc, iters, eps, norm_eps, sinkhorn)
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)  # [T, H]
    return collapsed, post, comb


@register_op("mhc_post", "torch")
def mhc_post_torch(y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Reference post-mix: new streams [T, hc, H] = post_k * y + sum_j comb[j, k] * stream_j (streams' dtype)."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * y.unsqueeze(1) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


@register_op("mhc_head", "torch")
def mhc_head_torch(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, eps: float,
                   norm_eps: float) -> torch.Tensor:
    """Reference head collapse [T, H] (`hc_collapse_torch`)."""
    return hc_collapse_torch(streams, fn, base, scale, eps, norm_eps)


def _default(device: torch.device) -> str:
    # NOTE: the fused Triton kernels on CUDA: they passed their `gpu` tests on an H200 (2026-12-05) against the
    # float32 CPU reference; "torch" elsewhere (`op_impls={"mhc_pre": "torch", ...}` picks it on CUDA too).
    return "triton" if device.type == "cuda" and triton is not None else "torch"


for _op in ("mhc_pre", "mhc_post", "mhc_head"):
    register_default_impl(_op)(_default)


# ---------------------------------------------------------------------------- checks


def _needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _check_device(name: str, t: torch.Tensor) -> None:
    if t.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"{name} needs CUDA tensors (or TRITON_INTERPRET=1), got {t.device}")


def check_mhc_pre_args(name: str, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                       num_logits: int, num_scales: int) -> None:
    """Raise a ValueError naming `name` unless streams [T, hc, H] (contiguous, float) and the float32
    parameters fn [num_logits, hc*H], base [num_logits], scale [num_scales] (contiguous) fit."""
    if streams.dim() != 3:
        raise ValueError(f"{name}: streams must be [T, hc, H], got {list(streams.shape)}")
    if streams.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{name}: streams must be bfloat16, float16 or float32, got {streams.dtype}")
    _, hc, hidden = streams.shape
    for what, t, shape in (("fn", fn, (num_logits, hc * hidden)), ("base", base, (num_logits,)),
                           ("scale", scale, (num_scales,))):
        if tuple(t.shape) != shape or t.dtype != torch.float32:
            raise ValueError(f"{name}: {what} must be float32 {list(shape)}, got {t.dtype} {list(t.shape)}")
        if t.device != streams.device:
            raise ValueError(f"{name}: {what} is on {t.device}, streams on {streams.device}")
    if not all(t.is_contiguous() for t in (streams, fn, base, scale)):
        raise ValueError(f"{name}: streams, fn, base and scale must be contiguous (call .contiguous())")
    _check_device(name, streams)


# ---------------------------------------------------------------------------- Triton

K_SLICE = 256
"""Columns of the flattened streams each `_mhc_proj_kernel` program sums (V4-Flash: 16384 / 256 = 64 splits).
NOTE: 1024 (16 programs at decode) took 38 us a call at batch 1 on the H200 (2026-12-05), ~40 GB/s of the
1.5 MB float32 `fn`: too few programs for 132 SMs."""

if triton is not None:
    from deepinfer.kernels.sinkhorn import _ordered_sum

    @triton.jit
    def _rnd(x, like):
        """x (float32) rounded to pointer `like`'s element type and back: where the reference's ops round."""
        return x.to(like.dtype.element_ty).to(tl.float32)

    @triton.jit
    def _mhc_proj_kernel(x_ptr, fn_ptr, part_ptr, ss_ptr, T, KK, k_slice, NM, NM_PAD: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
        # program (token block, split s): partial x @ fn.T and sum of x^2 over columns [s*k_slice, (s+1)*k_slice)
        rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        s = tl.program_id(1)
        rn = tl.arange(0, NM_PAD)
        t_ok, n_ok = rt < T, rn < NM
        acc = tl.zeros((BLOCK_T, NM_PAD), dtype=tl.float32)
        ss = tl.zeros((BLOCK_T,), dtype=tl.float32)
        k_lo = s * k_slice
        for k0 in range(0, k_slice, BLOCK_K):
            kk = k_lo + k0 + tl.arange(0, BLOCK_K)
            k_ok = (kk < KK) & (k0 + tl.arange(0, BLOCK_K) < k_slice)
            x = tl.load(x_ptr + rt[:, None].to(tl.int64) * KK + kk[None, :], mask=t_ok[:, None] & k_ok[None, :],
                        other=0.0).to(tl.float32)
            f = tl.load(fn_ptr + rn[None, :] * KK + kk[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            ss += tl.sum(x * x, axis=1)
            acc += tl.dot(x, f, input_precision="ieee")
        base = (s * T + rt).to(tl.int64)
        tl.store(part_ptr + base[:, None] * NM_PAD + rn[None, :], acc, mask=t_ok[:, None])
        tl.store(ss_ptr + base, ss, mask=t_ok)

    @triton.jit
    def _col(mix, cols, c):
        """Column c of mix [BLOCK_T, NM_PAD] as [BLOCK_T] (exact: one non-zero term)."""
        return tl.sum(tl.where(cols == c, mix, 0.0), axis=1)

    @triton.jit
    def _mhc_mix_kernel(x_ptr, part_ptr, ss_ptr, base_ptr, scale_ptr, coll_ptr, post_ptr, comb_ptr, T, H, SPLIT,
                        eps, norm_eps, ITERS: tl.constexpr, HC: tl.constexpr, HC_PAD: tl.constexpr,
                        NM_PAD: tl.constexpr, HEAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
        DT = x_ptr.dtype.element_ty
        rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        t_ok = rt < T
        cols = tl.arange(0, NM_PAD)[None, :]
        mix = tl.zeros((BLOCK_T, NM_PAD), dtype=tl.float32)
        ss = tl.zeros((BLOCK_T,), dtype=tl.float32)
        for s in range(0, SPLIT):  # in split order: deterministic
            base = (s * T + rt).to(tl.int64)
            mix += tl.load(part_ptr + base[:, None] * NM_PAD + cols, mask=t_ok[:, None], other=0.0)
            ss += tl.load(ss_ptr + base, mask=t_ok, other=0.0)
        rms = tl.math.rsqrt(ss / (HC * H) + norm_eps)
        mix = mix * rms[:, None]
        jj = tl.arange(0, HC_PAD)[None, :]  # [1, HC_PAD]
        # pre [BLOCK_T, HC_PAD] (padded entries 0)
        pre = tl.zeros((BLOCK_T, HC_PAD), dtype=tl.float32)
        sc0 = tl.load(scale_ptr)
        for j in tl.static_range(HC):
            v = _col(mix, cols, j) * sc0 + tl.load(base_ptr + j)
            pre = tl.where(jj == j, (tl.math.div_rn(tl.full(v.shape, 1.0, tl.float32), 1.0 + tl.exp(-v)) + eps)[:, None],
                           pre)
        if not HEAD:
            sc1 = tl.load(scale_ptr + 1)
            sc2 = tl.load(scale_ptr + 2)
            for j in tl.static_range(HC):
                v = _col(mix, cols, HC + j) * sc1 + tl.load(base_ptr + HC + j)
                tl.store(post_ptr + rt * HC + j, 2.0 * tl.math.div_rn(tl.full(v.shape, 1.0, tl.float32),
                                                                        1.0 + tl.exp(-v)), mask=t_ok)
            # comb [BLOCK_T, HC_PAD, HC_PAD]: row i, column j; the softmax runs along j
            i3 = tl.arange(0, HC_PAD)[None, :, None]
            j3 = tl.arange(0, HC_PAD)[None, None, :]
            c3 = tl.full((BLOCK_T, HC_PAD, HC_PAD), float("-inf"), tl.float32)
            for i in tl.static_range(HC):
                for j in tl.static_range(HC):
                    v = _col(mix, cols, 2 * HC + i * HC + j) * sc2 + tl.load(base_ptr + 2 * HC + i * HC + j)
                    c3 = tl.where((i3 == i) & (j3 == j), v[:, None, None], c3)
            m = tl.max(c3, axis=2)
            m = tl.where(tl.arange(0, HC_PAD)[None, :] < HC, m, 0.0)  # padded rows: no -inf - -inf
            ex = tl.exp(c3 - m[:, :, None])  # padded entries: exp(-inf) = 0 (padded rows: masked below)
            real = (i3 < HC) & (j3 < HC)
            ex = tl.where(real, ex, 0.0)
            den = tl.where(i3 < HC, tl.sum(ex, axis=2)[:, :, None], 1.0)  # padded rows: no 0 / 0
            a = tl.where(real, tl.math.div_rn(ex, den) + eps, 0.0)
            a = tl.math.div_rn(a, _ordered_sum(a, i3, 1, HC) + eps)
            for _ in range(ITERS - 1):
                a = tl.math.div_rn(a, _ordered_sum(a, j3, 2, HC) + eps)
                a = tl.math.div_rn(a, _ordered_sum(a, i3, 1, HC) + eps)
            tl.store(comb_ptr + rt[:, None, None] * (HC * HC) + i3 * HC + j3, a,
                     mask=t_ok[:, None, None] & real)
        # collapse: sum_j pre_j * stream_j, added in j order
        for h0 in range(0, H, BLOCK_H):
            rh = h0 + tl.arange(0, BLOCK_H)
            msk = t_ok[:, None] & (rh < H)[None, :]
            acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
            for j in tl.static_range(HC):
                pj = tl.sum(tl.where(jj == j, pre, 0.0), axis=1)
                sj = tl.load(x_ptr + (rt[:, None].to(tl.int64) * HC + j) * H + rh[None, :], mask=msk, other=0.0)
                acc += pj[:, None] * sj.to(tl.float32)
            tl.store(coll_ptr + rt[:, None].to(tl.int64) * H + rh[None, :], acc.to(DT), mask=msk)

    @triton.jit
    def _mhc_post_kernel(y_ptr, x_ptr, post_ptr, comb_ptr, out_ptr, H, HC: tl.constexpr, HC_PAD: tl.constexpr,
                         BLOCK_H: tl.constexpr):
        DT = x_ptr.dtype.element_ty
        t = tl.program_id(0).to(tl.int64)
        rh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        h_ok = rh < H
        k = tl.arange(0, HC_PAD)
        k_ok = k < HC
        y = tl.load(y_ptr + t * H + rh, mask=h_ok, other=0.0).to(tl.float32)
        p = _rnd(tl.load(post_ptr + t * HC + k, mask=k_ok, other=0.0), x_ptr)
        first = _rnd(p[:, None] * y[None, :], x_ptr)  # post.to(dtype) * y, in dtype
        m = tl.zeros((HC_PAD, BLOCK_H), dtype=tl.float32)
        for j in tl.static_range(HC):
            cj = _rnd(tl.load(comb_ptr + t * (HC * HC) + j * HC + k, mask=k_ok, other=0.0), x_ptr)  # comb[j, k]
            sj = tl.load(x_ptr + (t * HC + j) * H + rh, mask=h_ok, other=0.0).to(tl.float32)
            m += cj[:, None] * sj[None, :]
        out = first + _rnd(m, x_ptr)
        tl.store(out_ptr + (t * HC + k[:, None]) * H + rh[None, :], out.to(DT), mask=k_ok[:, None] & h_ok[None, :])

    def _pre_launch(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
                    eps: float, norm_eps: float, head: bool):
        T, hc, hidden = streams.shape
        num_logits = fn.shape[0]
        kk = hc * hidden
        nm_pad = max(16, triton.next_power_of_2(num_logits))
        block_t, block_k = 16, 128
        tiles = triton.cdiv(T, block_t)
        # NOTE: the split depends on hc*H only, never on T: a token's sums are added in the same order
        # whatever the batch (batch invariance), and decode still spreads fn over cdiv(hc*H, K_SLICE) programs
        k_slice = K_SLICE
        split = triton.cdiv(kk, k_slice)
        dev = streams.device
        if T == 0:
            return (streams.new_empty(0, hidden), torch.empty(0, hc, device=dev), torch.empty(0, hc, hc, device=dev))
        part = torch.empty(split * T * nm_pad, dtype=torch.float32, device=dev)
        ss = torch.empty(split * T, dtype=torch.float32, device=dev)
        _mhc_proj_kernel[(tiles, split)](streams, fn, part, ss, T, kk, k_slice, num_logits, NM_PAD=nm_pad,
                                         BLOCK_T=block_t, BLOCK_K=block_k, num_warps=4)
        collapsed = torch.empty(T, hidden, dtype=streams.dtype, device=dev)
        post = torch.empty(T, hc, dtype=torch.float32, device=dev)
        comb = torch.empty(T, hc, hc, dtype=torch.float32, device=dev)
        mix_bt = 8
        _mhc_mix_kernel[(triton.cdiv(T, mix_bt),)](
            streams, part, ss, base, scale, collapsed, post, comb, T, hidden, split, eps, norm_eps, ITERS=iters,
            HC=hc, HC_PAD=triton.next_power_of_2(hc), NM_PAD=nm_pad, HEAD=head, BLOCK_T=mix_bt,
            BLOCK_H=min(512, triton.next_power_of_2(hidden)), num_warps=4)
        return collapsed, post, comb

    @register_op("mhc_pre", "triton")
    def mhc_pre_triton(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int,
                       iters: int, eps: float, norm_eps: float,
                       sinkhorn: Callable | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Fused pre-mix in two launches (see the module docstring): (collapsed [T, H] in streams' dtype,
        post [T, hc] float32, comb [T, hc, hc] float32). streams [T, hc, H] contiguous; fn [(2+hc)*hc, hc*H],
        base, scale [3] float32 contiguous. `sinkhorn` is ignored (the iterations run in the kernel).
        A call that needs a gradient takes the torch reference."""
        if _needs_grad(streams, fn, base, scale):
            return mhc_pre_torch(streams, fn, base, scale, hc, iters, eps, norm_eps, sinkhorn or sinkhorn_torch)
        check_mhc_pre_args("mhc_pre_triton", streams, fn, base, scale, (2 + hc) * hc, 3)
        if streams.shape[1] != hc or iters < 1:
            raise ValueError(f"mhc_pre_triton: streams must have hc={hc} streams and iters >= 1, got "
                             f"{list(streams.shape)}, iters={iters}")
        return _pre_launch(streams, fn, base, scale, iters, eps, norm_eps, head=False)

    @register_op("mhc_head", "triton")
    def mhc_head_triton(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, eps: float,
                        norm_eps: float) -> torch.Tensor:
        """Fused head collapse [T, H] in two launches: fn [hc, hc*H], base [hc], scale [1] float32."""
        if _needs_grad(streams, fn, base, scale):
            return mhc_head_torch(streams, fn, base, scale, eps, norm_eps)
        hc = streams.shape[1] if streams.dim() == 3 else 0
        check_mhc_pre_args("mhc_head_triton", streams, fn, base, scale, hc, 1)
        return _pre_launch(streams, fn, base, scale, 1, eps, norm_eps, head=True)[0]

    @register_op("mhc_post", "triton")
    def mhc_post_triton(y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """Fused post-mix in one launch: new streams [T, hc, H] (streams' dtype). y [T, H] in streams' dtype,
        streams [T, hc, H], post [T, hc] and comb [T, hc, hc] float32, all contiguous."""
        if _needs_grad(y, streams, post, comb):
            return mhc_post_torch(y, streams, post, comb)
        if streams.dim() != 3:
            raise ValueError(f"mhc_post_triton: streams must be [T, hc, H], got {list(streams.shape)}")
        T, hc, hidden = streams.shape
        for what, t, shape, dtype in (("y", y, (T, hidden), streams.dtype), ("post", post, (T, hc), torch.float32),
                                      ("comb", comb, (T, hc, hc), torch.float32)):
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise ValueError(f"mhc_post_triton: {what} must be {dtype} {list(shape)}, got {t.dtype} {list(t.shape)}")
            if t.device != streams.device:
                raise ValueError(f"mhc_post_triton: {what} is on {t.device}, streams on {streams.device}")
        if not all(t.is_contiguous() for t in (y, streams, post, comb)):
            raise ValueError("mhc_post_triton: y, streams, post and comb must be contiguous (call .contiguous())")
        _check_device("mhc_post_triton", streams)
        out = torch.empty_like(streams)
        if T and hidden:
            block_h = min(1024, triton.next_power_of_2(hidden))
            _mhc_post_kernel[(T, triton.cdiv(hidden, block_h))](y, streams, post, comb, out, hidden, HC=hc,
                                                                HC_PAD=triton.next_power_of_2(hc), BLOCK_H=block_h,
                                                                num_warps=4)
        return out
