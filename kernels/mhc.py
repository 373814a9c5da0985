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
  * the "split" variant of those two launches (`VARIANT`, env DEEPINFER_MHC_VARIANT; the default since its
    measurement on an H100 on 2026-12-05, "legacy" on request): for decode latency the projection's programs are cut further
    by logit groups and the mix / collapse runs over (token block, hidden block) programs, both giving the
    legacy kernels' bits (`_pre_launch_split` says why); for long chunks (T >= MATMUL_MIN_T) outside
    batch-invariant mode the projection is one cuBLAS float32 matmul (TF32 off), within float32 rounding.
  * the "fused" long-chunk projection (`LONG_PROJ`, env DEEPINFER_MHC_LONG_PROJ: "matmul" the default, "fused"
    opt-in until timed on a GPU): where the "split" variant takes the matmul route, `_mhc_proj_kernel` with TF32X3
    reads x [T, hc*H] once in its own dtype and accumulates both the sums of squares (float32) and x @ fn.T
    (3xTF32 tensor-core dots, float32-level accuracy) over (token block, K chunk) programs; the split mix adds
    the chunks' partials in chunk order. Why: on an H100 (2026-12-05, an 8,192-token prefill, 4 layers = 9
    calls) the matmul route's `_mhc_sumsq_kernel` (writing a float32 copy of x) took 2.5 ms and the cuBLAS
    float32 (FFMA) GEMM 2.7 ms, ~575 us a call, where reading the bf16 x once (268 MB) takes ~64-90 us.

NOTE (numerics): the Triton path computes rsqrt(mean(x^2) + eps) * (x @ fn.T) where the reference
computes (x * rsqrt(...)) @ fn.T, and sums in another order: equal within float32 rounding (the tests
bound it), not bit for bit; "torch" is the default on every device for now (see `_default`), "triton"
is chosen with `op_impls={"mhc_pre": "triton", ...}`. Where the reference rounds to the
streams' dtype (the collapse, post * y, the comb matmul, their sum) the kernels round at the same points.
"""

from __future__ import annotations

import os
import sys
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

VARIANT_ENV = "DEEPINFER_MHC_VARIANT"
"""Environment knob picking the pre-mix kernels (`VARIANT`, read once at import)."""
VARIANTS = ("legacy", "split")
VARIANT = os.environ.get(VARIANT_ENV, "split")
"""Which kernels `mhc_pre` / `mhc_head` ("triton") launch; a module-level switch (assign it, or set
DEEPINFER_MHC_VARIANT before import). "split" (the default): `_mhc_proj_nsplit_kernel` + `_mhc_mix_split_kernel`,
the same bits as "legacy" with more programs for decode (see `_pre_launch_split`), and for T >= `MATMUL_MIN_T`
outside batch-invariant mode the projection as one cuBLAS float32 matmul (`_proj_route`). "legacy":
`_mhc_proj_kernel` + `_mhc_mix_kernel`. Measured on an H100 (2026-12-05, V4-Flash-shaped 4-layer stack, with the
MoE `_grouped_mm` route): decode graph replay 1.96 -> 1.89 ms at batch 1, 5.80 -> 5.68 ms at batch 32, 6.68 ->
6.75 ms at batch 128 (those runs projected decode batches with the nsplit kernel; the default now keeps
`_mhc_proj_kernel` for them: `NSPLIT_MAX_T`); the mHC projection of an 8,192-token prefill 20.3 ms -> ~2.6 ms (the
matmul route)."""
MATMUL_MIN_T_ENV = "DEEPINFER_MHC_MATMUL_MIN_T"
"""Environment knob for `MATMUL_MIN_T` (0 turns the matmul route off)."""


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    try:
        return int(raw) if raw.strip() else default
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None


MATMUL_MIN_T = _env_int(MATMUL_MIN_T_ENV, 1024)
"""Tokens from which the "split" variant projects with a cuBLAS float32 matmul instead of the fixed-split
kernel (outside batch-invariant mode, TF32 off). NOTE: 1024 is a placeholder until `benchmarks/gpu_mhc.py`
has run on the H200 (the fixed-split kernel took 20 ms of a 108 ms 8,192-token prefill step, 2026-12-05)."""
LONG_PROJ_ENV = "DEEPINFER_MHC_LONG_PROJ"
"""Environment knob picking `LONG_PROJ` (read once at import)."""
LONG_PROJS = ("matmul", "fused")
LONG_PROJ = os.environ.get(LONG_PROJ_ENV, "matmul")
"""How the "split" variant projects a long chunk where it takes the cuBLAS route (T >= MATMUL_MIN_T, outside
batch-invariant mode, TF32 off; a module-level switch like `VARIANT`): "matmul" (the default) `_mhc_sumsq_kernel`
+ cuBLAS float32, "fused" (opt-in until timed on a GPU) one `_mhc_proj_kernel` launch (TF32X3) (3xTF32 tensor-core
dots; see `_pre_launch_split`). NOTE: the fused kernel does not use cuBLAS, so the TF32 flag does not concern it;
it keeps the matmul route's conditions so that the knob only swaps one route for the other."""
FUSED_BLOCK_T = 64
"""Token rows per fused-route program (64: one Hopper warp-group MMA's M; `fn` is re-read from L2
once per block: 1.5 MB at V4-Flash widths against the block's 2 MB of bf16 x)."""
FUSED_BLOCK_K = 64
"""Columns per step of the fused route (a power of two, at least 16)."""
FUSED_PROGRAMS = 256
"""Programs the fused route aims at: the K chunks per token block are the smallest power of two giving
at least this many (~2 per SM on 132 SMs; T = 1024: 16 blocks x 16 chunks, T = 8192: 128 x 2, T >= 16384: 1)."""
NSPLIT_MAX_T_ENV = "DEEPINFER_MHC_NSPLIT_MAX_T"
"""Environment knob for `NSPLIT_MAX_T`."""
NSPLIT_MAX_T = _env_int(NSPLIT_MAX_T_ENV, 0)
"""In the "split" variant below MATMUL_MIN_T, the largest T projected by `_mhc_proj_nsplit_kernel`; above it
`_mhc_proj_kernel` (the same bits on the GPU, fewer programs re-reading x). 0 (the default): never. NOTE: the H100
roofline of 2026-12-05 measured the nsplit projection slower than `_mhc_proj_kernel` at every decode batch (9 calls
a step: 102 vs 98 us at batch 1, 140 vs 97 at 32, 557 vs 336 at 128) while the split mix was faster (70 vs 123,
74 vs 203, 82 vs 210 us), so the default pairs the legacy projection with the split mix (`benchmarks/gpu_mhc.py`'s
`mix_split` case)."""
PROJ_BLOCK_N = 8
"""Logits per `_mhc_proj_nsplit_kernel` program (V4-Flash: 32 padded logits -> 4 programs per split)."""
PROJ_DOT_T = 16
"""Token rows per tl.dot in `_mhc_proj_nsplit_kernel` (a divisor of its 16-token block; 16: the legacy M, with
masked rows at decode; smaller: no masked FMAs, more passes over `fn` for full blocks). A fixed knob, never
chosen by T, so that a token's bits do not depend on T on the CPU interpreter either (on the GPU they do not
for any value)."""
PROJ_DOT_K = 128
"""Columns per tl.dot in `_mhc_proj_nsplit_kernel` (a divisor of K_SLICE; the FMA lowering holds a piece's
operands in registers, fewer columns fewer registers)."""
MIX_BLOCK_H = 256
"""Hidden columns each `_mhc_mix_split_kernel` program collapses (V4-Flash: 4096 / 256 = 16 programs a token tile)."""
MIX_BLOCK_H_LONG = 1024
"""MIX_BLOCK_H from T = 1024 tokens on: enough programs anyway, fewer recomputed Sinkhorns."""


def _variant() -> str:
    if VARIANT not in VARIANTS:
        raise ValueError(f"kernels.mhc.VARIANT ({VARIANT_ENV}) must be one of {VARIANTS}, got {VARIANT!r}")
    return VARIANT


def _long_proj(value: str | None = None) -> str:
    value = LONG_PROJ if value is None else value
    if value not in LONG_PROJS:
        raise ValueError(f"kernels.mhc.LONG_PROJ ({LONG_PROJ_ENV}) must be one of {LONG_PROJS}, got {value!r}")
    return value


def _batch_invariant_active() -> bool:
    """Whether `engine.batch_invariant.BatchInvariantMode` is on this thread's torch-function mode stack (a
    token's numbers must then not depend on T: no shape-dependent cuBLAS route). Not imported here: when its
    module was never imported, the mode cannot be active."""
    mod = sys.modules.get("deepinfer.engine.batch_invariant")
    if mod is None:
        return False
    from torch.overrides import _get_current_function_mode_stack

    return any(isinstance(m, mod.BatchInvariantMode) for m in _get_current_function_mode_stack())


def _cublas_tf32() -> bool:
    """Whether float32 cuBLAS matmuls may use TF32 (read only: torch refuses reads that mix its legacy and
    new precision APIs, so both are tried)."""
    m = torch.backends.cuda.matmul
    try:
        return bool(m.allow_tf32)
    except RuntimeError:
        return getattr(m, "fp32_precision", "ieee") == "tf32"


def _proj_route(T: int, variant: str | None = None, matmul_min_t: int | None = None,
                nsplit_max_t: int | None = None, long_proj: str | None = None) -> str:
    """How the pre-mix runs for T tokens: "legacy" (the legacy launches), or the "split" variant's mix after
    "nsplit" (`_mhc_proj_nsplit_kernel`, for T <= NSPLIT_MAX_T), "legacy_proj" (`_mhc_proj_kernel`) or, for
    T >= MATMUL_MIN_T outside batch-invariant mode and with TF32 off (their reduction order follows T), the
    long-chunk projection `LONG_PROJ`: "matmul" (cuBLAS float32) or "fused" (`_mhc_proj_kernel` with TF32X3).
    `matmul_min_t` / `nsplit_max_t` / `long_proj` override the module's knobs."""
    variant = _variant() if variant is None else variant
    long_proj = _long_proj(long_proj)
    if variant == "legacy":
        return "legacy"
    min_t = MATMUL_MIN_T if matmul_min_t is None else matmul_min_t
    if 0 < min_t <= T and not _batch_invariant_active() and not _cublas_tf32():
        return long_proj
    max_t = NSPLIT_MAX_T if nsplit_max_t is None else nsplit_max_t
    return "nsplit" if T <= max_t else "legacy_proj"


if triton is not None:
    from deepinfer.kernels.rope import round_like as _rnd  # x rounded where the torch reference's op rounds
    from deepinfer.kernels.sinkhorn import _ordered_sum

    @triton.jit
    def _mhc_proj_kernel(x_ptr, fn_ptr, part_ptr, ss_ptr, T, KK, k_slice, NM, NM_PAD: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, TF32X3: tl.constexpr = False):
        # program (token block, split s): partial x @ fn.T and sum of x^2 over columns [s*k_slice, (s+1)*k_slice),
        # x read once in the streams' dtype. TF32X3 (the "fused" long-chunk route): the dot in 3xTF32 on tensor cores
        # (hi*hi + hi*lo + lo*hi: float32-level accuracy; bf16 x is exact in TF32, its lo part 0), accumulated in the
        # MMA; else IEEE float32 (the legacy bits)
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
            if TF32X3:
                acc = tl.dot(x, f, acc, input_precision="tf32x3")
            else:
                acc += tl.dot(x, f, input_precision="ieee")
        base = (s * T + rt).to(tl.int64)
        tl.store(part_ptr + base[:, None] * NM_PAD + rn[None, :], acc, mask=t_ok[:, None])
        tl.store(ss_ptr + base, ss, mask=t_ok)

    @triton.jit
    def _col(mix, cols, c):
        """Column c of mix [BLOCK_T, NM_PAD] as [BLOCK_T] (exact: one non-zero term)."""
        return tl.sum(tl.where(cols == c, mix, 0.0), axis=1)

    @triton.jit
    def _mix_weights(mix, ss, cols, rt, st, base_ptr, scale_ptr, post_ptr, comb_ptr, H, eps, norm_eps,
                     ITERS: tl.constexpr, HC: tl.constexpr, HC_PAD: tl.constexpr, HEAD: tl.constexpr,
                     BLOCK_T: tl.constexpr):
        """The mix kernels' weights from the summed partials of a token block (`mix` [BLOCK_T, NM_PAD] logits,
        `ss` [BLOCK_T] sums of squares; `cols` = arange(NM_PAD)[None, :], `rt` the block's tokens): the RMS
        scale, pre (returned, [BLOCK_T, HC_PAD], padded entries 0) and, unless HEAD, post [T, HC] and the
        Sinkhorn-normalised comb [T, HC, HC] stored where `st` [BLOCK_T]. Shared by `_mhc_mix_kernel` and
        `_mhc_mix_split_kernel` (which stores from one hidden block only); Triton inlines it, so both keep the
        arithmetic and bits they had with it written out in each."""
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
                                                                        1.0 + tl.exp(-v)), mask=st)
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
                     mask=st[:, None, None] & real)
        return pre

    @triton.jit
    def _collapse_block(x_ptr, coll_ptr, pre, jj, rt, t_ok, rh, H, HC: tl.constexpr, BLOCK_T: tl.constexpr,
                        BLOCK_H: tl.constexpr):
        """collapsed[rt, rh] = sum_j pre[:, j] * stream_j[rt, rh], added in j order (one hidden block of the
        collapse; the legacy mix loops over the blocks, the split mix is one block a program)."""
        DT = x_ptr.dtype.element_ty
        msk = t_ok[:, None] & (rh < H)[None, :]
        acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
        for j in tl.static_range(HC):
            pj = tl.sum(tl.where(jj == j, pre, 0.0), axis=1)
            sj = tl.load(x_ptr + (rt[:, None].to(tl.int64) * HC + j) * H + rh[None, :], mask=msk, other=0.0)
            acc += pj[:, None] * sj.to(tl.float32)
        tl.store(coll_ptr + rt[:, None].to(tl.int64) * H + rh[None, :], acc.to(DT), mask=msk)

    @triton.jit
    def _mhc_mix_kernel(x_ptr, part_ptr, ss_ptr, base_ptr, scale_ptr, coll_ptr, post_ptr, comb_ptr, T, H, SPLIT,
                        eps, norm_eps, ITERS: tl.constexpr, HC: tl.constexpr, HC_PAD: tl.constexpr,
                        NM_PAD: tl.constexpr, HEAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
        rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        t_ok = rt < T
        cols = tl.arange(0, NM_PAD)[None, :]
        mix = tl.zeros((BLOCK_T, NM_PAD), dtype=tl.float32)
        ss = tl.zeros((BLOCK_T,), dtype=tl.float32)
        for s in range(0, SPLIT):  # in split order: deterministic
            base = (s * T + rt).to(tl.int64)
            mix += tl.load(part_ptr + base[:, None] * NM_PAD + cols, mask=t_ok[:, None], other=0.0)
            ss += tl.load(ss_ptr + base, mask=t_ok, other=0.0)
        pre = _mix_weights(mix, ss, cols, rt, t_ok, base_ptr, scale_ptr, post_ptr, comb_ptr, H, eps, norm_eps, ITERS,
                           HC, HC_PAD, HEAD, BLOCK_T)  # [BLOCK_T, HC_PAD]
        jj = tl.arange(0, HC_PAD)[None, :]  # [1, HC_PAD]
        # collapse: sum_j pre_j * stream_j, added in j order
        for h0 in range(0, H, BLOCK_H):
            _collapse_block(x_ptr, coll_ptr, pre, jj, rt, t_ok, h0 + tl.arange(0, BLOCK_H), H, HC, BLOCK_T, BLOCK_H)

    # ------------------------------------------------------------ the "split" variant (see `_pre_launch_split`)

    @triton.jit
    def _mhc_proj_nsplit_kernel(x_ptr, fn_ptr, part_ptr, ss_ptr, T, KK, k_slice, NM, NM_PAD: tl.constexpr,
                                BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                                DOT_T: tl.constexpr, DOT_K: tl.constexpr):
        # program (token block, split s, logit group g): `_mhc_proj_kernel`'s partials for logits
        # [g*BLOCK_N, (g+1)*BLOCK_N) only, with the same bits (see `_pre_launch_split`):
        # * ss (group 0 only): that kernel's x tile [BLOCK_T, BLOCK_K] and loop line for line, so the same
        #   register layout and reduction tree;
        # * the projection: tl.dot over [DOT_T, DOT_K] x [DOT_K, BLOCK_N] pieces, row blocks without a token
        #   skipped. Each output of an IEEE float32 tl.dot is one FMA chain over k in order from the
        #   accumulator whatever the tile's M, N and K, so the pieces chain exactly as that kernel's dot.
        t0 = tl.program_id(0) * BLOCK_T
        s = tl.program_id(1)
        g = tl.program_id(2)
        k_lo = s * k_slice
        if g == 0:
            rt = t0 + tl.arange(0, BLOCK_T)
            t_ok = rt < T
            ss = tl.zeros((BLOCK_T,), dtype=tl.float32)
            for k0 in range(0, k_slice, BLOCK_K):
                kk = k_lo + k0 + tl.arange(0, BLOCK_K)
                k_ok = (kk < KK) & (k0 + tl.arange(0, BLOCK_K) < k_slice)
                x = tl.load(x_ptr + rt[:, None].to(tl.int64) * KK + kk[None, :], mask=t_ok[:, None] & k_ok[None, :],
                            other=0.0).to(tl.float32)
                ss += tl.sum(x * x, axis=1)
            tl.store(ss_ptr + (s * T + rt).to(tl.int64), ss, mask=t_ok)
        rn = g * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < NM
        k_end = tl.where(g * BLOCK_N < NM, k_slice, 0)  # a group of padding logits only stores its zeros
        for r0 in tl.static_range(0, BLOCK_T, DOT_T):
            if t0 + r0 < T:
                rd = t0 + r0 + tl.arange(0, DOT_T)
                d_ok = rd < T
                acc = tl.zeros((DOT_T, BLOCK_N), dtype=tl.float32)
                for k0 in range(0, k_end, DOT_K):
                    kd = k_lo + k0 + tl.arange(0, DOT_K)
                    kd_ok = (kd < KK) & (k0 + tl.arange(0, DOT_K) < k_slice)
                    xd = tl.load(x_ptr + rd[:, None].to(tl.int64) * KK + kd[None, :],
                                 mask=d_ok[:, None] & kd_ok[None, :], other=0.0).to(tl.float32)
                    f = tl.load(fn_ptr + rn[None, :] * KK + kd[:, None], mask=kd_ok[:, None] & n_ok[None, :],
                                other=0.0)
                    acc += tl.dot(xd, f, input_precision="ieee")
                base = (s * T + rd).to(tl.int64)
                tl.store(part_ptr + base[:, None] * NM_PAD + rn[None, :], acc, mask=d_ok[:, None])

    @triton.jit
    def _mhc_sumsq_kernel(x_ptr, xf_ptr, ss_ptr, KK, WRITE: tl.constexpr, BLOCK_K: tl.constexpr):
        # one token a program: sum of x^2 over its hc*H columns (float32), and x as float32 when WRITE (the
        # matmul route's operand: cuBLAS has no bf16 x float32 GEMM), reading the streams once
        t = tl.program_id(0).to(tl.int64)
        acc = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, KK, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < KK
            x = tl.load(x_ptr + t * KK + kk, mask=k_ok, other=0.0).to(tl.float32)
            if WRITE:
                tl.store(xf_ptr + t * KK + kk, x, mask=k_ok)
            acc += x * x
        tl.store(ss_ptr + t, tl.sum(acc, axis=0))

    @triton.jit
    def _mhc_mix_split_kernel(x_ptr, part_ptr, ss_ptr, base_ptr, scale_ptr, coll_ptr, post_ptr, comb_ptr, T, H,
                              eps, norm_eps, SPLIT: tl.constexpr, ITERS: tl.constexpr, HC: tl.constexpr,
                              HC_PAD: tl.constexpr, NM_PAD: tl.constexpr, HEAD: tl.constexpr,
                              BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
        # program (token block, hidden block): `_mhc_mix_kernel` with the collapse of hidden columns
        # [pid_h*BLOCK_H, (pid_h+1)*BLOCK_H) only. Every program re-adds the partials and recomputes pre (and
        # post, comb: program 0 of each token block stores them). The arithmetic is `_mhc_mix_kernel`'s, line for
        # line (the weights: the same `_mix_weights`) and with the same tile shapes; the partials' loop is
        # unrolled (SPLIT constexpr), the adds kept in split order, so their loads are in flight together instead
        # of one L2 round trip per split.
        rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        t_ok = rt < T
        t_st = rt < tl.where(tl.program_id(1) == 0, T, 0)  # post and comb: stored by hidden block 0 only
        cols = tl.arange(0, NM_PAD)[None, :]
        mix = tl.zeros((BLOCK_T, NM_PAD), dtype=tl.float32)
        ss = tl.zeros((BLOCK_T,), dtype=tl.float32)
        for s in tl.static_range(SPLIT):  # in split order: deterministic, the legacy sums
            base = (s * T + rt).to(tl.int64)
            mix += tl.load(part_ptr + base[:, None] * NM_PAD + cols, mask=t_ok[:, None], other=0.0)
            ss += tl.load(ss_ptr + base, mask=t_ok, other=0.0)
        pre = _mix_weights(mix, ss, cols, rt, t_st, base_ptr, scale_ptr, post_ptr, comb_ptr, H, eps, norm_eps, ITERS,
                           HC, HC_PAD, HEAD, BLOCK_T)  # [BLOCK_T, HC_PAD]
        jj = tl.arange(0, HC_PAD)[None, :]  # [1, HC_PAD]
        _collapse_block(x_ptr, coll_ptr, pre, jj, rt, t_ok, tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H), H, HC,
                        BLOCK_T, BLOCK_H)

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
                    eps: float, norm_eps: float, head: bool, variant: str | None = None,
                    matmul_min_t: int | None = None):
        """The pre-mix launches of `variant` (default: the module's `VARIANT`); see `_proj_route`."""
        route = _proj_route(streams.shape[0], variant, matmul_min_t)
        if route == "legacy":
            return _pre_launch_legacy(streams, fn, base, scale, iters, eps, norm_eps, head)
        return _pre_launch_split(streams, fn, base, scale, iters, eps, norm_eps, head,
                                 "legacy" if route == "legacy_proj" else route)

    def _pre_launch_legacy(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                           iters: int, eps: float, norm_eps: float, head: bool):
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

    def _fused_split(T: int, kk: int, block_t: int, block_k: int, split: int | None = None) -> tuple[int, int]:
        """(K chunks per token block, columns per chunk) of the fused route: `split` chunks (default: the
        smallest power of two reaching FUSED_PROGRAMS programs, at most 32: the mix unrolls their adds), each a
        whole number of `block_k` steps, none empty (so fewer than asked when hc*H has fewer steps)."""
        steps = triton.cdiv(kk, block_k)
        if split is None:
            split = 1
            while triton.cdiv(T, block_t) * split < FUSED_PROGRAMS and split < min(32, steps):
                split *= 2
        if split < 1:
            raise ValueError(f"mhc: fused_split must be >= 1, got {split}")
        k_chunk = triton.cdiv(steps, split) * block_k
        return triton.cdiv(kk, k_chunk), k_chunk

    def _pre_launch_split(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                          iters: int, eps: float, norm_eps: float, head: bool, proj: str = "nsplit",
                          block_n: int | None = None, block_h: int | None = None, dot_t: int | None = None,
                          dot_k: int | None = None, fused_block_t: int | None = None,
                          fused_block_k: int | None = None, fused_split: int | None = None):
        """The "split" variant: the legacy partials and weights, computed by more programs.

        * `_mhc_proj_nsplit_kernel`: `_mhc_proj_kernel`'s (token block, split) program cut further by groups of
          `block_n` logits (V4-Flash decode: 64 x 4 programs instead of 64), its dot in [dot_t, dot_k] pieces
          (at decode: no FMAs on masked rows). Same bits on the GPU: an IEEE float32 tl.dot is lowered to
          FMAs (no tensor-core path), each output one fused multiply-add chain over k in order starting from
          the accumulator (Triton's FMA dot lowering, `GenericFMAVectorMultiplier`; `acc += tl.dot(..)` is
          folded into the dot's accumulator by `CombineDotAddFPattern`), so an output does not depend on the
          tile's M, N or K as long as the pieces run in k order; the sum of squares uses the legacy x tile
          unchanged. NOTE: the CPU interpreter runs tl.dot as numpy's BLAS matmul, whose rounding follows the
          tile shape, so there it is only equal within float32 rounding (the `gpu` tests check the bits).
        * `matmul` (T >= MATMUL_MIN_T, outside batch-invariant mode): x @ fn.T by cuBLAS in float32 and the
          sums of squares by `_mhc_sumsq_kernel` (one split): not the legacy bits, within float32 rounding.
        * `fused` (the same place, `LONG_PROJ` "fused"): `_mhc_proj_kernel` with TF32X3 over (token block of
          FUSED_BLOCK_T, K chunk) programs, x read once in its dtype, no float32 copy; the K chunks per block
          (`_fused_split`) are the "split" the mix adds in order. NOTE: T blocks alone give 16 programs at
          T = 1024 (64-token blocks) for 132 SMs, and smaller blocks re-read `fn` (1.5 MB) more often, so the
          columns are cut into power-of-two chunks up to ~FUSED_PROGRAMS programs; a chunk's partials are
          [T, NM_PAD] float32 (T = 1024, 16 chunks: 2 MB against 33 MB of x). Within float32 rounding of the
          reference; the chunks follow T, so (like `matmul`) a token's bits do.
        * `_mhc_mix_split_kernel`: the legacy mix over (token block, hidden block) programs (V4-Flash decode:
          16 instead of 1), each re-adding the partials in split order; the same bits.

        `proj` "legacy" pairs `_mhc_proj_kernel` with the new mix (tests and `benchmarks/gpu_mhc.py` isolate the
        mix with it); `block_n` / `block_h` / `dot_t` / `dot_k` override PROJ_BLOCK_N / MIX_BLOCK_H (_LONG) /
        PROJ_DOT_T / PROJ_DOT_K, `fused_block_t` / `fused_block_k` / `fused_split` FUSED_BLOCK_T /
        FUSED_BLOCK_K / the K chunks per token block (benchmark sweeps).
        """
        T, hc, hidden = streams.shape
        num_logits = fn.shape[0]
        kk = hc * hidden
        nm_pad = max(16, triton.next_power_of_2(num_logits))
        dev = streams.device
        if T == 0:
            return (streams.new_empty(0, hidden), torch.empty(0, hc, device=dev), torch.empty(0, hc, hc, device=dev))
        if proj not in ("nsplit", "legacy", "matmul", "fused"):
            raise ValueError(f"proj must be 'nsplit', 'legacy', 'matmul' or 'fused', got {proj!r}")
        if proj == "matmul":
            if _cublas_tf32():
                raise ValueError("mhc: the matmul route needs TF32 off for cuBLAS float32 matmuls")
            split = 1
            ss = torch.empty(T, dtype=torch.float32, device=dev)
            flat = streams.view(T, kk)
            xf = flat if streams.dtype == torch.float32 else torch.empty(T, kk, dtype=torch.float32, device=dev)
            _mhc_sumsq_kernel[(T,)](flat, xf, ss, kk, WRITE=xf is not flat,
                                    BLOCK_K=min(2048, triton.next_power_of_2(kk)), num_warps=4)
            part = F.pad(torch.mm(xf, fn.t()), (0, nm_pad - num_logits))  # [T, nm_pad] float32, TF32 off
        elif proj == "fused":
            bt = FUSED_BLOCK_T if fused_block_t is None else fused_block_t
            bk = FUSED_BLOCK_K if fused_block_k is None else fused_block_k
            if any(v < 16 or v & (v - 1) for v in (bt, bk)):
                raise ValueError(f"mhc: fused_block_t and fused_block_k must be powers of two >= 16, got {bt}, {bk}")
            split, k_chunk = _fused_split(T, kk, bt, bk, fused_split)
            part = torch.empty(split * T * nm_pad, dtype=torch.float32, device=dev)  # [split, T, nm_pad]
            ss = torch.empty(split * T, dtype=torch.float32, device=dev)  # [split, T]
            _mhc_proj_kernel[(triton.cdiv(T, bt), split)](streams, fn, part, ss, T, kk, k_chunk, num_logits,
                                                         NM_PAD=nm_pad, BLOCK_T=bt, BLOCK_K=bk, TF32X3=True,
                                                         num_warps=4)
        else:
            block_t, block_k = 16, 128  # `_mhc_proj_kernel`'s tile: the same x layout and ss tree
            split = triton.cdiv(kk, K_SLICE)
            part = torch.empty(split * T * nm_pad, dtype=torch.float32, device=dev)
            ss = torch.empty(split * T, dtype=torch.float32, device=dev)
            if proj == "legacy":
                _mhc_proj_kernel[(triton.cdiv(T, block_t), split)](streams, fn, part, ss, T, kk, K_SLICE, num_logits,
                                                                   NM_PAD=nm_pad, BLOCK_T=block_t, BLOCK_K=block_k,
                                                                   num_warps=4)
            else:
                bn = min(PROJ_BLOCK_N if block_n is None else block_n, nm_pad)
                dt = PROJ_DOT_T if dot_t is None else dot_t
                dk = PROJ_DOT_K if dot_k is None else dot_k
                if any(v < 1 or v & (v - 1) for v in (bn, dt, dk)) or block_t % dt or K_SLICE % dk or dk < 8:
                    raise ValueError(f"mhc: block_n, dot_t and dot_k must be powers of two, dot_t <= {block_t}, "
                                     f"8 <= dot_k <= {K_SLICE}; got {bn}, {dt}, {dk}")
                _mhc_proj_nsplit_kernel[(triton.cdiv(T, block_t), split, nm_pad // bn)](
                    streams, fn, part, ss, T, kk, K_SLICE, num_logits, NM_PAD=nm_pad, BLOCK_T=block_t,
                    BLOCK_K=block_k, BLOCK_N=bn, DOT_T=dt, DOT_K=dk, num_warps=4)
        collapsed = torch.empty(T, hidden, dtype=streams.dtype, device=dev)
        post = torch.empty(T, hc, dtype=torch.float32, device=dev)
        comb = torch.empty(T, hc, hc, dtype=torch.float32, device=dev)
        mix_bt = 8  # `_mhc_mix_kernel`'s: the same layouts for the softmax's sum
        if block_h is None:
            block_h = MIX_BLOCK_H if T < 1024 else MIX_BLOCK_H_LONG
        bh = min(block_h, triton.next_power_of_2(hidden))
        if bh < 1 or bh & (bh - 1):
            raise ValueError(f"mhc: block_h must be a power of two, got {bh}")
        _mhc_mix_split_kernel[(triton.cdiv(T, mix_bt), triton.cdiv(hidden, bh))](
            streams, part, ss, base, scale, collapsed, post, comb, T, hidden, eps, norm_eps, SPLIT=split,
            ITERS=iters, HC=hc, HC_PAD=triton.next_power_of_2(hc), NM_PAD=nm_pad, HEAD=head, BLOCK_T=mix_bt,
            BLOCK_H=bh, num_warps=4)
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
