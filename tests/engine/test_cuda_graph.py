"""CUDA-graph decode (`engine.cuda_graph`), host-sync-free steps and the GPU executor default.

CPU tests check the pieces (buckets, the graph-input walk, the blockers, the executor default);
`gpu` tests check that a replay computes what the eager step computes: on a toy model written here,
and on the built-in model with every attention backend that is (or, for `torch`, is declared for the
test) graph-safe, over 64 greedy steps; and that a decode step runs under
`torch.cuda.set_sync_debug_mode("error")`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.engine.cuda_graph import (
    CudaGraphRunner,
    UnsupportedLeaf,
    clone_tensors,
    flatten,
    graph_batch_sizes,
    graph_blockers,
)
from deepinfer.engine.executor import executor_name, resolve_async_scheduling
from deepinfer.engine.forward_batch import ForwardBatch, SeqChunk
from deepinfer.engine.moe import MoEBackend
from tests.engine.graph_standin import rerun_record

# --------------------------------------------------------------------------- CPU


def test_buckets_cover_every_batch_up_to_max_num_seqs():
    assert graph_batch_sizes(100) == (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100)
    assert graph_batch_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 48, 64)
    assert graph_batch_sizes(6, (4, 2, 2, 16)) == (2, 4, 6)
    with pytest.raises(ValueError, match="positive"):
        graph_batch_sizes(8, (0, 4))


@dataclass
class _Meta:
    n: int
    rows: torch.Tensor
    tables: dict[str, tuple[torch.Tensor, torch.Tensor]]
    extra: list | None = None


def test_flatten_describes_structure_and_keeps_aliases():
    rows = torch.arange(4)
    a = _Meta(3, rows, {"x": (rows, torch.ones(4, 2))}, [1, None])
    s1, t1 = flatten(a)
    assert len(t1) == 2 and t1[0] is rows  # the alias is one leaf
    b = _Meta(3, torch.zeros(4, dtype=torch.long), {"x": (torch.zeros(4, dtype=torch.long), torch.ones(4, 2))},
              [1, None])
    assert flatten(b)[0] != s1  # an alias broken is another structure
    same = clone_tensors(a)
    s2, t2 = flatten(same)
    assert s2 == s1 and same.tables["x"][0] is same.rows and same.rows is not rows
    assert flatten(_Meta(4, rows, a.tables, [1, None]))[0] != s1  # a host int differs
    assert flatten(_Meta(3, rows, {"x": (rows, torch.ones(5, 2))}, [1, None]))[0] != s1  # a shape differs
    with pytest.raises(UnsupportedLeaf):
        flatten(_Meta(3, rows, {}, [object()]))


class _FakeCache:
    def __init__(self, device="cpu", dummy=True):
        self.device = torch.device(device)
        self.num_slots = 8
        if dummy:
            self.dummy_slot, self.dummy_block = 7, 99


def test_pad_appends_dummy_rows_and_picks_the_bucket():
    runner = CudaGraphRunner(nn.Linear(1, 1), _FakeCache(), (1, 2, 4, 8))
    assert [runner.bucket(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    ids, seqs = runner.pad([[5], [6], [7]], [SeqChunk(0, [0], 10, 1)] * 3, 4)
    assert ids == [[5], [6], [7], [0]]
    assert (seqs[-1].slot, seqs[-1].block_table, seqs[-1].num_computed_tokens, seqs[-1].num_new_tokens) == (7, [99], 0, 1)


def test_blockers_name_the_device_the_cache_and_unsafe_backends():
    class Unsafe:
        name = "u"

    class Safe:
        cuda_graph_safe = True

    model = nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1))
    model[0].backend, model[1].backend = Unsafe(), Safe()
    reasons = graph_blockers(model, _FakeCache(dummy=False), "cpu")
    assert any("not CUDA" in r for r in reasons)
    assert any("dummy_slot" in r for r in reasons)
    assert any("Unsafe (u)" in r for r in reasons) and not any("Safe (" in r for r in reasons)


def test_overlapped_scheduling_is_the_cuda_default_only():
    from deepinfer.engine.engine import EngineConfig

    assert resolve_async_scheduling(None, "cpu") is False
    assert resolve_async_scheduling(None, "cuda:1") is True
    assert executor_name(None, None, "cuda") == "threaded"
    assert executor_name(None, None, "cpu") == "inprocess"
    assert executor_name(None, False, "cuda") == "inprocess"
    cfg = EngineConfig(device="cuda")
    assert executor_name(cfg.executor, cfg.async_scheduling, cfg.device) == "threaded"
    assert EngineConfig().enforce_eager is False


def test_cpu_runner_stays_eager():
    from deepinfer.engine.model_runner import ModelRunner

    runner = ModelRunner(nn.Linear(1, 1), _FakeCache())
    assert runner.cuda_graphs is None and any("not CUDA" in r for r in runner.cuda_graph_blockers)
    assert ModelRunner(nn.Linear(1, 1), _FakeCache(), enforce_eager=True).cuda_graph_blockers == ["enforce_eager"]


# --------------------------------------------------------------------------- GPU helpers


class DenseMoEForTests(MoEBackend):
    """Every expert on every token, weighted by a one-hot routing matrix: no host sync, graph-safe."""

    name = "dense-test"
    cuda_graph_safe = True

    def prepare(self, experts) -> None:
        self.w1 = torch.stack([e.w1.weight for e in experts])  # [E, I, H]
        self.w3 = torch.stack([e.w3.weight for e in experts])  # [E, I, H]
        self.w2 = torch.stack([e.w2.weight for e in experts])  # [E, H, I]
        self.limit = experts[0].limit

    def forward(self, x, topk_weights, topk_ids):
        g = torch.einsum("th,eih->tei", x, self.w1).clamp(max=self.limit)
        u = torch.einsum("th,eih->tei", x, self.w3).clamp(min=-self.limit, max=self.limit)
        y = torch.einsum("tei,ehi->teh", F.silu(g) * u, self.w2)  # [T, E, H]
        w = torch.zeros(x.shape[0], self.w1.shape[0], dtype=torch.float32, device=x.device)
        w.scatter_add_(1, topk_ids, topk_weights.float())  # [T, E]
        return (y * w[..., None].to(y.dtype)).sum(dim=1)


DENSE = "dense-test"


def use_dense_moe(model) -> None:
    from deepinfer.engine.models.deepseek_v4 import MoE

    for m in model.modules():
        if isinstance(m, MoE):
            m.backend = DenseMoEForTests()
            m.prepare()


def native_safe(kind: str) -> list[str]:
    """Registered attention / MoE backends that declare themselves graph-safe (other than `torch`)."""
    if kind == "attention":
        from deepinfer.engine.attention import attention_backend_names as names
        from deepinfer.engine.attention import get_attention_backend as get
    else:
        from deepinfer.engine.moe import get_moe_backend as get
        from deepinfer.engine.moe import moe_backend_names as names
    return [n for n in names() if n != "torch" and getattr(get(n), "cuda_graph_safe", False)]


def graph_cases() -> list[tuple[str, str]]:
    """(attention, MoE) pairs: `torch` attention declared graph-safe for the test (its metadata holds
    step-varying host ints, so the guard must send most steps back to eager) with the dense test MoE,
    and every natively graph-safe attention backend with a graph-safe MoE backend."""
    moes = native_safe("moe") or [DENSE]
    return [("torch", DENSE)] + [(a, moes[0]) for a in native_safe("attention")]


@contextlib.contextmanager
def declared_safe(attention_backend: str):
    """`torch` attention declared graph-safe for the duration (a no-op for other backends)."""
    from deepinfer.engine.attention.torch_backend import TorchAttentionBackend

    if attention_backend != "torch":
        yield
        return
    had = "cuda_graph_safe" in TorchAttentionBackend.__dict__
    old = TorchAttentionBackend.__dict__.get("cuda_graph_safe")
    TorchAttentionBackend.cuda_graph_safe = True
    try:
        yield
    finally:
        if had:
            TorchAttentionBackend.cuda_graph_safe = old
        else:
            del TorchAttentionBackend.cuda_graph_safe


def real_dummy(cache) -> None:
    """For the `torch` backend, which cannot mask padding rows: the cache's last slot and block (real
    memory, never used by the tests' few requests) as the dummy ones."""
    cache.dummy_slot = cache.num_slots - 1
    cache.dummy_block = cache.num_blocks - 1


# --------------------------------------------------------------------------- GPU: toy model


@dataclass
class _ToyMeta:
    is_pure_decode: bool
    slots: torch.Tensor  # [B]
    scale: dict[str, tuple[torch.Tensor]]  # {"a": ([B],)}
    num_done: int


class _ToyModel(nn.Module):
    """A decode step in miniature: embeds, updates a per-slot state, reads it back, projects to logits."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.head = nn.Linear(16, 50, bias=False)
        self.num_done = 0

    def build_attention_metadata(self, batch, cache):
        slots = torch.tensor([s.slot for s in batch.seqs], device=cache.device)
        return _ToyMeta(True, slots, {"a": (batch.positions.float() + 1,)}, self.num_done)

    def forward(self, batch, cache):
        meta = batch.attn_metadata
        h = self.emb(batch.input_ids) * meta.scale["a"][0][:, None]
        cache.state[meta.slots] = cache.state[meta.slots] * 0.5 + h
        return cache.state[meta.slots] + meta.num_done

    def compute_logits(self, hidden):
        return self.head(hidden).float()

    @torch.inference_mode()
    def step(self, batch, cache, meta=None):
        hidden = self(batch, cache)
        return self.compute_logits(hidden if batch.logits_indices is None else hidden[batch.logits_indices])


@pytest.mark.gpu
def test_toy_replay_equals_eager_and_falls_back_on_a_changed_host_value():
    _toy_replay_equals_eager("cuda", CudaGraphRunner)


def _toy_replay_equals_eager(device: str, runner_cls) -> None:
    torch.manual_seed(0)
    model = _ToyModel().to(device)
    caches = []
    for _ in range(2):
        c = _FakeCache(device)
        c.state = torch.zeros(8, 16, device=device)
        caches.append(c)
    runner = runner_cls(model, caches[1], (1, 2, 4))
    held, copies = [], []
    for step in range(12):
        model.num_done = 1 if step == 9 else 0
        ids, seqs = [[step + 1], [2 * step + 3], [7]], [SeqChunk(s, [0], step + 5, 1) for s in (0, 1, 2)]
        ids, seqs = runner.pad(ids, seqs, 4)
        outs = []
        for cache in caches:
            b = ForwardBatch.build(ids, seqs, device=device, logits=[2, 0, 1])
            b.num_dummy_rows = 1
            b.attn_metadata = model.build_attention_metadata(b, cache)
            got = runner.run(b) if cache is caches[1] else None
            outs.append(model.step(b, cache) if got is None else got)
        assert torch.equal(outs[0], outs[1]), step
        held.append(outs[1])
        copies.append(outs[1].clone())
    assert runner.stats == {"captures": 1, "replays": 10, "eager_fallbacks": 1}
    assert torch.equal(caches[0].state, caches[1].state)
    assert all(torch.equal(h, c) for h, c in zip(held, copies))  # later replays overwrote no earlier result


class ReplayByRerun(CudaGraphRunner):
    """The graph runner with a stand-in for CUDA graphs, so its logic runs on the CPU.

    `record` computes the output buffer without leaving a trace (the cache tensors are restored, as a
    capture runs nothing); the stand-in graph's `replay` re-runs the step on the *static* buffers and
    copies the result into that buffer, as a real replay does. A missed input copy, a stale buffer or a
    result handed out without copying shows as a wrong answer.
    """

    record = rerun_record


def test_replay_logic_on_the_cpu_toy_model():
    _toy_replay_equals_eager("cpu", ReplayByRerun)


def test_replayed_engine_gives_the_eager_greedy_tokens_on_the_cpu():
    """The built-in model through the engine (threaded executor, a 5-row batch padded to 8) with the
    stand-in graphs: `torch` attention declared graph-safe, so the guard must also send steps back."""
    from deepinfer.engine.engine import Engine, EngineConfig
    from deepinfer.engine.sampling import SamplingParams

    prompts = _prompts((8, 8, 8, 8, 8))

    def run(graphs: bool):
        eng = Engine(EngineConfig(max_num_seqs=16, max_model_len=128, async_scheduling=True, enforce_eager=True))
        use_dense_moe(eng.model)
        if graphs:
            real_dummy(eng.cache)
            eng.runner.cuda_graphs = ReplayByRerun(eng.model, eng.cache, (1, 2, 4, 8, 16))
        for i, p in enumerate(prompts):
            eng.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        outs = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                outs[o.request_id] = o.outputs[0].token_ids
        eng.shutdown()
        return [outs[str(i)] for i in range(len(prompts))], eng.runner.cuda_graphs

    ref, _ = run(False)
    with declared_safe("torch"):
        got, graphs = run(True)
    assert got == ref
    assert set(graphs.graphs) == {8}
    assert graphs.stats["captures"] == 1 and graphs.stats["replays"] >= 2 and graphs.stats["eager_fallbacks"] >= 1


# --------------------------------------------------------------------------- GPU: the built-in model


def _engine(attention_backend: str, moe: str, enforce_eager: bool, **kw):
    from deepinfer.engine.engine import Engine, EngineConfig

    eng = Engine(EngineConfig(device="cuda", attention_backend=attention_backend,
                              moe_backend="torch" if moe == DENSE else moe, enforce_eager=enforce_eager,
                              max_num_seqs=16, max_model_len=512, seed=0, **kw))
    if moe == DENSE:
        use_dense_moe(eng.model)
    return eng


def _graph_engine(attention_backend: str, moe: str, sizes=(1, 2, 4, 8, 16), **kw):
    """An engine whose decode steps run as graphs. With natively graph-safe backends that is the engine's
    own set-up (start-up capture); otherwise it is built eager, made graph-safe (dense MoE, `torch`
    declared safe, real dummy slot) and given a runner that captures lazily, from real steps (torch's
    metadata matches a capture from its own steps only)."""
    if attention_backend != "torch" and moe != DENSE:
        eng = _engine(attention_backend, moe, enforce_eager=False, cuda_graph_batch_sizes=sizes, **kw)
        assert eng.runner.cuda_graphs is not None, eng.runner.cuda_graph_blockers
        return eng
    eng = _engine(attention_backend, moe, enforce_eager=True, **kw)
    if attention_backend == "torch":
        real_dummy(eng.cache)
    assert not graph_blockers(eng.model, eng.cache, "cuda"), graph_blockers(eng.model, eng.cache, "cuda")
    eng.runner.cuda_graphs = CudaGraphRunner(eng.model, eng.cache, sizes)
    if attention_backend != "torch":
        eng.runner.capture_cuda_graphs()
    return eng


def _generate(eng, prompts, num_tokens):
    """Greedy tokens of each prompt (`num_tokens`: one count for all, or one each), then the engine shut down."""
    from deepinfer.engine.sampling import SamplingParams

    counts = num_tokens if isinstance(num_tokens, list | tuple) else [num_tokens] * len(prompts)
    for i, (p, n) in enumerate(zip(prompts, counts)):
        eng.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    outs: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id] = o.outputs[0].token_ids
    eng.shutdown()
    return [outs[str(i)] for i in range(len(prompts))]


def _prompts(lens, vocab=129280, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lens]


@pytest.mark.gpu
@pytest.mark.parametrize(("backend", "moe"), graph_cases())
def test_graph_decode_gives_the_eager_greedy_tokens_over_64_steps(backend, moe):
    # 5 rows: padded to the bucket of 8. torch's metadata matches the (lazy) capture only while no row
    # completes a window and no row gains a visible entry: equal lengths (multiples of 4) give it two replays.
    lens = (8, 8, 8, 8, 8) if backend == "torch" else (5, 37, 64, 130, 9)
    prompts = _prompts(lens)
    with declared_safe(backend):
        ref = _generate(_engine(backend, moe, enforce_eager=True), prompts, 64)
        eng = _graph_engine(backend, moe)
        got = _generate(eng, prompts, 64)
    assert got == ref
    stats = eng.runner.cuda_graphs.stats
    assert stats["replays"] >= 1, stats
    if backend != "torch":  # metadata that depends only on the batch size: no step falls back
        assert stats["eager_fallbacks"] == 0, stats
    else:  # torch's metadata holds step-varying host ints: the guard must catch them
        assert stats["eager_fallbacks"] >= 1, stats


@pytest.mark.gpu
@pytest.mark.parametrize(("backend", "moe"), graph_cases())
def test_graph_replay_logits_are_bit_identical_to_eager_on_the_same_padded_batch(backend, moe):
    from deepinfer.engine.builtin_model import builtin_model_path
    from deepinfer.engine.loader import load_checkpoint
    from deepinfer.engine.testing.model_runner import ModelRunnerForTests

    with declared_safe(backend):
        model, _ = load_checkpoint(builtin_model_path(), dtype="bfloat16", device="cuda", attention_backend=backend,
                                   moe_backend="torch" if moe == DENSE else moe)
        if moe == DENSE:
            use_dense_moe(model)
        drivers = [ModelRunnerForTests(model, max_seqs=12, max_len=256) for _ in range(2)]  # eager, graphs
        if backend == "torch":
            for d in drivers:
                real_dummy(d.cache)
        prompts = _prompts((4, 20, 60) if backend == "torch" else (3, 20, 61), seed=1)
        toks = [int(drivers[0].prefill(i, p).argmax()) for i, p in enumerate(prompts)]
        for i, p in enumerate(prompts):
            drivers[1].prefill(i, p)
        graphs = CudaGraphRunner(model, drivers[1].cache, (4,))
        for step in range(8):
            outs = []
            for d in drivers:
                ids, seqs = graphs.pad([[t] for t in toks], [SeqChunk(i, d.tables[i], d.lens[i], 1) for i in range(3)], 4)
                b = ForwardBatch.build(ids, seqs, device="cuda", logits=[2, 0, 1])
                b.num_dummy_rows = 1
                b.attn_metadata = model.build_attention_metadata(b, d.cache)
                got = graphs.run(b) if d is drivers[1] else None
                outs.append(model.step(b, d.cache) if got is None else got)
                for i in range(3):
                    d.lens[i] += 1
            assert torch.equal(outs[0], outs[1]), (backend, step)
            toks = outs[0].argmax(-1).tolist()
            toks = [toks[1], toks[2], toks[0]]  # logits came in row order 2, 0, 1
    assert graphs.stats["replays"] >= 1, graphs.stats


def _sync_cases():
    cases = [("torch", DENSE, False), ("torch", DENSE, True)]
    cases += [("torch", m, False) for m in native_safe("moe")]
    cases += [(a, m, False) for a, m in graph_cases()[1:]]
    return cases


@pytest.mark.gpu
@pytest.mark.parametrize(("backend", "moe", "random_sampling"), _sync_cases())
def test_a_decode_step_does_not_synchronise_with_the_host(backend, moe, random_sampling):
    """The forward and the sampler of a replayed and an eager decode step, and the batch / sampling-batch
    building, under sync-debug "error" (the metadata building is left out: `attention/base.py` copies
    its host lists with blocking `torch.tensor(..., device=)`)."""
    from deepinfer.engine.sampling import SamplingBatch, SamplingParams

    with declared_safe(backend):
        eng = _graph_engine(backend, moe, sizes=(4,), async_scheduling=False)
    params = SamplingParams(temperature=0.8 if random_sampling else 0.0, top_p=0.9 if random_sampling else 1.0,
                            max_tokens=8, ignore_eos=True)
    prompts = _prompts((8, 8, 8, 8), seed=2)  # positions 8, 9, 10: the torch metadata stays as captured
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params)
    for _ in range(3):  # prefill, first decode (the capture when lazy), one replay
        eng.step()
    out = eng.scheduler.schedule()
    eng.runner.update_states(out, {})
    step = eng._prepare(out, eng._inflight_token_ids())
    sbatch = SamplingBatch.build([params] * 4, [[1]] * 4, prompts, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        logits = eng.runner.run(step.batch)  # a replay
        eng.sampler.sample(logits, sbatch)
        eager = eng.model.step(step.batch, eng.cache)  # the same step eagerly (its cache writes are idempotent)
        eng.sampler.sample(eager, sbatch)
        b2 = ForwardBatch.build([[3]] * 4, [SeqChunk(0, [0], 8, 1)] * 4, device="cuda")
        SamplingBatch.build([params] * 4, [[1]] * 4, prompts, device="cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert eng.runner.cuda_graphs.stats["replays"] >= 1, eng.runner.cuda_graphs.stats
    assert b2.num_tokens == 4
    eng.shutdown()


@pytest.mark.gpu
@pytest.mark.xfail(raises=RuntimeError, strict=True,
                   reason="engine/moe/torch_backend.py reads the routed expert ids on the host (`.tolist()` in "
                          "single_token_forward / loop_forward); moe_backend='triton' is the graph-safe one on CUDA")
def test_an_eager_decode_step_with_the_torch_moe_backend_synchronises():
    from deepinfer.engine.sampling import SamplingParams

    eng = _engine("torch", "torch", enforce_eager=True, async_scheduling=False)
    eng.add_request("0", _prompts((8,))[0], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    eng.step()
    out = eng.scheduler.schedule()
    eng.runner.update_states(out, {})
    step = eng._prepare(out, {})
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        eng.runner.run(step.batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        eng.shutdown()
