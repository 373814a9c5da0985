"""The plain-torch MoE backends: the reference for every other backend.

  * `"torch"`: where the weights' device supports `torch._grouped_mm` (decided once, in `prepare`),
    the routed experts' weights are packed into two stacks and every (token, expert) pair runs through
    two grouped matmuls; elsewhere it is `"torch_loop"`.
  * `"torch_loop"`: one small SwiGLU per expert that received tokens.

Both take the single-token path for a batch of one token (decode of one sequence): no sort or scatter,
the chosen experts summed in ascending expert id, which is the order the general paths add in, so the
paths give bit-identical sums.

Quantized experts (w1/w2/w3 are `engine.quant` modules: `Fp8Linear`, `Fp4Linear`) run through both
backends by calling those modules (`module_swiglu`), never their `.weight`; `"torch"` then takes the
per-expert loop (`_grouped_mm` is for plain float weights only). The `"fp4"` backend
(`engine.moe.fp4_backend`) runs FP4 experts grouped.

NOTE: the grouped path is validated on the CPU only; on CUDA `"torch"` keeps the per-expert loop until
it is validated there (`grouped_mm_supported`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.engine.moe.base import MoEBackend, register_moe_backend


def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the `"torch"` backend uses `torch._grouped_mm` for expert weights on `device` in `dtype`."""
    return device.type == "cpu"


def grouped_mm_fast(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `torch._grouped_mm` runs for `dtype` on `device` as one grouped kernel with no host sync: the
    CPU (float32 / bfloat16 / float16), and CUDA bfloat16 on compute capability 9.x / 10.x (torch's CUTLASS
    grouped GEMM). Elsewhere on CUDA (other dtypes or GPUs) torch falls back to copying the group offsets to
    the host and looping over matmuls, a sync per call. Used by the `"triton"` backend's large-batch route
    (`triton_backend.grouped_mm_experts`); the `"torch"` backend keeps `grouped_mm_supported`.
    NOTE: both devices need rows whose strides are multiples of 16 bytes (`grouped_mm_aligned`)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device.type == "cpu":
        return dtype in (torch.float32, torch.bfloat16, torch.float16)
    if device.type == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device)[0] in (9, 10)
    return False


def grouped_mm_aligned(hidden: int, inter: int, dtype: torch.dtype) -> bool:
    """Whether `pack_experts`' stacks of experts [inter, hidden] in `dtype` (and activations of those widths)
    meet `torch._grouped_mm`'s 16-byte stride rule, including the up half of w13 (offset inter * hidden)."""
    return hidden * dtype.itemsize % 16 == 0 and inter * dtype.itemsize % 16 == 0


def has_plain_weights(expert: nn.Module) -> bool:
    """Whether an expert's w1/w2/w3 are plain `nn.Linear`s (float weights), not quantized modules."""
    return all(isinstance(getattr(expert, w), nn.Linear) for w in ("w1", "w2", "w3"))


def module_swiglu(expert: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x [n, H] -> [n, H]: the expert's clamped SwiGLU through its linear *modules* (quantized or not)."""
    g = expert.w1(x).clamp(max=expert.limit)
    u = expert.w3(x).clamp(min=-expert.limit, max=expert.limit)
    return expert.w2(F.silu(g) * u)


def call_expert(expert: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x [n, H] -> [n, H]: the expert's own forward (plain float weights)."""
    return expert(x)


ExpertFn = Callable[[nn.Module, torch.Tensor], torch.Tensor]
"""How a backend runs one expert on its tokens: `call_expert` or `module_swiglu`, picked in `prepare`."""


def expert_fn_for(experts: Sequence[nn.Module]) -> ExpertFn:
    """`call_expert` for plain float experts, `module_swiglu` for quantized ones."""
    return call_expert if has_plain_weights(experts[0]) else module_swiglu


def pack_experts(experts: Sequence[nn.Module]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack the routed experts' weights for one grouped matmul per projection:
    (w13 [E, H, 2*inter] = [w1 | w3] transposed, w2 [E, inter, H]).

    NOTE: the stacks become the only storage: every expert's `w1/w2/w3.weight` is replaced by a
    parameter viewing into them (same `requires_grad`), so memory does not grow and `state_dict()`
    keeps the checkpoint names.
    """
    inter = experts[0].w1.weight.shape[0]
    w13 = torch.stack([torch.cat([ex.w1.weight.detach(), ex.w3.weight.detach()], 0) for ex in experts])  # [E, 2I, H]
    w2 = torch.stack([ex.w2.weight.detach() for ex in experts])  # [E, H, I]
    for e, ex in enumerate(experts):
        rg = ex.w1.weight.requires_grad
        ex.w1.weight = nn.Parameter(w13[e, :inter], requires_grad=rg)
        ex.w3.weight = nn.Parameter(w13[e, inter:], requires_grad=rg)
        ex.w2.weight = nn.Parameter(w2[e], requires_grad=rg)
    return w13.transpose(1, 2), w2.transpose(1, 2)


def single_token_forward(experts: Sequence[nn.Module], x: torch.Tensor, topk_weights: torch.Tensor,
                         topk_ids: torch.Tensor, fn: ExpertFn = call_expert) -> torch.Tensor:
    """x: [1, H] -> [1, H]: the chosen experts in ascending id, each scaled by its weight, summed in that order."""
    ids = topk_ids[0].tolist()
    w = topk_weights.to(x.dtype)
    out = None
    for k in sorted(range(len(ids)), key=ids.__getitem__):
        y = fn(experts[ids[k]], x) * w[:, k:k + 1]
        out = y if out is None else out + y
    return out


def _route(topk_weights: torch.Tensor, topk_ids: torch.Tensor):
    """Every (token, expert) pair in expert order: (expert ids [T*k], token of each pair [T*k],
    its weight [T*k]); the sort is stable, so a token's pairs keep their slot order within an expert."""
    flat_e = topk_ids.reshape(-1)
    order = torch.argsort(flat_e, stable=True)
    return flat_e, order // topk_ids.shape[1], topk_weights.reshape(-1)[order]


def loop_forward(experts: Sequence[nn.Module], x: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, fn: ExpertFn = call_expert) -> torch.Tensor:
    """x: [T, H] -> [T, H]: one SwiGLU per expert over its tokens, scattered back with `index_add_`."""
    out = torch.zeros_like(x)
    flat_e, tok, wsorted = _route(topk_weights, topk_ids)
    counts = torch.bincount(flat_e, minlength=len(experts)).tolist()
    off = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        t = tok[off:off + c]
        y = fn(experts[e], x[t]) * wsorted[off:off + c, None].to(x.dtype)
        out.index_add_(0, t, y)
        off += c
    return out


def grouped_forward(w13: torch.Tensor, w2: torch.Tensor, limit: float, x: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor) -> torch.Tensor:
    """x: [T, H] -> [T, H]: every (token, expert) pair in expert order through two grouped matmuls
    (w13 [E, H, 2*inter], w2 [E, inter, H] from `pack_experts`), scattered back with `index_add_`."""
    inter = w2.shape[1]
    out = torch.zeros_like(x)
    flat_e, tok, wsorted = _route(topk_weights, topk_ids)
    offs = torch.bincount(flat_e, minlength=w13.shape[0]).cumsum(0).to(torch.int32)
    h = torch._grouped_mm(x[tok], w13, offs=offs)  # [T*k, 2*inter]
    g = h[:, :inter].clamp(max=limit)
    u = h[:, inter:].clamp(min=-limit, max=limit)
    y = torch._grouped_mm(F.silu(g) * u, w2, offs=offs) * wsorted[:, None].to(x.dtype)  # [T*k, H]
    out.index_add_(0, tok, y)
    return out


@register_moe_backend("torch_loop")
class TorchLoopMoEBackend(MoEBackend):
    """One SwiGLU per expert that received tokens (any device, autograd); the weights stay as loaded."""

    def __init__(self) -> None:
        self.experts: Sequence[nn.Module] = ()
        self.expert_fn: ExpertFn = call_expert

    def prepare(self, experts: Sequence[nn.Module]) -> None:
        self.experts, self.expert_fn = experts, expert_fn_for(experts)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:
            return single_token_forward(self.experts, x, topk_weights, topk_ids, self.expert_fn)
        return loop_forward(self.experts, x, topk_weights, topk_ids, self.expert_fn)


@register_moe_backend("torch")
class TorchMoEBackend(MoEBackend):
    """Grouped matmuls over packed expert weights where `grouped_mm_supported`, else the per-expert loop.

    NOTE: the weights are packed in `prepare` unless they need a gradient there (packing replaces the
    parameter objects, which would detach them from an optimizer); and a forward that needs a gradient
    takes the loop, since the packed stacks are not the leaves autograd would update.
    """

    def __init__(self) -> None:
        self.experts: Sequence[nn.Module] = ()
        self.packed: tuple[torch.Tensor, torch.Tensor] | None = None
        """(w13 [E, H, 2*inter], w2 [E, inter, H]) views of the experts' storage, or None (loop)."""
        self.limit = 0.0
        self.expert_fn: ExpertFn = call_expert

    def prepare(self, experts: Sequence[nn.Module]) -> None:
        self.experts, self.limit, self.packed = experts, experts[0].limit, None
        self.expert_fn = expert_fn_for(experts)
        first = experts[0].w1.weight
        if (self.expert_fn is call_expert and grouped_mm_supported(first.device, first.dtype)
                and not (first.requires_grad and torch.is_grad_enabled())):
            self.packed = pack_experts(experts)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:
            return single_token_forward(self.experts, x, topk_weights, topk_ids, self.expert_fn)
        if self.packed is None or torch.is_grad_enabled() and self.experts[0].w1.weight.requires_grad:
            return loop_forward(self.experts, x, topk_weights, topk_ids, self.expert_fn)
        return grouped_forward(*self.packed, self.limit, x, topk_weights, topk_ids)
