"""DeepSeek-V4.1's DSpark draft stages (`engine.models.dspark`) and `speculative="dspark"`
(`engine.spec_decode.dspark_drafter`): the published-layout round trip with `mtp.*`, the draft forward against the
test-only reference written from the official code (`dspark_reference.py`), the DSpark features of the paged
step, and greedy outputs with speculation equal to outputs without (always-rejected real drafts; an oracle
drafter whose drafts are partly right, so acceptance stops at every position), with the confidence head's
sigmoid feeding the verify schedule."""

from __future__ import annotations

import json

import pytest
import torch

from deepinfer.engine.cache.v41 import V41KVCache
from deepinfer.engine.config import V41Config
from deepinfer.engine.forward_batch import ForwardBatch, SeqChunk
from deepinfer.engine.models.deepseek_v41 import load_published, published_storage, published_tensors
from deepinfer.engine.spec_decode.dspark_drafter import DSparkDrafter
from deepinfer.engine.spec_decode.mtp_drafter import DraftSeq
from deepinfer.engine.testing.make_checkpoint import main as make_checkpoint_main
from deepinfer.engine.testing.make_checkpoint import random_v41_model, with_tiny_dspark
from tests.engine.v41.configs import tiny_config
from tests.engine.v41.dspark_reference import DSparkReference

# NOTE: `TINY_V41_DSPARK`: three stages as Flash has, targets straddling the last KV source (5: before the
# decoder-replay cut, 6 and 7 after it), a block of 4, a smaller MoE than the backbone's


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config()
    cfg["text_config"] = with_tiny_dspark(cfg["text_config"])
    return random_v41_model(V41Config.from_hf_dict(cfg), seed=5).eval()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("v41_dspark")
    return make_checkpoint_main([str(out), "--format", "published-v41", "--dspark", "--seed", "3", "--overwrite"])


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 63, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ------------------------------------------------------------------ loading


def test_published_round_trip_with_dspark_stages(ckpt):
    from safetensors import safe_open

    from deepinfer.engine.loader import read_checkpoint_config

    config, _ = read_checkpoint_config(ckpt)  # no longer refused: nothing unsupported
    assert config.num_nextn_predict_layers == 3 and config.unsupported() == []
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    stored = {}
    for file in sorted(set(index.values())):
        with safe_open(str(ckpt / file), framework="pt") as f:
            stored.update({k: f.get_tensor(k) for k in f.keys() if k.startswith("mtp.")})
    for name in ("mtp.0.main_proj.weight", "mtp.0.main_proj.scale", "mtp.0.main_norm.weight", "mtp.2.norm.weight",
                 "mtp.2.markov_head.embed.weight", "mtp.2.markov_head.head.weight",
                 "mtp.2.confidence_head.proj.weight", "mtp.1.attn.wkv.scale", "mtp.1.ffn.experts.2.w1.scale",
                 "mtp.1.ffn.gate.bias", "mtp.2.hc_ffn_fn"):
        assert name in stored, name
    assert "mtp.0.norm.weight" not in stored and "mtp.1.main_proj.weight" not in stored  # per-stage heads only
    assert stored["mtp.0.main_proj.weight"].dtype == torch.float8_e4m3fn and published_storage(
        "mtp.0.main_proj.weight") == "fp8"
    assert stored["mtp.2.markov_head.head.weight"].dtype == torch.bfloat16
    assert stored["mtp.1.ffn.gate.bias"].dtype == torch.float32
    assert len([n for n in stored if ".ffn.experts." in n and n.endswith("w1.weight")]) == 3 * 3
    # kept as stored by the engine's reader, and written back unchanged
    kept = load_published(ckpt, keep_fp8=True, keep_fp4=True)
    assert len(kept.mtp) == 3 and type(kept.mtp[0].main_proj).__name__ == "Fp8Linear"
    back = published_tensors(kept)
    def raw(t):
        return t.view(torch.uint8) if t.element_size() == 1 else t

    for name, t in stored.items():
        assert back[name].dtype == t.dtype and torch.equal(raw(back[name]), raw(t)), name
    # a checkpoint of these stages lacking one of their tensors is refused, naming it
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["text_config"]["dspark_markov_rank"] = 8
    bad = ckpt.parent / "bad_dspark"
    bad.mkdir()
    for f in ckpt.iterdir():
        (bad / f.name).symlink_to(f)
    (bad / "config.json").unlink()
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="markov_head"):
        load_published(bad)


# ------------------------------------------------------------------ the forward against the reference


def _reference(model):
    return DSparkReference(model.config, model.state_dict(), model.engram_hash.token_map)


def test_dspark_draft_matches_official_reference(model):
    """Prefill seeds the rings (no drafts), then decode steps draft a block each: drafts, Markov-biased logits and
    confidence logits equal the reference's (float32); committing three positions at once (accepted drafts)
    equals the reference stepping them one at a time."""
    cfg = model.config
    P, T = 9, 16  # window 4: the rings wrap
    tokens = _ids(T, 1)
    ref = _reference(model)
    with torch.no_grad():
        _, mh = ref.forward_hidden(torch.tensor([tokens]))  # [1, T, 3H] (causal: each row its prefix's)
    assert ref.forward_spec(torch.tensor([tokens[P]]), mh[:, :P], 0) is None  # prefill: seeding only
    drafter = DSparkDrafter(model, num_slots=2, num_draft_tokens=3)
    feats = mh[0]
    drafter.commit(feats, [DraftSeq(1, 0, list(range(P)), tokens[1:P + 1], 0, False)])
    for i in range(P, P + 2):  # official decode steps at start_pos i
        out_ids, logits, conf = ref.forward_spec(torch.tensor([tokens[i + 1]]), mh[:, i:i + 1], i)
        seq = DraftSeq(1, i, [i], [tokens[i + 1]], 0, True)
        drafter.commit(feats, [seq])
        ours = drafter.draft([seq], "cpu")
        assert ours.draft_ids[0].tolist() == out_ids[0, 1:].tolist()
        torch.testing.assert_close(ours.logits, logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(ours.confidence_logits, conf, atol=1e-4, rtol=1e-4)
    # three verified positions in one committed pass, drafting from the last (the reference steps them)
    for i in range(P + 2, P + 4):
        ref.forward_spec(torch.tensor([tokens[i + 1]]), mh[:, i:i + 1], i)
    out_ids, logits, conf = ref.forward_spec(torch.tensor([tokens[P + 5]]), mh[:, P + 4:P + 5], P + 4)
    seq = DraftSeq(1, P + 2, [P + 2, P + 3, P + 4], tokens[P + 3:P + 6], 0, True)
    drafts, probs, _ = drafter.propose(feats, [seq])
    assert drafts == [out_ids[0, 1:4].tolist()]  # num_draft_tokens 3 of the block of 4
    torch.testing.assert_close(torch.tensor(probs), torch.sigmoid(conf[:, :3]), atol=1e-5, rtol=1e-5)
    assert cfg.dspark_block_size == 4 and DSparkDrafter(model, 2, 9).num_draft_tokens == 4  # capped at the block


def test_paged_step_returns_the_reference_features(model):
    """`forward(return_streams=True)` hands the drafter each target layer's input streams averaged over hc, for a
    chunked prefill and a decode row, with decoder-side replay off (every row) and on (rows before the tail: 0)."""
    tokens = _ids(11, 2)
    ref = _reference(model)
    with torch.no_grad():
        _, mh = ref.forward_hidden(torch.tensor([tokens]))
    for replay in (False, True):
        model.decoder_replay = replay
        cache = V41KVCache(model.config, 4, 4, 1)
        got, done = [], 0
        for n in (6, 4, 1):
            seqs = [SeqChunk(0, [0, 1, 2, 3], done, n, 0, 0, num_prompt_tokens=10)]
            batch = ForwardBatch.build([tokens[done:done + n]], seqs)
            with torch.no_grad():
                _, f = model(batch, cache, return_streams=True)
            got.append(f)
            done += n
        got = torch.cat(got)
        if not replay:
            torch.testing.assert_close(got, mh[0], atol=1e-4, rtol=1e-4)
        else:  # target 5 is before the cut (every row, exact); 6 and 7 after it: the tail rows only (replay's values)
            H, start = model.config.hidden_size, 10 - model.config.sliding_window
            torch.testing.assert_close(got[:, :H], mh[0, :, :H], atol=1e-4, rtol=1e-4)
            assert not got[:start, H:].any() and got[start:, H:].abs().amin(dim=-1).gt(0).all()
    model.decoder_replay = False


# ------------------------------------------------------------------ speculative="dspark" in the engine


class Oracle:
    """Swaps the engine's drafter output for the true greedy continuation with some drafts corrupted (after
    running the real drafter): acceptance then stops at every draft position across the run."""

    def __init__(self, propose, expected: list[list[int]], vocab: int, every: int = 4) -> None:
        self.real, self.expected, self.vocab, self.every = propose, expected, vocab, every

    def propose(self, features, seqs):
        drafts, probs, feats = self.real(features, seqs)
        for i, s in enumerate(seqs):
            if not drafts[i]:
                continue
            lo, hi = s.first_pos + 1, s.first_pos + 1 + len(s.next_token_ids)
            match = [e for e in self.expected if e[lo:hi] == s.next_token_ids]
            if len(match) != 1:
                continue
            p = hi - 2  # the last committed position; drafts are positions p + 2 ..
            true = (match[0][p + 2:p + 2 + len(drafts[i])] + [5] * len(drafts[i]))[:len(drafts[i])]
            drafts[i] = [t if (p + j) % self.every != self.every - 1 else (t + 1) % self.vocab
                         for j, t in enumerate(true)]
        return drafts, probs, feats


def test_greedy_dspark_equals_no_speculation(ckpt, monkeypatch):
    from deepinfer import LLM, SamplingParams
    from deepinfer.engine.spec_decode import executor as spec_executor

    prompts = [_ids(n, 10 + n) for n in (3, 9, 17)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    kw = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=8, block_size=8)  # chunked prefill
    llm = LLM(str(ckpt), **kw)
    base = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.shutdown()

    seen = []
    choose = spec_executor.choose_verify_lengths
    monkeypatch.setattr(spec_executor, "choose_verify_lengths",
                        lambda conf, **k: seen.append(conf) or choose(conf, **k))
    llm = LLM(str(ckpt), speculative="dspark", num_draft_tokens=3, verify_schedule="confidence", **kw)
    spec = llm.engine.spec
    # the random drafter's drafts: all rejected (rollback every step), same tokens
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == base
    stats = llm.engine.speculative_stats()
    assert stats["num_verified_drafts"] > 0
    # the confidences the schedule read are the head's sigmoids: in (0, 1), one per draft
    assert seen and all(0 < c < 1 for conf in seen for cs in conf for c in cs)
    # partly right drafts (acceptance stops at every position somewhere), batch of 3 then batch 1
    expected = [p + b for p, b in zip(prompts, base)]
    spec.verify_schedule = "full"
    real = spec.drafter.propose
    spec.drafter.propose = Oracle(real, expected, 64, every=1).propose  # every draft wrong
    before = llm.engine.speculative_stats()
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == base
    after = llm.engine.speculative_stats()
    assert after["num_accepted_drafts"] == before["num_accepted_drafts"]
    assert after["num_verified_drafts"] > before["num_verified_drafts"]
    spec.drafter.propose = Oracle(real, expected, 64).propose
    before = llm.engine.speculative_stats()["num_accepted_drafts"]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == base
    (one,) = llm.generate([prompts[2]], params, use_tqdm=False)
    assert list(one.outputs[0].token_ids) == base[2]
    stats = llm.engine.speculative_stats()
    assert stats["num_accepted_drafts"] > before
    assert all(0 < a < v for a, v in zip(stats["accepted_per_position"], stats["verified_per_position"]))
    llm.shutdown()


def test_speculative_names_per_model(ckpt):
    from deepinfer.engine.engine import EngineConfig

    assert EngineConfig(model=str(ckpt), speculative="dspark").speculative == "dspark"
    from deepinfer import LLM

    with pytest.raises(ValueError, match="speculative='dspark'"):
        LLM(str(ckpt), speculative="mtp", max_model_len=32, max_num_seqs=1)
    with pytest.raises(ValueError, match="DSpark stages"):
        DSparkDrafter(random_v41_model(V41Config.from_hf_dict(tiny_config()), seed=1), 1, 3)


@pytest.mark.gpu
def test_greedy_dspark_equals_no_speculation_on_cuda(ckpt):
    """The same equality on a CUDA device (float32: a verify chunk and decode rows round alike only there), real
    and partly right drafts."""
    from deepinfer import LLM, SamplingParams

    prompts = [_ids(n, 30 + n) for n in (3, 9, 17, 40)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for dtype in ("float32",):
        kw = dict(max_model_len=96, max_num_seqs=4, max_num_batched_tokens=16, block_size=8, device="cuda",
                  dtype=dtype)
        llm = LLM(str(ckpt), **kw)
        base = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.shutdown()
        llm = LLM(str(ckpt), speculative="dspark", num_draft_tokens=3, **kw)
        assert [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)] == base
        spec = llm.engine.spec
        spec.drafter.propose = Oracle(spec.drafter.propose, [p + b for p, b in zip(prompts, base)], 64).propose
        assert [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)] == base
        assert llm.engine.speculative_stats()["num_accepted_drafts"] > 0
        llm.shutdown()
