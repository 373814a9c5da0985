"""The engine core and the offline API: batching, chunking, prefix caching with bounded replay,
preemption, sampling behaviour and input validation, against single-request runs and HF."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer.engine import LLM, InvalidRequestError, SamplingParams
from deepinfer.engine.engine import Engine, EngineConfig
from deepinfer.engine.model_runner import exact_replay_tokens
from deepinfer.engine.testing.make_checkpoint import make_checkpoint
from deepinfer.engine.testing.model_runner import ModelRunnerForTests
from deepinfer.engine.testing.presets import PRESETS

TINY = [p for p in PRESETS if p != "small"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    paths = {}

    def get(preset: str = "tiny"):
        if preset not in paths:
            paths[preset] = make_checkpoint(tmp_path_factory.mktemp(preset), preset=preset, seed=2)
        return str(paths[preset])

    return get


def _prompts(num: int, vocab: int, lo: int = 1, hi: int = 120, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (num,), generator=g).tolist()
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lens]


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("preset", TINY)
def test_batch_of_32_equals_alone_and_hf(ckpt, preset):
    llm = LLM(ckpt(preset), max_num_seqs=32, max_num_batched_tokens=256)
    vocab = llm.engine.model_config.vocab_size
    prompts = _prompts(32, vocab, seed=1)
    together = _ids(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False))
    runner_model = llm.engine.model
    for i, p in enumerate(prompts):
        alone = ModelRunnerForTests(runner_model, 1, len(p) + 16).greedy(0, p, 12)
        assert together[i] == alone, f"request {i} (len {len(p)})"
    if preset != "tiny-softmax":  # HF has no softmax router
        transformers = pytest.importorskip("transformers")
        hf = transformers.DeepseekV4ForCausalLM.from_pretrained(ckpt(preset), dtype=torch.float32).eval()
        for i in (0, 7, 19):
            seq = list(prompts[i])
            with torch.no_grad():
                for _ in range(12):
                    seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
            assert together[i] == seq[len(prompts[i]):], f"HF oracle, request {i}"


def test_chunked_prefill_budgets_and_seqs_cap(ckpt):
    prompts = _prompts(6, 512, lo=20, hi=90, seed=2)
    ref = None
    for budget in (1, 7, 64, 4096):
        llm = LLM(ckpt(), max_num_batched_tokens=budget, max_num_seqs=4)
        got = _ids(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False))
        ref = ref or got
        assert got == ref, f"budget {budget}"


def test_prefix_cache_computes_only_new_tokens_and_matches_cold(ckpt):
    llm = LLM(ckpt(), max_num_seqs=4)
    eng = llm.engine
    base = _prompts(1, 512, lo=150, hi=150, seed=3)[0]
    tail = [7, 8, 9, 10, 11]
    cold = LLM(ckpt(), max_num_seqs=4, enable_prefix_caching=False)
    cold_out = _ids(cold.generate([{"prompt_token_ids": base + tail}], GREEDY, use_tqdm=False))
    llm.generate([{"prompt_token_ids": base}], SamplingParams(max_tokens=1), use_tqdm=False)
    before = eng.num_computed_tokens_total
    out = llm.generate([{"prompt_token_ids": base + tail}], GREEDY, use_tqdm=False)[0]
    bs = eng.cache.block_size
    hit = (len(base) // bs) * bs
    assert out.num_cached_tokens == hit
    replay = min(hit, eng.replay_tokens)
    prompt_computed = len(base) + len(tail) - hit + replay
    assert eng.num_computed_tokens_total - before == prompt_computed + GREEDY.max_tokens - 1
    assert out.outputs[0].token_ids == cold_out[0]


def test_bounded_replay_at_every_offset(ckpt):
    """Replay start lands on every offset modulo the sliding window and the compress rates."""
    cold = LLM(ckpt(), enable_prefix_caching=False)
    base = _prompts(1, 512, lo=140, hi=140, seed=4)[0]
    cfg = cold.engine.model_config
    minimum = exact_replay_tokens(cfg)
    period = math.lcm(cfg.sliding_window, *cfg.compress_rates.values())
    prompts = [base[:n] + [3, 4, 5] for n in (96, 111, 128, 135)]
    ref = _ids(cold.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False))
    llm = LLM(ckpt())
    for extra in range(period):
        llm.engine.replay_tokens = minimum + extra
        llm.engine.kv_manager.block_pool.reset_prefix_cache()
        llm.generate([{"prompt_token_ids": base}], SamplingParams(max_tokens=1), use_tqdm=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        assert all(o.num_cached_tokens > 0 for o in outs)
        assert _ids(outs) == ref, f"replay {minimum + extra}"


def test_replay_below_minimum_is_refused(ckpt):
    with pytest.raises(ValueError, match="replay_tokens"):
        LLM(ckpt(), replay_tokens=3)


def test_preemption_under_tiny_pool(ckpt):
    prompts = _prompts(10, 512, lo=30, hi=80, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ref = _ids(LLM(ckpt(), max_num_seqs=10).generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
    small = LLM(ckpt(), max_num_seqs=10, num_blocks=10, block_size=16, max_model_len=140)
    got = _ids(small.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
    assert small.engine.scheduler.num_preemptions > 0
    assert got == ref


def test_seeded_sampling_is_batch_invariant(ckpt):
    llm = LLM(ckpt(), max_num_seqs=8)
    p = _prompts(1, 512, seed=6)[0]
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": q} for q in _prompts(5, 512, seed=7)]
    mixed = llm.generate(others[:2] + [{"prompt_token_ids": p}] + others[2:],
                         [SamplingParams(temperature=0.8, max_tokens=9)] * 2 + [sp] + [SamplingParams(seed=5)] * 3,
                         use_tqdm=False)[2].outputs[0].token_ids
    assert alone == mixed
    other_seed = llm.generate([{"prompt_token_ids": p}], SamplingParams(temperature=1.0, top_p=0.9, seed=99,
                              max_tokens=16, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    assert other_seed != alone


def test_stop_conditions_and_limits(ckpt):
    llm = LLM(ckpt())
    p = _prompts(1, 512, seed=8)[0]
    free = llm.generate([{"prompt_token_ids": p}], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    assert len(free.token_ids) == 20 and free.finish_reason == "length"
    stop_id = free.token_ids[5]
    first = free.token_ids.index(stop_id)
    out = llm.generate([{"prompt_token_ids": p}], SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop_id]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[: first + 1] and out.stop_reason == stop_id
    # min_tokens: the stop id cannot end the sequence before min_tokens tokens
    out = llm.generate([{"prompt_token_ids": p}], SamplingParams(temperature=0.0, max_tokens=20,
                       stop_token_ids=[free.token_ids[0]], min_tokens=4), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 4
    # stop string: take a piece of the decoded text and stop on it
    text = free.text
    if len(text) > 6:
        needle = text[3:6]
        out = llm.generate([{"prompt_token_ids": p}], SamplingParams(temperature=0.0, max_tokens=20, stop=[needle],
                           ignore_eos=True), use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop" and needle not in out.text and text.startswith(out.text)


def test_n_greater_than_one_shares_prompt(ckpt):
    llm = LLM(ckpt())
    p = _prompts(1, 512, lo=100, hi=100, seed=9)[0]
    out = llm.generate([{"prompt_token_ids": p}], SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=8,
                       ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs) == 3 and all(len(o.token_ids) == 8 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    # children after the first start from the cached prompt blocks
    assert llm.engine.kv_manager.num_prefix_hit_tokens > 0


def test_logprobs_match_log_softmax(ckpt):
    llm = LLM(ckpt())
    p = _prompts(1, 512, seed=10)[0]
    out = llm.generate([{"prompt_token_ids": p}], SamplingParams(temperature=0.0, max_tokens=5, logprobs=3, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    runner = ModelRunnerForTests(llm.engine.model, 1, 256)
    logits = runner.run([(0, p + out.token_ids[:-1])], logits="all")[len(p) - 1:]
    ref = torch.log_softmax(logits, dim=-1)
    assert len(out.logprobs) == 5
    for i, lp in enumerate(out.logprobs):
        assert lp.token_id == out.token_ids[i]
        assert math.isclose(lp.logprob, ref[i, lp.token_id].item(), abs_tol=1e-4)
        top = torch.topk(ref[i], 3)
        assert lp.top_token_ids == top.indices.tolist()


def test_prompt_logprobs_match_log_softmax(ckpt):
    llm = LLM(ckpt())
    p = _prompts(1, 512, lo=40, hi=40, seed=12)[0]
    out = llm.generate([{"prompt_token_ids": p}], SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    ref = torch.log_softmax(ModelRunnerForTests(llm.engine.model, 1, 64).run([(0, p)], logits="all"), dim=-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(p)
    for i in range(1, len(p)):
        lp = out.prompt_logprobs[i]
        assert lp.token_id == p[i] and math.isclose(lp.logprob, ref[i - 1, p[i]].item(), abs_tol=1e-4)
        assert len(lp.top_token_ids) == 2


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ([], {}, "prompt"),
        ([5, 512], {}, "prompt_token_ids"),
        ([5, -1], {}, "prompt_token_ids"),
        ([5] * 10, {"max_tokens": 10_000}, "max_tokens"),
        ([5], {"temperature": -0.5}, "temperature"),
        ([5], {"top_p": 0.0}, "top_p"),
        ([5], {"top_p": 1.5}, "top_p"),
        ([5], {"top_k": -2}, "top_k"),
        ([5], {"n": 0}, "n"),
        ([5], {"max_tokens": -3}, "max_tokens"),
        ([5], {"temperature": float("nan")}, "temperature"),
        ([5], {"logit_bias": {600: 1.0}}, "logit_bias"),
    ],
)
def test_bad_input_is_refused_and_engine_keeps_serving(ckpt, prompt, params, field):
    eng = Engine(EngineConfig(model=ckpt(), max_model_len=256))
    good = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    eng.add_request("good", {"prompt_token_ids": [3, 4, 5]}, good)
    eng.step()
    with pytest.raises(InvalidRequestError) as e:
        eng.add_request("bad", {"prompt_token_ids": prompt}, SamplingParams(**params))
    assert e.value.field == field and field.split("_")[0] in str(e.value)
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id] = o
    assert set(outs) == {"good"} and len(outs["good"].outputs[0].token_ids) == 12
    # LLM.generate validates the whole list before queueing anything
    llm = LLM(ckpt(), max_model_len=256)
    with pytest.raises(InvalidRequestError):
        llm.generate([{"prompt_token_ids": [3, 4]}, {"prompt_token_ids": prompt}], SamplingParams(**params), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_abort_frees_blocks_and_slots(ckpt):
    eng = Engine(EngineConfig(model=ckpt()))
    free0, slots0 = eng.kv_manager.num_free_blocks, eng.slots.num_free_slots
    eng.add_request("a", list(range(3, 80)), SamplingParams(max_tokens=50))
    eng.add_request("b", list(range(3, 40)), SamplingParams(max_tokens=5, temperature=0.0))
    for _ in range(3):
        eng.step()
    assert eng.abort_request("a")
    while eng.has_unfinished_requests():
        eng.step()
    eng.step()
    assert eng.slots.num_free_slots == slots0
    assert eng.kv_manager.num_free_blocks == free0


def test_streaming_deltas_concatenate(ckpt):
    llm = LLM(ckpt())
    p = _prompts(1, 512, seed=11)[0]
    full = llm.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)[0].outputs[0]
    toks, text = [], ""
    for out in llm.stream({"prompt_token_ids": p}, GREEDY):
        toks += out.new_token_ids.get(0, [])
        text += out.new_text.get(0, "")
    assert toks == full.token_ids and text == full.text


def test_async_scheduling_gives_the_same_outputs(ckpt):
    prompts = _prompts(12, 512, lo=5, hi=100, seed=13)
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=7, max_tokens=15, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[100, 200, 300]),
              SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=10, ignore_eos=True)] * 3

    def run(async_scheduling: bool, **kw):
        llm = LLM(ckpt(), async_scheduling=async_scheduling, max_num_seqs=8, **kw)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert not llm.engine.has_unfinished_requests()
        return [[c.token_ids for c in o.outputs] for o in outs], llm

    sync, _ = run(False)
    got, llm = run(True)
    assert got == sync
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.kv_manager.num_blocks
    tight, llm = run(True, num_blocks=12, block_size=16, max_model_len=140, max_num_batched_tokens=64)
    assert tight == sync


def test_imported_kv_continues_exactly(ckpt):
    """Prefill on one engine, copy its compressed-KV bytes into another engine's reserved blocks,
    decode there after bounded replay: the same tokens as one engine doing everything."""
    prompt = _prompts(1, 512, lo=150, hi=150, seed=14)[0]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ref = LLM(ckpt()).generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
    a = Engine(EngineConfig(model=ckpt()))
    a.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    while not any(o.outputs[0].token_ids for o in a.step()):
        pass
    src = a.kv_descriptors("r")
    b = Engine(EngineConfig(model=ckpt()))
    for num_kv in (len(prompt), 97, 64):
        rid = f"b{num_kv}"
        dst = b.reserve_kv(rid, prompt, params, num_kv)
        pools_a, pools_b = a.cache.compressed_pools(), b.cache.compressed_pools()
        by_block = {}
        for (name, _blk, off, nb) in src:
            by_block.setdefault(name, []).append((off, nb))
        dst_by = {}
        for (name, _blk, off, nb) in dst:
            dst_by.setdefault(name, []).append((off, nb))
        moved = 0
        for name, ranges in dst_by.items():
            sa = pools_a[name].view(-1).view(torch.uint8)
            sb = pools_b[name].view(-1).view(torch.uint8)
            # same number of layers; the destination table may be shorter (fewer tokens)
            per_layer_dst = len(ranges) // pools_b[name].shape[0]
            per_layer_src = len(by_block[name]) // pools_a[name].shape[0]
            for layer in range(pools_b[name].shape[0]):
                for k in range(per_layer_dst):
                    (do, n), (so, _) = ranges[layer * per_layer_dst + k], by_block[name][layer * per_layer_src + k]
                    sb[do:do + n] = sa[so:so + n]
                    moved += n
        assert moved > 0
        b.commit_kv(rid)
        out = None
        while b.has_unfinished_requests():
            for o in b.step():
                out = o
        assert out.outputs[0].token_ids == ref, f"num_kv_tokens={num_kv}"
    a.abort_request("r")
    assert b.kv_manager.num_free_blocks == b.kv_manager.num_blocks


def test_prefix_hit_with_replay_split_across_steps(ckpt):
    """A replay longer than the step budget spans several steps before the hit boundary."""
    prompt = _prompts(1, 512, lo=200, hi=200, seed=15)[0]
    cold = LLM(ckpt(), enable_prefix_caching=False).generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)
    llm = LLM(ckpt(), max_num_batched_tokens=16)
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1), use_tqdm=False)
    warm = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
    assert warm.num_cached_tokens > 0
    assert warm.outputs[0].token_ids == cold[0].outputs[0].token_ids
