"""The Triton decode top-k post-processing (`kernels.indexer.select_topk_triton`, `_topk_post_kernel`) against
the reference `select_topk`: `torch.equal` (int64 indices, ascending, -1 padded) over scores with many ties
(zeros), -0.0, -inf inside the visible range, rows with fewer visible entries than k, C <= topk and padding
rows; the whole Triton `indexer_topk` against `indexer_topk_torch` where the raw head sums are -0.0 (the
scores kernel must store +0.0: checked on CUDA only, the interpreter's `tl.sum` starts from +0.0); and the launches of the Triton impl (scores, selection, post-kernel). CPU
under `TRITON_INTERPRET=1` in a subprocess (as tests/kernels/test_indexer.py); CUDA in `gpu` tests.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from deepinfer.kernels.indexer import indexer_topk_torch, select_topk
from tests.kernels._interp import prefetch_interpreted, run_interpreted


def tied_scores(B, C, pos, rate, seed, neg_zero=True):
    """Scores [B, C] as the scores kernel writes them: small integers (many exact ties, a third zeros),
    -inf past each row's visible count `(pos + 1) // rate` and at a few visible entries (padding blocks);
    `neg_zero`: some zeros are -0.0 (the raw head sums; the CPU selection must not care)."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(-2, 3, (B, C), generator=g).float()
    s[torch.rand(B, C, generator=g) < 0.3] = 0.0
    if neg_zero:
        s[(s == 0) & (torch.rand(B, C, generator=g) < 0.5)] = -0.0
    s[torch.rand(B, C, generator=g) < 0.05] = float("-inf")
    vis = torch.arange(C)[None, :] < ((pos + 1) // rate)[:, None]
    return s.masked_fill(~vis, float("-inf"))


def negative_weight_case(seed=0, B=4, IH=4, ID=16, N=10, epb=4, MB=5, rate=4, dtype=torch.float32):
    """Decode-indexer inputs whose scores hold many raw -0.0: every weight negative in rows 0 and 2 (relu 0
    times a negative weight, summed over heads), small integers (exact sums), zero keys; row B-1 pads."""
    from tests.kernels.test_indexer import make_case

    c = make_case(B=B, IH=IH, ID=ID, N=N, epb=epb, MB=MB, rate=rate, seed=seed, integer=True, dtype=dtype)
    c["weights"][0] = -c["weights"][0].abs()
    c["weights"][2] = -c["weights"][2].abs()
    c["pool"][:, 0] = 0  # a zero key in every block: exact zero scores
    c["pos"][1] = 2 * rate - 1  # two visible entries: fewer than k
    return c


def raw_head_sums(c):
    """The real rows' scores summed over heads in order from head 0 (no +0.0 start, as a GPU reduction):
    -0.0 where every term is -0.0."""
    epb, C = c["pool"].shape[1], c["block_tables"].shape[1] * c["pool"].shape[1]
    keys = c["pool"][c["block_tables"][:-1, torch.arange(C) // epb], torch.arange(C) % epb].float()
    terms = torch.relu(torch.einsum("bhd,bcd->bhc", c["q"][:-1].float(), keys)) * c["q"].shape[2] ** -0.5
    terms = terms * c["weights"][:-1, :, None]
    raw = terms[:, 0]
    for h in range(1, terms.shape[1]):
        raw = raw + terms[:, h]
    return raw


def has_neg_zero(t):
    return bool(((t == 0) & t.signbit()).any())


_INTERPRETED = textwrap.dedent("""
    import torch
    import triton.runtime.interpreter as interp
    from tests.kernels.test_indexer_topk import tied_scores, negative_weight_case, raw_head_sums, has_neg_zero
    from tests.kernels.test_indexer import make_case
    import deepinfer.kernels.indexer as ind
    from deepinfer.benchmarks.op_inventory import _Counter

    # the post-kernel against select_topk: ties, -0.0, -inf inside, few visible, C <= topk, padding rows
    for seed, (B, C, rate) in enumerate([(6, 40, 4), (5, 16, 4), (4, 9, 2), (3, 600, 1), (2, 1, 4), (3, 0, 4)]):
        g = torch.Generator().manual_seed(100 + seed)
        pos = torch.randint(0, max(1, C) * rate, (B,), generator=g)
        pos[0] = C * rate - 1 if C else 0   # all visible
        pos[-1] = 0                          # a padding row
        if B > 2:
            pos[1] = 3 * rate - 1            # 3 visible
        s = tied_scores(B, C, pos, rate, seed)
        # k = 512 (V4's index_topk) once, where C > k: ~3 s a call under the interpreter; k = 40 has C <= k
        for k in (1, 3, 9, 16, 40) + ((512,) if C > 512 else ()):
            got = ind.select_topk_triton(s, pos, rate, k)
            want = ind.select_topk(s, (pos + 1) // rate, k)
            assert got.dtype == torch.int64 and torch.equal(got, want), (B, C, rate, k, got, want)
    # C <= topk with more visible than C (a position past the table): select_topk keeps the C padding
    pos = torch.tensor([40, 3, 0])
    s = tied_scores(3, 4, pos, 4, 9)
    assert torch.equal(ind.select_topk_triton(s, pos, 4, 6), ind.select_topk(s, (pos + 1) // 4, 6))
    # empty batch / k = 0; the argument checks
    assert ind.select_topk_triton(torch.zeros(0, 8), torch.zeros(0, dtype=torch.long), 4, 3).shape == (0, 3)
    assert ind.select_topk_triton(torch.zeros(2, 8), torch.zeros(2, dtype=torch.long), 4, 0).shape == (2, 0)
    for bad, msg in [(dict(scores=torch.zeros(2, 8, dtype=torch.float64)), "float32"),
                     (dict(pos=torch.zeros(2, dtype=torch.int32)), "int64"), (dict(rate=0), "rate")]:
        args = {**dict(scores=torch.zeros(2, 8), pos=torch.zeros(2, dtype=torch.long), rate=4, topk=3), **bad}
        try:
            ind.select_topk_triton(**args)
        except ValueError as e:
            assert msg in str(e), str(e)
        else:
            raise AssertionError(msg)

    # the whole Triton indexer where the raw head sums are -0.0: the stored scores are +0.0, the indices the
    # reference's
    seen = []
    select = ind.select_topk_triton
    def spy(scores, *a):
        seen.append(scores.clone())
        return select(scores, *a)
    ind.select_topk_triton = spy
    for seed in range(3):
        c = negative_weight_case(seed)
        for k in (2, 5, 16, 24):
            assert torch.equal(ind.indexer_topk_triton(**c, topk=k, block_c=16), ind.indexer_topk_torch(**c, topk=k))
    assert bool(has_neg_zero(raw_head_sums(c)))  # the case does make -0.0 sums
    # (vacuous here: the interpreter's tl.sum is numpy's, which starts from +0.0; the gpu test checks it)
    assert not any(has_neg_zero(s) for s in seen)
    ind.select_topk_triton = select

    # launches: the scores kernel, the selection (a stable sort here, torch.topk on CUDA), the post-kernel
    c = make_case(B=3, MB=8)
    counter, run = _Counter(), interp.InterpretedFunction.run
    def counted_run(self, *a, **k):
        counter.counts[("top", "triton." + self.fn.__name__)] += 1
        counter.active = False
        try:
            return run(self, *a, **k)
        finally:
            counter.active = True
    interp.InterpretedFunction.run = counted_run
    try:
        with counter:
            ind.indexer_topk_triton(**c, topk=4)
    finally:
        interp.InterpretedFunction.run = run
    ops = {n: v for (_, n), v in counter.counts.items()}
    assert ops == {"triton._indexer_scores_kernel": 1, "aten.sort": 1, "triton._topk_post_kernel": 1}, ops
    print("ok")
""")


def test_topk_post_kernel_under_interpreter():
    pytest.importorskip("triton")
    assert run_interpreted(_INTERPRETED, timeout=600).strip() == "ok"


@pytest.mark.gpu
@pytest.mark.parametrize("C,k", [(300, 512), (4096, 512), (700, 16)])
def test_select_topk_triton_on_cuda(C, k):
    """CUDA: the post-kernel after torch.topk equals select_topk on CUDA (same topk) and on the CPU (stable
    sort: the documented tie behaviour), over tied +0.0 scores (the scores kernel never stores -0.0)."""
    from deepinfer.kernels.indexer import select_topk_triton

    B, rate = 7, 4
    pos = torch.randint(0, C * rate, (B,), generator=torch.Generator().manual_seed(C))
    pos[0], pos[1], pos[-1] = C * rate - 1, 2 * rate - 1, 0
    s = tied_scores(B, C, pos, rate, seed=k, neg_zero=False)
    want = select_topk(s, (pos + 1) // rate, k)
    got = select_topk_triton(s.cuda(), pos.cuda(), rate, k)
    assert torch.equal(got.cpu(), want)
    assert torch.equal(select_topk(s.cuda(), (pos.cuda() + 1) // rate, k).cpu(), want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_indexer_topk_negative_zero_and_graph_on_cuda(dtype, monkeypatch):
    """CUDA: raw -0.0 head sums (all-negative weights; head dim 64: an exact power-of-two scale) select the
    reference's entries; the Triton impl runs without a host sync and replays in a CUDA graph."""
    import deepinfer.kernels.indexer as ind
    from deepinfer.kernels.indexer import indexer_topk_triton

    c = negative_weight_case(B=6, IH=64, ID=64, N=80, epb=32, MB=48, rate=4, dtype=dtype)
    assert has_neg_zero(raw_head_sums(c))
    ref = indexer_topk_torch(**c, topk=512)
    gpu = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in c.items()}
    seen, select = [], ind.select_topk_triton
    monkeypatch.setattr(ind, "select_topk_triton", lambda s, *a: (seen.append(s.clone()), select(s, *a))[1])
    assert torch.equal(indexer_topk_triton(**gpu, topk=512).cpu(), ref)
    assert not has_neg_zero(seen[0])  # the scores kernel stored +0.0
    monkeypatch.undo()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        indexer_topk_triton(**gpu, topk=512)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        indexer_topk_triton(**gpu, topk=512)  # warm-up on the capture stream
        with torch.cuda.graph(graph, stream=stream):
            out = indexer_topk_triton(**gpu, topk=512)
    torch.cuda.current_stream().wait_stream(stream)
    gpu["pos"].copy_(torch.tensor([10, 300, 7, 1000, 64, 0]))
    c["pos"].copy_(gpu["pos"].cpu())
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), indexer_topk_torch(**c, topk=512))


# the background run of the interpreter script (tests/kernels/_interp.py: CI time)
prefetch_interpreted(_INTERPRETED, tests=("test_topk_post_kernel_under_interpreter",), timeout=600)
