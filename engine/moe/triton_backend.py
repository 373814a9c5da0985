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
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from torch import nn

from deepinfer.engine.moe.base import MoEBackend, register_moe_backend
from deepinfer.engine.moe.fp4_backend import pack_fp4_experts
from deepinfer.engine.moe.torch_backend import has_plain_weights, pack_experts
from deepinfer.engine.quant.act_quant import fp8_round_activations
from deepinfer.engine.quant.linear import Fp4Linear, Fp8Linear, register_gemm_ops
from deepinfer.kernels import moe_gemm
from deepinfer.kernels.registry import get_op


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
                                 f"{e}.{name} differs")
    inter, bn = first.w1.out_features, first.w1.block[0]
    if inter % bn:
        raise ValueError(f"the 'triton' MoE backend needs the expert width ({inter}) to be a multiple of the FP8 "
                         f"block ({bn})")
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
                             f"{', '.join(kinds)} (use moe_backend='torch')")
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

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        dtype, topk_ids = x.dtype, topk_ids.contiguous()
        x = self.prepare_input(x).contiguous()
        sorted_pairs, counts = self._align(topk_ids, self.w13[0].shape[0])  # [T*k], [E] on the device
        act = self._up(x, self.w13, sorted_pairs, counts, topk_ids.shape[1], self.limit, self.wfmt, self.block)
        act = self.prepare_input(act.to(dtype)).contiguous()
        y = self._down(act, self.w2, sorted_pairs, counts, topk_weights.contiguous(), self.wfmt, self.block).to(dtype)
        return self._combine(y, topk_ids)  # [T, H]
