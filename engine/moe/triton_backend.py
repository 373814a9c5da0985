"""The `"triton"` MoE backend: routed experts as grouped GEMMs with no host sync, CUDA-graph safe.

`forward(x, topk_weights, topk_ids)` is four launches whose shapes depend on the token count only
(`kernels.moe_gemm`): group the R = T * k (token, expert) pairs by expert on the device (`moe_align`:
sorted pairs and rows per expert as device tensors), the gate/up projections with the clamped SwiGLU
fused (`moe_up`, gathering each pair's token row), the down projection times the routing weight
(`moe_down`), and the per-token sum of its k rows in ascending expert id (`moe_combine`, no atomics:
deterministic). With it the router runs as one kernel too (`routing_impl = "triton"`,
`kernels.moe_routing`), so the routed part of a MoE layer is the gate's matmul plus five launches.

Experts: plain float linears (bf16 / fp16 / fp32, stacked in `prepare` by `torch_backend.pack_experts`:
w13 [E, 2I, H], w2 [E, H, I]), FP4 `engine.quant.Fp4Linear`s (stacked by `fp4_backend.pack_fp4_experts`,
decoded in registers) or FP8 block-scaled `engine.quant.Fp8Linear`s (`pack_fp8_experts`; with
`act_quant` the activations are first rounded onto the FP8 grid as `Fp8Linear` does); either way the
stacks become the experts' storage (`state_dict()` keeps the checkpoint names, memory does not grow).

Arithmetic: that of `"torch"` / `"torch_loop"` (rounding to x's dtype after each projection, the clamps,
silu, the product, the weighting and each add of the combine, a token's experts added in ascending id),
up to the float32 summation order inside the dot products; no autograd.

On CUDA (or the CPU under `TRITON_INTERPRET=1`) the Triton kernels run; elsewhere `prepare` picks the
ops' torch references (the same arithmetic, host loops), so the backend works on any device.

Large batches (prefill): the fixed-tile grouped kernels reach ~114 TFLOP/s on the H200 at 8,192 tokens, where
torch's CUTLASS grouped GEMM is far faster at that size. So a forward with R = T * k rows at or above
`grouped_mm_min_rows` (env `DEEPINFER_MOE_GROUPED_MM_MIN_ROWS`, read when the backend is constructed; an
attribute you may assign; default `DEFAULT_GROUPED_MM_MIN_ROWS`, 0 = off) runs the two projections
through `torch._grouped_mm` instead (`grouped_mm_experts`): the same align and combine ops around them,
the `"swiglu"` op between, the weights the same packed stacks viewed transposed (no copy). Only plain float
experts whose device and dtype have a fused `_grouped_mm` (`torch_backend.grouped_mm_fast`: bf16 on
sm90/sm100, any float on the CPU); FP8/FP4 experts keep their kernels. R is a host int from the batch's
shape, so the choice never syncs; decode sizes stay below any sensible threshold, and a forward inside a
CUDA-graph capture never takes the route, so captured decode steps are the four kernels whatever the
threshold; nor does a forward of at most `graph_tokens` tokens (the largest graph's tokens, which the graph runners
record with `keep_graph_shapes_off_grouped_mm`), so that a graph's eager warm-up or an eager fallback of its shape
computes the bits its replays do. Measured on an H100 (2026-12-05, V4-Flash-shaped 4-layer stack, 8,192-token
prefill, with the mHC "split" variant): 89.3 -> 70.1 ms a prefill step with the route at 4,096 rows; decode
unchanged (graphs). The batch-invariant mode never reaches it: `engine.batch_invariant` swaps this backend for
`BatchInvariantTritonMoEBackend` (one tile config for every batch, never the route).

FP4 experts (the published V4 checkpoints) take a route of their own from `fp4_dequant_rows_per_expert` rows per
expert on average (env `DEEPINFER_MOE_FP4_DEQUANT_ROWS_PER_EXPERT`, default `DEFAULT_FP4_DEQUANT_ROWS_PER_EXPERT`,
0 = off; also at least `grouped_mm_min_rows` rows, and bf16 activations): `fp4_grouped_mm_experts` dequantizes a
group of experts at a time to bf16 (the `"fp4_dequant"` op, exact) into a bounded scratch and runs the same
`_grouped_mm` projections on that group's rows. The Triton FP4 kernels decode every weight tile once per
BLOCK_M rows of its expert (integer ops in registers: Hopper has no FP4 conversion), which bounds them at
prefill sizes; the route decodes each weight once a forward, at the cost of writing and reading the bf16 copy
(8x the FP4 bytes) and one host sync (the group boundaries), so it pays only with many rows per expert.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from torch import nn

from deepinfer.engine.moe.base import MoEBackend, register_moe_backend
from deepinfer.engine.moe.fp4_backend import pack_fp4_experts
from deepinfer.engine.moe.torch_backend import grouped_mm_aligned, grouped_mm_fast, has_plain_weights, pack_experts
from deepinfer.engine.quant.act_quant import fp8_round_activations
from deepinfer.engine.quant.linear import Fp4Linear, Fp8Linear, register_gemm_ops
from deepinfer.kernels import moe_gemm
from deepinfer.kernels.registry import get_op

_AUTO_HINT = ("; pass moe_backend='torch' for these experts (the default moe_backend='auto' picks 'triton' on a CUDA "
              "device)")


def triton_usable(device: torch.device) -> bool:
    """Whether the Triton kernels run for tensors on `device` (CUDA with triton, or the CPU interpreter)."""
    if moe_gemm.triton is None:
        return False
    return device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def pack_fp8_experts(experts: Sequence[nn.Module]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stack FP8 experts: (w13 e4m3 [E, 2I, H], s13 [E, 2I/bn, H/bk], w2 e4m3 [E, H, I], s2 [E, H/bn, I/bk]).

    The experts' parameters are replaced by views into the stacks (as `pack_fp4_experts` does); the gate
    and up halves must be whole scale blocks (I a multiple of bn).
    """
    first = experts[0]
    for e, ex in enumerate(experts):
        for name in ("w1", "w2", "w3"):
            mod, ref = getattr(ex, name), getattr(first, name)
            if not isinstance(mod, Fp8Linear) or (mod.in_features, mod.out_features, mod.block,
                                                   mod.scale.dtype) != (ref.in_features, ref.out_features,
                                                                        ref.block, ref.scale.dtype):
                raise ValueError(f"the 'triton' MoE backend needs FP8 experts of one shape and block; expert "
                                 f"{e}.{name} differs{_AUTO_HINT}")
    inter, bn = first.w1.out_features, first.w1.block[0]
    if inter % bn:
        raise ValueError(f"the 'triton' MoE backend needs the expert width ({inter}) to be a multiple of the FP8 "
                         f"block ({bn}){_AUTO_HINT}")
    w13 = torch.stack([torch.cat([ex.w1.weight.detach(), ex.w3.weight.detach()]) for ex in experts])
    s13 = torch.stack([torch.cat([ex.w1.scale.detach(), ex.w3.scale.detach()]) for ex in experts])
    w2 = torch.stack([ex.w2.weight.detach() for ex in experts])
    s2 = torch.stack([ex.w2.scale.detach() for ex in experts])
    for e, ex in enumerate(experts):
        ex.w1.weight = nn.Parameter(w13[e, :inter], requires_grad=False)
        ex.w3.weight = nn.Parameter(w13[e, inter:], requires_grad=False)
        ex.w1.scale = nn.Parameter(s13[e, :inter // bn], requires_grad=False)
        ex.w3.scale = nn.Parameter(s13[e, inter // bn:], requires_grad=False)
        ex.w2.weight = nn.Parameter(w2[e], requires_grad=False)
        ex.w2.scale = nn.Parameter(s2[e], requires_grad=False)
    return w13, s13, w2, s2


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


GROUPED_MM_MIN_ROWS_ENV = "DEEPINFER_MOE_GROUPED_MM_MIN_ROWS"
"""Environment knob: the (token, expert) rows from which a `"triton"` backend runs its projections through
`torch._grouped_mm` (`TritonMoEBackend.grouped_mm_min_rows`; read at construction; unset =
`DEFAULT_GROUPED_MM_MIN_ROWS`, 0 = never)."""
DEFAULT_GROUPED_MM_MIN_ROWS = 4096
"""The route from 4,096 (token, expert) rows (683 tokens at V4's top-6). NOTE: the H100 run of 2026-12-05 measured
the route at this threshold against none on an 8,192-token prefill (49,152 rows), not the crossover itself;
`benchmarks/moe_kernels.py --parts prefill,routed --tokens 256,1024,4096` measures it."""


def grouped_mm_min_rows_from_env() -> int:
    """`DEEPINFER_MOE_GROUPED_MM_MIN_ROWS` as a non-negative int (`DEFAULT_GROUPED_MM_MIN_ROWS` when unset); a
    ValueError otherwise."""
    return _nonneg_int_env(GROUPED_MM_MIN_ROWS_ENV, DEFAULT_GROUPED_MM_MIN_ROWS)


FP4_DEQUANT_ROWS_PER_EXPERT_ENV = "DEEPINFER_MOE_FP4_DEQUANT_ROWS_PER_EXPERT"
"""Environment knob: the average (token, expert) rows per expert from which a `"triton"` backend with FP4 experts
takes the dequantize-then-`_grouped_mm` route (`TritonMoEBackend.fp4_dequant_rows_per_expert`; read at
construction; unset = `DEFAULT_FP4_DEQUANT_ROWS_PER_EXPERT`, 0 = never)."""
DEFAULT_FP4_DEQUANT_ROWS_PER_EXPERT = 160
"""The measured crossover (H100, 2026-12-06, `benchmarks/moe_kernels.py --parts prefill_fp4`, V4-Flash widths): the
four kernels win at 96 rows per expert (64 experts 2.5 vs 3.5 ms, 256 experts 9.1 vs 13.0 ms), the route from 192
(256 experts 14.3 vs 17.9 ms; 64 experts at 384 4.9 vs 8.1 ms, at 768 6.7 vs 14.3 ms); interpolated, they cross at
~145-165."""
FP4_DEQUANT_SCRATCH_BYTES = 1 << 30
"""The bf16 scratch the FP4 route dequantizes into (a group of experts at a time: 16 of V4-Flash's 48 MiB ones)."""


def _nonneg_int_env(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    try:
        value = int(raw) if raw.strip() else default
    except ValueError:
        raise ValueError(f"{name} must be a non-negative integer, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"{name} must be a non-negative integer (0 = off), got {value}")
    return value


def _expert_projections(xs: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, offs: torch.Tensor, limit: float,
                        swiglu) -> torch.Tensor:
    """Rows xs [R, H] sorted by expert (group ends `offs`) through float stacks w13 [G, 2I, H] (gate rows, then
    up rows) and w2 [G, H, I] -> [R, H]: gate and up as two grouped GEMMs (each comes out contiguous for the
    SwiGLU op), the clamped SwiGLU, the down projection."""
    inter = w2.shape[2]
    w13t = w13.transpose(1, 2)  # [G, H, 2I] K-major (the layout `pack_experts` returns)
    g = torch._grouped_mm(xs, w13t[:, :, :inter], offs=offs)  # [R, I]
    u = torch._grouped_mm(xs, w13t[:, :, inter:], offs=offs)  # [R, I]
    act = swiglu(g, u, limit)  # [R, I]
    del g, u
    return torch._grouped_mm(act, w2.transpose(1, 2), offs=offs)  # [R, H]


def _combine_sorted(y_sorted: torch.Tensor, sorted_pairs: torch.Tensor, topk_ids: torch.Tensor,
                    topk_weights: torch.Tensor, combine) -> torch.Tensor:
    rows = torch.empty_like(sorted_pairs)  # pair p's row of y_sorted (the inverse of the sort)
    rows.scatter_(0, sorted_pairs.long(), torch.arange(rows.numel(), dtype=rows.dtype, device=rows.device))
    # NOTE: the combine gathers each pair's row, weights it (one rounding of a product of two x-dtype values) and
    # adds a token's rows in ascending expert id: the bits of putting the rows back, weighting them and combining,
    # without the second [R, H] and its two passes (H100, 8,192 tokens at top-6: ~1.2 ms a layer of index_copy_ and
    # mul_ in the 2026-12-05 profile)
    return combine(y_sorted, topk_ids, rows=rows, weights=topk_weights)  # [T, H]


def _check_route_inputs(name: str, x: torch.Tensor, hidden: int, dtype: torch.dtype, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor) -> None:
    if x.dim() != 2 or x.shape[1] != hidden or x.dtype != dtype:
        raise ValueError(f"{name}: x must be [T, {hidden}] in the experts' dtype {dtype}, "
                         f"got {x.dtype} {list(x.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"{name}: topk_ids and topk_weights must be [T={x.shape[0]}, k], got "
                         f"{list(topk_ids.shape)} and {list(topk_weights.shape)}")


def grouped_mm_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor,
                       w2: torch.Tensor, limit: float, align, swiglu, combine) -> torch.Tensor:
    """The routed experts with both projections as `torch._grouped_mm`: x [T, H] -> [T, H] in x's dtype.

    w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I] are the backend's contiguous float stacks, read
    transposed (views, no copy); `align`, `swiglu`, `combine` are the `"moe_align"`, `"swiglu"` and
    `"moe_combine"` implementations. Steps: align the T * k pairs by expert; gather each sorted pair's token
    row; gate and up as two grouped GEMMs (so each comes out contiguous for the SwiGLU op) -> [R, I]; the
    clamped SwiGLU; the down projection -> [R, H] in expert order; the combine, reading pair p (p = t * k + slot)
    at its sorted row, times the pair's weight rounded to x's dtype, a token's rows added in ascending expert id.

    Arithmetic: the Triton path's roundings (each projection, the clamps, silu, the product, the weighting,
    each add of the combine) up to the float32 summation order inside the GEMMs. No host sync (the offsets
    are a device cumsum of the align's counts) on the devices of `torch_backend.grouped_mm_fast`.
    NOTE (memory): no copy of the weights. Transient activations: the gathered x [R, H] with gate and up
    [R, I] each, then act [R, I] with the down projection's [R, H]: a peak of R (H + 2I) elements, 0.8 GB for
    8,192 tokens at top-6, H 4096, I 2048 in bf16, where the Triton path holds act [R, I] and the pair rows
    [R, H] (0.6 GB).
    """
    _check_route_inputs("grouped_mm_experts", x, w13.shape[2], w13.dtype, topk_weights, topk_ids)
    sorted_pairs, counts = align(topk_ids, w13.shape[0])  # [R], [E] on the device
    offs = counts.cumsum(0, dtype=torch.int32)
    xs = x.index_select(0, sorted_pairs // topk_ids.shape[1])  # [R, H] each sorted pair's token row
    y_sorted = _expert_projections(xs, w13, w2, offs, limit, swiglu)  # [R, H] rows in expert order
    del xs
    return _combine_sorted(y_sorted, sorted_pairs, topk_ids, topk_weights, combine)


def fp4_grouped_mm_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                           w13: tuple[torch.Tensor, torch.Tensor], w2: tuple[torch.Tensor, torch.Tensor], block: int,
                           limit: float, align, swiglu, combine, dequant,
                           scratch_bytes: int = FP4_DEQUANT_SCRATCH_BYTES) -> torch.Tensor:
    """The routed FP4 experts at prefill sizes: x [T, H] bf16 -> [T, H] bf16, `grouped_mm_experts` over weights
    dequantized a group of experts at a time.

    w13 = (packed int8 [E, 2I, H/2], scales e8m0 [E, 2I, H/block]) and w2 = (packed [E, H, I/2], scales
    [E, H, I/block]) are the backend's FP4 stacks; `dequant` the `"fp4_dequant"` implementation. The experts go in
    groups of as many as fit `scratch_bytes` of bf16 (at least one); a group whose experts got no row is skipped.
    Each group's rows (a contiguous run of the expert-sorted pairs) take `_expert_projections` and land in their
    rows of the sorted output; the combine is `grouped_mm_experts`'s.

    Arithmetic: the FP4 Triton path's (every dequantized weight is exact in bf16; bf16 products summed in float32,
    rounded after each projection) up to the float32 summation order. NOTE: one host sync (the group boundaries
    from the align's counts): eager prefill only, never inside a CUDA-graph capture (`uses_grouped_mm`).
    NOTE (memory): the scratch (<= `scratch_bytes`, 2 (2I H + H I) bytes an expert) plus the transients of
    `grouped_mm_experts` for one group's rows, and the gathered x and sorted output [R, H] each.
    """
    (p13, s13), (p2, s2) = w13, w2
    num_experts, n13, hidden = p13.shape[0], p13.shape[1], 2 * p13.shape[2]
    inter = 2 * p2.shape[2]
    _check_route_inputs("fp4_grouped_mm_experts", x, hidden, torch.bfloat16, topk_weights, topk_ids)
    per_expert = 2 * (n13 * hidden + hidden * inter)
    group = max(1, min(num_experts, scratch_bytes // per_expert))
    sorted_pairs, counts = align(topk_ids, num_experts)  # [R], [E] on the device
    offs = counts.cumsum(0, dtype=torch.int32)
    ends = [0] + offs.tolist()  # the host sync: row boundaries of every expert
    xs = x.index_select(0, sorted_pairs // topk_ids.shape[1])  # [R, H]
    y_sorted = torch.empty_like(xs)
    w13b = torch.empty(group, n13, hidden, dtype=torch.bfloat16, device=x.device)
    w2b = torch.empty(group, hidden, inter, dtype=torch.bfloat16, device=x.device)
    for e0 in range(0, num_experts, group):
        e1 = min(num_experts, e0 + group)
        r0, r1 = ends[e0], ends[e1]
        if r1 == r0:
            continue
        ng = e1 - e0
        dequant(p13[e0:e1], s13[e0:e1], block, out=w13b[:ng])
        dequant(p2[e0:e1], s2[e0:e1], block, out=w2b[:ng])
        y_sorted[r0:r1] = _expert_projections(xs[r0:r1], w13b[:ng], w2b[:ng], offs[e0:e1] - r0, limit, swiglu)
    del xs, w13b, w2b
    return _combine_sorted(y_sorted, sorted_pairs, topk_ids, topk_weights, combine)


@register_moe_backend("triton")
class TritonMoEBackend(MoEBackend):
    """Grouped expert GEMMs in four launches, no host sync (see the module docstring)."""

    cuda_graph_safe = True

    def __init__(self) -> None:
        self.experts: Sequence[nn.Module] = ()
        self.w13: tuple[torch.Tensor, ...] = ()
        """Stacked gate|up weights: float ([E, 2I, H],) or FP4 (packed [E, 2I, H/2], scales [E, 2I, H/32])."""
        self.w2: tuple[torch.Tensor, ...] = ()
        """Stacked down weights: float ([E, H, I],) or FP4 (packed [E, H, I/2], scales [E, H, I/32])."""
        self.wfmt = moe_gemm.WFMT_FLOAT
        self.block = 32
        self.limit = 0.0
        self.impl_name = ""
        """"triton" or "torch" (the ops' references), picked in `prepare` from the weights' device."""
        self.prepare_input = _identity
        """Applied to x and to the SwiGLU output before each projection (FP8 activation rounding, or nothing)."""
        self.grouped_mm_min_rows = grouped_mm_min_rows_from_env()
        """Rows (tokens x top-k) from which `forward` runs `grouped_mm_experts` where `grouped_mm_usable`;
        0 = never. From `DEEPINFER_MOE_GROUPED_MM_MIN_ROWS` at construction; assignable."""
        self.graph_tokens = 0
        """The most tokens a CUDA graph of this model computes (`keep_graph_shapes_off_grouped_mm`): a forward of at
        most that many tokens never takes the route, whatever the threshold."""
        self.grouped_mm_usable = False
        """Whether the experts can take the `_grouped_mm` route: plain float stacks whose device and dtype have
        a fused `_grouped_mm` with aligned strides (decided in `prepare`; never for FP8 / FP4)."""
        self.fp4_dequant_rows_per_expert = _nonneg_int_env(FP4_DEQUANT_ROWS_PER_EXPERT_ENV,
                                                           DEFAULT_FP4_DEQUANT_ROWS_PER_EXPERT)
        """Average rows per expert from which FP4 experts take `fp4_grouped_mm_experts` (0 = never); from
        `DEEPINFER_MOE_FP4_DEQUANT_ROWS_PER_EXPERT` at construction; assignable."""
        self.fp4_dequant_scratch_bytes = FP4_DEQUANT_SCRATCH_BYTES
        """The bf16 scratch of the FP4 route (`fp4_grouped_mm_experts`'s `scratch_bytes`); assignable."""
        self.fp4_route_usable = False
        """Whether FP4 experts can take their dequantize route: bf16 `_grouped_mm` fused on their device, aligned
        widths (decided in `prepare`); the activations must also be bf16 (checked per forward)."""

    def prepare(self, experts: Sequence[nn.Module]) -> None:
        first = experts[0]
        if has_plain_weights(first):
            w13t, w2t = pack_experts(experts)  # views [E, H, 2I], [E, I, H] of contiguous stacks
            self.w13, self.w2 = (w13t.transpose(1, 2),), (w2t.transpose(1, 2),)
            self.wfmt = moe_gemm.WFMT_FLOAT
        elif all(isinstance(getattr(first, n), Fp4Linear) for n in ("w1", "w2", "w3")):
            w13, s13, w2, s2 = pack_fp4_experts(experts)
            self.w13, self.w2, self.block = (w13, s13), (w2, s2), first.w1.block
            self.wfmt = moe_gemm.WFMT_FP4
        elif all(isinstance(getattr(first, n), Fp8Linear) for n in ("w1", "w2", "w3")):
            w13, s13, w2, s2 = pack_fp8_experts(experts)
            self.w13, self.w2, self.block = (w13, s13), (w2, s2), tuple(first.w1.block)
            self.wfmt = moe_gemm.WFMT_FP8
        else:
            kinds = sorted({type(getattr(first, n)).__name__ for n in ("w1", "w2", "w3")})
            raise ValueError(f"the 'triton' MoE backend runs float, FP4 or FP8 experts of one kind, not "
                             f"{', '.join(kinds)}{_AUTO_HINT}")
        register_gemm_ops()
        self.prepare_input = (fp8_round_activations if self.wfmt == moe_gemm.WFMT_FP8 and first.w1.act_quant
                              else _identity)
        if not all(t.is_contiguous() for t in (*self.w13, *self.w2)):
            raise ValueError("the 'triton' MoE backend needs contiguous expert stacks")
        self.experts, self.limit = experts, float(first.limit)
        self.impl_name = "triton" if triton_usable(self.w13[0].device) else "torch"
        self.routing_impl = self.impl_name
        self._align = get_op("moe_align", self.impl_name)
        self._up = get_op("moe_up", self.impl_name)
        self._down = get_op("moe_down", self.impl_name)
        self._combine = get_op("moe_combine", self.impl_name)
        self._swiglu = get_op("swiglu", self.impl_name)
        w = self.w13[0]
        self.grouped_mm_usable = (self.wfmt == moe_gemm.WFMT_FLOAT and grouped_mm_fast(w.device, w.dtype)
                                  and grouped_mm_aligned(w.shape[2], w.shape[1] // 2, w.dtype))
        self.fp4_route_usable = (self.wfmt == moe_gemm.WFMT_FP4 and grouped_mm_fast(w.device, torch.bfloat16)
                                 and grouped_mm_aligned(2 * w.shape[2], w.shape[1] // 2, torch.bfloat16))
        if self.fp4_route_usable:
            self._dequant = get_op("fp4_dequant", self.impl_name)

    def uses_grouped_mm(self, num_rows: int, num_tokens: int | None = None,
                        x_dtype: torch.dtype = torch.bfloat16) -> bool:
        """Whether a forward of `num_rows` (token, expert) rows of `num_tokens` tokens with activations in `x_dtype`
        takes a `_grouped_mm` route (host values only; False inside a CUDA-graph capture and for at most
        `graph_tokens` tokens, so captured steps and their eager warm-ups / fallbacks keep the four kernels). FP4
        experts also need `fp4_dequant_rows_per_expert` rows per expert on average and bf16 activations."""
        if self.fp4_route_usable:
            num_experts = self.w13[0].shape[0]
            usable = (x_dtype == torch.bfloat16
                      and 0 < self.fp4_dequant_rows_per_expert * num_experts <= num_rows)
        else:
            usable = self.grouped_mm_usable
        return (usable and 0 < self.grouped_mm_min_rows <= num_rows
                and (num_tokens is None or num_tokens > self.graph_tokens)
                and not (self.w13[0].is_cuda and torch.cuda.is_current_stream_capturing()))

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if self.uses_grouped_mm(topk_ids.numel(), topk_ids.shape[0], x.dtype):  # prefill: see the module docstring
            args = (x.contiguous(), topk_weights.contiguous(), topk_ids.contiguous())
            if self.fp4_route_usable:
                return fp4_grouped_mm_experts(*args, self.w13, self.w2, self.block, self.limit, self._align,
                                              self._swiglu, self._combine, self._dequant,
                                              self.fp4_dequant_scratch_bytes)
            return grouped_mm_experts(*args, self.w13[0], self.w2[0], self.limit, self._align, self._swiglu,
                                      self._combine)
        dtype, topk_ids = x.dtype, topk_ids.contiguous()
        x = self.prepare_input(x).contiguous()
        sorted_pairs, counts = self._align(topk_ids, self.w13[0].shape[0])  # [T*k], [E] on the device
        act = self._up(x, self.w13, sorted_pairs, counts, topk_ids.shape[1], self.limit, self.wfmt, self.block)
        act = self.prepare_input(act.to(dtype)).contiguous()
        y = self._down(act, self.w2, sorted_pairs, counts, topk_weights.contiguous(), self.wfmt, self.block).to(dtype)
        return self._combine(y, topk_ids)  # [T, H]


def keep_graph_shapes_off_grouped_mm(model: nn.Module, max_tokens: int) -> None:
    """Record on every `"triton"` MoE backend of `model` that CUDA graphs compute up to `max_tokens` tokens a step
    (the graph runners call this with their largest bucket x queries per request), so that no forward of a graph's
    shape, captured or eager, takes the `_grouped_mm` route."""
    for module in model.modules():
        backend = module.__dict__.get("backend")
        backend = getattr(backend, "inner", backend)  # expert parallelism wraps the local experts' backend
        if isinstance(backend, TritonMoEBackend):
            backend.graph_tokens = max(backend.graph_tokens, int(max_tokens))
