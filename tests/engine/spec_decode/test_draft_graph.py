"""CUDA graphs of the MTP drafter's whole drafting (`engine.spec_decode.draft_graph.DraftGraphRunner`).

CPU tests use a stand-in for CUDA graphs (`DraftReplayByRerun`: the capture leaves no trace, a replay re-runs the
drafting on the static buffers), as test_verify_graph.py does for verify steps: the graphed drafting against the
eager one (drafts, probabilities, confidence features and the drafter's window cache, over steps with ragged
committed chunks that wrap the window ring), and speculative greedy decoding through the engine with both graph
stand-ins against plain decoding. `gpu` tests: a replayed drafting equals the eager drafting of the same
steps (tokens and cache bit for bit on the same padded batch), and it does not synchronise with the host.
"""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer.engine import SamplingParams
from deepinfer.engine.engine import Engine, EngineConfig
from deepinfer.engine.spec_decode.draft_graph import DraftGraphRunner
from deepinfer.engine.spec_decode.mtp_drafter import DraftSeq, MTPDrafter
from tests.engine.graph_standin import rerun_record
from tests.engine.spec_decode.test_verify_graph import VerifyReplayByRerun, _run, tiny  # noqa: F401 (fixture)


class DraftReplayByRerun(DraftGraphRunner):
    """The drafting graph runner with a stand-in for CUDA graphs (see test_verify_graph.VerifyReplayByRerun)."""

    record = rerun_record


def test_packed_to_device_gives_back_every_tensor():
    from deepinfer.engine.spec_decode.verify_rows import packed_to_device

    g = torch.Generator().manual_seed(0)
    ts = [torch.arange(5), torch.rand(3, 7, generator=g) > 0.5, torch.randn(2, 3, generator=g), torch.zeros(0, 4),
          torch.tensor(7), torch.randn(4, 6, generator=g).t(), torch.randn(3, generator=g).to(torch.bfloat16)]
    out = packed_to_device(ts, "cpu")
    for a, b in zip(ts, out, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        assert b.storage_offset() * b.element_size() % 16 == 0


def test_static_window_step_metadata_equals_the_host_builder():
    """The device-side builder of the chained steps' metadata against `static_verify_metadata(seqs, B_pad, 1, ...)`:
    the same structure (what a graph checks) and every tensor equal; positions before the window fills, a state start
    inside the window (bounded replay), padding requests."""
    from deepinfer.engine.cuda_graph import flatten
    from deepinfer.engine.forward_batch import ForwardBatch, SeqChunk
    from deepinfer.engine.spec_decode.verify_rows import static_verify_metadata, static_window_step_metadata

    eng = Engine(EngineConfig(max_num_seqs=4, speculative="mtp", num_draft_tokens=3))
    d = eng.spec.drafter
    inner = eng.model.model
    rope_fns = {"main": inner.rotary_main, "compress": inner.rotary_compress}
    specs, W = (d.layer.attn.spec,), d.layer.attn.spec.window
    for seqs, Bp in (([SeqChunk(2, [], 5, 1, 0)], 1), ([SeqChunk(0, [], 300, 1, 0), SeqChunk(3, [], 7, 1, 0),
                                                       SeqChunk(1, [], W + 40, 1, W + 10)], 4)):
        pad = Bp - len(seqs)
        rows = ForwardBatch(input_ids=torch.zeros(Bp, dtype=torch.long),
                            seqs=seqs + [SeqChunk(seqs[0].slot, [], 0, 1)] * pad)
        ref = static_verify_metadata(seqs, Bp, 1, rows.positions, specs, rope_fns, d.cache, 1)
        got = static_window_step_metadata(
            rows.positions, torch.tensor([s.slot for s in seqs] + [seqs[0].slot] * pad),
            torch.tensor([s.state_start for s in seqs] + [0] * pad), torch.arange(Bp) < len(seqs), specs, rope_fns,
            d.cache.block_size)
        (s_ref, t_ref), (s_got, t_got) = flatten(ref), flatten(got)
        assert s_ref == s_got
        for a, b in zip(t_ref, t_got, strict=True):
            assert torch.equal(a, b)
    eng.shutdown()


def _cache_state(drafter: MTPDrafter) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in drafter.cache.state_tensors().items() if v.numel()}


@pytest.mark.parametrize("keep_features", [False, True])
def test_graphed_drafting_equals_the_eager_drafting(tiny, keep_features):  # noqa: F811
    """Three requests (slots 0, 2, 3), a prefill-sized first committed pass (eager in both), then 10 steps of
    ragged committed chunks (1 .. 4 rows, as after 0 .. 3 accepted drafts) across the tiny preset's 8-row window:
    the same drafts, probabilities (and features) and drafter cache as the eager drafter, step by step; the
    3-request steps pad to the bucket of 4 (a padding request mirrors request 0)."""
    eng = Engine(EngineConfig(model=tiny, max_num_seqs=4, speculative="mtp", num_draft_tokens=3))
    model, k = eng.model, 3
    eager, graphed = MTPDrafter(model, 4, k), MTPDrafter(model, 4, k)
    for d in (eager, graphed):
        d.keep_features = keep_features
    graphed.graphs = runner = DraftReplayByRerun(graphed, (1, 2, 4), max_queries=1 + k)
    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    H, hc = model.config.hidden_size, model.config.hc_mult
    slots = [0, 2, 3]
    pos = [0, 0, 0]
    for step in range(11):
        widths = [rng.randint(5, 12) for _ in slots] if step == 0 else [rng.randint(1, 1 + k) for _ in slots]
        streams = torch.randn(sum(widths) + 3, hc, H, generator=g)  # a few rows no seq reads
        seqs, row = [], 2
        for s, p, w in zip(slots, pos, widths):
            seqs.append(DraftSeq(s, p, list(range(row, row + w)), [rng.randint(2, 500) for _ in range(w)], 0, True))
            row += w
        a, b = eager.propose(streams, seqs), graphed.propose(streams, seqs)
        assert a[0] == b[0], step
        torch.testing.assert_close(torch.tensor(a[1]), torch.tensor(b[1]), rtol=1e-4, atol=1e-5)
        if keep_features:
            for fa, fb in zip(a[2], b[2]):
                torch.testing.assert_close(fa, fb, rtol=1e-4, atol=1e-4)
        else:
            assert a[2] == b[2] == [None] * 3
        sa, sb = _cache_state(eager), _cache_state(graphed)
        for name in sa:
            torch.testing.assert_close(sa[name], sb[name], rtol=1e-4, atol=1e-5, msg=f"step {step}: {name}")
        pos = [p + w for p, w in zip(pos, widths)]
    st = runner.stats
    assert st["captures"] + st["replays"] == 10 and st["replays"] >= 5 and st["eager_steps"] == 1, st
    assert st["eager_fallbacks"] == 0, st
    eng.shutdown()


def test_a_step_with_a_non_drafting_or_long_chunk_drafts_eagerly(tiny):  # noqa: F811
    eng = Engine(EngineConfig(model=tiny, max_num_seqs=4, speculative="mtp", num_draft_tokens=3))
    d = MTPDrafter(eng.model, 4, 3)
    d.graphs = runner = DraftReplayByRerun(d, (1, 2, 4), max_queries=4)
    streams = torch.randn(6, eng.model.config.hc_mult, eng.model.config.hidden_size)
    out = d.propose(streams, [DraftSeq(0, 0, [0, 1, 2, 3, 4], [5, 6, 7, 8, 9], 0, True)])  # 5 rows > 4
    assert len(out[0][0]) == 3 and runner.stats["eager_steps"] == 1 and not runner.graphs
    out = d.propose(streams, [DraftSeq(0, 5, [5], [11], 0, True), DraftSeq(1, 0, [0], [12], 0, False)])
    assert len(out[0][0]) == 3 and out[0][1] == [] and not runner.graphs  # not every seq drafts: eager
    assert DraftGraphRunner(d, (1, 2, 4, 8, 128), max_queries=4).batch_sizes == (1, 2, 4, 8)  # MAX_REQUESTS
    eng.shutdown()


class _CaptureFails(DraftGraphRunner):
    def record(self, fn):
        raise RuntimeError("operation not permitted when stream is capturing")


def test_a_failed_capture_turns_the_drafting_graphs_off_and_drafts_eagerly(tiny):  # noqa: F811
    """A drafting op that cannot be captured must not fail the engine: the step keeps its eager drafting (a capture
    runs nothing) and later steps draft eagerly, with the same drafts as the eager drafter."""
    eng = Engine(EngineConfig(model=tiny, max_num_seqs=4, speculative="mtp", num_draft_tokens=3))
    eager, graphed = MTPDrafter(eng.model, 4, 3), MTPDrafter(eng.model, 4, 3)
    graphed.graphs = runner = _CaptureFails(graphed, (1, 2, 4), max_queries=4)
    hc, H = eng.model.config.hc_mult, eng.model.config.hidden_size
    g = torch.Generator().manual_seed(1)
    for step, (p, w) in enumerate(((0, 6), (6, 2), (8, 1))):
        streams = torch.randn(w + 1, hc, H, generator=g)
        seqs = [DraftSeq(1, p, list(range(1, 1 + w)), [7 + i for i in range(w)], 0, True)]
        assert eager.propose(streams, seqs)[0] == graphed.propose(streams, seqs)[0], step
    assert runner.disabled and "capturing" in runner.disabled and not runner.graphs
    assert runner.stats["capture_failures"] == 1 and runner.stats["eager_steps"] == 2, runner.stats
    eng.shutdown()


@pytest.mark.parametrize("schedule", ["full", "confidence"])
def test_builtin_model_with_draft_and_verify_graphs_gives_the_plain_greedy_tokens(schedule):
    """The built-in model, async scheduling (the drafter on its thread), buckets up to 4: the drafting of 5
    requests and of prefill chunks runs eagerly, that of 1 .. 4 decoding requests replays; plain greedy tokens."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 1000, (n,), generator=g).tolist() for n in (6, 11, 4, 9, 14)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (6, 20, 10, 20, 14)]
    ref = _run(Engine(EngineConfig(max_num_seqs=8)), prompts, params)
    eng = Engine(EngineConfig(max_num_seqs=8, speculative="mtp", num_draft_tokens=3, verify_schedule=schedule,
                              async_scheduling=True))
    eng.spec.graphs = VerifyReplayByRerun(eng.model, eng.cache, (1, 2, 4), max_queries=4)
    eng.runner.defer_verify_metadata = True
    eng.spec.drafter.graphs = runner = DraftReplayByRerun(eng.spec.drafter, (1, 2, 4), max_queries=4)
    assert _run(eng, prompts, params) == ref
    st = runner.stats
    assert st["replays"] >= 3 and st["eager_steps"] >= 2 and st["eager_fallbacks"] == 0, st
    eng.shutdown()


# --------------------------------------------------------------------------- GPU


def _gpu_drafters(backend: str, moe: str):
    from tests.engine.spec_decode.test_verify_graph import _load_builtin

    model = _load_builtin(backend, moe)
    drafters = [MTPDrafter(model, 4, 3) for _ in range(2)]  # eager, graphs
    drafters[1].graphs = DraftGraphRunner(drafters[1], (4,), max_queries=4)
    return model, drafters


def _gpu_cases():
    from tests.engine.spec_decode.test_verify_graph import _gpu_graph_cases

    return _gpu_graph_cases()


def _steps(model, widths: list[list[int]], seed: int):
    """Per step: (streams, seqs) of three requests committing `widths[step]` rows each."""
    rng = random.Random(seed)
    g = torch.Generator(device="cuda").manual_seed(seed)
    H, hc = model.config.hidden_size, model.config.hc_mult
    dtype = model.model.embed_tokens.weight.dtype
    pos = [0, 0, 0]
    for ws in widths:
        streams = torch.randn(sum(ws), hc, H, generator=g, device="cuda", dtype=dtype)
        seqs, row = [], 0
        for s, (p, w) in enumerate(zip(pos, ws)):
            seqs.append(DraftSeq(s, p, list(range(row, row + w)), [rng.randint(2, 1000) for _ in range(w)], 0, True))
            row += w
        yield streams, seqs
        pos = [p + w for p, w in zip(pos, ws)]


@pytest.mark.gpu
@pytest.mark.parametrize(("backend", "moe"), _gpu_cases())
def test_gpu_replayed_drafting_equals_its_eager_run_on_the_same_padded_steps(backend, moe):
    """Twelve steps: the graph runner's eager run of each step's static inputs (a second runner that never
    captures) and the replays give the same drafts, probabilities and drafter cache bit for bit; the eager
    (unpadded) drafter gives the same drafts up to rare bf16 near-ties (checked loosely)."""
    from tests.engine.test_cuda_graph import declared_safe

    with declared_safe(backend):
        model, (eager, graphed) = _gpu_drafters(backend, moe)
        static = MTPDrafter(model, 4, 3)
        static_runner = DraftGraphRunner(static, (4,), max_queries=4)
        agree = total = 0
        rng = random.Random(0)
        widths = [[rng.randint(20, 40) for _ in range(3)]] + [[rng.randint(1, 4) for _ in range(3)] for _ in range(11)]
        with torch.inference_mode():
            for streams, seqs in _steps(model, widths, seed=0):
                a = eager.propose(streams, seqs)
                b = graphed.propose(streams, seqs)
                key = static_runner.key(seqs)
                if key is None:
                    c = static.propose(streams, seqs)
                else:
                    out = static_runner._draft(static_runner.inputs(streams, seqs, key))
                    c = (out[0][:3].tolist(), out[1][:3].tolist())
                assert b[0] == c[0] and b[1] == c[1]
                for name, v in static.cache.state_tensors().items():
                    assert torch.equal(v, graphed.cache.state_tensors()[name]), name
                agree += sum(x == y for x, y in zip(a[0], b[0]))
                total += len(a[0])
        assert agree >= total - 2, (agree, total)
    st = graphed.graphs.stats
    assert st["replays"] >= 8 and st["eager_fallbacks"] == 0, st


@pytest.mark.gpu
@pytest.mark.parametrize(("backend", "moe"), _gpu_cases())
def test_gpu_a_replayed_drafting_does_not_synchronise_with_the_host(backend, moe):
    """The inputs (static metadata, non-blocking copies), the replay and the slicing of the outputs under
    `set_sync_debug_mode("error")`; the caller's one read of the drafts comes after."""
    from tests.engine.test_cuda_graph import declared_safe

    with declared_safe(backend):
        model, (_, graphed) = _gpu_drafters(backend, moe)
        steps = list(_steps(model, [[30, 25, 40], [2, 2, 2], [2, 2, 2]], seed=1))
        with torch.inference_mode():
            for streams, seqs in steps[:2]:  # the prefill pass (eager), then the capture of key (4, 2)
                graphed.propose(streams, seqs)
            streams, seqs = steps[2]
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                out = graphed.graphs.run(streams, seqs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        assert out is not None and out[0].shape == (3, 3), graphed.graphs.stats
        assert graphed.graphs.stats["replays"] == 1, graphed.graphs.stats
