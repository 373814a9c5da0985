"""Issue 30's multi-GPU run in one call: an expert-parallel instance over the GPUs of one host against one GPU.

    python -m deepinfer.benchmarks.multi_gpu_ep [--device cuda|cpu] [--ranks N] [--json OUT] [--quick]
        [--moe-backend torch] [--time-budget-s 540]

(`deploy/device/multi_gpu_ep.sh` wraps it for a device call: NVLink multicast off, JSON under $OUT.)

Three steps, each catching and recording its own failure in the JSON (so one failing step does not lose the
others' figures); the JSON is rewritten after every step (a run killed at its time limit keeps what it had), and a
step that would start after `--time-budget-s` is recorded as skipped.

1. **correctness** (`correctness`): a V4-Flash-shaped random checkpoint (`ckpt_config`: `gpu_roofline.v4_flash_4l`'s
   real widths - hidden 4096, 64 heads x 512, vocab 129280, experts of width 2048, top-6 - on 4 layers SWA, SWA,
   CSA, HCA, with `max(16, 4 N)` routed experts so they split over N ranks; `--quick`: the `tiny` preset with 8
   experts) written by `engine.testing.make_checkpoint`, then greedy tokens of a few prompts from three engines, in
   this order: one process, `expert_parallel_size=N` with N redundant experts and EPLB every 2 steps
   (`num_redundant_experts`, `eplb_interval_steps`), and `expert_parallel_size=N` without (the EP engines get
   `max_num_batched_tokens` x N: the same prefill tokens per rank per step). Per prompt: equal or the first
   differing position.
   Batch-invariant numerics on the CPU (bit-identical expected); on CUDA off by default (`--batch-invariant`), so
   bf16 near-ties may flip a late greedy token: the first differing position says how late.
2. **all-to-all** (`alltoall`): N fresh rank processes (NCCL on CUDA, gloo on the CPU; `engine.distributed.group`),
   one MoE layer of real V4-Flash sizes (256 experts of width 2048, hidden 4096, top-6, bf16; each rank builds only
   its own experts) through `engine.moe.ep_backend.ExpertParallelMoEBackend` with the `AllToAllDispatcher`, at
   decode batch 1, 32, 128 tokens per rank and prefill 4096 tokens per rank, routing uniform (`--zipf 0`; reuses
   `benchmarks.expert_parallel.skewed_popularity` / `skewed_batch`). The dispatcher and the inner backend are wrapped
   to synchronise the device at each phase's edges, so the backend's own phase timers
   (`ExpertParallelMoEBackend.timings`) read device time: dispatch (the count exchange + rows + ids, and the wait for
   the slowest rank), expert compute, combine. Per size: mean over ranks per layer, the slowest rank's expert time,
   and the bytes each rank sends per dispatch.
3. **decode** (`decode`): decode tokens/s per GPU of the EP engine (from step 1) against the one-GPU engine at the
   same per-GPU batch (`--decode-batches`, requests of `--context` prompt tokens, greedy, every request running:
   the timed steps start once every request has its first token; no batch starts after `--decode-budget-s`, so the
   EP engine still runs when the one-GPU figures were slow), eager on both (`enforce_eager`: the EP
   dispatcher is not graph-safe, so both run the same path), and the fraction of the HBM roofline per GPU
   (`benchmarks.gpu_roofline.decode_bytes` over rank 0's model with the experts the step hit on the busiest rank,
   against `gpu_roofline.copy_rate`).

Prints a markdown table for BENCHMARKS.md and writes `--json`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
import traceback
from pathlib import Path

import torch

from deepinfer.benchmarks.expert_parallel import skewed_batch, skewed_popularity
from deepinfer.benchmarks.gpu_roofline import copy_rate, decode_bytes, sync, v4_flash_4l

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
"""NVLink multicast stays off on the shared GPU hosts (device docs): set in this process, inherited by every rank."""


# ------------------------------------------------------------------ sizes


def sizes(args: argparse.Namespace) -> dict:
    """Every size the run uses (`--quick`: tiny, for the CPU smoke test)."""
    if args.quick:
        return {"prompts": 3, "prompt_len": 12, "max_tokens": 6, "tokens": [1, 4], "prefill_tokens": 32,
                "hidden": 64, "inter": 32, "experts": 8, "topk": 2, "steps": 3, "warmup": 1,
                "decode_batches": [1, 2], "context": 12, "decode_steps": 3, "decode_warmup": 1}
    return {"prompts": 4, "prompt_len": 64, "max_tokens": 24, "tokens": [1, 32, 128], "prefill_tokens": 4096,
            "hidden": 4096, "inter": 2048, "experts": 256, "topk": 6, "steps": 20, "warmup": 3,
            "decode_batches": [1, 32, 128], "context": 512, "decode_steps": 10, "decode_warmup": 3}


def ckpt_config(ranks: int, quick: bool) -> dict:
    """The correctness checkpoint's transformers-style config: real V4-Flash widths on 4 layers with
    max(16, 4 N) routed experts (rounded up to a multiple of N), or the `tiny` preset with 8 experts (`quick`); no MTP layer."""
    from deepinfer.engine.testing.presets import get_preset

    if quick:
        return {**get_preset("tiny").hf_config(), "n_routed_experts": -(-max(8, 2 * ranks) // ranks) * ranks,
                "num_nextn_predict_layers": 0}
    return {**v4_flash_4l(), "n_routed_experts": -(-max(16, 4 * ranks) // ranks) * ranks}


# ------------------------------------------------------------------ step 2: all-to-all vs expert compute


class _SyncedDispatcher:
    """A `Dispatcher` that synchronises the device before and after each collective, so the EP backend's host
    timers around `dispatch` / `combine` read the collective's device time."""

    def __init__(self, inner, device: torch.device) -> None:
        self.inner, self.device = inner, device
        self.world_size, self.rank = inner.world_size, inner.rank

    def dispatch(self, x, dest_rank, local_ids):
        sync(self.device)
        out = self.inner.dispatch(x, dest_rank, local_ids)
        sync(self.device)
        return out

    def combine(self, y, handle):
        sync(self.device)
        out = self.inner.combine(y, handle)
        sync(self.device)
        return out


def _alltoall_rank(rank: int, p: dict, port: int, out) -> None:
    """One rank of step 2 (a spawned process); rank 0 puts the gathered figures on `out`."""
    import torch.distributed as dist

    from deepinfer.engine.distributed.group import GroupAddress, backend_for, join_group, leave_group, rank_device
    from deepinfer.engine.models.deepseek_v4 import Expert
    from deepinfer.engine.moe.base import get_moe_backend
    from deepinfer.engine.moe.ep_backend import AllToAllDispatcher, ExpertParallelMoEBackend, ExpertPlacement

    os.environ.update(MULTICAST_OFF)
    device = rank_device(p["device"], rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dtype = getattr(torch, p["dtype"])
    W, E, k, H = p["ranks"], p["experts"], p["topk"], p["hidden"]
    ctrl = join_group(GroupAddress("127.0.0.1", port, W, backend_for(p["device"])), rank)
    try:
        placement = ExpertPlacement.contiguous(E, W, 0)
        local = placement.local_experts(rank)
        torch.manual_seed(1000 + rank)
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                built = {e: Expert(H, p["inter"], limit=10.0).requires_grad_(False) for e in local}
        finally:
            torch.set_default_dtype(prev)
        experts = [built.get(e, built[local[0]]) for e in range(E)]  # only the local ones are read
        inner = get_moe_backend(p["moe_backend"])()
        backend = ExpertParallelMoEBackend(inner, _SyncedDispatcher(AllToAllDispatcher(world_size=W, rank=rank),
                                                                    device), placement)
        backend.prepare(experts)
        inner_forward = inner.forward

        def synced_forward(*a):
            y = inner_forward(*a)
            sync(device)
            return y

        inner.forward = synced_forward
        pop = skewed_popularity(E, p["zipf"], seed=0)
        cases = {}
        with torch.inference_mode():
            for T in p["tokens"]:
                batches = [skewed_batch(pop, T, k, H, seed=s * 7919 + rank) for s in range(p["steps"] + p["warmup"])]
                batches = [(x.to(device, dtype), w.to(device), i.to(device)) for x, w, i in batches]
                for x, w, i in batches[:p["warmup"]]:
                    backend(x, w, i)
                backend.reset_counts()
                sync(device)
                t0 = time.perf_counter()
                for x, w, i in batches[p["warmup"]:]:
                    backend(x, w, i)
                sync(device)
                cases[T] = {"timings": dict(backend.timings), "recv_rows": backend.num_recv_rows,
                            "wall_s": time.perf_counter() - t0}
        gathered = [None] * W if rank == 0 else None
        dist.gather_object(cases, gathered, dst=0, group=ctrl)
        if rank == 0:
            n, elt = p["steps"], torch.empty(0, dtype=dtype).element_size()
            res = []
            for T in p["tokens"]:
                tm = [g[T]["timings"] for g in gathered]
                res.append({
                    "tokens_per_rank": T, "phase": "prefill" if T == p["prefill_tokens"] else "decode",
                    "dispatch_ms": 1e3 * statistics.mean(t["dispatch"] for t in tm) / n,
                    "experts_ms": 1e3 * statistics.mean(t["experts"] for t in tm) / n,
                    "experts_max_ms": 1e3 * max(t["experts"] for t in tm) / n,
                    "combine_ms": 1e3 * statistics.mean(t["combine"] for t in tm) / n,
                    "layer_ms": 1e3 * max(g[T]["wall_s"] for g in gathered) / n,
                    "dispatch_bytes_per_rank": T * k * H * elt,
                    "recv_rows_per_rank": [g[T]["recv_rows"] / n for g in gathered],  # mean per step
                })
            out.put({"cases": res})
    except BaseException as e:  # rank 0's failure reaches the parent; the others' show as a timeout there
        if rank == 0:
            out.put({"error": f"rank {rank}: {e!r}", "traceback": traceback.format_exc()})
        raise
    finally:
        leave_group()


def run_alltoall(args: argparse.Namespace, sz: dict) -> dict:
    """Blocks while step 2's N rank processes run; their figures."""
    import torch.multiprocessing as mp

    from deepinfer.engine.distributed.group import free_port

    p = {"device": args.device, "ranks": args.ranks, "experts": sz["experts"], "topk": sz["topk"],
         "hidden": sz["hidden"], "inter": sz["inter"], "tokens": [*sz["tokens"], sz["prefill_tokens"]],
         "prefill_tokens": sz["prefill_tokens"], "steps": sz["steps"], "warmup": sz["warmup"], "zipf": args.zipf,
         "moe_backend": args.moe_backend, "dtype": "bfloat16" if args.device == "cuda" else "float32"}
    if p["experts"] % args.ranks:
        raise ValueError(f"{p['experts']} experts do not split over {args.ranks} ranks")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_alltoall_rank, args=(r, p, port, out), daemon=True) for r in range(args.ranks)]
    for proc in procs:
        proc.start()
    try:
        res = out.get(timeout=args.step_timeout_s)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.terminate()
    if "error" in res:
        raise RuntimeError(res["error"] + "\n" + res["traceback"])
    return {"params": p, **res}


# ------------------------------------------------------------------ steps 1 and 3: engines


def _prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (length,), generator=g).tolist() for _ in range(num)]


def greedy_tokens(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Blocks until every prompt has its `max_tokens` greedy tokens."""
    from deepinfer.engine import SamplingParams

    for i, prompt in enumerate(prompts):
        engine.add_request(f"c{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = list(o.outputs[0].token_ids)
    return [out[f"c{i}"] for i in range(len(prompts))]


def compare(ref: list[list[int]], got: list[list[int]]) -> dict:
    """Per prompt: None when equal, else the first differing position."""
    first = []
    for a, b in zip(ref, got):
        diff = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        first.append(diff if diff is not None or len(a) == len(b) else min(len(a), len(b)))
    return {"equal": all(f is None for f in first), "first_difference": first}


def _gate_hits(engine, run_step) -> list[int]:
    """Distinct routed experts per MoE layer in one step of a one-process engine (hooks on the gates)."""
    hits: list[int] = []
    handles = [layer.ffn.gate.register_forward_hook(lambda m, i, o: hits.append(int(o[1].unique().numel())))
               for layer in engine.model.model.layers]
    try:
        run_step()
    finally:
        for h in handles:
            h.remove()
    return hits


def _ep_hits(engine, ranks: int, run_step) -> list[int]:
    """Per MoE layer: distinct experts one step hit on the busiest rank of a multi-rank engine (contiguous
    placement, no redundant experts: rank r holds experts [r E / N, (r + 1) E / N))."""
    engine.executor.expert_loads(reset=True)
    run_step()
    loads = engine.executor.expert_loads(reset=True).per_rank
    hits = []
    for layer in range(len(loads[0])):
        counts = [sum(r[layer].expert_counts[e] for r in loads) for e in range(len(loads[0][layer].expert_counts))]
        per = len(counts) // ranks
        hits.append(max(sum(1 for c in counts[r * per:(r + 1) * per] if c) for r in range(ranks)))
    return hits


def decode_throughput(engine, ranks: int, per_gpu_batch: int, context: int, steps: int, warmup: int,
                      vocab: int, copy_bps: float | None) -> dict:
    """Blocks while `per_gpu_batch * ranks` greedy requests decode; tokens/s per GPU over `steps` timed steps
    after every request has its first token and `warmup` more steps."""
    from deepinfer.engine import SamplingParams

    n = per_gpu_batch * ranks
    prompts = _prompts(n, context, vocab, seed=per_gpu_batch)
    total = warmup + steps + 4
    ids = [f"d{per_gpu_batch}-{i}" for i in range(n)]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, SamplingParams(max_tokens=total, temperature=0.0, ignore_eos=True))
    got = dict.fromkeys(ids, 0)

    def step() -> int:
        before = sum(got.values())
        for o in engine.step():
            got[o.request_id] = len(o.outputs[0].token_ids)
        return sum(got.values()) - before

    try:
        prefill_steps = 0
        while min(got.values()) == 0:
            step()
            prefill_steps += 1
        for _ in range(warmup):
            step()
        device = engine.model.model.embed_tokens.weight.device
        sync(device)
        t0 = time.perf_counter()
        tokens = sum(step() for _ in range(steps))
        sync(device)
        ms = 1e3 * (time.perf_counter() - t0) / steps
        res = {"per_gpu_batch": per_gpu_batch, "requests": n, "ms_per_step": ms, "tokens_per_step": tokens / steps,
               "tokens_per_s": tokens / steps / ms * 1e3, "tokens_per_s_per_gpu": tokens / steps / ms * 1e3 / ranks,
               "prefill_steps": prefill_steps}
        if copy_bps:
            try:
                hits = _ep_hits(engine, ranks, step) if ranks > 1 else _gate_hits(engine, step)
                ctx = context + warmup + steps + 1
                need = decode_bytes(engine.model, per_gpu_batch, ctx, hits)
                roof_ms = 1e3 * need["total"] / copy_bps
                res.update(bytes_per_gpu=need, experts_hit_busiest_rank=hits, roofline_ms=roof_ms,
                           fraction_of_roofline=roof_ms / ms)
            except Exception as e:  # the figure is optional; the throughput stands
                res["roofline_error"] = repr(e)
        return res
    finally:
        for rid in ids:
            engine.abort_request(rid)
        while engine.has_unfinished_requests():
            engine.step()


def engine_phase(args: argparse.Namespace, sz: dict, ckpt: str, vocab: int, *, ranks: int, eplb: bool,
                 decode: bool) -> dict:
    """One engine: greedy tokens of the correctness prompts, then (`decode`) the decode throughput per batch."""
    from deepinfer.engine.engine import Engine

    kw = dict(model=ckpt, device=args.device, dtype="bfloat16" if args.device == "cuda" else "float32",
              max_num_seqs=max(sz["prompts"], max(sz["decode_batches"]) * ranks),
              max_num_batched_tokens=8192 * ranks,  # the same prefill tokens per rank per step as one GPU
              max_model_len=sz["context"] + 64, async_scheduling=args.async_scheduling == "on", enforce_eager=True,
              batch_invariant=args.batch_invariant, moe_backend=args.moe_backend,
              attention_backend=args.attention_backend)
    if ranks > 1:
        kw["expert_parallel_size"] = ranks
    if eplb:
        kw.update(num_redundant_experts=ranks, eplb_interval_steps=2)
    t0 = time.perf_counter()
    engine = Engine(**kw)
    res: dict = {"start_s": time.perf_counter() - t0}
    try:
        res["tokens"] = greedy_tokens(engine, _prompts(sz["prompts"], sz["prompt_len"], vocab, seed=0),
                                      sz["max_tokens"])
        if ranks > 1:
            res["imbalance"] = engine.executor.expert_loads().imbalance
        if decode:
            res["decode"] = []
            for b in sz["decode_batches"]:
                if time.monotonic() > args.decode_deadline:
                    res["decode"].append({"per_gpu_batch": b, "error": "skipped: past the decode time budget"})
                    continue
                try:
                    res["decode"].append(decode_throughput(engine, ranks, b, sz["context"], sz["decode_steps"],
                                                           sz["decode_warmup"], vocab, args.copy_bps))
                except Exception as e:
                    res["decode"].append({"per_gpu_batch": b, "error": repr(e), "traceback": traceback.format_exc()})
    finally:
        engine.shutdown()
        del engine
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return res


# ------------------------------------------------------------------ the run


def machine_info(args: argparse.Namespace) -> dict:
    info = {"host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "device": args.device,
            "ranks": args.ranks, **{k: os.environ.get(k) for k in MULTICAST_OFF}}
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                                        cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except Exception:
        info["commit"] = None
    info["commit"] = info["commit"] or os.environ.get("DEEPINFER_COMMIT")  # a device copy of the tree has no .git
    if args.device == "cuda":
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        try:
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:
            info["nccl"] = None
    return info


def run(args: argparse.Namespace) -> dict:
    """Runs the steps in order, each recorded (figures, or its error) in the report; writes `--json` after each."""
    os.environ.update(MULTICAST_OFF)
    sz = sizes(args)
    report: dict = {"benchmark": "multi_gpu_ep", "machine": machine_info(args), "sizes": sz, "steps": {}}
    deadline = time.monotonic() + args.time_budget_s
    args.decode_deadline = time.monotonic() + args.decode_budget_s

    def save() -> None:
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(report, indent=1, default=str))

    def step(name: str, fn) -> object:
        if time.monotonic() > deadline:
            report["steps"][name] = {"skipped": f"time budget of {args.time_budget_s} s spent"}
            save()
            return None
        t0 = time.perf_counter()
        try:
            value = fn()
            report["steps"][name] = {"ok": True, "seconds": time.perf_counter() - t0}
        except BaseException as e:  # noqa: BLE001 - every step's failure is recorded, the run goes on
            if isinstance(e, KeyboardInterrupt):
                raise
            value = None
            report["steps"][name] = {"ok": False, "seconds": time.perf_counter() - t0, "error": repr(e),
                                     "traceback": traceback.format_exc()}
            print(f"[multi_gpu_ep] step {name} failed: {e!r}", flush=True)
        save()
        return value

    report["alltoall"] = step("alltoall", lambda: run_alltoall(args, sz))
    # one HBM rate for every engine's roofline (cuda:0; every GPU of the host is the same kind)
    args.copy_bps = report["copy_bytes_per_s"] = step("copy_rate", lambda: copy_rate(torch.device(args.device)))
    with tempfile.TemporaryDirectory(prefix="multi-gpu-ep-") as tmp:
        cfg = ckpt_config(args.ranks, args.quick)
        report["checkpoint"] = {k: cfg[k] for k in ("hidden_size", "moe_intermediate_size", "num_hidden_layers",
                                                    "n_routed_experts", "num_experts_per_tok", "vocab_size")}

        def make() -> str:
            from deepinfer.engine.testing.make_checkpoint import make_checkpoint

            return str(make_checkpoint(Path(tmp) / "v4flash", preset=cfg, seed=3,
                                       dtype="bfloat16" if args.device == "cuda" else "float32"))

        ckpt = step("checkpoint", make)
        engines = {}
        if ckpt is not None:
            vocab = cfg["vocab_size"]
            engines["one"] = step("engine_one", lambda: engine_phase(args, sz, ckpt, vocab, ranks=1, eplb=False,
                                                                     decode=True))
            # EPLB before the EP engine's decode figures: correctness first when the time budget runs short
            engines["ep_eplb"] = step("engine_ep_eplb", lambda: engine_phase(args, sz, ckpt, vocab,
                                                                             ranks=args.ranks, eplb=True,
                                                                             decode=False))
            engines["ep"] = step("engine_ep", lambda: engine_phase(args, sz, ckpt, vocab, ranks=args.ranks,
                                                                   eplb=False, decode=True))
    report["engines"] = engines
    corr = {}
    one, ep, eplb = engines.get("one"), engines.get("ep"), engines.get("ep_eplb")
    if one and ep:
        corr["ep_vs_one"] = compare(one["tokens"], ep["tokens"])
    if one and eplb:
        corr["ep_eplb_vs_one"] = compare(one["tokens"], eplb["tokens"])
    if ep and eplb:
        corr["eplb_vs_no_eplb"] = compare(ep["tokens"], eplb["tokens"])
        corr["imbalance_no_eplb"], corr["imbalance_eplb"] = ep.get("imbalance"), eplb.get("imbalance")
    report["correctness"] = corr
    report["decode"] = [{"per_gpu_batch": a.get("per_gpu_batch"), "one": a, "ep": b}
                        for a, b in zip((one or {}).get("decode", []), (ep or {}).get("decode", []))]
    save()
    return report


def _f(x, fmt: str = ".2f") -> str:
    return "n/a" if x is None else format(x, fmt)


def format_report(r: dict) -> str:
    """The markdown for BENCHMARKS.md."""
    m = r["machine"]
    lines = [f"Multi-GPU EP run: {m['ranks']} ranks on {m['device']} ({', '.join(m.get('gpus', [])) or m['host']}), "
             f"{m['date']}, commit {m.get('commit')}, torch {m['torch']}, NCCL {m.get('nccl')}; "
             f"NCCL_NVLS_ENABLE={m.get('NCCL_NVLS_ENABLE')}", ""]
    lines += ["| step | result | seconds |", "|---|---|---|"]
    for name, s in r["steps"].items():
        state = "skipped: " + s["skipped"] if "skipped" in s else ("ok" if s["ok"] else "FAILED: " + s["error"][:120])
        lines.append(f"| {name} | {state} | {_f(s.get('seconds'), '.1f')} |")
    c = r.get("correctness", {})
    ck = r.get("checkpoint", {})
    lines += ["", f"Correctness (checkpoint: hidden {ck.get('hidden_size')}, {ck.get('num_hidden_layers')} layers, "
              f"{ck.get('n_routed_experts')} experts of width {ck.get('moe_intermediate_size')} top-"
              f"{ck.get('num_experts_per_tok')}, vocab {ck.get('vocab_size')}):", "",
              "| comparison | greedy tokens equal | first differing position per prompt |", "|---|---|---|"]
    for key, label in (("ep_vs_one", f"EP {m['ranks']} vs one process"), ("eplb_vs_no_eplb", "EPLB on vs off"),
                       ("ep_eplb_vs_one", f"EP {m['ranks']} with EPLB vs one process")):
        if key in c:
            lines.append(f"| {label} | {c[key]['equal']} | {c[key]['first_difference']} |")
        else:
            lines.append(f"| {label} | not run | |")
    if c.get("imbalance_eplb") is not None and c.get("imbalance_no_eplb") is not None:
        lines.append(f"\nImbalance (max / mean rows per rank per MoE layer): EPLB off "
                     f"{[round(x, 3) for x in c['imbalance_no_eplb'] or []]}, on "
                     f"{[round(x, 3) for x in c['imbalance_eplb']]}")
    a = r.get("alltoall")
    if a:
        p = a["params"]
        lines += ["", f"All-to-all per MoE layer ({p['experts']} experts top-{p['topk']}, hidden {p['hidden']}, "
                  f"width {p['inter']}, {p['dtype']}, {p['moe_backend']} experts, routing Zipf {p['zipf']}, "
                  f"{p['steps']} steps):", "",
                  "| phase | tokens/rank | dispatch ms | experts ms (mean / slowest) | combine ms | layer ms | "
                  "dispatch MB/rank | (dispatch + combine) / experts |", "|---|---|---|---|---|---|---|---|"]
        for x in a["cases"]:
            ratio = (x["dispatch_ms"] + x["combine_ms"]) / x["experts_ms"] if x["experts_ms"] else None
            lines.append(f"| {x['phase']} | {x['tokens_per_rank']} | {x['dispatch_ms']:.3f} | "
                         f"{x['experts_ms']:.3f} / {x['experts_max_ms']:.3f} | {x['combine_ms']:.3f} | "
                         f"{x['layer_ms']:.3f} | {x['dispatch_bytes_per_rank'] / 1e6:.2f} | {_f(ratio)} |")
    if r.get("decode"):
        lines += ["", "Decode (greedy, eager, every request running):", "",
                  "| per-GPU batch | one GPU tok/s | EP tok/s per GPU | EP / one | one GPU ms/step | EP ms/step | "
                  "roofline fraction one / EP |", "|---|---|---|---|---|---|---|"]
        for d in r["decode"]:
            o, e = d["one"], d["ep"]
            if "error" in o or "error" in e:
                lines.append(f"| {d['per_gpu_batch']} | {o.get('error', '')[:60]} | {e.get('error', '')[:60]} "
                             "| | | | |")
                continue
            lines.append(f"| {d['per_gpu_batch']} | {o['tokens_per_s_per_gpu']:.1f} | {e['tokens_per_s_per_gpu']:.1f} "
                         f"| {e['tokens_per_s_per_gpu'] / o['tokens_per_s_per_gpu']:.3f} | {o['ms_per_step']:.2f} | "
                         f"{e['ms_per_step']:.2f} | {_f(o.get('fraction_of_roofline'), '.3g')} / "
                         f"{_f(e.get('fraction_of_roofline'), '.3g')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m deepinfer.benchmarks.multi_gpu_ep",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--ranks", type=int, default=None, help="EP group size (default: every visible GPU; 2 on CPU)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (the CPU smoke test)")
    parser.add_argument("--moe-backend", default="torch", help="the experts' backend (engine and step 2)")
    parser.add_argument("--attention-backend", default="torch", help="the engines' attention backend")
    parser.add_argument("--async-scheduling", choices=("on", "off"), default="off",
                        help="the engines' overlapped scheduling (EP instances overlap steps since 2026-12-05)")
    parser.add_argument("--zipf", type=float, default=0.0, help="step 2's routing skew (0: uniform)")
    parser.add_argument("--batch-invariant", choices=("auto", "on", "off"), default="auto",
                        help="engines' batch-invariant numerics (auto: on for the CPU, off for CUDA)")
    parser.add_argument("--time-budget-s", type=float, default=540.0, help="no step starts after this")
    parser.add_argument("--decode-budget-s", type=float, default=420.0,
                        help="no decode batch starts after this (leaves time for the later engines)")
    parser.add_argument("--step-timeout-s", type=float, default=300.0, help="step 2's wait for its ranks")
    args = parser.parse_args(argv)
    if args.ranks is None:
        args.ranks = torch.cuda.device_count() if args.device == "cuda" else 2
    if args.ranks < 1:
        raise SystemExit("--ranks must be at least 1 (no GPU visible?)")
    if args.device == "cuda" and args.ranks > torch.cuda.device_count():
        raise SystemExit(f"--ranks {args.ranks} but {torch.cuda.device_count()} GPUs visible")
    args.batch_invariant = {"on": True, "off": False, "auto": args.device == "cpu"}[args.batch_invariant]
    report = run(args)
    print(format_report(report), flush=True)
    return report


if __name__ == "__main__":
    main()
