"""The `triton` attention backend's prefill path (`kernels.prefill_attention` plus the indexer's selection per
query) against the `torch` backend (the oracle), on the tiny random model in float32.

Every token's logits (not only the last) over chunked prefills: two requests' chunks in one step, chunks
shorter and longer than the window, a later chunk that reads the ring's history and entries written by
earlier chunks, CSA rows whose indexer picks fewer entries than are visible, a mixed step (decode rows
beside a chunk), and a chunk whose state starts inside its window (bounded replay: history before
`state_start` masked). The caches (rings, compressor buffers, pools) must end equal too.

On the CPU the backend runs the kernels' torch references; under `TRITON_INTERPRET=1` (a subprocess) the
Triton kernels; on CUDA (`gpu`) both, float32 and bf16.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from deepinfer.engine.forward_batch import ForwardBatch, SeqChunk
from deepinfer.engine.loader import load_checkpoint
from deepinfer.engine.testing.make_checkpoint import make_checkpoint
from deepinfer.engine.testing.model_runner import ModelRunnerForTests
from deepinfer.engine.testing.presets import get_preset
from tests.kernels._interp import prefetch_interpreted
from tests.kernels._kernel_checks import interpreted_figure

PLAN = [
    [(0, 37), (1, 5)],  # two first chunks in one step (one shorter than the window)
    [(0, 50), (1, 11)],  # later chunks: ring history, earlier entries; CSA picks 12 of up to 21
    [(0, 1), (1, 1), (2, 20)],  # a mixed step: decode rows beside a first chunk
]


def tiny_config() -> dict:
    cfg = get_preset("tiny").hf_config()
    cfg.update(index_topk=12)
    return cfg


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("tiny12p"), preset=tiny_config(), seed=3)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(2, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _replay(runner, seq: int, ids: list[int], p0: int, state_start: int) -> torch.Tensor:
    """A chunk of `ids` at positions p0.. whose slot's state is valid from `state_start` on; all logits."""
    runner.lens[seq] = p0
    seqs = [SeqChunk(seq, runner.tables[seq], p0, len(ids), state_start=state_start)]
    batch = ForwardBatch.build([ids], seqs, device=runner.device, logits="all")
    batch.attn_metadata = runner.model.build_attention_metadata(batch, runner.cache)
    return runner.run_batch(batch)


def prefill_logits(ckpt, backend, impl=None, device="cpu", dtype="float32", plan=PLAN):
    """(every token's logits of each step of `plan`, then of a bounded-replay chunk; the final caches)."""
    model, _ = load_checkpoint(ckpt, dtype=dtype, device=device, attention_backend=backend)
    model.model.attention_backend.impl = impl
    streams = {s: _ids(200, seed=10 + s) for s in range(4)}
    runner = ModelRunnerForTests(model, max_seqs=4, max_len=160)
    out = []
    for step in plan:
        out.append(runner.run([(s, streams[s][runner.lens[s]:runner.lens[s] + n]) for s, n in step], logits="all"))
    out.append(_replay(runner, 3, streams[3][:13], p0=30, state_start=35))
    return out, {**runner.cache.state_tensors(), **runner.cache.compressed_pools()}


def prefill_parity(ckpt, impl, device="cpu", plan=PLAN):
    """Worst |logit difference| of every token between the torch and the triton backend (float32) over
    `plan`; asserts equal greedy tokens and caches."""
    (la, ca), (lb, cb) = (prefill_logits(ckpt, b, impl if b == "triton" else None, device, plan=plan)
                          for b in ("torch", "triton"))
    for step, (a, b) in enumerate(zip(la, lb)):
        assert a.argmax(-1).tolist() == b.argmax(-1).tolist(), step
    for name, t in ca.items():
        torch.testing.assert_close(cb[name], t, atol=2e-5, rtol=2e-5, msg=name)
    return max((a - b).abs().max().item() for a, b in zip(la, lb))


def test_prefill_matches_the_torch_backend(ckpt):
    assert prefill_parity(ckpt, None) < 1e-4


_INTERPRETED = textwrap.dedent("""
    import sys
    from pathlib import Path
    from tests.engine.attention.test_triton_prefill import prefill_parity
    print("ok", prefill_parity(Path(sys.argv[1]), "triton"))
""")


def test_prefill_kernels_in_the_model_under_interpreter(ckpt):
    pytest.importorskip("triton")
    assert interpreted_figure(_INTERPRETED, str(ckpt), timeout=900) < 1e-4


@pytest.mark.gpu
def test_cuda_prefill_parity_float32(ckpt):
    assert prefill_parity(ckpt, None, device="cuda") < 1e-3


@pytest.mark.gpu
def test_cuda_prefill_bf16_error_is_the_torch_backends(ckpt):
    """bf16 logits of both backends against float32 ones (per token, relative to the token's largest float32
    logit). NOTE: the kernel sums in float32 where the torch backend rounds logits and probabilities to bf16,
    and a near-tie in the indexer's top-k may flip in either; the bar is the decode test's."""
    ref = torch.cat(prefill_logits(ckpt, "torch", device="cuda")[0])
    scale = ref.abs().amax(-1, keepdim=True)
    errs = [((torch.cat(prefill_logits(ckpt, b, device="cuda", dtype="bfloat16")[0]) - ref).abs() / scale).amax(-1)
            for b in ("torch", "triton")]
    assert errs[1].median() <= 1.25 * errs[0].median() + 0.005, (errs[1].median(), errs[0].median())
    assert errs[1].mean() <= 2 * errs[0].mean() + 0.01, (errs[1].mean(), errs[0].mean())


# the background run of the interpreter script (tests/kernels/_interp.py: CI time)
prefetch_interpreted(_INTERPRETED, tests=("test_prefill_kernels_in_the_model_under_interpreter",), timeout=900,
                     make_args=lambda d: (str(make_checkpoint(d, preset=tiny_config(), seed=3)),))  # `ckpt`'s
