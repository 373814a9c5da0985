"""FP8 activations as the official DeepSeek reference quantizes them (`engine.quant.act_quant`): a hand-computed
case (power-of-two scales, exact E4M3 values), `Fp8Linear(act_quant=True)` against the reference, and the
engine-level mode switch (`EngineConfig.fp8_activations`, `load_checkpoint(fp8_activations=...)`)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.quant import Fp8Linear
from deepinfer.engine.quant.act_quant import act_dequant_fp8, act_quant_fp8, fp8_round_activations
from deepinfer.engine.quant.linear import set_fp8_activations
from deepinfer.kernels.fp8_gemm import fp8_gemm_torch


def test_hand_computed_case():
    x = torch.zeros(3, 256)
    # token 0, channels 0-127: amax 448 -> 448 / 448 = 1 = 2**0 exactly (a power of two: ceil keeps it)
    x[0, 0], x[0, 1], x[0, 2] = 448.0, 1.0625, -3.3
    # token 0, channels 128-255: amax 449 -> 449 / 448 just above 1 -> scale 2; 449 / 2 = 224.5 -> 224 (step 16 there)
    x[0, 128], x[0, 129] = 449.0, 0.30078125  # 0.30078125 / 2 = 0.150390625 -> e4m3 0.15625 (nearest)
    # token 1: amax 1.0 -> 1 / 448 in (2**-9, 2**-8] -> scale 2**-8; 1.0 / 2**-8 = 256 (exact in e4m3)
    x[1, 5], x[1, 6] = 1.0, -0.0302734375  # / 2**-8 = -7.75 -> e4m3 spacing 0.5 at [4, 8): -7.75 is a tie -> -8
    # token 2, channels 0-127 all zero: amax floor 1e-4 -> 1e-4 / 448 ~ 2.23e-7 -> scale 2**-22, values 0
    x[2, 200] = -0.5  # channels 128-255: 0.5 / 448 -> scale 2**-9 (0.5/448 in (2**-10, 2**-9]); -0.5 / 2**-9 = -256
    x8, s = act_quant_fp8(x)
    assert x8.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (3, 2)
    assert s.tolist() == [[1.0, 2.0], [2.0 ** -8, 2.0 ** -22], [2.0 ** -22, 2.0 ** -9]]
    v = x8.float()
    assert v[0, :3].tolist() == [448.0, 1.0, -3.25]  # 1.0625 is halfway 1 / 1.125 -> even mantissa 1.0
    assert v[0, 128:130].tolist() == [224.0, 0.15625]
    assert v[1, 5:7].tolist() == [256.0, -8.0]
    assert v[2, 200].item() == -256.0 and v[2, :128].abs().sum() == 0
    assert torch.equal(act_dequant_fp8(x8, s)[0, :3], torch.tensor([448.0, 1.0, -3.25]))


def test_scales_are_powers_of_two_and_values_on_the_grid():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 300, generator=g) * torch.logspace(-3, 3, 300)  # K not a multiple of 128
    x8, s = act_quant_fp8(x)
    assert s.shape == (7, 3)
    mant, _ = torch.frexp(s)
    assert torch.all(mant == 0.5)  # powers of two
    amax = torch.nn.functional.pad(x, (0, 84)).view(7, 3, 128).abs().amax(-1)
    assert torch.all(amax / s <= 448) and torch.all(amax / s > 224)  # the smallest power of two that fits
    # the e4m3 cast is round-to-nearest: no value is further than half a step from x / s
    back = act_dequant_fp8(x8, s)
    assert torch.all((back - x).abs() <= torch.maximum(x.abs() * 2.0 ** -4, s.repeat_interleave(128, 1)[:, :300]
                                                       * 2.0 ** -10))
    assert torch.equal(fp8_round_activations(x.bfloat16()).float(), act_dequant_fp8(*act_quant_fp8(x.bfloat16())))


@pytest.mark.parametrize("out_features, in_features", [(256, 384), (130, 200), (1, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_activation_linear_matches_the_reference(out_features, in_features, dtype):
    g = torch.Generator().manual_seed(2)
    w = torch.randn(out_features, in_features, generator=g)
    lin = Fp8Linear.from_float(w)
    x = torch.randn(2, 5, in_features, generator=g).to(dtype)
    plain = lin(x)
    lin.set_act_quant(True)
    y = lin(x)
    assert y.shape == (2, 5, out_features) and y.dtype == dtype and "act_quant=True" in repr(lin)
    # the reference: the official GEMM's products x8 * s_x * w8 * s_w, summed in float32
    x8, sx = act_quant_fp8(x.reshape(-1, in_features))
    ref = (act_dequant_fp8(x8, sx) @ lin.dequantized().T).view(2, 5, out_features).to(dtype)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    assert not torch.equal(y, plain)  # the mode changes the numbers
    lin.set_act_quant(False)
    assert torch.equal(lin(x), plain)  # and switching back restores the bf16 path bit for bit
    # act_quant=True at construction is the same as switching it on
    other = Fp8Linear(in_features, out_features, act_quant=True)
    other.weight.data, other.scale.data = lin.weight.data, lin.scale.data
    assert torch.equal(other(x), y)
    assert torch.equal(fp8_gemm_torch(fp8_round_activations(x.reshape(-1, in_features)), lin.weight, lin.scale,
                                      lin.block).view(2, 5, out_features), y)


def test_mode_switch_over_a_model():
    model = torch.nn.Sequential(Fp8Linear.from_float(torch.randn(16, 8)), torch.nn.ReLU(),
                                Fp8Linear.from_float(torch.randn(4, 16)))
    assert set_fp8_activations(model, "fp8") == 2 and all(m.act_quant for m in (model[0], model[2]))
    assert set_fp8_activations(model, "bf16") == 2 and not model[0].act_quant
    with pytest.raises(ValueError, match=r"fp8_activations must be one of \['bf16', 'fp8'\], got 'int8'"):
        set_fp8_activations(model, "int8")


def test_engine_config_and_loader_take_the_mode(tmp_path):
    from pydantic import ValidationError

    from deepinfer.engine.engine import EngineConfig
    from deepinfer.engine.loader import load_checkpoint
    from deepinfer.engine.testing.make_checkpoint import make_checkpoint
    from deepinfer.engine.testing.model_runner import ModelRunnerForTests

    assert EngineConfig().fp8_activations == "bf16"
    assert EngineConfig(fp8_activations="fp8").fp8_activations == "fp8"
    with pytest.raises(ValidationError):
        EngineConfig(fp8_activations="int8")
    path = make_checkpoint(tmp_path / "ck", preset="tiny", seed=1, format="published", mtp_layers=0)
    default, _ = load_checkpoint(path)
    fp8, _ = load_checkpoint(path, fp8_activations="fp8")
    lins = [m for m in fp8.modules() if isinstance(m, Fp8Linear)]
    assert lins and all(m.act_quant for m in lins)
    assert not any(m.act_quant for m in default.modules() if isinstance(m, Fp8Linear))
    ids = [3, 7, 11, 5, 9]
    a = ModelRunnerForTests(default, max_seqs=1, max_len=8).prefill(0, ids)
    b = ModelRunnerForTests(fp8, max_seqs=1, max_len=8).prefill(0, ids)
    assert not torch.equal(a, b) and (a - b).abs().max() < 0.1 * a.abs().max()  # same weights, FP8 activations


@pytest.mark.gpu
@pytest.mark.parametrize("out_features, in_features", [(512, 4096), (130, 200)])
def test_fp8_activation_linear_on_cuda_matches_the_cpu_reference(out_features, in_features):
    g = torch.Generator().manual_seed(3)
    lin = Fp8Linear.from_float(torch.randn(out_features, in_features, generator=g) * 0.05)
    x = torch.randn(7, in_features, generator=g).bfloat16()
    lin.set_act_quant(True)
    ref = lin(x)  # CPU: the torch reference
    gpu = lin.to("cuda")
    y = gpu(x.cuda())
    assert gpu.impl_name != "torch" and gpu.act_quant and y.dtype == torch.bfloat16
    # the same FP8 activations on both devices (bit for bit), then the GEMM within bf16 rounding
    assert torch.equal(fp8_round_activations(x.cuda()).cpu(), fp8_round_activations(x))
    torch.testing.assert_close(y.cpu().float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_bf16_activations_are_the_ones_that_match_transformers(tmp_path):
    """transformers dequantizes the FP8 weights and runs plain matmuls: the default (activations as they come)
    matches it; the official FP8 activations do not (measured on all five published variants: <= 2.3e-5 vs
    0.26 - 2.5 max |d logprob|)."""
    parity = pytest.importorskip("tests.engine.checkpoints.test_transformers_parity")
    from deepinfer.engine.loader import load_checkpoint
    from deepinfer.engine.testing.make_checkpoint import make_checkpoint
    from deepinfer.engine.testing.model_runner import ModelRunnerForTests

    path = make_checkpoint(tmp_path / "ck", seed=1, format="published", max_shard_size="200KB", preset="tiny",
                           expert_dtype="fp4", expert_dtype_in="top")
    hf, _ = parity._hf(path)
    worst = {}
    for mode in ("bf16", "fp8"):
        ours, _ = load_checkpoint(path, "float32", fp8_activations=mode)
        for seed in range(3, 13):  # a prompt that meets no indexer tie (see the parity tests)
            ids = parity._prompt(33, ours.config.vocab_size, seed=seed)
            with parity._count_index_ties() as ties:
                got = ModelRunnerForTests(ours, max_seqs=1, max_len=34).prefill(0, ids)
            if not ties[0]:
                break
        ref = parity._hf_last_logprobs(hf.eval(), ids)
        worst[mode] = (torch.log_softmax(got.float(), -1) - ref).abs().max().item()
    assert worst["bf16"] <= 2e-3 < worst["fp8"], worst
