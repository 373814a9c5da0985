"""Speculative decoding on a multi-rank instance (`engine.distributed.spec`): `expert_parallel_size` = 2 and 4, gloo
ranks in processes. Each rank verifies and drafts its own requests (its ring rows rolled back on a rejection), a
rank without requests joins the MoE collectives with zero rows, and rank 0 decides the verify schedule for the
whole batch. Greedy tokens equal the one-process engine's without speculation, token for token.

On random checkpoints the MTP drafts are nearly always rejected, so an oracle drafter (the reference continuation
with errors injected, set on rank 0's scheduler between steps) exercises every accepted length on every rank; the
built-in model's own drafts are mostly accepted.
"""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer.engine import LLM, SamplingParams
from deepinfer.engine.config import ModelConfig
from deepinfer.engine.engine import Engine
from deepinfer.engine.testing.make_checkpoint import _write_ours, random_weights
from deepinfer.engine.testing.presets import PRESETS


@pytest.fixture(scope="module")
def tiny8(tmp_path_factory):
    """The `tiny` preset (window 8, CSA rate 4) with 8 routed experts (2 per rank at EP = 4) and one random MTP
    layer."""
    hf = {**PRESETS["tiny"].hf_config(), "n_routed_experts": 8, "num_nextn_predict_layers": 1}
    out = tmp_path_factory.mktemp("tiny8mtp")
    _write_ours(out, hf, random_weights(ModelConfig.from_hf_dict(hf), torch.float32, seed=6, mtp=True),
                torch.float32, 1 << 40)
    return str(out)


def _prompts(num: int, seed: int, vocab: int = 500) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (int(n),), generator=g).tolist() for n in torch.randint(3, 40, (num,), generator=g)]


def _run(engine: Engine, prompts, max_tokens, drafts_fn=None) -> list[list[int]]:
    """Each request's tokens; `max_tokens[i]`: an int (greedy, ignore_eos) or the request's `SamplingParams`."""
    for i, (p, n) in enumerate(zip(prompts, max_tokens)):
        sp = n if isinstance(n, SamplingParams) else SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        engine.add_request(str(i), p, sp)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
        if drafts_fn is not None:
            for req in engine.scheduler.running.values():
                if req.spec_token_ids:
                    req.spec_token_ids = drafts_fn(req)
    return [outs[str(i)] for i in range(len(prompts))]


def _oracle(prompts, ref, k: int, error_rate: float, seed: int):
    rng = random.Random(seed)
    full = {str(i): p + r for i, (p, r) in enumerate(zip(prompts, ref))}

    def drafts(req):
        seq = full[req.req_id]
        return [t + 1 if rng.random() < error_rate else t for t in seq[req.num_tokens:req.num_tokens + k]] or [3]
    return drafts


def test_ep2_and_ep4_speculative_equal_one_process_without_speculation(tiny8):
    """Batch-invariant mode (bit-equal MoE numerics across rank layouts). Requests of different lengths, so late
    steps leave ranks without requests; the random MTP drafts (rejected: every rank rolls back) and oracle drafts
    with errors (every accepted length), the full and the confidence schedules."""
    kw = dict(model=tiny8, max_num_seqs=6, max_model_len=128, batch_invariant=True)
    prompts = _prompts(5, seed=1)
    max_tokens = [3, 10, 2, 8, 6]
    ref = _run(Engine(**kw), prompts, max_tokens)

    ep = Engine(expert_parallel_size=2, speculative="mtp", num_draft_tokens=3, **kw)
    try:
        assert ep.executor.state.spec is ep.spec and ep.cache.num_slots == 3 and ep.spec.drafter.cache.num_slots == 3
        assert _run(ep, prompts, max_tokens) == ref
        m = ep.spec.metrics
        assert m.num_verified_drafts > 15 and m.num_steps > 0
        # oracle drafts: accepted prefixes of every length, on both ranks
        assert _run(ep, prompts, max_tokens, _oracle(prompts, ref, 3, 0.25, seed=3)) == ref
        assert 0 < m.num_accepted_drafts < m.num_verified_drafts and m.accepted_per_position[2] > 0
    finally:
        ep.shutdown()

    ep = Engine(expert_parallel_size=4, speculative="mtp", num_draft_tokens=2, verify_schedule="confidence",
                verify_floor=0, **kw)
    try:
        assert _run(ep, prompts, max_tokens) == ref
        m = ep.spec.metrics
        assert m.num_proposed_drafts > 0  # the schedule (rank 0's, over the whole batch) verified a subset
        assert _run(ep, prompts, max_tokens, _oracle(prompts, ref, 2, 0.3, seed=4)) == ref
        assert m.num_accepted_drafts > 0
    finally:
        ep.shutdown()


def test_ep2_seeded_sampling_preemption_and_prefix_hits(tiny8):
    """Seeded sampling with penalties (each rank samples its verify rows with the per-position streams, seeds of
    the expanded rows resolved by rank 0), chunked prefills, preemptions in short per-rank pools and prefix-cache
    hits on the rank holding the prefix: the one-process engine's tokens without speculation, bit for bit."""
    kw = dict(model=tiny8, max_num_seqs=4, max_model_len=64, batch_invariant=True, block_size=8,
              max_num_batched_tokens=20)  # chunked prefills share steps with verifies
    g = torch.Generator().manual_seed(8)
    prefix = torch.randint(2, 500, (24,), generator=g).tolist()
    prompts = [prefix + [7, 8], torch.randint(2, 500, (20,), generator=g).tolist(), prefix + [9],
               torch.randint(2, 500, (16,), generator=g).tolist()]
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.7, top_k=20, seed=12, max_tokens=16, ignore_eos=True,
                             repetition_penalty=1.3, frequency_penalty=0.5),
              SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=1.2, presence_penalty=1.0, seed=13, max_tokens=16, ignore_eos=True)]
    ref = _run(Engine(**kw), prompts, params)
    ep = Engine(expert_parallel_size=2, speculative="mtp", num_draft_tokens=3, num_blocks=7, **kw)
    try:
        assert _run(ep, prompts, params, _oracle(prompts, ref, 3, 0.2, seed=5)) == ref
        assert ep.scheduler.num_preemptions > 0 and ep.spec.metrics.num_accepted_drafts > 10
        assert _run(ep, prompts, params, _oracle(prompts, ref, 3, 0.2, seed=6)) == ref  # again: prefix hits
        assert ep.kv_manager.num_prefix_hit_tokens > 0
    finally:
        ep.shutdown()


def test_builtin_model_llm_with_expert_parallelism_accepts_drafts():
    """`LLM(model, speculative="mtp", expert_parallel_size=2)` on the built-in model (its MTP layer drafts well):
    the one-process engine's greedy tokens without speculation (a structured-output request included), most
    drafts accepted, on both ranks."""
    import deepseek_recipe as recipe

    from deepinfer.engine.builtin_model import builtin_model_path
    from deepinfer.engine.tokenizer import load_chat_encoding

    enc = load_chat_encoding(builtin_model_path())
    qs = ["What is 37 + 48?", "Repeat these words: apple banana cherry Paris", "What is 12 + 79?"]
    prompts = [{"prompt_token_ids": enc.encode(recipe.Conversation([recipe.UserMessage(q)]))} for q in qs]
    from deepinfer.engine.sampling.params import StructuredOutputParams

    natural = SamplingParams(temperature=0.0, max_tokens=24)
    # a structured-output request: its verify rows masked by its grammar on the rank that samples them
    params = [natural, SamplingParams(temperature=0.0, max_tokens=8,
                                      structured_output=StructuredOutputParams(regex="[0-9]{1,3}")), natural]
    kw = dict(max_num_seqs=4, max_model_len=256, batch_invariant=True)
    ref = [o.outputs[0].token_ids for o in LLM(**kw).generate(prompts, params, use_tqdm=False)]
    llm = LLM(speculative="mtp", expert_parallel_size=2, **kw)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == ref
        stats = llm.engine.speculative_stats()
        assert stats["mean_accepted_length"] >= 1.8 and stats["num_accepted_drafts"] > 0
    finally:
        llm.engine.shutdown()


def test_split_spec_step_maps_verifies_to_ranks(tiny8):
    """The split on its own: each rank gets its requests' verify entries with local seq indices and local first
    sampling rows, and the merge puts the ranks' results back in the step's sampling order."""
    from deepinfer.engine.distributed.spec import merge_spec_results, split_spec_step
    from deepinfer.engine.forward_batch import ForwardBatch, SeqChunk
    from deepinfer.engine.spec_decode.executor import LocalSpecResult, SpecPreparedStep, _Verify

    # slots 0, 1, 2, 3 -> ranks 0, 1, 0, 1; seq 0 a prefill chunk (no sampling), seqs 1-3 verify 2, 0, 1 drafts
    seqs = [SeqChunk(0, [], 0, 4, 0), SeqChunk(1, [], 5, 3, 0), SeqChunk(2, [], 7, 1, 0), SeqChunk(3, [], 9, 2, 0)]
    logits = [4 + 0, 4 + 1, 4 + 2, 7, 8 + 0, 8 + 1]  # seq 1's rows, seq 2's, seq 3's
    batch = ForwardBatch.build([[1] * 4, [2] * 3, [3], [4] * 2], seqs, logits=logits)
    verify = [_Verify(1, 0, [5, 6]), _Verify(2, 3, []), _Verify(3, 4, [7])]
    step = SpecPreparedStep(batch, None, verify=verify, next_token_ids=[9, None, None, None],
                            mtp_state_starts=[0, 0, 0, 0], wants_drafts=[False, True, True, True])
    plans, rows_of_rank, verify_at = split_spec_step(step, 2)
    assert rows_of_rank == [[3], [0, 1, 2, 4, 5]]
    assert verify_at == [(1, 0), (0, 0), (1, 1)]
    assert [(v.seq_idx, v.first_row, v.drafts) for v in plans[0].verify] == [(1, 0, [])]
    assert [(v.seq_idx, v.first_row, v.drafts) for v in plans[1].verify] == [(0, 0, [5, 6]), (1, 3, [7])]
    assert plans[1].logits_rows == [0, 1, 2, 3, 4]  # rank 1's flat rows: seq 1 from 0, seq 3 from 3
    assert plans[0].next_token_ids == [9, None] and plans[1].wants_drafts == [True, True]
    r0 = LocalSpecResult([[30]], [[None]], [[31]], [[0.5]], [None], 1.0, 0.1)
    r1 = LocalSpecResult([[10, 11], [20]], [[None] * 2, [None]], [[12], [21]], [[0.1], [0.2]], [None, None], 2.0, 0.2)
    merged = merge_spec_results([r0, r1], verify_at)
    assert merged.token_ids == [[10, 11], [30], [20]] and merged.draft_token_ids == [[12], [31], [21]]
    assert merged.model_s == 2.0


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL all-to-all between ranks)")
def test_ep2_speculative_on_two_gpus_matches_one_gpu(tiny8):
    """The NCCL path: rank r on cuda:r verifying and drafting its own requests, the MoE dispatch / combine as NCCL
    all-to-alls, control (plans, tokens, drafts) on gloo; greedy tokens equal one GPU without speculation."""
    kw = dict(model=tiny8, device="cuda", max_num_seqs=4, max_model_len=128, async_scheduling=False)
    prompts = _prompts(4, seed=2)
    max_tokens = [3, 9, 4, 7]
    ref = _run(Engine(**kw), prompts, max_tokens)
    ep = Engine(expert_parallel_size=2, speculative="mtp", num_draft_tokens=3, **kw)
    try:
        assert _run(ep, prompts, max_tokens, _oracle(prompts, ref, 3, 0.25, seed=7)) == ref
        assert ep.spec.metrics.num_accepted_drafts > 0
    finally:
        ep.shutdown()
