"""The `"triton"` MoE backend (`engine.moe.triton_backend`): against the torch backends (float, FP4 and
FP8 experts, learned and hash routing), its router kernel, its CUDA-graph contract, and (GPU) greedy tokens
of the built-in model equal to the `"torch"` backend's.

CPU tests run the backend's torch references and, in a subprocess under `TRITON_INTERPRET=1`, its Triton
kernels (tiny shapes, float32); `gpu` tests run on CUDA in bf16.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from deepinfer.engine.config import ModelConfig
from deepinfer.engine.models.deepseek_v4 import MoE
from deepinfer.engine.moe import MoEBackend, get_moe_backend
from deepinfer.engine.moe.triton_backend import TritonMoEBackend
from deepinfer.engine.quant.linear import Fp4Linear, Fp8Linear
from deepinfer.engine.testing.presets import PRESETS
from tests.kernels._interp import prefetch_interpreted, run_interpreted


def _config(**over) -> ModelConfig:
    return ModelConfig.from_hf_dict({**PRESETS["tiny"].hf_config(), **over})


def _moe(backend: str, seed: int = 0, is_hash: bool = False, quant=None, device="cpu", dtype=torch.float32,
         **over) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(_config(**over), is_hash, backend)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
        if is_hash:
            vocab, k = moe.gate.tid2eid.shape
            moe.gate.tid2eid.copy_(torch.rand(vocab, len(moe.experts)).argsort(dim=-1)[:, :k])
    if quant is not None:
        for ex in moe.experts:
            for name in ("w1", "w2", "w3"):
                setattr(ex, name, quant.from_float(getattr(ex, name).weight.detach()))
    moe = moe.to(device)
    if dtype != torch.float32:  # the float32-kept gate bias stays float32, as the loader keeps it
        moe = moe.to(dtype)
        if not is_hash:
            moe.gate.bias = moe.gate.bias.float()
    return moe.requires_grad_(False)


def _inputs(num_tokens: int, hidden: int = 64, seed: int = 1, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(num_tokens, hidden, generator=g).to(device, dtype),
            torch.randint(0, 128, (num_tokens,), generator=g).to(device))


def test_registered_and_graph_safe():
    assert get_moe_backend("triton") is TritonMoEBackend
    assert TritonMoEBackend.cuda_graph_safe and not MoEBackend.cuda_graph_safe
    assert not get_moe_backend("torch").cuda_graph_safe and get_moe_backend("torch").routing_impl == "torch"


@pytest.mark.parametrize("is_hash", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 9])
def test_cpu_path_equals_torch_loop(is_hash, num_tokens):
    fast, ref = _moe("triton", is_hash=is_hash), _moe("torch_loop", is_hash=is_hash)
    names = sorted(fast.state_dict())
    x, ids = _inputs(num_tokens)
    torch.testing.assert_close(fast(x, ids), ref(x, ids), atol=1e-6, rtol=1e-6)
    assert sorted(fast.state_dict()) == names and fast.backend.impl_name == "torch"  # no triton on the CPU
    assert fast.gate.routing_impl == "torch"
    assert fast.experts[1].w3.weight.data_ptr() == fast.backend.w13[0][1, 32:].data_ptr()  # views, no copy


def test_fp4_experts_equal_torch_loop():
    fast, ref = _moe("triton", quant=Fp4Linear), _moe("torch_loop", quant=Fp4Linear)
    x, ids = _inputs(9)
    torch.testing.assert_close(fast(x, ids), ref(x, ids), atol=1e-5, rtol=1e-5)


_FP8_SHAPE = {"hidden_size": 160, "moe_intermediate_size": 128}  # whole 128-row scale blocks per half


@pytest.mark.parametrize("act_quant", [False, True])
def test_fp8_experts_equal_torch_loop(act_quant):
    fast, ref = _moe("triton", quant=Fp8Linear, **_FP8_SHAPE), _moe("torch_loop", quant=Fp8Linear, **_FP8_SHAPE)
    for moe in (fast, ref):
        for ex in moe.experts:
            for name in ("w1", "w2", "w3"):
                getattr(ex, name).set_act_quant(act_quant)
    x, ids = _inputs(9, 160)
    torch.testing.assert_close(fast(x, ids), ref(x, ids), atol=1e-5, rtol=1e-5)


def test_fp8_experts_need_whole_scale_blocks():
    moe = _moe("triton", quant=Fp8Linear)  # expert width 32 < the 128-row block
    with pytest.raises(ValueError, match="multiple of the FP8 block"):
        moe.prepare()


def test_router_follows_the_backend():
    moe = _moe("triton")
    moe.prepare()
    moe.backend.routing_impl = "torch"  # what prepare picks off CUDA; the gate takes what the backend says
    moe.gate.set_routing_impl("torch")
    with pytest.raises(ValueError, match="no implementation 'nope'"):
        moe.gate.set_routing_impl("nope")


_INTERPRETED = textwrap.dedent("""
    import torch
    from tests.engine.moe.test_triton_moe import _moe, _inputs
    from deepinfer.engine.quant.linear import Fp4Linear, Fp8Linear
    for is_hash in (False, True):
        for quant in (None, Fp4Linear, Fp8Linear):
            over = {"hidden_size": 160, "moe_intermediate_size": 128} if quant is Fp8Linear else {}
            fast = _moe("triton", is_hash=is_hash, quant=quant, **over)
            ref = _moe("torch_loop", is_hash=is_hash, quant=quant, **over)
            for n in (1, 6, 40):
                x, ids = _inputs(n, over.get("hidden_size", 64))
                got, want = fast(x, ids), ref(x, ids)
                assert fast.backend.impl_name == "triton" and fast.gate.routing_impl == "triton"
                torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)  # float32 sums of ~1e2 in another order
    print("OK")
""")


def test_triton_kernels_under_the_interpreter():
    pytest.importorskip("triton")
    out = run_interpreted(_INTERPRETED)
    assert "OK" in out, out


# ---------------------------------------------------------------------------- CUDA


@pytest.fixture
def _no_tuning(monkeypatch):
    """GPU tests run each grouped GEMM's first (default) tile config: fewer compiles."""
    monkeypatch.setenv("DEEPINFER_QGEMM_TUNE", "0")

_BIG = {"hidden_size": 512, "moe_intermediate_size": 256, "n_routed_experts": 16, "num_experts_per_tok": 6}


@pytest.mark.gpu
@pytest.mark.parametrize("is_hash", [False, True])
@pytest.mark.parametrize("quant", [None, Fp4Linear, Fp8Linear])
def test_bf16_on_cuda_tracks_torch_loop(is_hash, quant, _no_tuning):
    fast = _moe("triton", is_hash=is_hash, quant=quant, device="cuda", dtype=torch.bfloat16, **_BIG)
    ref = _moe("torch_loop", is_hash=is_hash, quant=quant, device="cuda", dtype=torch.bfloat16, **_BIG)
    for n in (1, 7, 300):
        x, ids = _inputs(n, 512, device="cuda", dtype=torch.bfloat16)
        got, want = fast(x, ids).float(), ref(x, ids).float()
        assert fast.backend.impl_name == "triton" and fast.gate.routing_impl == "triton"
        err = ((got - want).abs() / (want.abs() + want.abs().mean())).max().item()
        assert err < 5e-2, (n, err)


@pytest.mark.gpu
def test_no_host_sync_and_cuda_graph_capture():
    """The routed MoE (router kernel + backend + shared expert) and the fused mHC ops under
    `set_sync_debug_mode("error")`, then captured in a CUDA graph and replayed on new inputs."""
    from deepinfer.kernels import get_op

    moe = _moe("triton", device="cuda", dtype=torch.bfloat16, **_BIG)
    x, ids = _inputs(32, 512, device="cuda", dtype=torch.bfloat16)
    hc, H = 4, 512
    streams = torch.randn(32, hc, H, device="cuda", dtype=torch.bfloat16)
    fn = torch.randn((2 + hc) * hc, hc * H, device="cuda") * 0.02
    base, scale = torch.zeros((2 + hc) * hc, device="cuda"), torch.ones(3, device="cuda")
    pre, post_op = get_op("mhc_pre", "triton"), get_op("mhc_post", "triton")

    def step():
        coll, post, comb = pre(streams, fn, base, scale, hc, 20, 1e-6, 1e-6)
        return post_op(moe(coll, ids), streams, post, comb)

    with torch.inference_mode():
        step()  # warm-up: compiles and times the tile configs (host syncs allowed here)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            eager = step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = step()
        graph.replay()
        assert torch.equal(static_out, eager)
        x2, ids2 = _inputs(32, 512, seed=7, device="cuda", dtype=torch.bfloat16)
        streams.copy_(torch.randn_like(streams))
        ids.copy_(ids2)
        graph.replay()
        assert torch.equal(static_out, step())


def _builtin_greedy(moe_backend: str, steps: int = 32) -> list[list[int]]:
    from deepinfer.engine.builtin_model import builtin_model_path
    from deepinfer.engine.loader import load_checkpoint
    from deepinfer.engine.testing.model_runner import ModelRunnerForTests

    model, _ = load_checkpoint(builtin_model_path(), dtype="bfloat16", device="cuda", moe_backend=moe_backend)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 5000, (n,), generator=g).tolist() for n in (5, 40, 97)]
    r = ModelRunnerForTests(model, len(prompts), 160)
    logits = r.run([(i, p) for i, p in enumerate(prompts)])
    outs = [[] for _ in prompts]
    for _ in range(steps):
        toks = logits.argmax(-1).tolist()
        for i, t in enumerate(toks):
            outs[i].append(t)
        logits = r.run([(i, [t]) for i, t in enumerate(toks)])
    return outs


@pytest.mark.gpu
def test_builtin_model_greedy_equals_torch_backend(_no_tuning):
    assert _builtin_greedy("triton") == _builtin_greedy("torch")


@pytest.mark.gpu
def test_published_fp4_checkpoint_greedy_equals_fp4_backend(tmp_path, _no_tuning):
    from deepinfer.engine.loader import load_checkpoint
    from deepinfer.engine.testing.make_checkpoint import make_checkpoint
    from deepinfer.engine.testing.model_runner import ModelRunnerForTests

    path = make_checkpoint(tmp_path / "pub", preset="tiny", seed=5, format="published")
    outs = []
    for backend in ("triton", "fp4"):
        model, _ = load_checkpoint(path, dtype="bfloat16", device="cuda", moe_backend=backend)
        ids = torch.randint(2, 500, (30,), generator=torch.Generator().manual_seed(1)).tolist()
        outs.append(ModelRunnerForTests(model, 1, 80).greedy(0, ids, 24))
    assert outs[0] == outs[1]


# the background run of the interpreter script (tests/kernels/_interp.py: CI time)
prefetch_interpreted(_INTERPRETED, tests=("test_triton_kernels_under_the_interpreter",), timeout=300)
