"""Speculative decoding after imported KV (the disaggregated decode stage, in process).

A decode instance receives a prompt's compressed KV from a prefill instance and rebuilds the bounded
state by bounded replay of the prompt's tail; the committed pass of the MTP drafter runs over the
replayed positions too, so its window ring comes out as on an engine that computed the whole prompt
(`engine.spec_decode.drafter_replay_tokens`), and the outputs equal the offline engine's.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine import SamplingParams
from deepinfer.engine.config import ModelConfig
from deepinfer.engine.engine import Engine, EngineConfig
from deepinfer.engine.spec_decode import drafter_replay_tokens
from deepinfer.engine.testing.make_checkpoint import _write_ours, random_weights
from deepinfer.engine.testing.presets import PRESETS


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The `tiny` preset (window 8) with one random MTP layer."""
    hf = {**PRESETS["tiny"].hf_config(), "num_nextn_predict_layers": 1}
    out = tmp_path_factory.mktemp("tiny")
    _write_ours(out, hf, random_weights(ModelConfig.from_hf_dict(hf), torch.float32, seed=5, mtp=True),
                torch.float32, 1 << 40)
    return str(out)


def _copy_kv(src: Engine, src_descriptors, dst: Engine, dst_descriptors) -> None:
    """Copy the compressed-KV bytes of `src_descriptors` into `dst_descriptors` (pool by pool, block by block)."""
    by_pool: dict[str, list] = {}
    for name, _block, offset, nbytes in src_descriptors:
        by_pool.setdefault(name, []).append((offset, nbytes))
    pools_src, pools_dst = src.cache.compressed_pools(), dst.cache.compressed_pools()
    dst_by_pool: dict[str, list] = {}
    for name, _block, offset, nbytes in dst_descriptors:
        dst_by_pool.setdefault(name, []).append((offset, nbytes))
    for name, ranges in dst_by_pool.items():
        a = pools_src[name].view(-1).view(torch.uint8)
        b = pools_dst[name].view(-1).view(torch.uint8)
        num_layers = pools_dst[name].shape[0]
        per_dst, per_src = len(ranges) // num_layers, len(by_pool[name]) // num_layers
        for layer in range(num_layers):
            for k in range(per_dst):
                (do, n), (so, _) = ranges[layer * per_dst + k], by_pool[name][layer * per_src + k]
                b[do:do + n] = a[so:so + n]


def _ring_rows(engine: Engine, req_id: str, positions: range) -> torch.Tensor:
    """The drafter's window-ring rows of `positions` for the request's slot: [num_positions, dim]."""
    [ring] = [t for t in engine.spec.drafter.cache.state_tensors().values() if t.numel()]
    slot = engine.slots.get_slot_id(req_id)
    return ring[0, slot, [p % ring.shape[2] for p in positions]]


def test_replay_rebuilds_the_drafter_window_and_outputs_are_exact(tiny):
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(2, 512, (100,), generator=g).tolist()
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ref = Engine(EngineConfig(model=tiny))
    ref.add_request("r", {"prompt_token_ids": prompt}, greedy)
    want = None
    while ref.has_unfinished_requests():
        want = [o for o in ref.step() if o.finished] or want
    want = want[0].outputs[0].token_ids

    # "prefill": a speculative engine computes the whole prompt and samples token 1
    a = Engine(EngineConfig(model=tiny, speculative_tokens=3))
    a.add_request("r", {"prompt_token_ids": prompt}, greedy)
    [first] = a.step()
    assert first.outputs[0].token_ids == want[:1]
    window = a.model_config.sliding_window
    assert drafter_replay_tokens(a.model_config) <= a.replay_tokens < len(prompt) - window
    positions = range(len(prompt) - window + 1, len(prompt))  # the drafter's keys its next query reads
    rows_a = _ring_rows(a, "r", positions).clone()
    assert rows_a.abs().sum() > 0

    # "decode": the KV arrives, the bounded state and the drafter's window are rebuilt by bounded replay
    b = Engine(EngineConfig(model=tiny, speculative_tokens=3))
    dst = b.reserve_kv("d", prompt, greedy, len(prompt))
    _copy_kv(a, a.kv_descriptors("r"), b, dst)
    b.commit_kv("d", want[:1])
    outs = b.step()  # the replay of the prompt's tail + token 1's position: samples token 2, drafts
    assert b.scheduler.get_request("d").spec_token_ids
    torch.testing.assert_close(_ring_rows(b, "d", positions), rows_a, rtol=1e-5, atol=1e-5)
    while b.has_unfinished_requests():
        outs = [o for o in b.step() if o.finished] or outs
    assert outs[0].outputs[0].token_ids == want
    assert b.spec.metrics.num_verifications > 0
    a.abort_request("r")


def test_drafts_handed_over_with_the_kv_are_verified_by_the_first_decode_step(tiny):
    from deepinfer.kv_transfer.pd_connector import decode_notice, encode_notice, notice_draft_token_ids

    payload = encode_notice([7], [8, 9, 10])  # the transfer notice carries them after the first token
    assert (decode_notice(payload), notice_draft_token_ids(payload)) == ([7], [8, 9, 10])
    assert notice_draft_token_ids(encode_notice([7])) == [] == notice_draft_token_ids(b"")

    g = torch.Generator().manual_seed(6)
    prompt = torch.randint(2, 512, (60,), generator=g).tolist()
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ref = Engine(EngineConfig(model=tiny))
    ref.add_request("r", {"prompt_token_ids": prompt}, greedy)
    want = None
    while ref.has_unfinished_requests():
        want = [o for o in ref.step() if o.finished] or want
    want = want[0].outputs[0].token_ids

    # "prefill": a speculative engine samples token 1 and drafts the next block (what it sends with the KV)
    a = Engine(EngineConfig(model=tiny, speculative="mtp", num_draft_tokens=3))
    a.add_request("r", {"prompt_token_ids": prompt}, greedy)
    [first] = a.step()
    assert first.outputs[0].token_ids == want[:1]
    mtp_drafts = a.scheduler.get_request("r").spec_token_ids
    assert len(mtp_drafts) == 3
    # "decode": the MTP's own drafts, the true continuation (all accepted) and wrong ones (all rejected); the
    # last with a small step budget, so the bounded replay takes several chunks
    cases = ((mtp_drafts, None, 2048), (want[1:4], 3, 2048), ([(t + 1) % 512 for t in want[1:4]], 0, 2048),
             (want[1:4], 3, 8))
    for drafts, accepted, budget in cases:
        b = Engine(EngineConfig(model=tiny, speculative="mtp", num_draft_tokens=3, max_num_batched_tokens=budget))
        dst = b.reserve_kv("d", prompt, greedy, len(prompt))
        _copy_kv(a, a.kv_descriptors("r"), b, dst)
        b.commit_kv("d", want[:1], drafts)
        req = b.scheduler.get_request("d")
        steps = 0
        while steps == 0 or req.num_computed_tokens < len(prompt):  # (it counts the imported KV until admitted)
            assert b.step() == []  # the bounded replay of the prompt's tail only: token 1 waits for its drafts
            steps += 1
        assert steps == 1 if budget > len(prompt) else steps > 1
        assert req.spec_token_ids == list(drafts) and req.num_computed_tokens == len(prompt) == req.num_tokens - 1
        assert b.spec.metrics.num_imported_drafts == 3
        b.step()  # token 1 + the drafts in one verifying step
        m = b.spec.metrics
        assert (m.num_verifications, m.num_verified_drafts) == (1, 3)
        if accepted is not None:
            assert m.num_accepted_drafts == accepted
        outs = []
        while b.has_unfinished_requests():
            outs = [o for o in b.step() if o.finished] or outs
        assert outs[0].outputs[0].token_ids == want
    # a non-speculative decode ignores them
    c = Engine(EngineConfig(model=tiny))
    dst = c.reserve_kv("d", prompt, greedy, len(prompt))
    _copy_kv(a, a.kv_descriptors("r"), c, dst)
    c.commit_kv("d", want[:1], want[1:4])
    assert c.scheduler.get_request("d").spec_token_ids == []
    outs = []
    while c.has_unfinished_requests():
        outs = [o for o in c.step() if o.finished] or outs
    assert outs[0].outputs[0].token_ids == want
    a.abort_request("r")
