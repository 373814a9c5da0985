"""The decode indexer (`kernels.indexer`): the torch reference against the model's `Indexer.score_batched`
and `topk_mask` (the tie rule), the Triton scores + top-k against the reference (CPU under
`TRITON_INTERPRET=1` in a subprocess; CUDA with exactly representable data, so the indices must match
bit for bit, ties included).
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from deepinfer.engine.config import ModelConfig
from deepinfer.engine.models.deepseek_v4 import Indexer, topk_mask
from deepinfer.engine.testing.presets import PRESETS
from deepinfer.kernels.indexer import indexer_scores_torch, indexer_topk_torch, select_topk
from tests.kernels._interp import prefetch_interpreted, run_interpreted


def make_case(B=5, IH=8, ID=16, N=12, epb=4, MB=4, rate=4, seed=0, integer=False, dtype=torch.float32,
              device="cpu"):
    """Random decode-indexer inputs; `integer`: small integers and power-of-two weights (exact sums in any
    order), with many exact ties. The last row is a padding row (position 0, padding blocks)."""
    g = torch.Generator().manual_seed(seed)
    if integer:
        q = torch.randint(-2, 3, (B, IH, ID), generator=g).float()
        pool = torch.randint(-1, 2, (N, epb, ID), generator=g).float()
        w = 2.0 ** torch.randint(-3, 3, (B, IH), generator=g).float() * (torch.randint(0, 2, (B, IH), generator=g) * 2 - 1)
    else:
        q, pool = torch.randn(B, IH, ID, generator=g), torch.randn(N, epb, ID, generator=g)
        w = torch.randn(B, IH, generator=g)
        pool[0, 1] = 0  # an all-zero key: scores exactly 0 (ties)
        pool[1, epb - 1] = 0
    pos = torch.randint(0, MB * epb * rate, (B,), generator=g)
    pos[0] = MB * epb * rate - 1
    pos[-1] = 0
    bt = torch.stack([torch.randperm(N, generator=g)[:MB] for _ in range(B)])
    bt[-1] = N
    return dict(q=q.to(dtype=dtype, device=device), weights=w.to(device), pool=pool.to(dtype=dtype, device=device),
                pos=pos.to(device), block_tables=bt.to(device), rate=rate)


def test_scores_are_the_models():
    config = ModelConfig.from_hf_dict(PRESETS["tiny"].hf_config())
    torch.manual_seed(0)
    indexer = Indexer(config, 4)
    B, rd = 3, config.rope_head_dim
    q_res, x = torch.randn(B, config.q_lora_rank), torch.randn(B, config.hidden_size)
    cos, sin = torch.randn(B, rd // 2), torch.randn(B, rd // 2)
    c = make_case(B=B, IH=indexer.num_heads, ID=indexer.head_dim)
    c["block_tables"][-1] = c["block_tables"][0]  # no padding row here
    q = indexer._queries(q_res, cos, sin)
    weights = indexer.weights_proj(x).float() * indexer.num_heads**-0.5
    scores = indexer_scores_torch(q, weights, c["pool"], c["pos"], c["block_tables"], 4)
    epb = c["pool"].shape[1]
    C = c["block_tables"].shape[1] * epb
    rows = c["block_tables"][:, torch.arange(C) // epb] * epb + torch.arange(C) % epb
    keys = c["pool"].reshape(-1, c["pool"].shape[-1])[rows]  # [B, C, ID]
    ref = indexer.score_batched(q_res, x, keys, cos, sin)
    visible = torch.arange(C)[None, :] < ((c["pos"] + 1) // 4)[:, None]
    torch.testing.assert_close(scores[visible], ref[visible], atol=1e-6, rtol=1e-6)
    assert torch.all(scores[~visible] == float("-inf"))


@pytest.mark.parametrize("integer", [False, True])
@pytest.mark.parametrize("k", [1, 3, 7, 16, 40])
def test_selection_is_the_tie_rule(integer, k):
    c = make_case(seed=k, integer=integer)
    scores = indexer_scores_torch(c["q"], c["weights"], c["pool"], c["pos"], c["block_tables"], 4)
    idx = indexer_topk_torch(**c, topk=k)
    assert idx.shape == (5, k)
    num_vis = (c["pos"] + 1) // 4
    C = scores.shape[1]
    visible = torch.arange(C)[None, :] < num_vis[:, None]
    want = topk_mask(scores, visible, k)
    for b in range(5):
        got = [int(i) for i in idx[b] if i >= 0]
        assert got == sorted(got) and all(i == -1 for i in idx[b, len(got):].tolist())  # ascending, valid first
        assert got == torch.nonzero(want[b])[:, 0].tolist(), b
    assert torch.all(idx[-1] == -1)  # the padding row selects nothing


def test_select_topk_breaks_ties_by_index():
    scores = torch.tensor([[0.0, 1.0, 0.0, -0.0, 1.0, 0.0, float("-inf")]])
    assert select_topk(scores, torch.tensor([6]), 3).tolist() == [[0, 1, 4]]
    assert select_topk(scores, torch.tensor([2]), 3).tolist() == [[0, 1, -1]]


_INTERPRETED = textwrap.dedent("""
    import torch
    from tests.kernels._kernel_checks import assert_refused
    from tests.kernels.test_indexer import make_case
    from deepinfer.kernels.indexer import indexer_scores_torch, indexer_topk_torch, indexer_topk_triton
    for seed, kw in [(0, {}), (1, dict(integer=True)), (2, dict(IH=5, ID=32, epb=2, rate=8, MB=6)),
                     (3, dict(integer=True, epb=8, MB=3))]:
        c = make_case(seed=seed, **kw)
        for k in (1, 4, 9, 64):
            for block_c in (16, 32):
                got = indexer_topk_triton(**c, topk=k, block_c=block_c)
                ref = indexer_topk_torch(**c, topk=k)
                assert torch.equal(got, ref), (seed, k, block_c, got, ref)
    c = make_case()
    for bad, msg in [(dict(weights=c["weights"].double()), "weights must be"), (dict(q=c["q"].half()), "one dtype"),
                     (dict(pos=c["pos"].int()), "int64")]:
        assert_refused(lambda: indexer_topk_triton(**{**c, **bad}, topk=4), msg)
    print("ok")
""")


def test_triton_kernel_under_interpreter():
    pytest.importorskip("triton")
    out = run_interpreted(_INTERPRETED, timeout=600)
    assert out.strip() == "ok", out


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernel_on_cuda(dtype):
    """V4-Flash indexer sizes (64 heads, top-512, CSA rate 4; head dim 64, not 128, so that its scale
    64**-0.5 is a power of two) with small-integer data: every score is exact in any summation order,
    so the CUDA selection (torch.topk) must equal the CPU reference's (stable sort), ties included."""
    from deepinfer.kernels.indexer import indexer_topk_triton

    c = make_case(B=6, IH=64, ID=64, N=80, epb=32, MB=48, rate=4, seed=3, integer=True, dtype=dtype)
    ref = indexer_topk_torch(**c, topk=512)
    gpu = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in c.items()}
    assert torch.equal(indexer_topk_triton(**gpu, topk=512).cpu(), ref)
    assert torch.equal(indexer_topk_torch(**gpu, topk=512).cpu(), ref)


# the background run of the interpreter script (tests/kernels/_interp.py: CI time)
prefetch_interpreted(_INTERPRETED, tests=("test_triton_kernel_under_interpreter",), timeout=600)
