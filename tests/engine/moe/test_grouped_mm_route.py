"""The `"triton"` MoE backend's large-batch route through `torch._grouped_mm` (`DEEPINFER_MOE_GROUPED_MM_MIN_ROWS`):
taken only at or above the threshold with plain float experts, equal to the backend's own path (the Triton kernels
under `TRITON_INTERPRET=1`, or their torch references) and to the torch reference MoE; never for FP8 experts (FP4
ones have a dequantizing route of their own: test_fp4_dequant_route.py), inside a CUDA-graph capture, or in the
batch-invariant mode (which refuses the backend).

CPU tests are in-process (the backend's torch references) plus one interpreter subprocess (tiny shapes, float32);
`gpu` tests run bf16 on CUDA (8k rows against the Triton path; captured decode keeps the four kernels).
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from deepinfer.engine.moe.torch_backend import grouped_mm_aligned, grouped_mm_fast
from deepinfer.engine.moe.triton_backend import (
    DEFAULT_GROUPED_MM_MIN_ROWS,
    GROUPED_MM_MIN_ROWS_ENV,
    TritonMoEBackend,
    grouped_mm_experts,
    grouped_mm_min_rows_from_env,
)
from deepinfer.engine.quant.linear import Fp4Linear, Fp8Linear
from tests.engine.moe.test_triton_moe import _inputs, _moe
from tests.kernels._interp import prefetch_interpreted, run_interpreted

_WIDE = {"n_routed_experts": 8, "num_experts_per_tok": 3}  # more groups than the tiny preset's 4, some empty


def _routed(backend: str = "triton", min_rows: int = 1, **kw):
    moe = _moe(backend, **kw)
    moe.prepare()
    moe.backend.grouped_mm_min_rows = min_rows
    return moe


def test_grouped_mm_runs_on_the_cpu_with_16_byte_strides():
    """The CPU `_grouped_mm` this route relies on in the tests: bf16 / fp16 / fp32, K-major expert stacks (and the
    column slice the route takes for the up half), empty groups; rows whose stride is not a multiple of 16 bytes
    are refused, which `grouped_mm_aligned` predicts."""
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        w = torch.randn(4, 64, 48, generator=g).to(dtype)  # [E, 2I, H] as the backend stacks it
        x = torch.randn(20, 48, generator=g).to(dtype)
        offs = torch.tensor([5, 5, 12, 20], dtype=torch.int32)  # expert 1 empty
        out = torch._grouped_mm(x, w.transpose(1, 2)[:, :, 32:], offs=offs)
        want = torch.cat([x[:5] @ w[0, 32:].T, x[5:12] @ w[2, 32:].T, x[12:] @ w[3, 32:].T])
        torch.testing.assert_close(out, want)
        assert grouped_mm_fast(torch.device("cpu"), dtype) and grouped_mm_aligned(48, 32, dtype)
    x, w = torch.randn(20, 60).bfloat16(), torch.randn(4, 64, 60).bfloat16()
    assert not grouped_mm_aligned(60, 32, torch.bfloat16)
    with pytest.raises(RuntimeError, match="16 bytes"):
        torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
    assert not grouped_mm_fast(torch.device("cpu"), torch.float8_e4m3fn)


def test_env_knob(monkeypatch):
    monkeypatch.delenv(GROUPED_MM_MIN_ROWS_ENV, raising=False)
    assert grouped_mm_min_rows_from_env() == DEFAULT_GROUPED_MM_MIN_ROWS == TritonMoEBackend().grouped_mm_min_rows
    monkeypatch.setenv(GROUPED_MM_MIN_ROWS_ENV, "0")  # off
    assert TritonMoEBackend().grouped_mm_min_rows == 0
    monkeypatch.setenv(GROUPED_MM_MIN_ROWS_ENV, "4096")
    backend = TritonMoEBackend()
    assert backend.grouped_mm_min_rows == 4096
    monkeypatch.setenv(GROUPED_MM_MIN_ROWS_ENV, "8")  # read at construction, not later
    assert backend.grouped_mm_min_rows == 4096
    for bad in ("-1", "many"):
        monkeypatch.setenv(GROUPED_MM_MIN_ROWS_ENV, bad)
        with pytest.raises(ValueError, match=GROUPED_MM_MIN_ROWS_ENV):
            TritonMoEBackend()


@pytest.mark.parametrize("is_hash", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_equals_the_backend_path_and_torch_reference(is_hash, dtype, grouped_mm_calls):
    routed = _routed(is_hash=is_hash, dtype=dtype, **_WIDE)
    plain = _moe("triton", is_hash=is_hash, dtype=dtype, **_WIDE)
    ref = _moe("torch_loop", is_hash=is_hash, dtype=dtype, **_WIDE)
    x, ids = _inputs(40, dtype=dtype)
    got = routed(x, ids)
    assert len(grouped_mm_calls) == 3 and routed.backend.grouped_mm_usable
    tol = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1.6e-2}
    torch.testing.assert_close(got, plain(x, ids), **tol)
    torch.testing.assert_close(got, ref(x, ids), **tol)
    assert len(grouped_mm_calls) == 3  # the plain backend (threshold 0) and the reference never take it


def test_threshold_counts_rows_not_tokens(grouped_mm_calls):
    moe = _routed(min_rows=30, **_WIDE)  # top-3: 10 tokens are 30 rows
    for tokens, calls in ((9, 0), (10, 3), (1, 3)):
        x, ids = _inputs(tokens)
        moe(x, ids)
        assert len(grouped_mm_calls) == calls, tokens
    assert moe.backend.uses_grouped_mm(30) and not moe.backend.uses_grouped_mm(29)
    moe.backend.grouped_mm_min_rows = 0
    assert not moe.backend.uses_grouped_mm(10**9)


def test_graph_shapes_never_take_the_route(grouped_mm_calls):
    """A CUDA graph's eager warm-up and fallbacks must compute its replays' bits (captures never take the route):
    the graph runners record their largest step's tokens, and no forward of at most that many tokens takes it,
    whatever the threshold; larger (prefill) forwards still do."""
    from deepinfer.engine.cuda_graph import CudaGraphRunner, VerifyGraphRunner

    moe = _routed(min_rows=1, **_WIDE)
    holder = torch.nn.ModuleList([moe])
    CudaGraphRunner(holder, cache=None, batch_sizes=(1, 4, 8))
    assert moe.backend.graph_tokens == 8
    VerifyGraphRunner(holder, cache=None, batch_sizes=(1, 4), max_queries=4)
    assert moe.backend.graph_tokens == 16  # 4 requests x (1 + 3 drafts) verified tokens
    for tokens, calls in ((16, 0), (1, 0), (17, 3)):
        x, ids = _inputs(tokens)
        moe(x, ids)
        assert len(grouped_mm_calls) == calls, tokens


@pytest.mark.parametrize("quant", [Fp4Linear, Fp8Linear])
def test_quantized_experts_keep_their_kernels(quant, grouped_mm_calls):
    over = {"hidden_size": 160, "moe_intermediate_size": 128} if quant is Fp8Linear else {}
    moe = _routed(quant=quant, **over)
    x, ids = _inputs(40, over.get("hidden_size", 64))
    moe(x, ids)  # float32 activations: FP4 experts' own route (test_fp4_dequant_route.py) needs bf16 ones
    assert not moe.backend.grouped_mm_usable and not moe.backend.uses_grouped_mm(10**6, x_dtype=torch.float32)
    assert moe.backend.fp4_route_usable == (quant is Fp4Linear)
    assert not grouped_mm_calls


def test_unaligned_widths_keep_the_kernels(grouped_mm_calls):
    moe = _routed(hidden_size=62)  # float32 rows of 248 bytes
    x, ids = _inputs(40, 62)
    moe(x, ids)
    assert not moe.backend.grouped_mm_usable and not grouped_mm_calls


def test_batch_invariant_mode_never_reaches_the_route(monkeypatch):
    """The mode keeps a fixed-order path: it refuses the `"triton"` backend where its kernels do not run (the CPU
    without the interpreter), swaps it for `BatchInvariantTritonMoEBackend` (one tile config, never the route, even
    with the knob set), and swaps "torch" for its own backend."""
    from deepinfer.engine.batch_invariant import (
        BatchInvariantMoEBackend,
        BatchInvariantTritonMoEBackend,
        _swap_moe,
        check_config,
    )
    from deepinfer.engine.moe.torch_backend import TorchMoEBackend

    monkeypatch.setenv(GROUPED_MM_MIN_ROWS_ENV, "1")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not getattr(TritonMoEBackend, "batch_invariant_safe", False)  # NOTE: if that changes, turn the route off
    with pytest.raises(ValueError, match="CUDA only"):
        check_config("torch", "triton", "cpu")
    swapped = _swap_moe(TritonMoEBackend())
    assert isinstance(swapped, BatchInvariantTritonMoEBackend) and not swapped.uses_grouped_mm(1 << 20)
    assert isinstance(_swap_moe(TorchMoEBackend()), BatchInvariantMoEBackend)


def test_wrapper_checks_its_inputs():
    moe = _routed()
    w13, w2 = moe.backend.w13[0], moe.backend.w2[0]
    x, ids = _inputs(5)
    tw, tid = torch.full((5, 2), 0.5), torch.zeros(5, 2, dtype=torch.long)
    ops = (moe.backend._align, moe.backend._swiglu, moe.backend._combine)
    with pytest.raises(ValueError, match="experts' dtype"):
        grouped_mm_experts(x.double(), tw, tid, w13, w2, 10.0, *ops)
    with pytest.raises(ValueError, match="topk_ids and topk_weights"):
        grouped_mm_experts(x, tw[:4], tid, w13, w2, 10.0, *ops)


_INTERPRETED = textwrap.dedent("""
    import torch
    from deepinfer.kernels import get_op
    from tests.engine.moe.test_grouped_mm_route import _WIDE, _routed
    from tests.engine.moe.test_triton_moe import _inputs, _moe
    calls = []
    real = torch._grouped_mm
    torch._grouped_mm = lambda *a, **k: calls.append(1) or real(*a, **k)
    for is_hash in (False, True):
        routed = _routed(is_hash=is_hash, **_WIDE)
        plain = _moe("triton", is_hash=is_hash, **_WIDE)
        ref = _moe("torch_loop", is_hash=is_hash, **_WIDE)
        assert routed.backend.impl_name == "triton" and routed.backend._swiglu is get_op("swiglu", "triton")
        for n in (6, 40):
            x, ids = _inputs(n)
            before = len(calls)
            got = routed(x, ids)
            assert len(calls) == before + 3
            torch.testing.assert_close(got, plain(x, ids), atol=1e-4, rtol=1e-5)  # the Triton kernels' path
            torch.testing.assert_close(got, ref(x, ids), atol=1e-4, rtol=1e-5)
    print("OK")
""")


def test_route_under_the_interpreter():
    """The route around the Triton align / swiglu / combine kernels equals the Triton path and the reference."""
    pytest.importorskip("triton")
    out = run_interpreted(_INTERPRETED)
    assert "OK" in out, out


# ---------------------------------------------------------------------------- CUDA

_BIG = {"hidden_size": 512, "moe_intermediate_size": 256, "n_routed_experts": 16, "num_experts_per_tok": 6}


def _cuda_route_or_skip(moe) -> None:
    if not moe.backend.grouped_mm_usable:
        pytest.skip(f"no fused bf16 torch._grouped_mm on {torch.cuda.get_device_name()}")


@pytest.mark.gpu
@pytest.mark.parametrize("is_hash", [False, True])
def test_cuda_route_at_8k_rows_tracks_the_triton_path(is_hash, grouped_mm_calls, monkeypatch):
    monkeypatch.setenv("DEEPINFER_QGEMM_TUNE", "0")
    routed = _routed(is_hash=is_hash, min_rows=8192, device="cuda", dtype=torch.bfloat16, **_BIG)
    _cuda_route_or_skip(routed)
    plain = _moe("triton", is_hash=is_hash, device="cuda", dtype=torch.bfloat16, **_BIG)
    ref = _moe("torch_loop", is_hash=is_hash, device="cuda", dtype=torch.bfloat16, **_BIG)
    x, ids = _inputs(1366, 512, device="cuda", dtype=torch.bfloat16)  # 8,196 rows
    got = routed(x, ids).float()
    assert len(grouped_mm_calls) == 3
    kernels = plain(x, ids).float()
    for want in (kernels, ref(x, ids).float()):
        err = ((got - want).abs() / (want.abs() + want.abs().mean())).max().item()
        assert err < 5e-2, err
    assert (got - kernels).abs().mean() < 2e-2 * kernels.abs().mean()  # mostly the same bf16 values


@pytest.mark.gpu
def test_cuda_graph_capture_keeps_the_kernels(grouped_mm_calls, monkeypatch):
    """With a threshold below the batch, an eager forward takes the route but a captured one does not: the
    graph replays the four kernels, bit-identical to the backend with the route off."""
    monkeypatch.setenv("DEEPINFER_QGEMM_TUNE", "0")
    routed = _routed(min_rows=1, device="cuda", dtype=torch.bfloat16, **_BIG)
    _cuda_route_or_skip(routed)
    plain = _moe("triton", device="cuda", dtype=torch.bfloat16, **_BIG)
    x, ids = _inputs(32, 512, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        routed(x, ids)  # eager: the route (and the kernels' compile on the way)
        assert len(grouped_mm_calls) == 3
        plain(x, ids)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = routed(x, ids)
        assert len(grouped_mm_calls) == 3  # nothing captured through the route
        graph.replay()
        assert torch.equal(static_out, plain(x, ids))


@pytest.mark.gpu
def test_builtin_model_greedy_with_the_route_equals_torch_backend(monkeypatch):
    """Prefill rows (prompts of 5-97 tokens x top-k) over the threshold take the route, decode rows do not."""
    from tests.engine.moe.test_triton_moe import _builtin_greedy

    if not grouped_mm_fast(torch.device("cuda"), torch.bfloat16):
        pytest.skip("no fused bf16 torch._grouped_mm on this GPU")
    monkeypatch.setenv("DEEPINFER_QGEMM_TUNE", "0")
    monkeypatch.setenv(GROUPED_MM_MIN_ROWS_ENV, "64")
    assert _builtin_greedy("triton") == _builtin_greedy("torch")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_combines_expert_ordered_rows_like_putting_them_back(dtype):
    """The route hands the combine the down projection's expert-ordered rows, their inverse map and the weights;
    the result is bit for bit that of putting the rows back at their pairs, weighting them and combining them."""
    from deepinfer.kernels.registry import get_op

    align, swiglu, combine = (get_op(name, "torch") for name in ("moe_align", "swiglu", "moe_combine"))
    g = torch.Generator().manual_seed(2)
    E, H, inter, T, k = 4, 32, 16, 11, 2
    w13 = (torch.randn(E, 2 * inter, H, generator=g) * 0.2).to(dtype)
    w2 = (torch.randn(E, H, inter, generator=g) * 0.2).to(dtype)
    x = torch.randn(T, H, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    tw = torch.rand(T, k, generator=g)
    got = grouped_mm_experts(x, tw, ids, w13, w2, 10.0, align, swiglu, combine)
    sp, counts = align(ids, E)
    offs = counts.cumsum(0, dtype=torch.int32)
    xs = x.index_select(0, sp // k)
    w13t = w13.transpose(1, 2)
    act = swiglu(torch._grouped_mm(xs, w13t[:, :, :inter], offs=offs), torch._grouped_mm(xs, w13t[:, :, inter:],
                                                                                         offs=offs), 10.0)
    y_sorted = torch._grouped_mm(act, w2.transpose(1, 2), offs=offs)
    y = torch.empty_like(y_sorted).index_copy_(0, sp.long(), y_sorted)
    y.mul_(tw.reshape(-1, 1).to(dtype))
    assert torch.equal(got, combine(y, ids))


# the background run of the interpreter script (tests/kernels/_interp.py: CI time)
prefetch_interpreted(_INTERPRETED, tests=("test_route_under_the_interpreter",), timeout=300)
