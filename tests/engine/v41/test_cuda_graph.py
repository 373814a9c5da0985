"""DeepSeek-V4.1 decode steps as CUDA graphs: static decode rows (`DecodeRows.is_static`) read by
`deepseek_v41.PagedAttention._decode_static` and the Engram history read on the device
(`deepseek_v41_static.engram_grams_static`), replayed by `engine.cuda_graph.CudaGraphRunner`.

CPU: the static rows against the host-decided ones (the default without graphs, unchanged) on the tiny random V4.1 (window 4,
so rings wrap; ratio-2 and ratio-1 KV sources, so compressed entries are emitted and reused; the candidate filter
active: 2 blocks of 2 entries against up to ~30 visible; Engram at layers 1 and 4): same greedy tokens, logits and
cache within float rounding; padding rows (the cache's real dummy slot and block, which own no memory) change no
byte of the cache and no real row's logits; the flattened structure of the decode metadata does not change with
positions and lengths; a prefix hit decoded from inside the shared blocks; the published-layout tiny checkpoint
through the engine whose `ModelRunner` runs stand-in graphs (`tests.engine.test_cuda_graph.ReplayByRerun`) gives the
eager engine's greedy tokens, capturing once per bucket and never falling back; `graph_blockers` of V4.1 with the `triton` MoE backend (FP4 experts) names only the device; the
batch-invariant mode keeps host-decided rows and blocks graphs by name.
GPU (`gpu`): a replay equals the eager step bit for bit on a padded batch; 64 greedy steps with graphs equal the
enforce-eager engine's; a decode step (replay and eager) under `torch.cuda.set_sync_debug_mode("error")`.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.cache.v41 import V41KVCache
from deepinfer.engine.config import V41Config
from deepinfer.engine.cuda_graph import CudaGraphRunner, flatten, graph_blockers, graph_inputs
from deepinfer.engine.forward_batch import ForwardBatch, SeqChunk
from deepinfer.engine.testing.make_checkpoint import make_checkpoint, random_v41_model
from tests.engine.test_cuda_graph import ReplayByRerun, _generate
from tests.engine.v41.configs import tiny_config

BLOCK, MAX_LEN = 4, 64


@pytest.fixture(scope="module")
def model():
    return random_v41_model(V41Config.from_hf_dict(tiny_config()), seed=11).eval()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(make_checkpoint(tmp_path_factory.mktemp("v41graph") / "ck", format="published-v41", seed=5))


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 64, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Driver:
    """The paged step over a private `V41KVCache` (sized by `max_model_len`, so static rows carry `MAX_LEN / BLOCK`
    blocks) with `static_decode` set as asked; the model's flag is restored after each step."""

    def __init__(self, model, num_seqs: int, static: bool, device="cpu") -> None:
        per = -(-MAX_LEN // BLOCK)
        self.model, self.static = model, static
        dtype = model.embed.weight.dtype
        self.cache = V41KVCache(model.config, per * num_seqs, BLOCK, num_seqs, dtype=dtype, device=device,
                                max_model_len=MAX_LEN)
        self.tables = [list(range(i * per, (i + 1) * per)) for i in range(num_seqs)]
        self.lens = [0] * num_seqs
        self.state_start, self.frozen = [0] * num_seqs, [0] * num_seqs
        self.device = device

    def batch(self, work, pad_to: int = 0) -> ForwardBatch:
        """The step's batch (its metadata built), decode rows padded with the cache's dummy rows to `pad_to`."""
        ids = [list(t) for _, t in work]
        seqs = [SeqChunk(i, self.tables[i], self.lens[i], len(t), self.state_start[i], self.frozen[i]) for i, t in work]
        runner = CudaGraphRunner(self.model, self.cache, (max(pad_to, 1),))
        logits = list(range(len(work))) if all(len(t) == 1 for t in ids) else "last"
        if pad_to:
            ids, seqs = runner.pad(ids, seqs, pad_to)
        batch = ForwardBatch.build(ids, seqs, device=self.device, logits=logits)
        batch.num_dummy_rows = len(seqs) - len(work)
        old, self.model.static_decode = self.model.static_decode, self.static
        try:
            batch.attn_metadata = self.model.build_attention_metadata(batch, self.cache)
        finally:
            self.model.static_decode = old
        return batch

    def advance(self, work) -> None:
        for i, t in work:
            self.lens[i] += len(t)

    def step(self, work, pad_to: int = 0) -> torch.Tensor:
        """One step; the logits of each pair's last new token."""
        out = self.model.step(self.batch(work, pad_to), self.cache)
        self.advance(work)
        return out


def _schedule():
    """Three requests (3, 11, 19 prompt tokens) prefilled in chunks beside decode rows, then 14 decode steps:
    positions up to 33 (window 4 wraps; ~30 ratio-1 entries against a 4-entry candidate filter)."""
    ps = [_ids(3, 1), _ids(11, 2), _ids(19, 3)]
    steps = [[(0, ps[0]), (1, ps[1][:6])], [(1, ps[1][6:]), (2, ps[2][:10]), (0, [5])],
             [(2, ps[2][10:]), (0, [7]), (1, [9])]]
    steps += [[(0, [3 + k]), (1, [10 + k]), (2, [20 + k])] for k in range(14)]
    return steps


def test_static_rows_give_the_host_decided_tokens_logits_and_cache(model):
    host, static = Driver(model, 3, static=False), Driver(model, 3, static=True)
    for work in _schedule():
        dm = static.batch(work).attn_metadata.decode
        assert dm is None or dm.is_static
        a, b = host.step(work), static.step(work)
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    for name, t in host.cache.tensors.items():
        torch.testing.assert_close(static.cache.tensors[name], t, rtol=1e-4, atol=1e-4, msg=name)
    assert torch.equal(static.cache.tensors["engram_tokens"], host.cache.tensors["engram_tokens"])
    assert not model.static_decode  # the default (no graphs): host-decided rows, as before


def test_static_rows_read_frozen_entries_and_history_from_state_start(model):
    """A prefix hit decoded one token at a time from inside the shared blocks: request 1 shares request 0's first 5
    blocks (20 frozen tokens), its state valid from position 10 (`state_start`): decode rows at 10.. read no window
    key, compressor row or Engram history before 10 and write no entry of a frozen group (positions < 20)."""
    host, static = Driver(model, 2, static=False), Driver(model, 2, static=True)
    for d in (host, static):
        d.step([(0, _ids(24, 7))])
        d.tables[1] = d.tables[0][:5] + d.tables[1][5:]
        d.lens[1], d.state_start[1], d.frozen[1] = 10, 10, 20
    for k in range(16):
        work = [(1, [4 + k]), (0, [40 + k])]
        a, b = host.step(work), static.step(work)
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    for name, t in host.cache.tensors.items():
        torch.testing.assert_close(static.cache.tensors[name], t, rtol=1e-4, atol=1e-4, msg=name)


def test_padding_rows_write_nothing_and_change_no_real_row(model):
    """Decode steps padded to 8 rows with the cache's dummy slot and block (ids one past the pools, which own no
    memory: reads are clamped to the last slot / block, here a fourth request's that never runs): the real rows'
    logits are the unpadded step's (within float rounding: the CPU's matmuls round by batch size), the fourth slot's
    state and blocks stay untouched, and an all-padding step changes no byte of the cache."""
    plain, padded = Driver(model, 3, static=True), Driver(model, 4, static=True)
    padded.tables = padded.tables[:3] + [padded.tables[3]]
    for work in _schedule()[:3]:
        plain.step(work)
        padded.step(work)
    for work in _schedule()[3:9]:
        a, b = plain.step(work), padded.step(work, pad_to=8)
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    cache = padded.cache
    for name, t in cache.state_tensors().items():
        assert not t[:, 3].any(), name  # the clamped dummy slot's neighbour: never written
    for name, t in cache.compressed_pools().items():
        assert not t[:, padded.tables[3]].any(), name
    before = {n: t.clone() for n, t in cache.tensors.items()}
    padded.model.step(padded.batch([], pad_to=4), cache)
    for name, t in before.items():
        assert torch.equal(cache.tensors[name], t), name


def test_decode_metadata_structure_does_not_change_with_positions(model):
    d = Driver(model, 3, static=True)
    structures = set()
    for lens in ([0, 1, 2], [5, 17, 33], [40, 3, 62], [63, 63, 63]):
        d.lens = lens
        b = d.batch([(0, [4]), (1, [5]), (2, [6])], pad_to=4)
        assert b.attn_metadata.is_pure_decode and b.attn_metadata.decode.is_static
        structures.add(flatten(graph_inputs(b))[0])
    assert len(structures) == 1
    d.lens = [64, 0, 0]  # past max_model_len: refused, not silently cut
    with pytest.raises(ValueError, match="max_blocks_per_seq"):
        d.batch([(0, [4])], pad_to=1)


def _engine(ckpt: str, graphs: bool, monkeypatch=None, **kw):
    """The tiny checkpoint's engine on the CPU; `graphs`: as the engine runs them on CUDA (`ModelRunner` with no
    blocker: start-up capture of every bucket from all-dummy batches, `static_decode` turned on), with the stand-in
    graphs (`ReplayByRerun`) and the device check left out."""
    from deepinfer.engine import model_runner
    from deepinfer.engine.engine import Engine, EngineConfig

    if graphs:
        monkeypatch.setattr(model_runner, "graph_blockers", lambda model, cache, device: [])
        monkeypatch.setattr(model_runner, "CudaGraphRunner", ReplayByRerun)
    eng = Engine(EngineConfig(model=ckpt, max_num_seqs=8, max_model_len=128, block_size=BLOCK,
                              max_num_batched_tokens=16, enforce_eager=not graphs, cuda_graph_batch_sizes=(1, 2, 4, 8),
                              **kw))
    assert (eng.runner.cuda_graphs is not None) == graphs == eng.model.static_decode
    return eng


def test_engine_with_stand_in_graphs_gives_the_eager_greedy_tokens(ckpt, monkeypatch):
    """The published-layout tiny checkpoint (FP8 dense linears, MXFP4 experts, FP8 Engram tables kept) through the
    engine: 5 requests of 2..41 prompt tokens, chunked prefill (16-token budget) beside decode rows, decoder-side
    bounded replay on (the default), different output lengths so the decode batch shrinks through the buckets. The
    reference is the eager engine on the host-decided rows (the default without graphs)."""
    prompts = [_ids(n, 40 + n) for n in (2, 9, 23, 41, 5)]
    max_tokens = [20, 14, 9, 17, 6]
    ref = _generate(_engine(ckpt, graphs=False), prompts, max_tokens)
    eng = _engine(ckpt, graphs=True, monkeypatch=monkeypatch)
    graphs = eng.runner.cuda_graphs
    assert set(graphs.graphs) == {1, 2, 4, 8} and graphs.stats["captures"] == 4  # start-up, from all-dummy batches
    got = _generate(eng, prompts, max_tokens)
    assert got == ref
    assert graphs.stats["captures"] == 4 and graphs.stats["eager_fallbacks"] == 0, graphs.stats  # once per bucket
    assert graphs.stats["replays"] >= 10, graphs.stats


def test_blockers_of_v41_and_the_batch_invariant_mode(ckpt):
    from deepinfer.engine.batch_invariant import enable_batch_invariant
    from deepinfer.engine.loader import load_checkpoint
    from deepinfer.engine.models.deepseek_v41 import PagedAttention

    model, cfg = load_checkpoint(ckpt, moe_backend="triton")  # FP4 experts as grouped GEMMs: graph-safe
    cache = V41KVCache(cfg, 8, BLOCK, 2, max_model_len=32)
    assert PagedAttention.cuda_graph_safe and graph_blockers(model, cache, "cuda") == []
    assert any("not CUDA" in r for r in graph_blockers(model, cache, "cpu"))
    model, _ = load_checkpoint(ckpt)  # the `torch` MoE backend reads expert counts on the host
    assert any("TorchMoEBackend" in r for r in graph_blockers(model, cache, "cuda"))
    enable_batch_invariant(model)  # its paged attention keeps host-decided rows: no graphs, said by name
    model.static_decode = True
    assert not model.uses_static_decode(cache)
    assert any("BatchInvariantPagedAttention" in r for r in graph_blockers(model, cache, "cuda"))


# --------------------------------------------------------------------------- GPU


def _gpu_engine(ckpt: str, graphs: bool, **kw):
    from deepinfer.engine.engine import Engine, EngineConfig

    eng = Engine(EngineConfig(model=ckpt, device="cuda", dtype="bfloat16", moe_backend="triton", max_num_seqs=16,
                              max_model_len=256, block_size=BLOCK, enforce_eager=not graphs,
                              cuda_graph_batch_sizes=(1, 2, 4, 8, 16), seed=0, **kw))
    if graphs:
        assert eng.runner.cuda_graphs is not None, eng.runner.cuda_graph_blockers
    return eng


@pytest.mark.gpu
def test_v41_graph_replay_is_bit_identical_to_eager_on_a_padded_batch(ckpt):
    from deepinfer.engine.loader import load_checkpoint

    model, _ = load_checkpoint(ckpt, dtype="bfloat16", device="cuda", moe_backend="triton")
    drivers = [Driver(model, 3, static=True, device="cuda") for _ in range(2)]  # eager, graphs
    prompts = [_ids(3, 1), _ids(20, 2), _ids(45, 3)]
    for d in drivers:
        toks = [int(d.step([(i, p)])[0].argmax()) for i, p in enumerate(prompts)]
    graphs = CudaGraphRunner(model, drivers[1].cache, (4,))
    for step in range(12):
        work = [(i, [t]) for i, t in enumerate(toks)]
        outs = []
        for d in drivers:
            b = d.batch(work, pad_to=4)
            got = graphs.run(b) if d is drivers[1] else None
            outs.append(model.step(b, d.cache) if got is None else got)
            d.advance(work)
        assert torch.equal(outs[0], outs[1]), step
        toks = outs[0].argmax(-1).tolist()
    assert graphs.stats["captures"] == 1 and graphs.stats["replays"] == 11 and graphs.stats["eager_fallbacks"] == 0
    for name, t in drivers[0].cache.tensors.items():
        assert torch.equal(drivers[1].cache.tensors[name], t), name


@pytest.mark.gpu
def test_v41_graph_decode_gives_the_eager_greedy_tokens_over_64_steps(ckpt):
    prompts = [_ids(n, 60 + n) for n in (5, 37, 64, 130, 9)]
    ref_eng = _gpu_engine(ckpt, graphs=False)
    assert not ref_eng.model.static_decode  # graphs off: the host-decided rows, as before
    ref_eng.model.static_decode = True  # the rows the graphs read, eagerly
    ref = _generate(ref_eng, prompts, [64] * 5)
    eng = _gpu_engine(ckpt, graphs=True)
    assert eng.model.static_decode
    got = _generate(eng, prompts, [64] * 5)
    assert got == ref
    stats = eng.runner.cuda_graphs.stats
    assert stats["replays"] >= 60 and stats["eager_fallbacks"] == 0, stats


@pytest.mark.gpu
def test_a_v41_decode_step_does_not_synchronise_with_the_host(ckpt):
    """A replayed and an eager V4.1 decode step (forward + sampling) under sync-debug "error" (the metadata is built
    before: `attention/base.py` copies host lists with blocking `torch.tensor(..., device=)`)."""
    from deepinfer.engine.sampling import SamplingBatch, SamplingParams

    eng = _gpu_engine(ckpt, graphs=True, async_scheduling=False)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [_ids(n, 70 + n) for n in (8, 11, 30, 3)]
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params)
    for _ in range(4):
        eng.step()
    out = eng.scheduler.schedule()
    eng.runner.update_states(out, {})
    step = eng._prepare(out, eng._inflight_token_ids())
    assert step.batch.attn_metadata.is_pure_decode and step.batch.attn_metadata.decode.is_static
    sbatch = SamplingBatch.build([params] * 4, [[1]] * 4, prompts, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        logits = eng.runner.run(step.batch)  # a replay
        eng.sampler.sample(logits, sbatch)
        eager = eng.model.step(step.batch, eng.cache)  # the same step eagerly (values not compared)
        eng.sampler.sample(eager, sbatch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert eng.runner.cuda_graphs.stats["replays"] >= 1, eng.runner.cuda_graphs.stats
