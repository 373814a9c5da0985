"""The MoE routing op (`kernels.moe_routing`): the Triton kernel against the torch reference (the router's
arithmetic), the top-k tie rule, and the wrapper's checks.

The kernel runs on the CPU under `TRITON_INTERPRET=1` in a subprocess (the variable must be set before
triton is imported) on tiny shapes, float32 and float16 (triton's interpreter mishandles bfloat16), and on
CUDA in bf16 against the torch router on the same GPU (`gpu` tests).
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from deepinfer.kernels.moe_routing import check_routing_args, moe_routing_torch
from deepinfer.kernels.registry import default_impl
from tests.kernels._interp import prefetch_interpreted, run_interpreted


def test_reference_normalises_and_scales():
    g = torch.Generator().manual_seed(0)
    logits, bias = torch.randn(6, 8, generator=g), torch.randn(8, generator=g) * 0.1
    w, ids = moe_routing_torch(logits, 3, "sqrtsoftplus", 2.5, bias=bias)
    torch.testing.assert_close(w.sum(-1), torch.full((6,), 2.5))
    scores = torch.nn.functional.softplus(logits).sqrt()
    assert torch.equal(ids.sort(1).values, torch.topk(scores + bias, 3).indices.sort(1).values)
    assert default_impl("moe_routing", "cpu") == "torch"


def test_checks_name_the_bad_argument():
    x = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="exactly one of bias"):
        check_routing_args("r", x, 2, "sigmoid", None, None, None)
    with pytest.raises(ValueError, match="scoring must be one of"):
        check_routing_args("r", x, 2, "tanh", torch.zeros(4), None, None)
    with pytest.raises(ValueError, match="topk must be in"):
        check_routing_args("r", x, 5, "sigmoid", torch.zeros(4), None, None)
    with pytest.raises(ValueError, match="bias must be"):
        check_routing_args("r", x, 2, "sigmoid", torch.zeros(3), None, None)
    with pytest.raises(ValueError, match="tid2eid must be"):
        check_routing_args("r", x, 2, "sigmoid", None, torch.zeros(9, 3, dtype=torch.long), torch.zeros(2).long())
    with pytest.raises(ValueError, match="input_ids"):
        check_routing_args("r", x, 2, "sigmoid", None, torch.zeros(9, 2, dtype=torch.long), None)


_INTERPRETED = textwrap.dedent("""
    import torch
    from deepinfer.kernels.moe_routing import moe_routing_torch, moe_routing_triton, SCORING_FUNCS
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for scoring in ("sqrtsoftplus", "sigmoid", "softmax"):
        for dtype in (torch.float32, torch.float16):
            for T, E, k in ((1, 4, 2), (9, 12, 3), (5, 33, 6)):
                lg = (torch.randn(T, E, generator=g) * 4).to(dtype)
                if scoring != "softmax":  # (a float16 softmax row would underflow: 0 / 0 in both)
                    lg[0, 0] = 30.0  # softplus's linear branch
                bias = torch.randn(E, generator=g) * 0.1
                w0, i0 = moe_routing_torch(lg, k, scoring, 1.5, bias=bias)
                w1, i1 = moe_routing_triton(lg, k, scoring, 1.5, bias=bias)
                # slot r holds the r-th largest selection value, ties to the lower id: a stable descending sort
                sel = SCORING_FUNCS[scoring](lg) + bias
                assert torch.equal(i1, torch.sort(sel, dim=1, descending=True, stable=True).indices[:, :k])
                assert torch.equal(i0.sort(1).values, i1.sort(1).values), (scoring, dtype, i0, i1)
                err = (w0.gather(1, i0.argsort(1)).float() - w1.gather(1, i1.argsort(1)).float()).abs().max().item()
                assert err <= (1e-6 if dtype == torch.float32 else 1e-3), (scoring, dtype, err)
                worst = max(worst, err)
                tab = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(50)])
                ids = torch.randint(0, 50, (T,), generator=g)
                w0, i0 = moe_routing_torch(lg, k, scoring, 1.5, tid2eid=tab, input_ids=ids)
                w1, i1 = moe_routing_triton(lg, k, scoring, 1.5, tid2eid=tab, input_ids=ids)
                assert torch.equal(i0, i1)
                assert ((w0.float() - w1.float()).abs() <= 1e-3 * w0.float().abs() + 1e-6).all()
    # ties: many equal scores (zero bias, repeated logits): the lower ids win, in ascending order
    lg = torch.tensor([[1.0, 2.0, 2.0, 1.0, 2.0, 0.5], [0.0] * 6])
    w, i = moe_routing_triton(lg, 2, "sigmoid", 1.0, bias=torch.zeros(6))
    assert i.tolist() == [[1, 2], [0, 1]], i
    # an empty batch
    w, i = moe_routing_triton(torch.zeros(0, 6), 2, "sigmoid", 1.0, bias=torch.zeros(6))
    assert w.shape == (0, 2) and i.shape == (0, 2)
    print("OK", worst)
""")


def test_triton_kernel_under_the_interpreter():
    pytest.importorskip("triton")
    out = run_interpreted(_INTERPRETED)
    assert "OK" in out, out


# ---------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.parametrize("scoring, num_tokens, num_experts, k", [
    ("sqrtsoftplus", 1, 64, 6), ("sqrtsoftplus", 128, 256, 6), ("sqrtsoftplus", 4096, 64, 6),
    ("sqrtsoftplus", 33, 4, 2), ("sigmoid", 128, 64, 6), ("softmax", 128, 64, 6)])
def test_bf16_matches_the_torch_router_on_cuda(scoring, num_tokens, num_experts, k):
    from deepinfer.kernels.moe_routing import moe_routing_triton

    g = torch.Generator(device="cuda").manual_seed(num_tokens)
    x = torch.randn(num_tokens, 512, device="cuda", generator=g).bfloat16()
    gate = (torch.randn(num_experts, 512, device="cuda", generator=g) * 0.05).bfloat16()
    bias = torch.randn(num_experts, device="cuda", generator=g) * 0.01
    logits = torch.nn.functional.linear(x, gate)
    w0, i0 = moe_routing_torch(logits, k, scoring, 1.5, bias=bias)
    w1, i1 = moe_routing_triton(logits, k, scoring, 1.5, bias=bias)
    same = (i0.sort(1).values == i1.sort(1).values).all(1)
    assert same.float().mean().item() >= 0.999, f"{(~same).sum().item()} rows differ"
    a = w0.gather(1, i0.argsort(1))[same].float()
    b = w1.gather(1, i1.argsort(1))[same].float()
    assert ((a - b).abs() <= 1e-2 * a.abs() + 1e-6).all()  # one bf16 ulp
    tab = torch.randint(0, num_experts, (1000, k), device="cuda", generator=g)
    ids = torch.randint(0, 1000, (num_tokens,), device="cuda", generator=g)
    w0, i0 = moe_routing_torch(logits, k, scoring, 1.5, tid2eid=tab, input_ids=ids)
    w1, i1 = moe_routing_triton(logits, k, scoring, 1.5, tid2eid=tab, input_ids=ids)
    assert torch.equal(i0, i1)
    assert ((w0.float() - w1.float()).abs() <= 1e-2 * w0.float().abs() + 1e-6).all()


@pytest.mark.gpu
def test_ties_follow_cuda_topk():
    """Tied selection values: the kernel keeps the set CUDA's torch.topk keeps (the lowest ids)."""
    from deepinfer.kernels.moe_routing import moe_routing_triton

    logits = torch.zeros(16, 64, device="cuda", dtype=torch.bfloat16)
    logits[:, ::3] = 1.0
    bias = torch.zeros(64, device="cuda")
    w0, i0 = moe_routing_torch(logits, 6, "sqrtsoftplus", 1.0, bias=bias)
    w1, i1 = moe_routing_triton(logits, 6, "sqrtsoftplus", 1.0, bias=bias)
    assert torch.equal(i0.sort(1).values, i1.sort(1).values)
    assert i1[0].tolist() == [0, 3, 6, 9, 12, 15]


# the background run of the interpreter script (tests/kernels/_interp.py: CI time)
prefetch_interpreted(_INTERPRETED, tests=("test_triton_kernel_under_the_interpreter",), timeout=300)
