"""Batch-invariant mode (`batch_invariant=True`, engine/batch_invariant.py): a request's prompt and generated
logprobs are bit-identical (`torch.equal`) alone, beside random companions, under chunked prefill, with a
prefix-cache hit, after preemption, after a decode restart (prompt + tokens so far re-prefilled elsewhere, as a
migration does) and with speculative decoding; with the mode off the same comparisons differ somewhere (so these
tests can fail); seeded sampling repeats across companions. Plus the refusals and the op-level pieces.
The scenario helpers (`_fingerprint`, `_companions`, `_beside_companions`, `_preempted`, the `_assert_*`) also
serve DeepSeek-V4.1's file, tests/engine/v41/test_batch_invariant.py."""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine import LLM, SamplingParams
from deepinfer.engine.batch_invariant import BatchInvariantMode, attend_tiled, check_config, tree_sum
from deepinfer.engine.engine import EngineConfig
from deepinfer.engine.testing.make_checkpoint import make_checkpoint
from tests.kernels._interp import prefetch_interpreted, run_interpreted

VOCAB = 512
TARGET_LEN = 52
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=2)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(make_checkpoint(tmp_path_factory.mktemp("bi"), preset="tiny", seed=2))


def _ids(n: int, g: torch.Generator) -> list[int]:
    return torch.randint(2, VOCAB, (n,), generator=g).tolist()


TARGET = _ids(TARGET_LEN, torch.Generator().manual_seed(11))


def _fingerprint(out) -> tuple[list[int], torch.Tensor]:
    """Generated ids and every logprob the request reports (sampled, top, prompt) as one float tensor."""
    co = out.outputs[0]
    vals = []
    for lp in co.logprobs:
        vals += [lp.logprob, *lp.top_logprobs]
    for lp in (out.prompt_logprobs or [None])[1:]:
        vals += [lp.logprob, *lp.top_logprobs]
    return list(co.token_ids), torch.tensor(vals, dtype=torch.float64)


def _companions(num: int, seed: int, max_len: int = 70, ids=_ids) -> tuple[list[dict], list[SamplingParams]]:
    """`num` greedy requests of random prompts (`ids(n, generator)`, 1 .. `max_len` - 1 tokens) and lengths."""
    g = torch.Generator().manual_seed(seed)
    prompts, params = [], []
    for _ in range(num):
        n = int(torch.randint(1, max_len, (1,), generator=g))
        prompts.append({"prompt_token_ids": ids(n, g)})
        params.append(SamplingParams(temperature=0.0, max_tokens=int(torch.randint(1, 9, (1,), generator=g)),
                                     ignore_eos=True))
    return prompts, params


def _cases(ckpt: str, batch_invariant: bool) -> dict[str, tuple[list[int], torch.Tensor]]:
    """The target request's fingerprint in every scenario of the issue (CPU-cheap sizes)."""
    got = {}

    def run(name, llm, num_companions=0, seed=0, position=0):
        got[name] = _beside_companions(llm, TARGET, _companions, num_companions, seed, position)

    kw = dict(batch_invariant=batch_invariant, block_size=16, max_model_len=160)
    llm = LLM(ckpt, max_num_seqs=64, **kw)
    run("alone", llm)
    run("batch 2", llm, 1, seed=1)
    run("batch 9", llm, 8, seed=2, position=4)
    run("batch 33", llm, 32, seed=3, position=20)
    for budget in (5, 16):
        chunked = LLM(ckpt, max_num_seqs=8, max_num_batched_tokens=budget, **kw)
        run(f"chunks of {budget}, batch 4", chunked, 3, seed=4 + budget, position=1)
    # prefix-cache hit: a request sharing the first 48 tokens runs first, then the target hits them
    cached = LLM(ckpt, max_num_seqs=8, enable_prefix_caching=True, **kw)
    cached.generate([{"prompt_token_ids": TARGET[:48] + [7, 8, 9]}], SamplingParams(max_tokens=1), use_tqdm=False)
    hit = cached.generate([{"prompt_token_ids": TARGET}], GREEDY, use_tqdm=False)[0]
    assert hit.num_cached_tokens > 0
    got["prefix hit"] = _fingerprint(hit)
    # preemption: a pool too small for every request at once; the target arrives last, so it is the victim
    got["preempted and recomputed (first 6 tokens)"] = _preempted(LLM(ckpt, max_num_seqs=10, num_blocks=10, **kw),
                                                                 TARGET, _companions, 7, 60, 30)
    return got


def _beside_companions(llm: LLM, target: list[int], companions, num: int = 0, seed: int = 0,
                       position: int = 0) -> tuple[list[int], torch.Tensor]:
    """`target`'s greedy fingerprint at `position` in one batch with `num` `companions(num, seed)`."""
    prompts, params = companions(num, seed)
    prompts.insert(position, {"prompt_token_ids": target})
    params.insert(position, GREEDY)
    return _fingerprint(llm.generate(prompts, params, use_tqdm=False)[position])


def _preempted(small: LLM, target: list[int], companions, num: int, prompt_len: int,
               max_tokens: int) -> tuple[list[int], torch.Tensor]:
    """`target`'s fingerprint (its first 6 tokens, their logprobs and its prompt's) when it arrives last after `num`
    greedy `companions` (prompts repeated to `prompt_len` tokens; `max_tokens` each, as the target) on an engine
    whose pool cannot hold them all: it is preempted (asserted) and recomputed."""
    victims = []
    preempt = small.engine.scheduler._preempt

    def record(victim, step):
        victims.append(victim.req_id)
        return preempt(victim, step)

    small.engine.scheduler._preempt = record
    prompts, _ = companions(num, seed=9)
    prompts = [{"prompt_token_ids": (p["prompt_token_ids"] * 3)[:prompt_len]} for p in prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)] * num
    prompts.append({"prompt_token_ids": target})
    params.append(SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2,
                                 prompt_logprobs=2))
    outs = small.generate(prompts, params, use_tqdm=False)
    assert outs[-1].request_id in victims, f"the target was not preempted (victims: {victims})"
    ids, lps = _fingerprint(outs[-1])
    return ids[:6], torch.cat([lps[:6 * 3], lps[max_tokens * 3:]])


def _assert_all_equal(got: dict) -> None:
    """Every scenario of `_cases` gave the ids and logprobs of the request alone, bit for bit."""
    ref_ids, ref = got.pop("alone")
    for name, (ids, lps) in got.items():
        assert ids == ref_ids, name
        assert torch.equal(lps, ref), f"{name}: logprobs differ from the request alone"


def _assert_some_differ(got: dict) -> None:
    """With the mode off some scenario's logprobs differ from the request alone's (the comparison can fail)."""
    _, ref = got.pop("alone")
    differing = [name for name, (_, lps) in got.items() if not torch.equal(lps, ref)]
    assert differing, "with batch_invariant=False every scenario matched bit for bit: the test above cannot fail"


def test_logprobs_bit_identical_in_every_scenario_with_the_mode_on(ckpt):
    _assert_all_equal(_cases(ckpt, batch_invariant=True))


def test_the_same_comparison_differs_with_the_mode_off(ckpt):
    _assert_some_differ(_cases(ckpt, batch_invariant=False))


def _assert_seeded_sampling_repeats(llm: LLM, target: list[int], companions=_companions) -> None:
    """A seeded temperature-1 request samples the same tokens and logprobs beside 0 .. 12 `companions` (at several
    places in the batch), and another seed samples other tokens."""
    sp = SamplingParams(temperature=1.0, seed=1234, max_tokens=10, ignore_eos=True, logprobs=1)
    runs = []
    for k in range(5):
        prompts, params = companions(k * 3, seed=100 + k)
        prompts.insert(k, {"prompt_token_ids": target})
        params.insert(k, sp)
        out = llm.generate(prompts, params, use_tqdm=False)[k]
        runs.append((list(out.outputs[0].token_ids), torch.tensor([lp.logprob for lp in out.outputs[0].logprobs])))
    for ids, lps in runs[1:]:
        assert ids == runs[0][0]
        assert torch.equal(lps, runs[0][1])
    other = llm.generate([{"prompt_token_ids": target}],
                         SamplingParams(temperature=1.0, seed=99, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert list(other[0].outputs[0].token_ids) != runs[0][0]


def test_seeded_sampling_repeats_across_companions_and_seeds_differ(ckpt):
    _assert_seeded_sampling_repeats(LLM(ckpt, batch_invariant=True, max_num_seqs=16, max_num_batched_tokens=24), TARGET)


def _restart_cases(ckpt: str, batch_invariant: bool, k: int = 4, max_tokens: int = 10):
    """The target's uninterrupted run beside companions vs its continuation after a decode restart at token k.

    A decode restart (or migration, entrypoint/migration.py `continuation`) re-submits prompt + the k tokens the
    client already has, with `max_tokens - k`, to another instance: its prefill recomputes the KV those k decode
    steps wrote, then decoding goes on. Here the other instance is a second engine with other companions and a
    prefill budget that chunks the continuation's prompt. Per case: (uninterrupted, continued) fingerprints, each
    the tokens after k and the logprobs of every generated token (before k: the continuation's prompt logprobs
    of those tokens).
    """
    kw = dict(batch_invariant=batch_invariant, block_size=16, max_model_len=160)
    first = LLM(ckpt, max_num_seqs=8, **kw)
    second = LLM(ckpt, max_num_seqs=8, max_num_batched_tokens=16, enable_prefix_caching=False, **kw)
    got = {}
    for name, sp in (("greedy", dict(temperature=0.0)), ("seeded temperature 1", dict(temperature=1.0, seed=4321))):
        prompts, params = _companions(4, seed=21)
        prompts.insert(2, {"prompt_token_ids": TARGET})
        params.insert(2, SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=2, **sp))
        full = first.generate(prompts, params, use_tqdm=False)[2].outputs[0]
        prompts, params = _companions(3, seed=22)
        prompts.insert(1, {"prompt_token_ids": TARGET + full.token_ids[:k]})
        params.insert(1, SamplingParams(max_tokens=max_tokens - k, ignore_eos=True, logprobs=2, prompt_logprobs=2, **sp))
        cont = second.generate(prompts, params, use_tqdm=False)[1]
        assert cont.num_cached_tokens == 0

        def lps(entries):
            return torch.tensor([v for lp in entries for v in (lp.logprob, *lp.top_logprobs)], dtype=torch.float64)

        got[name] = ((full.token_ids[k:], lps(full.logprobs)),
                     (cont.outputs[0].token_ids, lps([*cont.prompt_logprobs[len(TARGET):], *cont.outputs[0].logprobs])))
    return got


def test_decode_restart_continuation_is_bit_identical_with_the_mode_on(ckpt):
    """Issue 23, "across a decode-worker restart": the continuation's prefill over prompt + generated tokens
    gives the logits the original decode steps gave, bit for bit, so greedy and seeded tokens and all logprobs
    after the restart equal the uninterrupted run's (the seeded noise is indexed by position, which the
    continuation keeps)."""
    for name, ((ids, lps), (cont_ids, cont_lps)) in _restart_cases(ckpt, batch_invariant=True).items():
        assert cont_ids == ids, name
        assert torch.equal(cont_lps, lps), f"{name}: logprobs after the restart differ from the uninterrupted run"


def test_decode_restart_continuation_differs_with_the_mode_off(ckpt):
    got = _restart_cases(ckpt, batch_invariant=False)
    assert any(not torch.equal(a[1], b[1]) for a, b in got.values()), (
        "with batch_invariant=False the continuation matched bit for bit: the test above cannot fail")


def _speculative_cases(tmp_path, batch_invariant: bool, with_oracle: bool = True) -> dict[str, dict]:
    """Greedy tokens and logprobs of 5 requests on a tiny checkpoint with a random MTP layer: without speculation,
    with its own MTP drafts (nearly all rejected) and with oracle drafts (the reference continuation: accepted).
    Per case: request id -> (token ids, logprobs)."""
    from deepinfer.engine.config import ModelConfig
    from deepinfer.engine.engine import Engine
    from deepinfer.engine.testing.make_checkpoint import _write_ours, random_weights
    from deepinfer.engine.testing.presets import PRESETS

    hf = {**PRESETS["tiny"].hf_config(), "num_nextn_predict_layers": 1}
    _write_ours(tmp_path, hf, random_weights(ModelConfig.from_hf_dict(hf), torch.float32, seed=5, mtp=True),
                torch.float32, 1 << 40)
    g = torch.Generator().manual_seed(3)
    prompts = [_ids(int(n), g) for n in torch.randint(5, 60, (5,), generator=g)]
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1)

    def run(k: int, oracle=None):
        engine = Engine(EngineConfig(model=str(tmp_path), batch_invariant=batch_invariant, speculative_tokens=k,
                                     max_num_seqs=8))
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, sp)
        done = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = (o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs])
            for req in engine.scheduler.running.values():
                if oracle is not None and req.spec_token_ids:
                    seq = prompts[int(req.req_id)] + oracle[req.req_id][0]
                    req.spec_token_ids = seq[req.num_tokens:req.num_tokens + k] or [3]
        return done

    ref = run(0)
    got = {"alone": ref, "mtp drafts": run(3)}
    if with_oracle:
        got["accepted oracle drafts"] = run(3, oracle=ref)
    return got


def test_speculative_decoding_is_bit_identical_with_the_mode_on(tmp_path):
    """Issue 24 item 5 (batch-invariant mode): verified positions give the bits of plain decode steps, whether
    their drafts are rejected or accepted (the mode's backend verifies through its per-query prefill path)."""
    got = _speculative_cases(tmp_path, batch_invariant=True)
    ref = got.pop("alone")
    for name, outs in got.items():
        assert outs == ref, name
    off = _speculative_cases(tmp_path / "off", batch_invariant=False, with_oracle=False)
    ref = off.pop("alone")
    assert any(outs[r][1] != ref[r][1] for outs in off.values() for r in ref), (
        "with batch_invariant=False speculation matched bit for bit: the test above cannot fail")


def test_refuses_backends_that_are_not_batch_invariant():
    with pytest.raises(ValueError, match="MoE backend 'fp4' is not batch invariant"):
        EngineConfig(batch_invariant=True, moe_backend="fp4")
    with pytest.raises(ValueError, match="batch_invariant=True is implemented for cpu and cuda"):
        check_config("torch", "torch", "meta")
    EngineConfig(batch_invariant=True)  # the torch backends are accepted


def test_tree_sum_ignores_trailing_zero_padding():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, generator=g)
    for width in (5, 6, 8, 13, 64):
        padded = torch.nn.functional.pad(x, (0, width - 5))
        assert torch.equal(tree_sum(padded, -1), tree_sum(x, -1))


def test_attend_tiled_matches_softmax_attention_and_ignores_masked_tail():
    g = torch.Generator().manual_seed(1)
    q, keys, sink = torch.randn(6, 4, 32, generator=g), torch.randn(6, 40, 32, generator=g), torch.randn(4, generator=g)
    valid = torch.rand(6, 40, generator=g) > 0.3
    got = attend_tiled(q, keys, valid, sink)
    logits = torch.einsum("nhd,nld->nhl", q, keys) * 32**-0.5
    logits = torch.cat([logits.masked_fill(~valid[:, None], float("-inf")), sink.view(1, -1, 1).expand(6, -1, 1)], -1)
    ref = torch.einsum("nhl,nld->nhd", logits.softmax(-1)[..., :40], keys)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    more = torch.cat([keys, torch.randn(6, 37, 32, generator=g)], 1)  # masked extra keys: same bits
    assert torch.equal(attend_tiled(q, more, torch.cat([valid, torch.zeros(6, 37, dtype=torch.bool)], 1), sink), got)


def test_mode_rows_do_not_depend_on_the_number_of_rows():
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(40, 64, generator=g), torch.randn(48, 64, generator=g)
    with BatchInvariantMode():
        full = torch.nn.functional.linear(x, w)
        gate = torch.sigmoid(x)
        for m in (1, 2, 3, 7, 11, 17):
            assert torch.equal(torch.nn.functional.linear(x[3:3 + m], w), full[3:3 + m])
            assert torch.equal(torch.sigmoid(x[3:3 + m]), gate[3:3 + m])
        with pytest.raises(RuntimeError, match="einsum"):
            torch.einsum("ij->i", x)


def _assert_alone_equals_beside_companions(ckpt: str, kw: dict, target: list[int], companions=_companions) -> None:
    """`target`'s greedy ids and logprobs alone equal those beside 31 `companions` and beside 5 chunked at 7 tokens
    (engines of `LLM(ckpt, **kw)`)."""
    ref = _fingerprint(LLM(ckpt, **kw).generate([{"prompt_token_ids": target}], GREEDY, use_tqdm=False)[0])
    for budget, num in ((2048, 31), (7, 5)):
        llm = LLM(ckpt, max_num_seqs=64, max_num_batched_tokens=budget, **kw)
        prompts, params = companions(num, seed=budget)
        outs = llm.generate([{"prompt_token_ids": target}] + prompts, [GREEDY] + params, use_tqdm=False)
        ids, lps = _fingerprint(outs[0])
        assert ids == ref[0] and torch.equal(lps, ref[1]), f"budget {budget}, {num} companions"


@pytest.mark.gpu
def test_batch_invariant_on_gpu(ckpt):
    """The same guarantee on CUDA (bf16): a request's logprobs alone equal those beside companions and chunked."""
    _assert_alone_equals_beside_companions(ckpt, dict(batch_invariant=True, device="cuda", dtype="bfloat16",
                                                       block_size=16, max_model_len=160), TARGET)


_INTERPRET_SCRIPT = """
import torch
from deepinfer.kernels.bi_matmul import bi_matmul, bi_matmul_torch
g = torch.Generator().manual_seed(3)
a, w = torch.randn(70, 45, generator=g), torch.randn(45, 37, generator=g)
full = bi_matmul(a, w)
torch.testing.assert_close(full, bi_matmul_torch(a, w), rtol=1e-5, atol=1e-5)
# NOTE: the interpreter's tl.dot is a numpy matmul of the tile, whose row bits depend on the row's place in
# the tile (CPU BLAS); rows keep their place here. On CUDA any offset is checked (test_bi_matmul_on_gpu).
for m in (1, 3, 17, 64, 65):
    assert torch.equal(bi_matmul(a[:m], w), full[:m]), m
q, k = torch.randn(6, 2, 4, 45, generator=g), torch.randn(6, 2, 45, 16, generator=g)
torch.testing.assert_close(bi_matmul(q, k), bi_matmul_torch(q, k), rtol=1e-5, atol=1e-5)
assert torch.equal(bi_matmul(q[2:3], k[2:3]), bi_matmul(q, k)[2:3])
# K split in slices (split_k_for: 2 for K = 1100 over one column tile), the partials added in slice order
from deepinfer.kernels.bi_matmul import split_k_for
a, w = torch.randn(70, 1100, generator=g), torch.randn(1100, 37, generator=g)
assert split_k_for(1100, 37) == 2
full = bi_matmul(a, w)
torch.testing.assert_close(full, bi_matmul_torch(a, w), rtol=1e-4, atol=1e-4)
for m in (1, 17, 65):
    assert torch.equal(bi_matmul(a[:m], w), full[:m]), m
q, k = torch.randn(3, 5, 1100, generator=g), torch.randn(3, 1100, 20, generator=g)
torch.testing.assert_close(bi_matmul(q, k), bi_matmul_torch(q, k), rtol=1e-4, atol=1e-4)
assert torch.equal(bi_matmul(q[1:2], k[1:2]), bi_matmul(q, k)[1:2])
print("OK")
"""


def test_bi_matmul_split_depends_on_k_and_n_only():
    """The K split of `bi_matmul`: a power of two from (K, N) alone (never M: a row's bits must not depend on it),
    1 where the weight already has enough column tiles or K is short, more for one-row GEMMs of narrow weights."""
    pytest.importorskip("triton")
    from deepinfer.kernels.bi_matmul import MAX_SPLIT, split_k_for

    assert split_k_for(4096, 129280) == 1  # the LM head: 2,020 column tiles
    assert split_k_for(512, 2048) == 1  # 16 steps of K: no room to split
    assert split_k_for(2048, 2048) == 4  # 32 tiles x 4 = 128 programs, 16 steps a slice
    assert split_k_for(4096, 4096) == 2  # 64 tiles x 2
    assert split_k_for(16384, 24) == MAX_SPLIT
    assert all(split_k_for(k, n) & (split_k_for(k, n) - 1) == 0 for k in (1, 100, 1000, 5000) for n in (1, 70, 9000))


def test_bi_matmul_kernel_under_the_interpreter():
    """kernels/bi_matmul.py: close to torch, and a row's bits do not depend on M or the batch (interpreter)."""
    pytest.importorskip("triton")
    out = run_interpreted(_INTERPRET_SCRIPT)
    assert "OK" in out, out


@pytest.mark.gpu
def test_bi_matmul_on_gpu():
    """On CUDA a row's bits do not depend on M, its offset or the batch (bf16 and float32)."""
    from deepinfer.kernels.bi_matmul import bi_matmul, bi_matmul_torch

    g = torch.Generator(device="cuda").manual_seed(4)
    for dtype, k, n in ((torch.bfloat16, 512, 1000), (torch.float32, 512, 1000), (torch.bfloat16, 2048, 2048),
                        (torch.bfloat16, 4096, 200)):  # the last two split K (4 and 8 slices)
        a = torch.randn(300, k, generator=g, device="cuda").to(dtype)
        w = torch.randn(k, n, generator=g, device="cuda").to(dtype) / 8
        full = bi_matmul(a, w)
        torch.testing.assert_close(full.float(), bi_matmul_torch(a, w).float(), rtol=2e-2, atol=2e-1)
        for start, m in ((0, 1), (5, 1), (7, 3), (13, 31), (100, 128), (1, 200)):
            assert torch.equal(bi_matmul(a[start:start + m], w), full[start:start + m]), (dtype, start, m)


# the background run of the interpreter script (tests/kernels/_interp.py: CI time)
prefetch_interpreted(_INTERPRET_SCRIPT, tests=("test_bi_matmul_kernel_under_the_interpreter",), timeout=300)
