"""MoE routing in one kernel: module op `"moe_routing"`, router logits -> (topk_weights, topk_ids).

`(logits [T, E], topk, scoring, scaling, bias [E] | None, tid2eid [V, k] | None, input_ids [T] | None)
-> (weights [T, k] in logits' dtype, ids [T, k] int64)`, the arithmetic of `engine.moe.router.Gate` after
its `F.linear` (the logits stay a cuBLAS matmul, the same call the torch router makes):

  * scores = `scoring`(logits): `sqrtsoftplus` (sqrt(softplus(l)), softplus's threshold 20 as torch's),
    `sigmoid` or `softmax` over the experts;
  * learned routing (`bias` given): the `topk` experts of largest `scores + bias` (the bias selects only);
    hash routing (`tid2eid` given): the experts `tid2eid[input_ids]`;
  * weights = the chosen scores / (their sum + 1e-20) * `scaling`.

Implementations:
  * `"torch"`: the reference (`moe_routing_torch`), exactly the ops `Gate` ran before it called this op
    (so the CPU path is unchanged bit for bit); `torch.topk(sorted=False)` leaves the slot order to torch.
  * `"triton"`: `_routing_kernel`, one program per `BLOCK_T` tokens, the whole row of E scores in registers
    (CUDA, or the CPU under `TRITON_INTERPRET=1`). It rounds to the logits' dtype after every step where
    torch's ops round (softplus, sqrt, the selection sum when the bias has that dtype, the weight sum, the
    division, the scaling), so in bf16 it computes the numbers the torch router computes, up to the last
    float32 bit of exp/log before that rounding (and softmax's sum order).

Top-k rule (NOTE, documented and tested): slot r holds the r-th largest selection value; among equal
values the lower expert id comes first. That is the set CUDA's `torch.topk` keeps (it keeps the lowest
indices among values tied at the k-th place; see `engine.models.deepseek_v4.topk_mask`), so the ids agree
with the torch router as sets; the *slot order* of `torch.topk(sorted=False)` is unspecified, and nothing
downstream depends on it (the `"triton"` MoE backend adds a token's experts in ascending id whatever their
slots). A NaN score is never selected by the kernel (torch ranks NaN highest); if a row had fewer than
`topk` non-NaN values the missing slots would point at expert E-1 (never out of range).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.kernels.registry import check_triton_launch, register_default_impl, register_op

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is optional on CPU-only installs
    triton = None

SCORINGS = ("sqrtsoftplus", "sigmoid", "softmax")
"""The scoring functions of `ModelConfig.scoring_func`, in the kernel's constexpr numbering."""

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_routing_args(name: str, logits: torch.Tensor, topk: int, scoring: str, bias: torch.Tensor | None,
                       tid2eid: torch.Tensor | None, input_ids: torch.Tensor | None) -> None:
    """Raise a ValueError naming `name` and the offending argument unless the arguments fit the op."""
    if logits.dim() != 2:
        raise ValueError(f"{name}: logits must be [num_tokens, num_experts], got {list(logits.shape)}")
    if logits.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name}: logits must be bfloat16, float16 or float32, got {logits.dtype}")
    if scoring not in SCORINGS:
        raise ValueError(f"{name}: scoring must be one of {SCORINGS}, got {scoring!r}")
    num_experts = logits.shape[1]
    if not 1 <= topk <= num_experts:
        raise ValueError(f"{name}: topk must be in [1, {num_experts}], got {topk}")
    if (bias is None) == (tid2eid is None):
        raise ValueError(f"{name}: give exactly one of bias (learned routing) and tid2eid (hash routing)")
    if bias is not None:
        if bias.shape != (num_experts,) or bias.dtype not in (torch.float32, logits.dtype):
            raise ValueError(f"{name}: bias must be [{num_experts}] float32 (or the logits' dtype), got "
                             f"{bias.dtype} {list(bias.shape)}")
        if bias.device != logits.device:
            raise ValueError(f"{name}: bias is on {bias.device}, logits on {logits.device}")
    else:
        if tid2eid.dim() != 2 or tid2eid.shape[1] != topk or tid2eid.dtype.is_floating_point:
            raise ValueError(f"{name}: tid2eid must be an integer table [vocab, topk={topk}], got {tid2eid.dtype} "
                             f"{list(tid2eid.shape)}")
        if input_ids is None or input_ids.shape != (logits.shape[0],) or input_ids.dtype.is_floating_point:
            raise ValueError(f"{name}: hash routing needs integer input_ids [{logits.shape[0]}]")
        if not (tid2eid.device == input_ids.device == logits.device):
            raise ValueError(f"{name}: tid2eid, input_ids and logits must share a device")


def _sqrtsoftplus(logits: torch.Tensor) -> torch.Tensor:
    return F.softplus(logits).sqrt()


def _softmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.softmax(dim=-1)


SCORING_FUNCS = {"sqrtsoftplus": _sqrtsoftplus, "sigmoid": torch.sigmoid, "softmax": _softmax}
"""`scoring` -> logits [num_tokens, num_experts] -> scores (the torch reference's)."""


@register_op("moe_routing", "torch", in_op_table=False)
def moe_routing_torch(logits: torch.Tensor, topk: int, scoring: str, scaling: float, bias: torch.Tensor | None = None,
                      tid2eid: torch.Tensor | None = None,
                      input_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference routing (any device, autograd): (weights [T, k] in logits' dtype, ids [T, k] int64)."""
    scores = SCORING_FUNCS[scoring](logits)  # [num_tokens, num_experts]
    if tid2eid is not None:
        idx = tid2eid[input_ids].long()
    else:
        idx = torch.topk(scores + bias, topk, dim=-1, sorted=False).indices
    w = scores.gather(1, idx)
    w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * scaling, idx


@register_default_impl("moe_routing")
def _default_moe_routing(device: torch.device) -> str:
    # NOTE: the torch router stays the default everywhere; the "triton" MoE backend asks for the kernel.
    return "torch"


BLOCK_T = 4
"""Tokens per program of the routing kernel (each holds its tokens' E scores in registers)."""

if triton is not None:

    from deepinfer.kernels.rope import round_like as _rnd  # x rounded where the torch reference's op rounds

    @triton.jit
    def _routing_kernel(logits_ptr, bias_ptr, table_ptr, ids_in_ptr, w_out_ptr, ids_out_ptr, T, E, stride_l,
                        scaling, TOPK: tl.constexpr, E_POW2: tl.constexpr, SCORING: tl.constexpr,
                        IS_HASH: tl.constexpr, ROUND_SEL: tl.constexpr, BLOCK_T: tl.constexpr):
        rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        col = tl.arange(0, E_POW2)[None, :]
        t_ok = rt < T
        ok = t_ok[:, None] & (col < E)
        lg = tl.load(logits_ptr + rt[:, None].to(tl.int64) * stride_l + col, mask=ok, other=0.0).to(tl.float32)
        if SCORING == 0:  # sqrt(softplus(l)); softplus = l above 20 (torch's threshold), else log1p(exp(l))
            y = tl.exp(tl.minimum(lg, 20.0))
            u = 1.0 + y
            # log1p(y) = log(u) * y / (u - 1) (exact where u rounds to 1: then log1p(y) = y)
            lp = tl.where(u == 1.0, y, tl.log(u) * tl.math.div_rn(y, tl.where(u == 1.0, 1.0, u - 1.0)))
            sp = _rnd(tl.where(lg > 20.0, lg, lp), logits_ptr)
            s = _rnd(tl.sqrt_rn(sp), logits_ptr)
        elif SCORING == 1:
            s = _rnd(tl.math.div_rn(tl.full(lg.shape, 1.0, tl.float32), 1.0 + tl.exp(-lg)), logits_ptr)
        else:
            m = tl.max(tl.where(ok, lg, float("-inf")), axis=1)
            ex = tl.where(ok, tl.exp(lg - m[:, None]), 0.0)
            den = tl.where(t_ok, tl.sum(ex, axis=1), 1.0)  # rows past T: no 0 / 0
            s = _rnd(tl.math.div_rn(ex, den[:, None]), logits_ptr)
        if not IS_HASH:
            sel = s + tl.load(bias_ptr + col, mask=col < E, other=0.0).to(tl.float32)
            if ROUND_SEL:
                sel = _rnd(sel, logits_ptr)
            sel = tl.where(ok, sel, float("-inf"))
            avail = ok
        else:
            tok = tl.load(ids_in_ptr + rt, mask=t_ok, other=0).to(tl.int64)
        total = tl.zeros([BLOCK_T], tl.float32)
        for r in tl.static_range(TOPK):
            if IS_HASH:
                idx = tl.load(table_ptr + tok * TOPK + r, mask=t_ok, other=0).to(tl.int32)
            else:
                # the largest available value, then the lowest expert id holding it (the tie rule)
                best = tl.max(tl.where(avail, sel, float("-inf")), axis=1)
                hit = avail & (sel == best[:, None])
                idx = tl.minimum(tl.min(tl.where(hit, col, E_POW2), axis=1), E - 1)
                avail = avail & (col != idx[:, None])
            w = tl.sum(tl.where(col == idx[:, None], s, 0.0), axis=1)  # exact: one non-zero term
            total += w
            tl.store(ids_out_ptr + rt * TOPK + r, idx.to(tl.int64), mask=t_ok)
            tl.store(w_out_ptr + rt * TOPK + r, w, mask=t_ok)  # the raw score; normalised below
        denom = _rnd(_rnd(total, logits_ptr) + 1e-20, logits_ptr)
        for r in tl.static_range(TOPK):
            w = tl.load(w_out_ptr + rt * TOPK + r, mask=t_ok, other=0.0).to(tl.float32)
            w = _rnd(_rnd(tl.math.div_rn(w, denom), logits_ptr) * scaling, logits_ptr)
            tl.store(w_out_ptr + rt * TOPK + r, w, mask=t_ok)

    @register_op("moe_routing", "triton", in_op_table=False)
    def moe_routing_triton(logits: torch.Tensor, topk: int, scoring: str, scaling: float,
                           bias: torch.Tensor | None = None, tid2eid: torch.Tensor | None = None,
                           input_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing in one launch (see the module docstring for the arithmetic and the top-k rule).

        logits [T, E] bf16/fp16/fp32 with contiguous rows; bias float32 (or logits' dtype) [E], or an
        integer tid2eid [vocab, topk] with input_ids [T]. No autograd, no host sync. On CUDA, or the CPU
        under `TRITON_INTERPRET=1`. Returns (weights [T, topk] in logits' dtype, ids [T, topk] int64).
        """
        check_routing_args("moe_routing_triton", logits, topk, scoring, bias, tid2eid, input_ids)
        check_triton_launch("moe_routing_triton", logits, "logits' rows", block=2)
        num_tokens, num_experts = logits.shape
        if num_experts > 4096:
            raise ValueError(f"moe_routing_triton holds a row of experts in registers: at most 4096, got {num_experts}")
        weights = torch.empty(num_tokens, topk, dtype=logits.dtype, device=logits.device)
        ids = torch.empty(num_tokens, topk, dtype=torch.int64, device=logits.device)
        if num_tokens == 0:
            return weights, ids
        is_hash = tid2eid is not None
        dummy = logits  # an unused pointer argument (never read under a constexpr branch)
        _routing_kernel[(triton.cdiv(num_tokens, BLOCK_T),)](
            logits, dummy if is_hash else bias, tid2eid.contiguous() if is_hash else dummy,
            input_ids.contiguous() if is_hash else dummy, weights, ids, num_tokens, num_experts, logits.stride(0),
            float(scaling), TOPK=topk, E_POW2=triton.next_power_of_2(num_experts), SCORING=SCORINGS.index(scoring),
            IS_HASH=is_hash, ROUND_SEL=not is_hash and bias.dtype != torch.float32 and logits.dtype != torch.float32,
            BLOCK_T=BLOCK_T)
        return weights, ids
