"""V4.1's MXFP4 routed experts and FP8 Engram tables kept quantized (`engine.quant.v41`, `engine.quant.engram`,
`kernels.engram_gather`, `deepseek_v41.load_published(keep_fp4=..., keep_engram=...)`, `load_for_engine`) and the
Engram placement the memory plan decides (`engine.fit`, `EngineConfig.engram_placement`).

On the tiny published checkpoint (`make_checkpoint --format published-v41`): the kept model's logits equal the
dequantized-at-load model's on every MoE backend; the kept experts and tables hold the checkpoint's bytes; the
tables are memory maps of the shards, never read through safetensors; the gather op's implementations agree bit
for bit (the Triton kernel under `TRITON_INTERPRET=1`); the placement follows the plan and the override, and the
engine gives the same tokens with either placement. GPU tests (skipped here): the kernel on a device table and
zero-copy on a pinned host table, and the kept model on CUDA with each placement.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from deepinfer.engine.models.deepseek_v41 import engram_token_map_for, load_published, published_tensors
from deepinfer.engine.quant.engram import (
    Fp8EngramTable,
    decide_engram_placement,
    map_safetensors_tensor,
)
from deepinfer.engine.quant.formats import quantize_fp8_block
from deepinfer.engine.quant.linear import Fp4Linear
from deepinfer.engine.testing.make_checkpoint import make_checkpoint
from deepinfer.kernels.engram_gather import engram_gather_host, engram_gather_torch, table_gather_impl
from tests.kernels._interp import prefetch_interpreted, run_interpreted

IDS = torch.randint(3, 64, (40,), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("v41q") / "ck", format="published-v41", seed=5)


@pytest.fixture(scope="module")
def ref(ckpt):
    model = load_published(ckpt)
    model.set_engram_token_map(engram_token_map_for(ckpt, model.config))
    with torch.no_grad():
        model.logits = model.forward_full(IDS)
    return model


def _kept(ckpt, moe_backend="torch", **flags):
    flags = flags or {"keep_fp8": True, "keep_fp4": True, "keep_engram": True}
    model = load_published(ckpt, moe_backend, **flags)
    model.set_engram_token_map(engram_token_map_for(ckpt, model.config))
    model.eval().requires_grad_(False)
    model.prepare_for_inference()
    return model


def _stored(ckpt):
    from safetensors import safe_open

    out = {}
    for file in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@pytest.mark.parametrize("moe_backend", ["torch", "torch_loop", "fp4", "triton"])
def test_kept_fp4_experts_equal_the_dequantized_model(ckpt, ref, moe_backend):
    """Routed experts kept MXFP4 (`Fp4Linear`) through each quantized MoE path give the dequantized model's logits
    (FP4 x 2^k products are exact; only float32 summation order may differ: 1e-5)."""
    kept = _kept(ckpt, moe_backend, keep_fp4=True)
    experts = [m for n, m in kept.named_modules() if ".ffn.experts." in n and isinstance(m, Fp4Linear)]
    assert len(experts) == 3 * kept.config.n_routed_experts * kept.config.num_hidden_layers
    with torch.no_grad():
        torch.testing.assert_close(kept.forward_full(IDS), ref.logits, rtol=1e-5, atol=1e-5)


def test_everything_kept_equals_the_dequantized_model_and_holds_the_stored_bytes(ckpt, ref):
    kept = _kept(ckpt)
    with torch.no_grad():
        torch.testing.assert_close(kept.forward_full(IDS), ref.logits, rtol=1e-5, atol=1e-5)
    stored, held = _stored(ckpt), kept.state_dict()
    names = [n for n in stored if ".ffn.experts." in n or ".engram.embed." in n]
    assert len(names) == 2 * 3 * 4 * 8 + 2 * 2
    for n in names:  # the checkpoint's bytes, dtype and shape exactly (no float copy, no re-quantization)
        assert held[n].dtype == stored[n].dtype and held[n].shape == stored[n].shape, n
        assert torch.equal(held[n].view(torch.uint8), stored[n].view(torch.uint8)), n
    out = published_tensors(kept)  # written back unchanged
    assert all(torch.equal(out[n].view(torch.uint8), stored[n].view(torch.uint8)) for n in names)
    tables = [m for m in kept.modules() if isinstance(m, Fp8EngramTable)]
    assert len(tables) == 2 and all(t.placement == "loaded" for t in tables)
    for t, layer in zip(tables, kept.config.engram_layer_ids):
        torch.testing.assert_close(t.dequantized(), ref.layers[layer].engram.embed.weight, rtol=0, atol=0)


def test_engram_tables_are_mapped_not_read(ckpt, monkeypatch):
    """The loader never reads a kept table through safetensors; the table is a view of a file mapping."""
    import safetensors

    real, read = safetensors.safe_open, []

    class Recording:
        def __init__(self, *a, **k):
            self.f = real(*a, **k)

        def __enter__(self):
            self.inner = self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.inner.get_tensor(name)

    monkeypatch.setattr(safetensors, "safe_open", Recording)
    kept = _kept(ckpt)
    assert read and not any(".engram.embed." in n for n in read)
    assert any(".engram.wkv." in n for n in read)  # the rest is read as before
    table = kept.layers[1].engram.embed
    assert not table.weight.untyped_storage().resizable()  # a borrowed buffer (the mapping), not an allocation


def test_map_safetensors_tensor_is_a_file_mapping(tmp_path):
    """A mapped tensor equals safetensors' copy, and its data is the file's mapping (/proc/self/maps names the file
    at its address), not memory the loader filled; writes stay private."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    w8, s = quantize_fp8_block(torch.randn(64, 96, generator=g), (1, 32))
    file = tmp_path / "m.safetensors"
    save_file({"a.weight": w8, "a.scale": s, "big": torch.zeros(1 << 14, 256, dtype=torch.uint8),
               "f": torch.randn(3, 5, generator=g)}, file)
    with safe_open(str(file), framework="pt") as f:
        for name in ("a.weight", "a.scale", "f"):
            m = map_safetensors_tensor(file, name)
            assert m.dtype == f.get_tensor(name).dtype and torch.equal(m.view(torch.uint8),
                                                                       f.get_tensor(name).view(torch.uint8))
    with pytest.raises(KeyError, match="no tensor 'nope'"):
        map_safetensors_tensor(file, "nope")
    mapped = map_safetensors_tensor(file, "big")
    ptr = mapped.data_ptr()
    spans = [line.split() for line in Path("/proc/self/maps").read_text().splitlines() if line.endswith(str(file))]
    assert any(int(sp[0].split("-")[0], 16) <= ptr < int(sp[0].split("-")[1], 16) for sp in spans), spans
    mapped[0, 0] = 7  # private: the file is not written
    assert map_safetensors_tensor(file, "big")[0, 0].item() == 0


def test_gather_op_implementations_agree():
    g = torch.Generator().manual_seed(3)
    for rows, dim in ((50, 32), (37, 96), (300, 256)):
        w = torch.randn(rows, dim, generator=g) * torch.logspace(-20, 20, rows)[:, None]
        w8, s = quantize_fp8_block(w, (1, 32))
        ref = w8.float() * s.float().repeat_interleave(32, 1)
        ids = torch.randint(0, rows, (29,), generator=g)
        for dtype in (torch.float32, torch.bfloat16):
            got = engram_gather_torch(ids, w8, s, dtype)
            assert got.dtype == dtype and torch.equal(got, ref[ids].to(dtype))
            assert torch.equal(engram_gather_host(ids, w8, s, dtype), got)
    assert engram_gather_torch(torch.empty(0, dtype=torch.int64), w8, s).shape == (0, 256)
    with pytest.raises(ValueError, match="int64"):
        engram_gather_torch(ids.int(), w8, s)
    with pytest.raises(ValueError, match="scale must be float8_e8m0fnu"):
        engram_gather_torch(ids, w8, s[:, :1])
    assert table_gather_impl(torch.device("cpu"), torch.device("cpu")) == "torch"
    assert table_gather_impl(torch.device("cpu"), torch.device("cuda")) == "host"
    if table_gather_impl(torch.device("cuda"), torch.device("cuda")) == "triton":  # triton installed
        assert table_gather_impl(torch.device("cpu"), torch.device("cuda"), pinned=True) == "triton"  # zero-copy


_INTERPRET_SCRIPT = textwrap.dedent("""
    import torch
    from deepinfer.engine.quant.formats import quantize_fp8_block
    from deepinfer.kernels.engram_gather import engram_gather_torch, engram_gather_triton

    g = torch.Generator().manual_seed(0)
    for rows, dim in [(50, 32), (37, 96), (100, 256)]:
        w = torch.randn(rows, dim, generator=g) * torch.logspace(-30, 30, rows)[:, None]
        w8, s = quantize_fp8_block(w, (1, 32))
        ids = torch.randint(0, rows, (23,), generator=g)
        for dtype in (torch.float32, torch.bfloat16):
            for block_n in (None, 1, 8):
                got = engram_gather_triton(ids, w8, s, dtype, block_n=block_n)
                assert torch.equal(got, engram_gather_torch(ids, w8, s, dtype)), (rows, dim, dtype, block_n)
    assert engram_gather_triton(torch.empty(0, dtype=torch.int64), w8, s).shape == (0, 256)
    print("OK")
""")


def test_gather_triton_under_the_interpreter():
    """The Triton gather-dequant kernel is bit-identical to the torch reference (dims not a power of two too)."""
    pytest.importorskip("triton")
    out = run_interpreted(_INTERPRET_SCRIPT)
    assert "OK" in out, out


def test_table_ignores_model_moves_and_casts():
    w8, s = quantize_fp8_block(torch.randn(10, 64), (1, 32))
    t = Fp8EngramTable(10, 64)
    t.set_tables(w8, s)
    t.to(torch.bfloat16)
    t.to("meta")
    assert t.weight.dtype == torch.float8_e4m3fn and t.scale.dtype == torch.float8_e8m0fnu
    assert t.weight.device.type == "cpu" and torch.equal(t.weight.view(torch.uint8), w8.view(torch.uint8))
    t.place("pinned_host", "cpu")  # no CUDA here: host memory as it is
    assert t.placement == "pinned_host" and t.weight.device.type == "cpu"
    t.out_dtype = torch.bfloat16
    assert t(torch.tensor([[1, 2], [3, 9]])).shape == (2, 2, 64)
    with pytest.raises(ValueError, match="placement must be"):
        t.place("disk", "cpu")


def test_placement_rule():
    decide = decide_engram_placement
    assert decide("auto", "cuda", num_seqs_fit_with_tables=64, max_num_seqs=64, table_bytes=1) == "device"
    assert decide("auto", "cuda", num_seqs_fit_with_tables=63, max_num_seqs=64, table_bytes=1) == "pinned_host"
    assert decide("auto", "cpu", num_seqs_fit_with_tables=0, max_num_seqs=64, table_bytes=1) == "device"
    assert decide("auto", "cuda", num_seqs_fit_with_tables=0, max_num_seqs=64, table_bytes=0) == "device"
    assert decide("device", "cuda", num_seqs_fit_with_tables=0, max_num_seqs=64, table_bytes=1) == "device"
    assert decide("pinned_host", "cpu", num_seqs_fit_with_tables=9, max_num_seqs=1, table_bytes=1) == "pinned_host"
    with pytest.raises(ValueError, match="engram_placement must be one of"):
        decide("host", "cuda", num_seqs_fit_with_tables=0, max_num_seqs=1, table_bytes=1)


def test_memory_plan_places_the_tables(ckpt):
    """The fit check counts the tables (`WeightBytes.engram_bytes`) and puts them on the device only when the
    device then still holds `max_num_seqs` sequences; pinned-host tables leave the device budget and must fit
    the host."""
    from deepinfer.engine.config import V41Config
    from deepinfer.engine.fit import ModelDoesNotFitError, check_fit

    config = V41Config.from_json_file(ckpt)
    kw = dict(dtype=torch.float32, max_model_len=64, block_size=4, max_num_seqs=4)
    table_bytes = (72 + 138) * (32 + 1)  # two tables: rows x (32 FP8 bytes + one UE8M0 scale)
    roomy = check_fit(ckpt, config, device="cuda", device_bytes=1 << 30, **kw)
    assert roomy.weights.engram_bytes == table_bytes and roomy.engram_placement == "device"
    tight_bytes = int((roomy.rank_weight_bytes + 3 * roomy.bytes_per_seq) / 0.9) + 1  # 3 of 4 sequences with tables
    tight = check_fit(ckpt, config, device="cuda", device_bytes=tight_bytes, **kw)
    assert tight.engram_placement == "pinned_host" and tight.engram_host_bytes == table_bytes
    assert tight.rank_weight_bytes == roomy.rank_weight_bytes - table_bytes and tight.num_seqs_fit >= 3
    assert "pinned host memory" in tight.summary()
    forced = check_fit(ckpt, config, device="cuda", device_bytes=tight_bytes, engram_placement="device", **kw)
    assert forced.engram_placement == "device" and forced.num_seqs_fit == 3
    assert check_fit(ckpt, config, device="cpu", device_bytes=tight_bytes, **kw).engram_placement == "device"
    with pytest.raises(ModelDoesNotFitError, match="Engram tables .* pinned host memory"):
        check_fit(ckpt, config, device="cuda", device_bytes=tight_bytes, host_bytes=table_bytes // 2, **kw)


def test_engine_placements_give_the_same_tokens(ckpt):
    """`EngineConfig.engram_placement`: the engine places its tables as told (auto on a CPU: the device), their rows
    dequantize to the engine dtype, and either placement gives the same greedy tokens."""
    from deepinfer import LLM, SamplingParams

    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 11, 3, 7, 12, 40], [8, 8, 30]]
    tokens = {}
    for placement in ("auto", "pinned_host"):
        llm = LLM(str(ckpt), max_model_len=64, max_num_seqs=2, block_size=4, dtype="bfloat16",
                  engram_placement=placement)
        assert llm.engine.fit.engram_placement == ("device" if placement == "auto" else placement)
        tables = [m for m in llm.engine.model.modules() if isinstance(m, Fp8EngramTable)]
        assert len(tables) == 2 and all(t.placement == llm.engine.fit.engram_placement for t in tables)
        assert all(t.out_dtype == torch.bfloat16 and t.weight.dtype == torch.float8_e4m3fn for t in tables)
        tokens[placement] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.shutdown()
    assert tokens["auto"] == tokens["pinned_host"]


@pytest.mark.gpu
def test_gather_on_cuda_device_and_pinned_tables():
    from deepinfer.kernels.engram_gather import engram_gather_triton

    g = torch.Generator().manual_seed(0)
    w8, s = quantize_fp8_block(torch.randn(4096, 256, generator=g), (1, 32))
    ids = torch.randint(0, 4096, (777,), generator=g)
    want = engram_gather_torch(ids, w8, s, torch.bfloat16)
    dev = ids.cuda()
    assert torch.equal(engram_gather_triton(dev, w8.cuda(), s.cuda(), torch.bfloat16).cpu(), want)
    assert torch.equal(engram_gather_torch(dev, w8.cuda(), s.cuda(), torch.bfloat16).cpu(), want)
    pw, ps = w8.pin_memory(), s.pin_memory()
    assert torch.equal(engram_gather_host(dev, pw, ps, torch.bfloat16).cpu(), want)
    assert torch.equal(engram_gather_triton(dev, pw, ps, torch.bfloat16).cpu(), want)  # zero copy over PCIe


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["device", "pinned_host"])
def test_kept_model_on_cuda_matches_the_cpu(ckpt, placement):
    from deepinfer.engine.config import V41Config
    from deepinfer.engine.models.deepseek_v41 import load_for_engine

    config = V41Config.from_json_file(ckpt)
    cpu = load_for_engine(ckpt, config, torch.float32, "cpu")
    cuda = load_for_engine(ckpt, config, torch.float32, "cuda", engram_placement=placement)
    tables = [m for m in cuda.modules() if isinstance(m, Fp8EngramTable)]
    assert all(t.weight.is_cuda == (placement == "device") for t in tables)
    assert all(t.weight.is_pinned() for t in tables if placement == "pinned_host")
    with torch.no_grad():
        torch.testing.assert_close(cuda.forward_full(IDS.cuda()).cpu(), cpu.forward_full(IDS), rtol=1e-4, atol=1e-4)


# the background run of the interpreter script (tests/kernels/_interp.py: CI time)
prefetch_interpreted(_INTERPRET_SCRIPT, tests=("test_gather_triton_under_the_interpreter",), timeout=300)
