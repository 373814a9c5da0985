"""A DeepSeek-V4.1 continuation keeps the original prompt's decoder-replay tail start (issue 23 §3 with issue 28
§3): after a decode restart or a migration the request comes back as prompt + the k tokens the client has, with
`max_tokens - k`; given the original prompt length (`Engine.add_request(num_original_prompt_tokens=P)`), its
layers after the last KV source start at `P - sliding_window` as the uninterrupted run's did, so with
`batch_invariant=True` and decoder-side bounded replay on (the default) its tokens and logprobs equal the
uninterrupted run's bit for bit (greedy and seeded), also with a prefix-cache hit on the continuation. Without
the field the continuation's tail starts k positions later and its logprobs differ (so the test can fail).

The replay-off continuation and the helpers (`TARGET`, `_companions`, the tiny published-layout checkpoint) are
tests/engine/v41/test_batch_invariant.py's. The token API carries the field too
(tests/entrypoint/test_migration.py: the migration's continuation sets it; the workers pass it to their engines).
"""

from __future__ import annotations

import time

import pytest
import torch

from deepinfer.engine import LLM, SamplingParams
from deepinfer.engine.errors import InvalidRequestError
from tests.engine.v41.test_batch_invariant import TARGET, _companions, ckpt  # noqa: F401  (ckpt: a fixture)

K, MAX_TOKENS = 4, 10
"""Tokens the client has when the continuation starts; the request's whole budget."""
KW = dict(batch_invariant=True, block_size=4, max_model_len=128)
"""Decoder-side bounded replay on: the engine's default for V4.1."""
SAMPLINGS = (dict(temperature=0.0), dict(temperature=1.0, seed=4321))


def _lps(entries) -> torch.Tensor:
    return torch.tensor([v for lp in entries for v in (lp.logprob, *lp.top_logprobs)], dtype=torch.float64)


def _generate_beside(llm: LLM, prompt: list[int], params: SamplingParams, seed: int, position: int, **kw):
    """Blocks until `prompt` (added with `kw`, e.g. `num_original_prompt_tokens`) and 3 random companions around
    it finished on `llm`'s engine; returns its `CompletionOutput` and the request's `num_cached_tokens`."""
    prompts, comp_params = _companions(3, seed=seed)
    engine = llm.engine
    ids = [engine.add_request(None, p, sp) for p, sp in zip(prompts[:position], comp_params[:position])]
    rid = engine.add_request(None, {"prompt_token_ids": prompt}, params, **kw)
    ids += [engine.add_request(None, p, sp) for p, sp in zip(prompts[position:], comp_params[position:])]
    done = {}
    while rid not in done or len(done) < len(ids) + 1:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done[rid].outputs[0], done[rid].num_cached_tokens


@pytest.fixture(scope="module")
def uninterrupted(ckpt):  # noqa: F811
    """Per sampling: the target's outputs run through beside 4 companions (decoded one position per step)."""
    llm = LLM(ckpt, max_num_seqs=8, **KW)
    assert llm.engine.model.decoder_replay
    got = []
    for sp in SAMPLINGS:
        prompts, params = _companions(4, seed=21)
        prompts.insert(2, {"prompt_token_ids": TARGET})
        params.insert(2, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2, **sp))
        got.append(llm.generate(prompts, params, use_tqdm=False)[2].outputs[0])
    return got


def test_continuation_with_the_original_prompt_length_is_bit_identical(ckpt, uninterrupted):  # noqa: F811
    """The continuation's prefill (chunked at 16 tokens beside other companions) computes the later layers from
    the original tail start: greedy and seeded tokens and every logprob after the restart are the uninterrupted
    run's; without the original length some logprob differs."""
    llm = LLM(ckpt, max_num_seqs=8, max_num_batched_tokens=16, **KW)
    for sp, full in zip(SAMPLINGS, uninterrupted):
        params = SamplingParams(max_tokens=MAX_TOKENS - K, ignore_eos=True, logprobs=2, **sp)
        prompt = TARGET + list(full.token_ids[:K])
        cont, _ = _generate_beside(llm, prompt, params, seed=22, position=1, num_original_prompt_tokens=len(TARGET))
        assert list(cont.token_ids) == list(full.token_ids[K:]), sp
        assert torch.equal(_lps(cont.logprobs), _lps(full.logprobs[K:])), sp
        # NOTE: the same continuation as a plain prompt: its tail starts K positions later
        plain, _ = _generate_beside(llm, prompt, params, seed=22, position=1)
        assert not torch.equal(_lps(plain.logprobs), _lps(full.logprobs[K:])), (
            f"{sp}: without num_original_prompt_tokens the continuation matched too: the test above cannot fail")


def test_continuation_with_a_prefix_hit_is_bit_identical(ckpt, uninterrupted):  # noqa: F811
    """A continuation whose prompt hits cached blocks (an earlier request shared its first 44 tokens): the bounded
    replay before the hit and the tail start fixed by the original prompt give the same bits."""
    llm = LLM(ckpt, max_num_seqs=8, enable_prefix_caching=True, **KW)
    llm.generate([{"prompt_token_ids": TARGET[:44] + [7, 8, 9]}], SamplingParams(max_tokens=1), use_tqdm=False)
    for sp, full in zip(SAMPLINGS, uninterrupted):
        params = SamplingParams(max_tokens=MAX_TOKENS - K, ignore_eos=True, logprobs=2, **sp)
        cont, num_cached = _generate_beside(llm, TARGET + list(full.token_ids[:K]), params, seed=23, position=2,
                                            num_original_prompt_tokens=len(TARGET))
        assert num_cached > 0
        assert list(cont.token_ids) == list(full.token_ids[K:]), sp
        assert torch.equal(_lps(cont.logprobs), _lps(full.logprobs[K:])), sp


def test_bad_original_prompt_lengths_are_refused(ckpt):  # noqa: F811
    engine = LLM(ckpt, max_num_seqs=2, **KW).engine
    for bad in (0, -1, len(TARGET) + 1, True, 3.0, "3"):
        with pytest.raises(InvalidRequestError) as e:
            engine.add_request(None, {"prompt_token_ids": TARGET}, num_original_prompt_tokens=bad)
        assert e.value.field == "num_original_prompt_tokens"
    assert not engine.has_unfinished_requests()
    rid = engine.add_request(None, {"prompt_token_ids": TARGET}, SamplingParams(max_tokens=1),
                             num_original_prompt_tokens=len(TARGET))  # the whole prompt: as unset
    assert engine.scheduler.get_request(rid).num_replay_prompt_tokens == len(TARGET)
    engine.abort_request(rid)


@pytest.mark.parametrize("mode", ["send", "replay"])
def test_prefill_and_decode_cores_carry_the_original_prompt_length(ckpt, uninterrupted, mode):  # noqa: F811
    """The workers' path (in process, NIXL over UCX loopback): the continuation reserved on a decode core and
    prefilled on a prefill core, both given the original prompt length, gives the uninterrupted run's tokens and
    logprobs (the prefill's first token, then the decode's), with the decode's bounded state sent by the prefill
    ("send") or rebuilt by bounded replay over the moved blocks ("replay")."""
    pytest.importorskip("nixl")
    from deepinfer.decode_worker.core import DecodeCore, DecodeFailed
    from deepinfer.engine.engine import Engine, EngineConfig
    from deepinfer.kv_transfer import LOOPBACK_UCX_ENV, KVTransferAgent
    from deepinfer.prefill_worker.core import KVDestination, PrefillCore, PrefillWork

    engines = [Engine(EngineConfig(model=ckpt, max_num_seqs=4, **KW)) for _ in range(2)]
    p_agent = KVTransferAgent(f"p-cont-{mode}", engines[0].cache, ucx_env=LOOPBACK_UCX_ENV, send_state=True)
    d_agent = KVTransferAgent(f"d-cont-{mode}", engines[1].cache, ucx_env=LOOPBACK_UCX_ENV, send_state=mode == "send")
    try:
        p_agent.add_peer(f"d-cont-{mode}", d_agent.metadata(), d_agent.pool_layout())
        prefill, decode = PrefillCore(engines[0], p_agent), DecodeCore(engines[1], d_agent, f"d-cont-{mode}")
        for i, (sp, full) in enumerate(zip(SAMPLINGS, uninterrupted)):
            rid, prompt = f"cont-{i}", TARGET + list(full.token_ids[:K])
            params = SamplingParams(max_tokens=MAX_TOKENS - K, ignore_eos=True, logprobs=2, **sp)
            res = decode.reserve(rid, prompt, params, num_original_prompt_tokens=len(TARGET))
            prefill.submit(PrefillWork(rid, prompt, params, KVDestination(res.peer, res.block_ids, res.transfer_id,
                                                                          30.0, state_slot=res.state_slot),
                                       num_original_prompt_tokens=len(TARGET)))
            first, out, deadline = None, None, time.monotonic() + 60.0
            while out is None:
                assert time.monotonic() < deadline, "the P/D run did not finish"
                for done in prefill.step():
                    assert not done.error, done.error
                    first = done.first_token_logprobs
                for ev in decode.step():
                    assert not isinstance(ev, DecodeFailed), ev.error
                    out = ev if ev.finished else out
            got = out.outputs[0]
            assert list(got.token_ids) == list(full.token_ids[K:]), (mode, sp)
            assert len(got.logprobs) == MAX_TOKENS - K - 1  # the first token's come from the prefill
            assert torch.equal(_lps([first, *got.logprobs]), _lps(full.logprobs[K:])), (mode, sp)
    finally:
        p_agent.close()
        d_agent.close()


def test_v4_accepts_and_ignores_it(tmp_path):
    """DeepSeek-V4 computes nothing from where a prompt ends (no decoder-side replay): the field is validated and
    changes no bit, so the entrypoint sets it on every continuation whatever the model."""
    from deepinfer.engine.testing.make_checkpoint import make_checkpoint

    engine = LLM(str(make_checkpoint(tmp_path / "v4", preset="tiny", seed=5)), batch_invariant=True,
                 max_model_len=128).engine
    assert not hasattr(engine.model, "decoder_replay")
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=2)
    got, outs = [], {}
    for kw in ({}, {"num_original_prompt_tokens": 40}):
        rid = engine.add_request(None, {"prompt_token_ids": TARGET}, params, **kw)
        while engine.has_unfinished_requests():
            outs.update({o.request_id: o for o in engine.step() if o.finished})
        got.append(outs[rid].outputs[0])
    assert got[0].token_ids == got[1].token_ids and torch.equal(_lps(got[0].logprobs), _lps(got[1].logprobs))
    with pytest.raises(InvalidRequestError):
        engine.add_request(None, {"prompt_token_ids": TARGET}, params, num_original_prompt_tokens=len(TARGET) + 1)
