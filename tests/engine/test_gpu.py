"""The same correctness checks on a CUDA device (skipped without one)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.loader import load_checkpoint
from deepinfer.engine.testing.make_checkpoint import make_checkpoint
from deepinfer.engine.testing.model_runner import ModelRunnerForTests

pytestmark = pytest.mark.gpu

HF_PRESETS = ["tiny", "tiny-yarn", "tiny-sigmoid"]


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n,), generator=g).tolist()


@pytest.mark.parametrize("preset", HF_PRESETS)
def test_prefix_logits_match_hf_on_cuda(tmp_path, preset):
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "DeepseekV4ForCausalLM"):
        pytest.skip("this transformers has no DeepseekV4ForCausalLM")
    path = make_checkpoint(tmp_path / preset, preset=preset, seed=1)
    ours, _ = load_checkpoint(path, dtype="float32", device="cuda")
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    ids = _prompt(200, ours.config.vocab_size, seed=3)
    for L in (1, 4, 9, 17, 33, 64, 129, 200):
        got = ModelRunnerForTests(ours, 1, L + 1).prefill(0, ids[:L])
        with torch.no_grad():
            ref = hf(torch.tensor([ids[:L]], device="cuda")).logits[0, -1].float()
        scale = max(ref.abs().max().item(), 1.0)
        assert (got - ref).abs().max().item() <= 1e-4 * scale, f"{preset} L={L}"


@pytest.mark.parametrize("preset", HF_PRESETS + ["tiny-softmax"])
def test_cuda_matches_cpu_incremental_and_batched(tmp_path, preset):
    path = make_checkpoint(tmp_path / preset, preset=preset, seed=2)
    cpu, _ = load_checkpoint(path, dtype="float32")
    gpu, _ = load_checkpoint(path, dtype="float32", device="cuda")
    prompts = [_prompt(n, cpu.config.vocab_size, seed=n) for n in (5, 40, 77)]
    ref = [ModelRunnerForTests(cpu, 1, 128).greedy(0, p, 16) for p in prompts]
    r = ModelRunnerForTests(gpu, len(prompts), 128)
    logits = r.run([(i, p) for i, p in enumerate(prompts)])
    outs = [[] for _ in prompts]
    for _ in range(16):
        toks = logits.argmax(-1).tolist()
        for i, t in enumerate(toks):
            outs[i].append(t)
        logits = r.run([(i, [t]) for i, t in enumerate(toks)])
    assert outs == ref


def test_llm_generate_on_cuda_equals_cpu(tmp_path):
    from deepinfer.engine import LLM, SamplingParams

    path = str(make_checkpoint(tmp_path / "tiny", preset="tiny", seed=3))
    prompts = [{"prompt_token_ids": _prompt(n, 512, seed=n)} for n in (3, 30, 90, 150)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    cpu = [o.outputs[0].token_ids for o in LLM(path).generate(prompts, params, use_tqdm=False)]
    gpu_llm = LLM(path, device="cuda")
    gpu = [o.outputs[0].token_ids for o in gpu_llm.generate(prompts, params, use_tqdm=False)]
    assert gpu == cpu
    # prefix-cache hit + replay on the GPU
    again = [o.outputs[0].token_ids for o in gpu_llm.generate(prompts, params, use_tqdm=False)]
    assert again == cpu


def test_bfloat16_on_cuda_tracks_float32(tmp_path):
    path = make_checkpoint(tmp_path / "tiny", preset="tiny", seed=4)
    f32, _ = load_checkpoint(path, dtype="float32", device="cuda")
    b16, _ = load_checkpoint(path, dtype="bfloat16", device="cuda")
    ids = _prompt(120, 512, seed=5)
    a = ModelRunnerForTests(f32, 1, 128).run([(0, ids)], logits="all")
    b = ModelRunnerForTests(b16, 1, 128).run([(0, ids)], logits="all")
    assert torch.isfinite(b).all()
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    assert agree > 0.9, f"bf16 top-1 agreement with fp32 only {agree:.2f}"
