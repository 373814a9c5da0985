"""CUDA graphs of speculative verify steps (`engine.cuda_graph.VerifyGraphRunner`, the static verify metadata of
`engine.spec_decode.verify_rows.static_verify_metadata`).

CPU tests use a stand-in for CUDA graphs (`VerifyReplayByRerun`: the capture leaves no trace, a replay re-runs the
step on the static buffers), as tests/engine/test_cuda_graph.py does for decode steps: the static form's forward
against the ragged verify path (hidden states and every cache tensor, several steps crossing windows and
compressor windows), its flattened structure across steps, and speculative greedy decoding through the engine with
the stand-in graphs against plain decoding (random `tiny` checkpoint with ragged oracle drafts; the built-in model
with its MTP drafter). `gpu` tests: replay == eager bit for bit on a padded verify batch, speculative greedy with
graphs == eager over 64 steps, and a replayed verify step under `torch.cuda.set_sync_debug_mode("error")`.
"""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer.engine import SamplingParams
from deepinfer.engine.config import ModelConfig
from deepinfer.engine.cuda_graph import VerifyGraphRunner, flatten, graph_inputs
from deepinfer.engine.engine import Engine, EngineConfig
from deepinfer.engine.forward_batch import ForwardBatch, SeqChunk
from deepinfer.engine.spec_decode.verify_rows import batch_verify_chunks
from deepinfer.engine.testing.make_checkpoint import _write_ours, random_weights
from deepinfer.engine.testing.presets import PRESETS
from tests.engine.graph_standin import rerun_record
from tests.engine.spec_decode.test_spec_ep import _run as run_requests


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The `tiny` preset (window 8, CSA rate 4 with the indexer, HCA rate 8) with an MTP layer, random weights."""
    hf = {**PRESETS["tiny"].hf_config(), "num_nextn_predict_layers": 1}
    out = tmp_path_factory.mktemp("tiny")
    _write_ours(out, hf, random_weights(ModelConfig.from_hf_dict(hf), torch.float32, seed=5, mtp=True),
                torch.float32, 1 << 40)
    return str(out)


class VerifyReplayByRerun(VerifyGraphRunner):
    """The verify graph runner with a stand-in for CUDA graphs, so its logic runs on the CPU: `record` computes the
    output buffers and restores every cache tensor (a capture runs nothing); `replay` re-runs the step on the
    static buffers and copies the results into those buffers. A missed input copy, a stale buffer or a result
    handed out without copying shows as a wrong answer."""

    record = rerun_record


def _cache(eng: Engine, max_model_len: int = 96):
    from deepinfer.engine.cache.kv_cache import V4KVCache

    bs = eng.cache.block_size
    return V4KVCache(eng.model_config, 96, bs, 8, max_model_len=max_model_len)


def _tables(cache, num_seqs: int) -> list[list[int]]:
    per = cache.max_blocks_per_seq
    return [list(range(per * s, per * s + per)) for s in range(num_seqs)]


def _state(cache) -> dict[str, torch.Tensor]:
    return {**{k: v.clone() for k, v in cache.state_tensors().items()},
            **{k: v.clone() for k, v in cache.compressed_pools().items()}}


# --------------------------------------------------------------------------- CPU


def test_static_verify_forward_equals_the_ragged_verify_path(tiny):
    """Five requests (one a plain decode row) padded to 8 requests of 6 queries, six steps in a row: the real rows'
    hidden states and streams and every cache tensor equal the ragged path's (float32 rounding), while windows
    wrap, compressor windows end inside chunks and the indexer selects."""
    eng = Engine(EngineConfig(model=tiny, max_num_seqs=8, speculative_tokens=3))
    model = eng.model
    caches = [_cache(eng), _cache(eng)]  # ragged, static
    runner = VerifyGraphRunner(model, caches[1], (1, 2, 4, 8), max_queries=6)
    g = torch.Generator().manual_seed(3)
    lens = [21, 9, 30, 14, 3]
    tables = _tables(caches[0], 5)
    prompts = [torch.randint(2, 512, (n,), generator=g).tolist() for n in lens]
    for cache in caches:
        model(ForwardBatch.build(prompts, [SeqChunk(s, tables[s], 0, n) for s, n in enumerate(lens)]), cache)
    rng = random.Random(0)
    for step in range(6):
        widths = [1] + [rng.randint(1, 5) for _ in range(4)]  # 1 + L_r (request 0: no drafts)
        ids = [torch.randint(2, 512, (w,), generator=g).tolist() for w in widths]
        seqs = [SeqChunk(s, tables[s], lens[s], w) for s, w in enumerate(widths)]
        batch = ForwardBatch.build(ids, seqs)
        meta = model.build_attention_metadata(batch, caches[0])
        batch_verify_chunks(meta, {i for i, w in enumerate(widths) if w > 1})
        ref_h, ref_s = model(batch, caches[0], meta, return_streams=True)
        padded, real_rows = runner.pad_verify(batch, (8, 6, caches[1].max_blocks_per_seq))
        got_h, got_s = model(padded, caches[1], padded.attn_metadata, return_streams=True)
        torch.testing.assert_close(got_h[real_rows], ref_h, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_s[real_rows], ref_s, rtol=1e-5, atol=1e-5)
        ref, got = _state(caches[0]), _state(caches[1])
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-5, msg=lambda m, k=k, st=step: f"{k} step {st}: {m}")
        accepted = [rng.randint(1, w) for w in widths]  # no rollback here: both caches see the same writes
        lens = [n + a for n, a in zip(lens, accepted)]


def test_static_verify_metadata_has_one_structure_per_key(tiny):
    """Steps of one key `(B_pad, N_pad)` with different requests, draft lengths, positions (window and compressor
    window crossings or none, padding requests or none) flatten to one structure; another N_pad to another."""
    eng = Engine(EngineConfig(model=tiny, max_num_seqs=8, speculative_tokens=3))
    cache = _cache(eng)
    runner = VerifyGraphRunner(eng.model, cache, (1, 2, 4, 8), max_queries=4)
    tables = _tables(cache, 8)
    cases = [  # (slot, position, 1 + L) per request
        [(0, 5, 4), (1, 17, 1), (2, 30, 2)],  # windows completed inside chunks
        [(3, 9, 2)],  # one request, seven padding requests, no window completed
        [(0, 1, 4), (1, 2, 4), (2, 3, 3), (3, 64, 4), (4, 0, 1), (5, 33, 2), (6, 7, 4), (7, 12, 4)],  # full bucket
    ]
    structures = set()
    for case in cases:
        ids = [[5] * w for _, _, w in case]
        batch = ForwardBatch.build(ids, [SeqChunk(s, tables[s], p, w) for s, p, w in case])
        key = runner.key(batch)
        assert key[:2] == (runner.bucket(len(case)), max(w for *_, w in case))
        need = max(-(-(p + w) // cache.block_size) for _, p, w in case)
        assert need <= key[2] < 2 * need and key[2] & (key[2] - 1) == 0  # blocks: a power of two
        padded, _ = runner.pad_verify(batch, (8, 4, cache.max_blocks_per_seq))
        vr = padded.attn_metadata.verify
        assert vr.is_static and vr.token_index.shape == (8, 4)
        slots = torch.cat([vr.slots, vr.write_slots] + [c.hist_slots for c in vr.compressors.values()])
        assert int(slots.max()) < cache.num_slots  # never the memoryless dummy slot
        for (rate, _), c in vr.compressors.items():  # every entry row written or read is inside the pools
            rows = cache.num_blocks * (cache.block_size // rate)
            assert int(c.write_rows.max()) < rows and int(c.entry_rows.max()) < rows
        structures.add(flatten(graph_inputs(padded))[0])
    assert len(structures) == 1
    ids = [[5, 6]]
    for key in ((8, 2, cache.max_blocks_per_seq), (8, 4, cache.max_blocks_per_seq - 1)):
        other = runner.pad_verify(ForwardBatch.build(ids, [SeqChunk(0, tables[0], 9, 2)]), key)[0]
        assert flatten(graph_inputs(other))[0] not in structures
    too_wide = ForwardBatch.build([[5] * 5], [SeqChunk(0, tables[0], 9, 5)])
    assert runner.key(too_wide) is None  # more queries than 1 + num_draft_tokens: eager
    past = ForwardBatch.build([[5] * 2], [SeqChunk(0, tables[0], cache.max_blocks_per_seq * cache.block_size - 1, 2)])
    assert runner.key(past) is None  # past max_blocks_per_seq: eager


def _run(engine: Engine, prompts, params, drafts_fn=None) -> list[list[int]]:
    """Each request's tokens (`test_spec_ep._run`) with `params` one `SamplingParams` for all or one each."""
    return run_requests(engine, prompts, params if isinstance(params, list) else [params] * len(prompts), drafts_fn)


@pytest.mark.parametrize("attention_backend", ["torch", "triton"])
def test_engine_with_verify_graphs_gives_the_plain_greedy_tokens(tiny, attention_backend):
    """Random `tiny` model, 6 requests, k = 3, oracle drafts of random lengths 0..3 with errors (so L_r, accepted
    lengths and positions vary per request and step; prefill steps run eagerly): the tokens equal plain decoding,
    each key is captured once and replayed, and the ineligible steps are counted. Both attention backends (the
    `triton` one runs its torch references on the CPU; its verify rows take the `torch` path, static form too)."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, 512, (n,), generator=g).tolist() for n in (3, 17, 25, 9, 31, 12)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    ref = _run(Engine(EngineConfig(model=tiny, max_num_seqs=8, attention_backend=attention_backend)), prompts, params)
    full = {str(i): p + r for i, (p, r) in enumerate(zip(prompts, ref))}
    rng = random.Random(4)

    def drafts(req):
        seq = full[req.req_id.split("#")[0]]
        k = rng.randint(0, 3)
        return [t + 1 if rng.random() < 0.25 else t for t in seq[req.num_tokens:req.num_tokens + k]]

    eng = Engine(EngineConfig(model=tiny, max_num_seqs=8, speculative_tokens=3, attention_backend=attention_backend))
    assert eng.spec.graphs is None and any("not CUDA" in r for r in eng.spec.verify_graph_blockers)
    eng.spec.graphs = graphs = VerifyReplayByRerun(eng.model, eng.cache, (1, 2, 4, 8), max_queries=4)
    eng.runner.defer_verify_metadata = True  # as `make_executor` sets it with graphs on
    assert _run(eng, prompts, params, drafts) == ref
    st = graphs.stats
    assert st["captures"] == len(graphs.graphs) >= 2 and st["replays"] >= 5, st
    assert st["eager_steps"] >= 1 and st["eager_fallbacks"] == 0, st
    assert all(b in (1, 2, 4, 8) and 1 <= n <= 4 for b, n, _ in graphs.graphs), list(graphs.graphs)
    assert len({n for _, n, _ in graphs.graphs}) >= 2, list(graphs.graphs)  # several N_pad keys were met
    m = eng.spec.metrics
    assert 0 < m.num_accepted_drafts < m.num_verified_drafts
    if attention_backend == "torch":  # the cap on captured keys: the rest runs eagerly, the tokens unchanged
        eng = Engine(EngineConfig(model=tiny, max_num_seqs=8, speculative_tokens=3))
        eng.spec.graphs = capped = VerifyReplayByRerun(eng.model, eng.cache, (1, 2, 4, 8), max_queries=4,
                                                       max_graphs=1)
        eng.runner.defer_verify_metadata = True
        rng.seed(4)
        assert _run(eng, prompts, params, drafts) == ref
        assert len(capped.graphs) == capped.stats["captures"] == 1 and capped.stats["over_cap"] >= 1, capped.stats


class _CaptureFails(VerifyGraphRunner):
    def record(self, fn):
        raise RuntimeError("operation not permitted when stream is capturing")


def test_a_failed_capture_turns_the_verify_graphs_off_and_verifies_eagerly(tiny):
    """An op that cannot be captured (or a graph pool out of memory) must not fail the engine: the step keeps its
    eager results (a capture runs nothing), later steps verify eagerly, and the tokens are plain decoding's."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 512, (n,), generator=g).tolist() for n in (5, 13)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ref = _run(Engine(EngineConfig(model=tiny, max_num_seqs=4)), prompts, params)
    full = {str(i): p + r for i, (p, r) in enumerate(zip(prompts, ref))}

    def drafts(req):
        seq = full[req.req_id.split("#")[0]]
        return seq[req.num_tokens:req.num_tokens + 2]

    eng = Engine(EngineConfig(model=tiny, max_num_seqs=4, speculative_tokens=3))
    eng.spec.graphs = runner = _CaptureFails(eng.model, eng.cache, (1, 2, 4), max_queries=4)
    eng.runner.defer_verify_metadata = True
    assert _run(eng, prompts, params, drafts) == ref
    assert runner.disabled and "capturing" in runner.disabled and not runner.graphs
    assert runner.stats["capture_failures"] == 1 and runner.stats["eager_steps"] >= 2, runner.stats


def test_builtin_model_mtp_with_verify_graphs_gives_the_plain_greedy_tokens():
    """The built-in model and its MTP drafter (confidence schedule: ragged L_r), async scheduling (the drafter on
    its thread), buckets up to 4: the steps of 5 requests run eagerly (their metadata deferred by the runner and
    built by the fallback), those of 3 or 4 are padded to 4 and replayed; the same tokens as plain decoding."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 1000, (n,), generator=g).tolist() for n in (6, 11, 4, 9, 14)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (6, 20, 10, 20, 14)]
    ref = _run(Engine(EngineConfig(max_num_seqs=8)), prompts, params)
    eng = Engine(EngineConfig(max_num_seqs=8, speculative="mtp", num_draft_tokens=3, verify_schedule="confidence",
                              async_scheduling=True))
    eng.spec.graphs = graphs = VerifyReplayByRerun(eng.model, eng.cache, (1, 2, 4), max_queries=4)
    eng.runner.defer_verify_metadata = True
    assert _run(eng, prompts, params) == ref
    st = graphs.stats
    assert st["replays"] >= 3 and st["eager_steps"] >= 2 and st["eager_fallbacks"] == 0, st
    eng.shutdown()


def test_enforce_eager_expert_parallelism_and_no_batched_verify_turn_verify_graphs_off(tiny):
    from types import SimpleNamespace

    eng = Engine(EngineConfig(model=tiny, max_num_seqs=8, speculative_tokens=3, enforce_eager=True))
    assert eng.spec.graphs is None and "enforce_eager" in eng.spec.verify_graph_blockers
    eng.spec.batched_verify = False
    reasons = eng.spec._verify_graph_blockers(SimpleNamespace(enforce_eager=False, expert_parallel_size=2))
    assert "expert_parallel_size > 1" in reasons and any("batched verify" in r for r in reasons)


# --------------------------------------------------------------------------- GPU


def _gpu_graph_cases():
    from tests.engine.test_cuda_graph import graph_cases

    return graph_cases()


def _load_builtin(backend: str, moe: str):
    from deepinfer.engine.builtin_model import builtin_model_path
    from deepinfer.engine.loader import load_checkpoint
    from tests.engine.test_cuda_graph import DENSE, use_dense_moe

    model, _ = load_checkpoint(builtin_model_path(), dtype="bfloat16", device="cuda", attention_backend=backend,
                               moe_backend="torch" if moe == DENSE else moe)
    if moe == DENSE:
        use_dense_moe(model)
    return model


@pytest.mark.gpu
@pytest.mark.parametrize(("backend", "moe"), _gpu_graph_cases())
def test_gpu_verify_replay_is_bit_identical_to_eager_on_the_same_padded_batch(backend, moe):
    """Three requests with ragged `1 + L_r` chunks padded to 4 requests of 4 queries, eight steps: the replay's hidden states,
    streams, logits and every cache tensor equal the eager forward of the same padded batch bit for bit."""
    from deepinfer.engine.testing.model_runner import ModelRunnerForTests
    from tests.engine.test_cuda_graph import _prompts, declared_safe

    with declared_safe(backend):
        model = _load_builtin(backend, moe)
        drivers = [ModelRunnerForTests(model, max_seqs=4, max_len=256) for _ in range(2)]  # eager, graphs
        prompts = _prompts((3, 20, 61), seed=1)
        for d in drivers:
            for i, p in enumerate(prompts):
                d.prefill(i, p)
        eager_runner = VerifyGraphRunner(model, drivers[0].cache, (4,), max_queries=4)
        graphs = VerifyGraphRunner(model, drivers[1].cache, (4,), max_queries=4)
        rng = random.Random(0)
        for step in range(8):
            widths = [rng.randint(1, 4) for _ in range(3)]
            ids = [[rng.randint(2, 1000) for _ in range(w)] for w in widths]
            outs = []
            for d in drivers:
                batch = ForwardBatch.build(ids, [SeqChunk(i, d.tables[i], d.lens[i], w) for i, w in enumerate(widths)],
                                           device="cuda")
                if d is drivers[0]:
                    padded, rows = eager_runner.pad_verify(batch, eager_runner.key(batch))
                    with torch.inference_mode():
                        h, s = model(padded, d.cache, padded.attn_metadata, return_streams=True)
                    h, s = h[rows], s[rows]
                else:
                    h, s = graphs.run(batch)
                outs.append((h, s, model.compute_logits(h)))
                for i, w in enumerate(widths):
                    d.lens[i] += w
            for a, b in zip(outs[0], outs[1]):
                assert torch.equal(a, b), (backend, step)
            for k, v in _state(drivers[0].cache).items():
                assert torch.equal(v, _state(drivers[1].cache)[k]), (backend, step, k)
    st = graphs.stats  # a step of another N_pad or blocks bucket is a new key (a capture)
    assert st["captures"] + st["replays"] == 8 and st["replays"] >= 3, st


def _spec_engine(backend: str, moe: str, graphs: bool, **kw):
    from tests.engine.test_cuda_graph import DENSE, _engine

    native = backend != "torch" and moe != DENSE
    eng = _engine(backend, moe, enforce_eager=not (graphs and native), speculative="mtp", num_draft_tokens=3,
                  cuda_graph_batch_sizes=(1, 2, 4, 8, 16), **kw)
    if graphs and not native:  # made graph-safe for the test (dense MoE, `torch` declared safe): lazy captures
        eng.spec.graphs = VerifyGraphRunner(eng.model, eng.cache, (1, 2, 4, 8, 16), max_queries=4)
        eng.runner.defer_verify_metadata = True
    assert (eng.spec.graphs is not None) == graphs, eng.spec.verify_graph_blockers
    return eng


@pytest.mark.gpu
@pytest.mark.parametrize(("backend", "moe"), _gpu_graph_cases())
@pytest.mark.parametrize("schedule", ["full", "confidence"])
def test_gpu_speculative_greedy_with_verify_graphs_equals_eager_over_64_steps(backend, moe, schedule):
    from tests.engine.test_cuda_graph import _generate, _prompts, declared_safe

    prompts = _prompts((5, 37, 64, 130, 9))
    with declared_safe(backend):
        plain = _generate(_engine_plain(backend, moe), prompts, 64)
        ref = _generate(_spec_engine(backend, moe, False, verify_schedule=schedule), prompts, 64)
        eng = _spec_engine(backend, moe, True, verify_schedule=schedule)
        got = _generate(eng, prompts, 64)
    assert got == ref, "verify graphs changed the speculative greedy tokens"
    assert got == plain, "speculative greedy tokens differ from plain decoding (eager speculation too: not the graphs)"
    st = eng.spec.graphs.stats
    assert st["replays"] >= 10 and st["eager_fallbacks"] == 0, st


def _engine_plain(backend, moe):
    from tests.engine.test_cuda_graph import _engine

    return _engine(backend, moe, enforce_eager=True)


@pytest.mark.gpu
@pytest.mark.parametrize(("backend", "moe"), _gpu_graph_cases())
def test_gpu_a_replayed_verify_step_does_not_synchronise_with_the_host(backend, moe):
    """A replayed verify step (the padding, the static metadata's device copies, the input copies, the replay and
    the gather of the real rows) and the logits under `set_sync_debug_mode("error")`."""
    from deepinfer.engine.testing.model_runner import ModelRunnerForTests
    from tests.engine.test_cuda_graph import _prompts, declared_safe

    with declared_safe(backend):
        model = _load_builtin(backend, moe)
        d = ModelRunnerForTests(model, max_seqs=4, max_len=256)
        for i, p in enumerate(_prompts((8, 12, 30), seed=2)):
            d.prefill(i, p)
        graphs = VerifyGraphRunner(model, d.cache, (4,), max_queries=4)

        def batch(widths):
            b = ForwardBatch.build([[7] * w for w in widths], [SeqChunk(i, d.tables[i], d.lens[i], w)
                                                               for i, w in enumerate(widths)], device="cuda")
            for i, w in enumerate(widths):
                d.lens[i] += w
            return b

        assert graphs.run(batch([4, 2, 3])) is not None  # the capture
        b = batch([3, 4, 1])
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            hidden, _ = graphs.run(b)
            model.compute_logits(hidden)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert graphs.stats["replays"] == 1, graphs.stats
