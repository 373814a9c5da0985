"""How close a decode step and a prefill come to the GPU's limits (issue 22's roofline table).

    python -m deepinfer.benchmarks.gpu_roofline [--batches 1,128] [--context 512]
        [--attention-backend torch,triton] [--moe-backend torch] [--json OUT]

Model: a V4-Flash-shaped stack (`v4_flash_4l`: hidden 4096, 64 heads x head_dim 512, q_lora 1024,
o_groups 8 x 1024, indexer 64 heads x 128 with top-512, window 128, CSA rate 4, HCA rate 128, hc_mult 4,
vocab 129280, 64 experts of width 2048 with top-6, 4 layers SWA, SWA, CSA, HCA; the first two route by
token hash), random bf16 weights built directly on the device (no checkpoint file). `--weights published` stores
them as DeepSeek's published checkpoints do (`published_storage`: the attention projections, the shared experts
and the MTP projections FP8 e4m3 with UE8M0 scales per 128 x 128 block, the routed experts MXFP4 — E2M1 with a
UE8M0 scale per 32; `published-base`: FP8 routed experts with float32 scales, as the `*-Base` checkpoints), kept
quantized in the engine's `Fp8Linear` / `Fp4Linear` and run through their GEMMs (issue 22's ">= 40% of the roofline
from the quantized bytes").

Decode at batch B: B requests at `--context` tokens each (the cache holds zeros: values do not change
the work), one new token per request per step. A step is what the engine's executor does for a
prepared step plus the preparation: build the flat batch and its attention metadata, run the model,
take the greedy tokens, copy them to the host (the step's one sync).

- **bytes a step must read** (`decode_bytes`): every weight the step touches once — attention,
  compressors, indexer, mHC, norms, router, shared expert, LM head, the embedding rows of the batch —
  plus the routed experts the batch actually hits in each layer (counted on the step's own routing),
  plus per request the KV and state it must read (window ring of every layer; for CSA all visible
  index keys and the top-k entries; for HCA all visible entries; the compressor rings once per window).
- **roofline time** = those bytes / the measured device-to-device copy rate (bytes read + written per
  second of a 1 GiB `copy_`); **fraction of roofline** = roofline time / measured step time.
- Measured step time eagerly and, where the model's backends are graph-safe (`engine.cuda_graph`),
  with CUDA graphs; **GPU busy** and **kernel launches** per step from `torch.profiler` (kernels on
  the device; launch calls of the CUDA runtime / driver, graph launches included), and the top kernels.

Prefill of one `--prefill-tokens` prompt in one chunk: the FLOPs it must do (`prefill_flops`: every
linear on every token — routed experts top-k per token — the LM head on the last token, and attention
over exactly the keys each query sees: window, the indexer's scores over visible entries and top-k
CSA entries, all visible HCA entries), achieved TFLOP/s and MFU against a measured bf16 8192^3 matmul.

Prints the table and writes `--json` (default `benchmarks/results/gpu_roofline_h200.json` on CUDA).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from deepinfer.engine.cache.kv_cache import V4KVCache
from deepinfer.engine.config import ModelConfig
from deepinfer.engine.cuda_graph import CudaGraphRunner, graph_blockers
from deepinfer.engine.forward_batch import ForwardBatch, SeqChunk
from deepinfer.engine.testing.presets import get_preset

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "gpu_roofline_h200.json"
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch",
                "cudaLaunchCooperativeKernel")


def v4_flash_4l() -> dict:
    """The issue's V4-Flash-shaped 4-layer stack (transformers-style config dict)."""
    cfg = get_preset("small").hf_config()
    cfg.update(
        vocab_size=129280, hidden_size=4096, moe_intermediate_size=2048, num_hidden_layers=4,
        num_attention_heads=64, head_dim=512, q_lora_rank=1024, o_groups=8, o_lora_rank=1024,
        n_routed_experts=64, num_experts_per_tok=6, hc_mult=4, index_n_heads=64, index_head_dim=128,
        index_topk=512, sliding_window=128, compress_rates={CSA: 4, HCA: 128},
        layer_types=[SLIDING, SLIDING, CSA, HCA], mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
        max_position_embeddings=65536, num_nextn_predict_layers=0, tie_word_embeddings=False,
    )
    return cfg


CONFIGS = {"v4-flash-4l": v4_flash_4l, "tiny": lambda: get_preset("tiny").hf_config()}
"""Config presets by name (`--config`); `tiny` is for smoke runs on the CPU."""


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------- the model


WEIGHTS = {"bf16": None, "published": "fp4", "published-base": "fp8"}
"""`--weights` -> the routed experts' storage of the published layout (None: every linear in `--dtype`)."""


@torch.no_grad()
def quantize_published(model, expert_dtype: str) -> dict[str, int]:
    """Replace every `nn.Linear` that DeepSeek's published checkpoints store quantized (`published_storage`) by the
    engine's `Fp8Linear` (128 x 128 blocks; UE8M0 scales, float32 for FP8 experts as in `*-Base`) / `Fp4Linear`
    (MXFP4) quantized from its weight, in place. Returns how many of each kind."""
    from torch import nn

    from deepinfer.engine.models.deepseek_v4_weights import published_storage
    from deepinfer.engine.quant.linear import Fp4Linear, Fp8Linear

    counts = {"fp8": 0, "fp4": 0}
    for name, mod in list(model.named_modules()):
        if not isinstance(mod, nn.Linear):
            continue
        kind = published_storage(name + ".weight", expert_dtype)
        if kind not in counts:
            continue
        w = mod.weight.detach().float()
        if kind == "fp4":
            new = Fp4Linear.from_float(w, 32)
        else:
            expert = published_storage(name + ".weight", "fp4") == "fp4"  # a routed expert (the Base layout)
            new = Fp8Linear.from_float(w, (128, 128), torch.float32 if expert else torch.float8_e8m0fnu)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, new)
        counts[kind] += 1
    return counts


@torch.no_grad()
def build_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, attention_backend: str = "torch",
                moe_backend: str = "torch", seed: int = 0, weights: str = "bf16"):
    """`DeepseekV4ForCausalLM` with random weights made on `device` (floats in `dtype` except the
    loader's float32-kept set; `weights` a `WEIGHTS` key: the published layout's linears quantized), hash
    tables of distinct random experts, ready for inference."""
    from deepinfer.engine.models.deepseek_v4 import DeepseekV4ForCausalLM
    from deepinfer.engine.models.deepseek_v4_weights import is_fp32_kept
    from deepinfer.engine.moe.router import Gate

    torch.manual_seed(seed)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = DeepseekV4ForCausalLM(cfg, attention_backend=attention_backend, moe_backend=moe_backend,
                                          num_mtp_layers=0)
    finally:
        torch.set_default_dtype(prev)
    for name, p in model.named_parameters():
        want = torch.float32 if is_fp32_kept(name) else dtype
        if p.dtype != want:
            p.data = p.data.to(want)
    for m in model.modules():
        if isinstance(m, Gate):
            m.weight.normal_(0, cfg.hidden_size**-0.5)
            if m.is_hash:  # k distinct experts per token id
                m.tid2eid.copy_(torch.rand(cfg.vocab_size, cfg.n_routed_experts, device=device).argsort(dim=1)[:, :m.topk])
    if WEIGHTS[weights] is not None:
        quantize_published(model, WEIGHTS[weights])
    model.eval().requires_grad_(False)
    model.prepare_for_inference()
    return model


def set_backends(model, attention_backend: str, moe_backend: str) -> None:
    """Swap the attention and MoE backends of a built model (no new weights)."""
    from deepinfer.engine.attention import get_attention_backend
    from deepinfer.engine.models.deepseek_v4 import MoE
    from deepinfer.engine.moe import get_moe_backend

    attn = get_attention_backend(attention_backend)()
    model.model.attention_backend = attn
    for layer in model.model.layers:
        layer.attn.backend = attn
    for m in model.modules():
        if isinstance(m, MoE) and m.backend.name != moe_backend:
            m.backend = get_moe_backend(moe_backend)()
            m.prepare()


def make_cache(model, num_seqs: int, max_len: int, device: torch.device) -> tuple[V4KVCache, list[list[int]]]:
    """A cache for `num_seqs` sequences of `max_len` tokens (plus one spare slot and block, the dummy
    ones where `V4KVCache` does not provide them), and each sequence's block table."""
    import math

    cfg = model.config
    block_size = max(64, math.lcm(*cfg.compress_rates.values()))
    per_seq = -(-max_len // block_size)
    dtype = model.model.embed_tokens.weight.dtype
    # NOTE: max_model_len bounds `max_blocks_per_seq`, the width of graph-safe metadata's block tables
    cache = V4KVCache(cfg, per_seq * num_seqs + 1, block_size, num_seqs + 1, dtype=dtype, device=device,
                      max_model_len=per_seq * block_size)
    if getattr(cache, "dummy_slot", None) is None:
        cache.dummy_slot, cache.dummy_block = num_seqs, per_seq * num_seqs
    return cache, [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(num_seqs)]


# --------------------------------------------------------------------------- what a step must do


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _module_nbytes(mod) -> int:
    """Bytes of a module's parameters as stored (a quantized linear: its codes and scales)."""
    return sum(_nbytes(p) for p in mod.parameters())


def _macs(linear) -> int:
    """Multiply-adds per token of a linear, float or quantized (`in_features x out_features`)."""
    return linear.in_features * linear.out_features


def decode_bytes(model, batch: int, context: int, experts_hit: list[int]) -> dict:
    """Bytes a decode step of `batch` requests at `context` tokens must read (see the module docstring).

    `experts_hit[i]`: distinct routed experts the step's tokens chose in MoE layer i.
    """
    cfg = model.config
    dense = routed = 0
    for name, p in model.named_parameters():
        if ".ffn.experts." in name:
            continue
        if name == "model.embed_tokens.weight":
            dense += batch * p.shape[1] * p.element_size()  # the rows of the batch's tokens
            if cfg.tie_word_embeddings:
                dense += _nbytes(p)  # the head reads all of it
            continue
        dense += _nbytes(p)
    for layer, hit in zip(model.model.layers, experts_hit):
        ex = layer.ffn.experts[0]
        routed += hit * sum(_module_nbytes(getattr(ex, w)) for w in ("w1", "w2", "w3"))
    elt = model.model.embed_tokens.weight.element_size()
    D, W, ID = cfg.head_dim, cfg.sliding_window, cfg.index_head_dim
    kv = 0
    for kind in [model.model.layers[i].attn.spec for i in range(len(model.model.layers))]:
        kv += W * D * elt  # the window ring
        if kind.is_compressed:
            c = (context + 1) // kind.compress_rate
            width = (2 if kind.is_overlap else 1) * D
            kv += kind.ring_len * width * 2 * elt // kind.compress_rate  # compressor rings, once per window
            if kind.has_indexer:
                kv += c * ID * elt + min(cfg.index_topk, c) * D * elt
                kv += kind.ring_len * 2 * ID * 2 * elt // kind.compress_rate
            else:
                kv += c * D * elt
    kv *= batch
    return {"weights_dense": dense, "weights_routed": routed, "kv_and_state": kv, "total": dense + routed + kv}


def prefill_flops(model, tokens: int) -> dict:
    """FLOPs a prefill of one `tokens`-token prompt must do (logits of its last token only)."""
    from deepinfer.engine.quant.linear import _QuantLinear

    cfg = model.config
    quantized = {name: m for name, m in model.named_modules() if isinstance(m, _QuantLinear)}
    per_token = 0
    for name, p in model.named_parameters():
        if p.dim() != 2 or name in ("model.embed_tokens.weight", "head.weight") or ".ffn.experts." in name:
            continue
        module, _, attr = name.rpartition(".")
        if module in quantized:  # its codes and scales: count the linear once, at its logical shape
            per_token += _macs(quantized[module]) if attr == "weight" else 0
            continue
        per_token += p.numel()
    ex = model.model.layers[0].ffn.experts[0]
    per_token += cfg.num_experts_per_tok * sum(_macs(getattr(ex, w)) for w in ("w1", "w2", "w3"))
    linear = 2 * tokens * per_token + 2 * cfg.hidden_size * cfg.vocab_size
    NH, D, W = cfg.num_attention_heads, cfg.head_dim, cfg.sliding_window
    t = torch.arange(1, tokens + 1, dtype=torch.float64)  # keys a query at position t-1 may see
    attn = 0.0
    for layer in model.model.layers:
        spec = layer.attn.spec
        keys = t.clamp(max=W)
        if spec.is_compressed:
            c = torch.div(t, spec.compress_rate, rounding_mode="floor")
            if spec.has_indexer:
                attn += float((2 * cfg.index_n_heads * cfg.index_head_dim * c).sum())
                keys = keys + c.clamp(max=cfg.index_topk)
            else:
                keys = keys + c
        attn += float((4 * NH * D * keys).sum())  # q.k and p.v
    return {"linear": float(linear), "attention": attn, "total": float(linear) + attn}


# --------------------------------------------------------------------------- device rates


def copy_rate(device: torch.device, nbytes: int = 1 << 30, iters: int = 10) -> float:
    """Bytes per second of a device-to-device `copy_` (bytes read + bytes written)."""
    if device.type != "cuda":
        nbytes = 1 << 24
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    sync(device)
    return 2 * nbytes * iters / (time.perf_counter() - t0)


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int = 8192, iters: int = 10) -> float:
    """FLOP/s of an `n`^3 matmul in `dtype`."""
    if device.type != "cuda":
        n, iters = 256, 2
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        a @ b
    sync(device)
    return 2 * n**3 * iters / (time.perf_counter() - t0)


# --------------------------------------------------------------------------- decode


class DecodeLoop:
    """Decode steps of `batch` requests over a zeroed cache, starting at `context` tokens each."""

    def __init__(self, model, batch: int, context: int, steps_budget: int, device: torch.device,
                 graphs: bool) -> None:
        self.model, self.batch, self.device = model, batch, device
        self.cache, self.tables = make_cache(model, batch, context + steps_budget + 1, device)
        self.lens = [context] * batch
        g = torch.Generator().manual_seed(batch)
        self.tokens = torch.randint(2, model.config.vocab_size, (batch,), generator=g).tolist()
        self.graphs = None
        if graphs:
            self.graphs = CudaGraphRunner(model, self.cache, (batch,))

    def prepare(self) -> ForwardBatch:
        """The host side of a step: the batch and its attention metadata (what an overlapped scheduler
        does while the previous step runs)."""
        seqs = [SeqChunk(i, self.tables[i], self.lens[i], 1) for i in range(self.batch)]
        batch = ForwardBatch.build([[t] for t in self.tokens], seqs, device=self.device,
                                   logits=list(range(self.batch)))
        batch.attn_metadata = self.model.build_attention_metadata(batch, self.cache)
        return batch

    def step(self) -> None:
        """Blocks for one step: prepare, run (replay when captured), greedy tokens to the host."""
        batch = self.prepare()
        logits = self.graphs.run(batch) if self.graphs is not None else None
        if logits is None:
            logits = self.model.step(batch, self.cache)
        self.tokens = logits.argmax(dim=-1).tolist()  # the step's one host sync
        self.lens = [n + 1 for n in self.lens]

    @torch.no_grad()
    def experts_hit(self) -> list[int]:
        """Distinct routed experts per MoE layer in one eager step (recorded with hooks, then one step run)."""
        hits: list[int] = []
        handles = [layer.ffn.gate.register_forward_hook(lambda m, i, o: hits.append(int(o[1].unique().numel())))
                   for layer in self.model.model.layers]
        graphs, self.graphs = self.graphs, None
        try:
            self.step()
        finally:
            self.graphs = graphs
            for h in handles:
                h.remove()
        return hits


def profile_steps(fn, steps: int, device: torch.device) -> dict:
    """Per-step GPU busy time, kernels, launch calls and the top kernels of `steps` calls of `fn`."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    with profile(activities=acts) as prof:
        for _ in range(steps):
            fn()
        sync(device)
    busy_us = kernels = launches = 0
    rows = []
    for a in prof.key_averages():
        if a.device_type == DeviceType.CUDA:
            t = getattr(a, "self_device_time_total", None)
            t = getattr(a, "self_cuda_time_total", 0) if t is None else t
            busy_us += t
            kernels += a.count
            rows.append((t / steps, a.count / steps, a.key))
        elif a.key in LAUNCH_CALLS:
            launches += a.count
    rows.sort(reverse=True)
    return {"gpu_busy_ms": busy_us / steps / 1000, "kernels_per_step": kernels / steps,
            "launches_per_step": launches / steps,
            "top_kernels": [{"name": k[:120], "us_per_step": round(t, 1), "calls_per_step": c} for t, c, k in rows[:15]]}


def time_steps(fn, steps: int, device: torch.device) -> float:
    """Milliseconds per call of `fn` over `steps` calls."""
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    sync(device)
    return 1000 * (time.perf_counter() - t0) / steps


def decode_case(model, batch: int, context: int, steps: int, device: torch.device, copy_bps: float,
                use_graphs: bool) -> dict:
    warm, prof_steps = 3, 3
    budget = 2 * (warm + steps + prof_steps) + 2
    loop = DecodeLoop(model, batch, context, budget, device, graphs=False)
    hits = loop.experts_hit()
    for _ in range(warm):
        loop.step()
    ms = time_steps(loop.step, steps, device)
    prof = profile_steps(loop.step, prof_steps, device)
    need = decode_bytes(model, batch, context, hits)
    roof_ms = 1000 * need["total"] / copy_bps
    case = {"batch": batch, "context": context, "ms_per_step": ms, "tokens_per_s": 1000 * batch / ms,
            "bytes_per_step": need["total"], "bytes": need, "experts_hit": hits, "roofline_ms": roof_ms,
            "fraction_of_roofline": roof_ms / ms, **prof}
    if use_graphs:
        gloop = DecodeLoop(model, batch, context, budget, device, graphs=True)
        for _ in range(warm):  # the first captures
            gloop.step()
        gms = time_steps(gloop.step, steps, device)
        gprof = profile_steps(gloop.step, prof_steps, device)
        # NOTE: the synchronous loop above pays the host's batch + metadata build and the token read-back
        # in series with the device; split them: the replay alone (inputs copied into the captured buffers,
        # no read-back: the device's time, what an overlapped scheduler sees when its host work is shorter)
        # and the host preparation alone.
        fixed = gloop.prepare()
        replay_ms = time_steps(lambda: gloop.graphs.run(fixed), steps, device)
        prepare_ms = time_steps(gloop.prepare, steps, device)
        case.update(ms_per_step_replay=replay_ms, fraction_of_roofline_replay=roof_ms / replay_ms,
                    ms_host_prepare=prepare_ms)
        case.update(ms_per_step_graphs=gms, fraction_of_roofline_graphs=roof_ms / gms,
                    graph_stats=dict(gloop.graphs.stats), graphs_profile=gprof)
    return case


def prefill_case(model, tokens: int, device: torch.device, matmul_fps: float, iters: int = 2) -> dict:
    cache, tables = make_cache(model, 1, tokens + 1, device)
    g = torch.Generator().manual_seed(tokens)
    ids = torch.randint(2, model.config.vocab_size, (tokens,), generator=g).tolist()

    def run() -> None:
        b = ForwardBatch.build([ids], [SeqChunk(0, tables[0], 0, tokens)], device=device)
        b.attn_metadata = model.build_attention_metadata(b, cache)
        model.step(b, cache).argmax(-1).tolist()

    run()  # warm-up
    ms = time_steps(run, iters, device)
    flops = prefill_flops(model, tokens)
    tflops = flops["total"] / (ms / 1000) / 1e12
    prof = profile_steps(run, 1, device)  # where the prefill's time goes (top kernels)
    return {"tokens": tokens, "ms": ms, "flops": flops, "tflops": tflops, "mfu": tflops * 1e12 / matmul_fps,
            "gpu_busy_ms": prof["gpu_busy_ms"], "kernels": prof["kernels_per_step"],
            "top_kernels": prof["top_kernels"]}


# --------------------------------------------------------------------------- report


def print_table(report: dict) -> None:
    bw = report["copy_tb_s"]
    print(f"\n{report['device']}, torch {report['torch']}, copy {bw:.2f} TB/s, bf16 matmul "
          f"{report['matmul_tflops']:.0f} TFLOP/s, config {report['config']}, weights {report.get('weights', 'bf16')}")
    print(f"| backends (attn/moe) | decode batch | ms per step | tokens/s | GPU busy per step | kernel launches "
          f"per step | bytes a step must read | roofline time at {bw:.1f} TB/s | fraction of roofline | "
          "ms per step (graphs) | fraction (graphs) | graph replay alone | fraction (replay) | host prepare |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for c in report["decode"]:
        g = (f"{c['ms_per_step_graphs']:.2f} | {100 * c['fraction_of_roofline_graphs']:.1f}%"
             if "ms_per_step_graphs" in c else "n/a | n/a")
        g += (f" | {c['ms_per_step_replay']:.2f} | {100 * c['fraction_of_roofline_replay']:.1f}% | "
              f"{c['ms_host_prepare']:.2f} ms" if "ms_per_step_replay" in c else " | n/a | n/a | n/a")
        print(f"| {c['attention_backend']}/{c['moe_backend']} | {c['batch']} | {c['ms_per_step']:.2f} | "
              f"{c['tokens_per_s']:,.0f} | {c['gpu_busy_ms']:.2f} ms | {c['launches_per_step']:,.0f} | "
              f"{c['bytes_per_step'] / 1e9:.2f} GB | {c['roofline_ms']:.2f} ms | "
              f"{100 * c['fraction_of_roofline']:.1f}% | {g} |")
    for p in report["prefill"]:
        print(f"prefill {p['tokens']} tokens ({p['attention_backend']}/{p['moe_backend']}): {p['ms']:.1f} ms, "
              f"{p['flops']['total'] / 1e12:.1f} TFLOP, {p['tflops']:.1f} TFLOP/s, MFU {100 * p['mfu']:.1f}%")
    for c in report["decode"]:
        print(f"\ntop kernels, {c['attention_backend']}/{c['moe_backend']} batch {c['batch']} (eager, per step):")
        for k in c["top_kernels"][:8]:
            print(f"  {k['us_per_step']:9.1f} us  x{k['calls_per_step']:<6g} {k['name'][:90]}")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m deepinfer.benchmarks.gpu_roofline")
    ap.add_argument("--config", default="v4-flash-4l", choices=sorted(CONFIGS))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="1,128")
    ap.add_argument("--context", type=int, default=512, help="tokens each decode request holds")
    ap.add_argument("--steps", type=int, default=10, help="timed decode steps per case")
    ap.add_argument("--prefill-tokens", type=int, default=8192, help="0 skips the prefill case")
    ap.add_argument("--attention-backend", default="torch", help="comma-separated attention backend names")
    ap.add_argument("--moe-backend", default="torch", help="comma-separated MoE backend names")
    ap.add_argument("--weights", default="bf16", choices=sorted(WEIGHTS),
                    help="bf16: every linear in --dtype; published / published-base: DeepSeek's FP8 + FP4 / FP8 layout")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    from deepinfer.engine.models.deepseek_v4_weights import parse_dtype

    device, dtype = torch.device(args.device), parse_dtype(args.dtype)
    cfg = ModelConfig.from_hf_dict(CONFIGS[args.config]())
    t0 = time.perf_counter()
    model = build_model(cfg, device, dtype, weights=args.weights)
    print(f"model built in {time.perf_counter() - t0:.1f}s "
          f"({sum(_nbytes(p) for p in model.parameters()) / 1e9:.2f} GB)", flush=True)
    copy_bps, matmul_fps = copy_rate(device), matmul_rate(device, dtype)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "config": args.config, "dtype": args.dtype, "weights": args.weights, "copy_tb_s": copy_bps / 1e12,
              "matmul_tflops": matmul_fps / 1e12, "decode": [], "prefill": []}
    for attn in args.attention_backend.split(","):
        for moe in args.moe_backend.split(","):
            set_backends(model, attn, moe)
            blockers = graph_blockers(model, make_cache(model, 1, 8, device)[0], device)
            for b in [int(x) for x in args.batches.split(",")]:
                c = decode_case(model, b, args.context, args.steps, device, copy_bps, use_graphs=not blockers)
                c.update(config=args.config, attention_backend=attn, moe_backend=moe, graph_blockers=blockers)
                report["decode"].append(c)
                print(f"{attn}/{moe} batch {b}: {c['ms_per_step']:.2f} ms/step eager"
                      + (f", {c['ms_per_step_graphs']:.2f} with graphs" if "ms_per_step_graphs" in c else
                         f" (no graphs: {'; '.join(blockers)})"), flush=True)
            if args.prefill_tokens:
                p = prefill_case(model, args.prefill_tokens, device, matmul_fps)
                p.update(config=args.config, attention_backend=attn, moe_backend=moe)
                report["prefill"].append(p)
                print(f"{attn}/{moe} prefill {args.prefill_tokens}: {p['ms']:.1f} ms, MFU {100 * p['mfu']:.1f}%, "
                      f"GPU busy {p['gpu_busy_ms']:.1f} ms, {p['kernels']:.0f} kernels; top: "
                      + "; ".join(f"{k['name'][:48]} {k['us_per_step'] / 1000:.1f} ms x{k['calls_per_step']:.0f}"
                                  for k in p["top_kernels"][:8]), flush=True)
    print_table(report)
    out = args.json or (DEFAULT_JSON if device.type == "cuda" else None)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))
        print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
