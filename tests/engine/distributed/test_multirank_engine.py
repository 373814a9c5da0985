"""An instance as a group of ranks (`engine.distributed`): `Engine(expert_parallel_size=N)` starts N - 1
rank processes (gloo on loopback) and must give the single-process engine's greedy tokens, with ranks that
have no requests in a step, redundant experts and EPLB re-placement while requests run; a killed rank
fails the instance as a whole."""

from __future__ import annotations

import queue

import pytest
import torch
from pydantic import ValidationError

from deepinfer.engine import SamplingParams
from deepinfer.engine.distributed.expert_parallel import held_expert_bytes
from deepinfer.engine.engine import Engine, EngineConfig
from deepinfer.engine.errors import InvalidRequestError
from deepinfer.engine.kv_connector import KVConnector, KVConnectorEvents
from deepinfer.engine.testing.make_checkpoint import make_checkpoint
from deepinfer.engine.testing.presets import PRESETS


class _OnePoolConnector(KVConnector):
    def poll(self) -> KVConnectorEvents:
        return KVConnectorEvents()


def _prompts(num: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (int(n),), generator=g).tolist() for n in torch.randint(3, 30, (num,), generator=g)]


def _generate(engine: Engine, prompts: list[list[int]], max_tokens: list[int]) -> dict[str, tuple]:
    """Greedy outputs per request: (token ids, logprobs of each sampled token)."""
    for i, (p, n) in enumerate(zip(prompts, max_tokens)):
        engine.add_request(str(i), p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=1))
    out = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = (o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs])
    return out


def test_multi_rank_config_is_checked_before_start():
    EngineConfig(expert_parallel_size=2, speculative_tokens=1)  # speculation runs over the ranks (test_spec_ep)
    EngineConfig(expert_parallel_size=2, async_scheduling=True)  # overlapped steps (test_ep_async)
    EngineConfig(expert_parallel_size=2, async_scheduling=True, speculative_tokens=1)
    with pytest.raises(ValidationError, match="leave executor unset"):
        EngineConfig(expert_parallel_size=2, executor="threaded")


def test_ep2_builtin_model_matches_one_process_and_a_killed_rank_fails_the_instance():
    """Built-in model (4 experts, top-2), EP = 2: requests of different lengths, so late steps leave a rank
    without requests (it joins the MoE collectives with zero rows)."""
    kw = dict(max_num_seqs=4, max_model_len=128)
    prompts = _prompts(3, 129000, seed=0)
    max_tokens = [3, 9, 5]
    one = Engine(**kw)
    ref = _generate(one, prompts, max_tokens)
    one.shutdown()
    ep = Engine(expert_parallel_size=2, **kw)
    try:
        got = _generate(ep, prompts, max_tokens)
        assert {r: t for r, (t, _) in got.items()} == {r: t for r, (t, _) in ref.items()}
        for r in ref:  # greedy tokens are equal; logprobs agree to float32 rounding (see the EP backend NOTE)
            torch.testing.assert_close(torch.tensor(got[r][1]), torch.tensor(ref[r][1]), rtol=1e-4, atol=1e-4)
        loads = ep.executor.expert_loads()
        assert len(loads.imbalance) == 4 and all(x >= 1.0 for x in loads.imbalance)
        assert sum(loads.expert_counts(1)) > 0
        # a connector that names one pool's blocks is refused with per-rank pools (`kv_transfer.ranked` serves them)
        with pytest.raises(ValueError, match="expert_parallel_size=2"):
            ep.set_kv_connector(_OnePoolConnector())
        with pytest.raises(InvalidRequestError, match="expert_parallel_size > 1"):
            ep.add_request("held", prompts[0], SamplingParams(max_tokens=2), hold_kv=True)
        watched = queue.Queue()
        ep.executor.watch_ranks(watched.put)  # what a serving shell uses to exit with its rank group
        ep.executor._procs[0].kill()
        assert "deepinfer-rank1 (exit code -9) died" in str(watched.get(timeout=30))
        ep.executor._procs[0].join(timeout=30)
        ep.add_request("late", prompts[0], SamplingParams(max_tokens=2))
        with pytest.raises(RuntimeError, match="died|failed|Connection"):
            while ep.has_unfinished_requests():
                ep.step()
    finally:
        ep.shutdown()


@pytest.fixture(scope="module")
def tiny8(tmp_path_factory):
    """The `tiny` architecture with 8 routed experts (2 per rank at EP = 4), random weights."""
    cfg = {**PRESETS["tiny"].hf_config(), "n_routed_experts": 8}
    return str(make_checkpoint(tmp_path_factory.mktemp("tiny8"), preset=cfg, seed=4))


def test_ep4_random_model_with_redundant_experts_and_eplb_is_bit_identical(tiny8):
    """EP = 4 with 4 redundant experts and EPLB every 3 steps (re-placement while requests run), in the
    batch-invariant mode: tokens and logprobs bit-identical to one process (ranks idle in late steps
    included: their experts compute other ranks' rows under the same numerics)."""
    kw = dict(model=tiny8, max_num_seqs=6, max_model_len=128, batch_invariant=True)
    prompts = _prompts(6, 500, seed=1)
    max_tokens = [4, 7, 2, 8, 5, 6]
    one = Engine(**kw)
    ref = _generate(one, prompts, max_tokens)
    one_bytes, one_blocks = held_expert_bytes(one.model), one.cache.num_blocks
    one.shutdown()
    ep = Engine(expert_parallel_size=4, num_redundant_experts=4, eplb_interval_steps=3, **kw)
    try:
        # each rank's cache: its 2 of the 6 state slots and the blocks of 2 sequences
        assert ep.cache.num_slots == 2 and 3 * ep.cache.num_blocks == one_blocks
        mem = ep.executor.rank_memory()  # each rank loaded only its 3 of the 12 slots' experts
        for r, m in enumerate(mem):
            assert m.expert_ids == [sorted(set((*range(8), 0, 1, 2, 3)[3 * r:3 * r + 3]))] * 4
            assert m.expert_bytes * 8 == one_bytes * 3 and m.num_blocks == ep.cache.num_blocks
        got = _generate(ep, prompts, max_tokens)
        assert got == ref
        placements = ep.executor.rebalance_experts()
        assert all(p == placements[0] for p in placements)  # every rank computed the same placement
        assert any(layer != tuple(range(8)) + (0, 1, 2, 3) for layer in placements[0])  # EPLB moved experts
        for r, m in enumerate(ep.executor.rank_memory()):  # the weights moved with the placement
            assert m.expert_ids == [sorted(set(layer[3 * r:3 * r + 3])) for layer in placements[0]]
        assert _generate(ep, prompts, max_tokens) == ref  # and the moved experts compute the same bits
    finally:
        ep.shutdown()


def test_ep2_prefix_caching_hits_on_the_rank_holding_the_prefix(tiny8):
    """Prefix caching with EP = 2 (per-rank pools, block ids carry the rank): requests sharing a prompt prefix
    with a finished one land on its rank, hit the cache there, and give the one-process engine's bits."""
    kw = dict(model=tiny8, max_num_seqs=4, max_model_len=128, batch_invariant=True, block_size=8)
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(2, 500, (64,), generator=g).tolist()
    first = [prefix + [11, 12, 13]]
    later = [prefix + [21, 22], prefix + [31], torch.randint(2, 500, (20,), generator=g).tolist()]

    def run(engine):
        out = _generate(engine, first, [3])
        for i, p in enumerate(later):
            engine.add_request(f"l{i}", p, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=1))
        engine.step()
        ranks = {f"l{i}": engine.slots.get_slot_id(f"l{i}") % 2 for i in range(len(later))}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    out[o.request_id] = (o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs])
        return out, ranks, engine.kv_manager.num_prefix_hit_tokens

    one = Engine(**kw)
    ref, _, ref_hits = run(one)
    one.shutdown()
    ep = Engine(expert_parallel_size=2, **kw)
    try:
        got, ranks, hits = run(ep)
        assert got == ref
        assert ranks["l0"] == ranks["l1"] == 0 and ranks["l2"] == 1  # the prefix's rank (0: the first request's)
        assert hits == ref_hits > 0
    finally:
        ep.shutdown()


def test_ep2_preemption_in_a_short_rank_pool_keeps_the_tokens(tiny8):
    """Per-rank pools of 6 blocks of 8 tokens: requests growing on one rank preempt a request of that rank
    (never one of the other rank, whose blocks would not help); tokens stay bit-identical to one process."""
    kw = dict(model=tiny8, max_num_seqs=4, max_model_len=48, batch_invariant=True, block_size=8,
              enable_prefix_caching=False)
    prompts = _prompts(4, 500, seed=7)
    prompts = [p[:20] for p in prompts]
    max_tokens = [20, 20, 20, 20]
    one = Engine(**kw)
    ref = _generate(one, prompts, max_tokens)
    one.shutdown()
    ep = Engine(expert_parallel_size=2, num_blocks=6, **kw)
    try:
        got = _generate(ep, prompts, max_tokens)
        assert {r: t for r, (t, _) in got.items()} == {r: t for r, (t, _) in ref.items()}
        assert got == ref
        assert ep.scheduler.num_preemptions > 0
    finally:
        ep.shutdown()


def test_ep2_ranks_sample_their_rows_bit_identically(tiny8):
    """Each rank samples its own rows (seeds of unseeded rows drawn by rank 0's sampler as one process would):
    random sampling with and without request seeds, penalties, logit bias, min_tokens, top-k/p and logprobs
    give the one-process engine's tokens and logprobs bit for bit."""
    kw = dict(model=tiny8, max_num_seqs=4, max_model_len=96, batch_invariant=True, seed=123)
    prompts = _prompts(5, 500, seed=9)
    params = [
        SamplingParams(max_tokens=6, temperature=0.9, seed=7, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=5, temperature=1.1, top_k=20, top_p=0.9, logprobs=1, ignore_eos=True),
        SamplingParams(max_tokens=7, temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5,
                       logit_bias={5: 3.0, 9: -2.0}, ignore_eos=True),
        SamplingParams(max_tokens=4, temperature=0.7, min_p=0.05, min_tokens=3, frequency_penalty=0.4, logprobs=0),
        SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True),
    ]

    def run(engine):
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.add_request(str(i), p, sp)
        out = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    out[o.request_id] = (o.outputs[0].token_ids, o.outputs[0].logprobs)
        return out

    one = Engine(**kw)
    ref = run(one)
    one.shutdown()
    ep = Engine(expert_parallel_size=2, **kw)
    try:
        assert run(ep) == ref
    finally:
        ep.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL all-to-all between ranks)")
def test_ep2_on_two_gpus_matches_one_gpu(tiny8):
    """The NCCL path: rank r on cuda:r, dispatch/combine as NCCL all-to-alls, control on gloo."""
    kw = dict(model=tiny8, device="cuda", max_num_seqs=4, max_model_len=128, async_scheduling=False)
    prompts = _prompts(4, 500, seed=2)
    max_tokens = [3, 6, 4, 5]
    one = Engine(**kw)
    ref = _generate(one, prompts, max_tokens)
    one.shutdown()
    ep = Engine(expert_parallel_size=2, num_redundant_experts=2, **kw)
    try:
        got = _generate(ep, prompts, max_tokens)
        assert {r: t for r, (t, _) in got.items()} == {r: t for r, (t, _) in ref.items()}
    finally:
        ep.shutdown()
