"""DeepSeek-V4.1 DSpark speculation across the prefill -> decode handover, in process (CPU, no NIXL), and the
worker / cluster configuration of `speculative="dspark"` and `engram_placement`.

* By hand, as `tests/engine/v41/test_transfer.py` moves V4.1's KV: engine A (the prefill, `speculative="dspark"`)
  computes a prompt and holds its blocks and slot; the paged pools and every state tensor of the slot — now
  including the DSpark stages' window rings `dspark_keys`, seeded from the prompt's `main_x` — are copied into
  engine B's reservation; B (the decode) gets A's first token and first block of drafts and continues. B's greedy
  tokens equal one engine's without speculation, and every block B's drafter proposes equals the offline
  speculative engine's block at the same step (the first one included: the rings came with the slot). With the
  rings left out of the copy the first block differs (the test sees the handover); with the state replayed
  instead (`bounded_state="replay"`) B's replay rebuilds them.
* The worker configs accept `--speculative dspark` and `--engram-placement`, refuse what the checkpoint cannot do
  before anything starts, and resolve the bounded state ("send" with DSpark); the cluster YAML and
  `deepinfer up --speculative dspark --engram-placement ...` set both stages.
The cluster over real processes and NIXL is tests/e2e/test_v41_dspark.py.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine import LLM, SamplingParams
from deepinfer.engine.engine import Engine, EngineConfig
from deepinfer.engine.testing.make_checkpoint import main as make_checkpoint_main

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
BLOCK = 8
SPEC = dict(speculative="dspark", num_draft_tokens=3)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("v41_dspark_pd")
    return str(make_checkpoint_main([str(out), "--format", "published-v41", "--dspark", "--seed", "3",
                                     "--overwrite"]))


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 63, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _record_blocks(engine: Engine) -> list[list[int]]:
    """Every non-empty block the engine's DSpark drafter hands on (one request at a time)."""
    blocks: list[list[int]] = []
    real = engine.spec.drafter.propose

    def propose(features, seqs):
        drafts, confs, feats = real(features, seqs)
        blocks.extend(list(d) for d in drafts if d)
        return drafts, confs, feats

    engine.spec.drafter.propose = propose
    return blocks


def _drain(engine: Engine, rid: str):
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == rid:
                out = o
    return out


@pytest.fixture(scope="module")
def offline(ckpt):
    """Per prompt length: greedy tokens without speculation, and the blocks an offline DSpark engine drafts."""
    prompts = {n: _prompt(n, seed=n) for n in (3, 13, 29)}
    plain = LLM(ckpt, block_size=BLOCK)
    spec = LLM(ckpt, block_size=BLOCK, **SPEC)
    blocks = _record_blocks(spec.engine)
    ref = {}
    for n, p in prompts.items():
        tokens = plain.generate([{"prompt_token_ids": p}], PARAMS, use_tqdm=False)[0].outputs[0].token_ids
        blocks.clear()
        same = spec.generate([{"prompt_token_ids": p}], PARAMS, use_tqdm=False)[0].outputs[0].token_ids
        assert same == tokens  # lossless offline (test_dspark.py's claim, here the reference of the handover)
        ref[n] = (p, list(tokens), [list(b) for b in blocks])
    return ref


@pytest.mark.parametrize("mode", ["state-moved", "state-moved-without-rings", "replay"])
def test_prefill_to_decode_hands_over_the_dspark_rings(ckpt, offline, mode):
    with_state = mode != "replay"
    a = Engine(EngineConfig(model=ckpt, block_size=BLOCK, num_blocks=64, max_num_seqs=4, **SPEC))
    b = Engine(EngineConfig(model=ckpt, block_size=BLOCK, num_blocks=64, max_num_seqs=4, **SPEC))
    assert "dspark_keys" in a.cache.state_tensors() and b.cache.pool_layouts["dspark_keys"].is_state
    decoded = _record_blocks(b)
    for n, (prompt, tokens, blocks) in offline.items():
        rid = f"r{n}"
        a.add_request(rid, {"prompt_token_ids": prompt}, PARAMS, hold_kv=True, hold_state=with_state)
        first = None
        while first is None:
            first = next((o for o in a.step() if o.request_id == rid and o.kv_block_ids is not None), None)
        drafts = list(a.scheduler.get_request(rid).spec_token_ids)
        assert drafts == blocks[0]  # the prefill drafts the offline engine's first block (sent in the notice)
        b.reserve_kv(rid, prompt, PARAMS, len(prompt), with_state=with_state)
        src, dst = first.kv_block_ids, b.kv_block_ids(rid)
        for name, pool in a.cache.compressed_pools().items():
            b.cache.compressed_pools()[name][:, dst] = pool[:, src]
        if with_state:
            src_slot, dst_slot = first.kv_state_slot, b.kv_state_slot(rid)
            for name, t in a.cache.state_tensors().items():
                if name == "dspark_keys" and mode == "state-moved-without-rings":
                    b.cache.state_tensors()[name][:, dst_slot] = 0.0  # what a peer without the rings leaves
                    continue
                b.cache.state_tensors()[name][:, dst_slot] = t[:, src_slot]
        a.abort_request(rid)
        a.release_kv(rid)
        decoded.clear()
        b.commit_kv(rid, first.outputs[0].token_ids, drafts)
        out = _drain(b, rid)
        assert out.outputs[0].token_ids == tokens, f"prompt of {n} tokens"  # lossless whatever the drafts
        if mode == "state-moved-without-rings":
            assert decoded[0] != blocks[1], "the test does not see whether the rings were handed over"
        else:
            # decode's blocks are the offline engine's, from the first one it drafts (after verifying block 0)
            assert decoded == blocks[1:len(decoded) + 1] and len(decoded) == len(blocks) - 1, f"prompt of {n} tokens"
    assert b.spec.metrics.num_imported_drafts == sum(len(v[2][0]) for v in offline.values())
    assert b.kv_manager.num_free_blocks == b.kv_manager.num_blocks


# ------------------------------------------------------------------ configuration


def test_worker_configs_take_dspark_and_engram_placement_and_refuse_what_the_checkpoint_cannot(ckpt):
    from deepinfer.decode_worker.config import DecodeWorkerConfig
    from deepinfer.prefill_worker.config import PrefillWorkerConfig
    from deepinfer.serving.config_cli import config_from_args, make_parser

    flags = ["--model", ckpt, "--speculative", "dspark", "--num-draft-tokens", "2", "--engram-placement", "pinned_host"]
    for cls in (DecodeWorkerConfig, PrefillWorkerConfig):
        config = config_from_args(cls, make_parser(cls, cls.__name__, ""), flags)
        engine = config.engine_config()
        assert (engine.speculative, engine.num_draft_tokens, engine.engram_placement) == ("dspark", 2, "pinned_host")
        # refused when the config is built, with the engine's message (nothing has started)
        with pytest.raises(ValueError, match="DSpark stages are DeepSeek-V4.1's"):
            cls(speculative="dspark")  # the built-in model is a DeepSeek-V4
        with pytest.raises(ValueError, match="DeepSeek-V4.1 has no MTP layer"):
            cls(model=ckpt, speculative="mtp")
        with pytest.raises(ValueError, match="has none: leave it 'auto'"):
            cls(engram_placement="device")
        assert cls(model="some-org/not-here", speculative="dspark").speculative == "dspark"  # a repo id: the engine checks
    # DSpark's rings travel with the sent state: "send" is the decode default and allowed; MTP still needs the replay
    assert DecodeWorkerConfig(model=ckpt, speculative="dspark").is_state_sent
    assert DecodeWorkerConfig(model=ckpt, speculative="dspark", bounded_state="send").is_state_sent
    assert not DecodeWorkerConfig(model=ckpt, speculative="dspark", bounded_state="replay").is_state_sent
    assert DecodeWorkerConfig(model=ckpt, speculative_tokens=2, speculative_method="dspark").speculative == "dspark"
    with pytest.raises(ValueError, match="bounded_state='replay'"):
        DecodeWorkerConfig(speculative="mtp", bounded_state="send")


def test_cluster_yaml_and_up_flags_set_both_stages(ckpt, tmp_path):
    from deepinfer.deploy.cli import _config_from_args, build_parser
    from deepinfer.deploy.config import ClusterConfig

    parser = build_parser()
    args = parser.parse_args(["up", "--model", ckpt, "--speculative", "dspark", "--engram-placement", "device",
                              "--kv-store-dir", "off"])
    config = _config_from_args(args, parser)
    for stage in ("prefill", "decode"):
        engine = config.role_config(stage).engine_config()
        assert (engine.speculative, engine.engram_placement) == ("dspark", "device"), stage
    assert config.role_config("decode").is_state_sent
    with pytest.raises(SystemExit):  # the built-in model (V4) has no DSpark stages: refused before anything starts
        _config_from_args(parser.parse_args(["up", "--speculative", "dspark", "--kv-store-dir", "off"]), parser)
    path = tmp_path / "cluster.yaml"
    path.write_text(f"model: {ckpt}\nkv_store_dir: off\ndecode:\n  balancer: {{policy: kv_load}}\n"
                    "  worker: {speculative: dspark}\n")
    with pytest.raises(ValueError, match="prefill worker settings too"):
        ClusterConfig.load(path)  # the decode takes the rings with the state: the prefill must have them
    path.write_text(f"model: {ckpt}\nkv_store_dir: off\ndecode:\n  balancer: {{policy: kv_load}}\n"
                    "  worker: {speculative: dspark, bounded_state: replay}\n")
    assert ClusterConfig.load(path).role_config("decode").speculative == "dspark"  # the replay rebuilds them
    path.write_text(f"model: {ckpt}\nkv_store_dir: off\nprefill:\n  balancer: {{policy: prefix_aware}}\n"
                    "  worker: {speculative: mtp}\n")
    with pytest.raises(ValueError, match="(?s)prefill settings.*no MTP layer"):
        ClusterConfig.load(path)


# ------------------------------------------------------------------ over NIXL (two agents in one process)


def test_prefill_and_decode_cores_over_nixl_move_the_rings(ckpt, offline):
    """The worker cores as the servers drive them (`PrefillCore` / `DecodeCore`), KV and slot moved by NIXL WRITE:
    the rings are a registered state region, the prefill's first block comes in the transfer notice, the decode's
    blocks are the offline engine's and its tokens the non-speculative ones. A prefill without the drafter cannot
    connect to a decode that takes the rings with the state; a decode without it takes the slot without them."""
    pytest.importorskip("nixl")
    from deepinfer.decode_worker.core import DecodeCore
    from deepinfer.kv_transfer import LOOPBACK_UCX_ENV, KVTransferAgent
    from deepinfer.prefill_worker.core import PrefillCore
    from tests.decode_worker.test_pd_cores import _run

    def engine(**kw):
        return Engine(EngineConfig(model=ckpt, num_blocks=32, max_num_seqs=4, **kw))

    p_eng, d_eng, plain = engine(**SPEC), engine(**SPEC), engine()
    agents = [KVTransferAgent(name, e.cache, ucx_env=LOOPBACK_UCX_ENV, send_state=True)
              for name, e in (("p41", p_eng), ("d41", d_eng), ("plain41", plain))]
    p_agent, d_agent, plain_agent = agents
    try:
        assert d_agent.pool_layout()["dspark_keys"]["is_state"]
        p_agent.add_peer("d41", d_agent.metadata(), d_agent.pool_layout())
        prefill, decode = PrefillCore(p_eng, p_agent), DecodeCore(d_eng, d_agent, "d41")
        decoded = _record_blocks(d_eng)
        for n, (prompt, tokens, blocks) in offline.items():
            decoded.clear()
            outs, firsts, errors = _run(prefill, decode, [(f"r{n}", prompt, PARAMS)])
            assert not errors and outs[f"r{n}"].outputs[0].token_ids == tokens, f"prompt of {n} tokens"
            assert decoded == blocks[1:], f"prompt of {n} tokens"  # the first block after the handover included
        assert d_eng.spec.metrics.num_imported_drafts == sum(len(v[2][0]) for v in offline.values())
        sent, received = p_agent.stats(), d_agent.stats()
        slot = p_eng.cache.pool_layouts
        ring_bytes = slot["dspark_keys"].num_layers * slot["dspark_keys"].unit_nbytes
        mc = p_eng.model_config  # per request: stages x window x head_dim x float32 (3 x 4 x 32 x 4 B here)
        assert ring_bytes == mc.num_nextn_predict_layers * mc.sliding_window * mc.head_dim * 4 == 1536
        block_bytes = sum(q.num_layers * q.unit_nbytes for q in slot.values() if not q.is_state)
        slot_bytes = sum(q.num_layers * q.unit_nbytes for q in slot.values() if q.is_state)
        bs = p_eng.kv_block_size
        assert received["kv_transfer_received_bytes_total"] == sent["kv_transfer_sent_bytes_total"] == sum(
            -(-n // bs) * block_bytes + slot_bytes for n in offline)
        # a prefill without the drafter has no rings to send into a decode that takes them: refused at connect
        with pytest.raises(ValueError, match="dspark_keys"):
            plain_agent.add_peer("d41", d_agent.metadata(), d_agent.pool_layout())
        # a decode without the drafter takes the slot without them (the prefill leaves its rings out)
        p_agent.add_peer("plain41", plain_agent.metadata(), plain_agent.pool_layout())
        prompt, tokens, _ = offline[29]
        outs, _, errors = _run(prefill, DecodeCore(plain, plain_agent, "plain41"), [("plain", prompt, PARAMS)])
        assert not errors and outs["plain"].outputs[0].token_ids == tokens
    finally:
        for agent in agents:
            agent.close()
