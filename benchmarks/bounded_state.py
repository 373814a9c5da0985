"""Bounded state on the decode side: sent by the prefill with the KV, or rebuilt by bounded replay.

    python -m deepinfer.benchmarks.bounded_state [--preset small] [--prompt-lens 64,256,1024] [--requests 8]
        [--max-tokens 8] [--threads 1] [--json OUT]

Both modes run the real prefill and decode cores (`PrefillCore`, `DecodeCore`) on two engines in
this process, the KV (and in "send" mode one state slot per request) moved by NIXL over UCX
loopback, on one random-weight checkpoint. For each prompt length, `--requests` requests with
distinct random prompts run one at a time (no batching effects), greedy, `--max-tokens` outputs.
Per request and mode:

- `decode_first_s`: wall time from the decode side receiving the KV (`commit_kv`) to its first
  decoded token (the second output token): bounded replay sits on this path;
- `decode_tokens`: tokens the decode engine computed for the request (replay + decode);
- `bytes`: bytes the NIXL transfer moved (KV blocks, plus the state slot in "send" mode);
- `transfer_s`: prefill-side time from posting the WRITE to its completion.

Outputs of the two modes are compared token for token (they must be equal). Figures are medians.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from deepinfer.decode_worker.core import DecodeCore
from deepinfer.engine.engine import Engine, EngineConfig, RequestOutput
from deepinfer.engine.sampling import SamplingParams
from deepinfer.engine.testing.make_checkpoint import make_checkpoint
from deepinfer.kv_transfer import LOOPBACK_UCX_ENV, KVTransferAgent
from deepinfer.prefill_worker.core import KVDestination, PrefillCore, PrefillWork


def _one(prefill: PrefillCore, decode: DecodeCore, rid: str, prompt: list[int], params: SamplingParams) -> dict:
    """Blocks while one request runs P -> D; returns its timings, tokens and bytes."""
    res = decode.reserve(rid, prompt, params, lease_s=120.0)
    dest = KVDestination(res.peer, res.block_ids, res.transfer_id, 60.0, state_slot=res.state_slot)
    tokens0 = decode.engine.timings["tokens"]
    sent0 = prefill.agent.stats()["kv_transfer_sent_bytes_total"]
    send_s0 = prefill.agent.stats()["kv_transfer_send_seconds_sum"]
    prefill.submit(PrefillWork(rid, prompt, params, dest))
    t_commit = None
    out: RequestOutput | None = None
    first_decoded_s = None
    while out is None:
        prefill.step()
        t_before = time.perf_counter()
        events = decode.step()
        if t_commit is None and res.transfer_id not in decode._by_transfer:
            t_commit = t_before  # the KV landed and was committed during this call
        for ev in events:
            if isinstance(ev, RequestOutput):
                if first_decoded_s is None and len(ev.outputs[0].token_ids) >= 2:
                    first_decoded_s = time.perf_counter() - t_commit
                if ev.finished:
                    out = ev
    stats = prefill.agent.stats()
    return {"token_ids": out.outputs[0].token_ids, "decode_first_s": first_decoded_s,
            "decode_tokens": decode.engine.timings["tokens"] - tokens0,
            "bytes": stats["kv_transfer_sent_bytes_total"] - sent0,
            "transfer_s": stats["kv_transfer_send_seconds_sum"] - send_s0}


def run(args: argparse.Namespace, path: str) -> dict:
    torch.set_num_threads(args.threads)
    cfg = dict(model=path, max_num_seqs=4, max_model_len=max(args.prompt_lens) + args.max_tokens + 8,
               max_num_batched_tokens=max(args.prompt_lens) + 8)
    results = {}
    outputs: dict[str, dict] = {}
    for mode in ("replay", "send"):
        p_eng, d_eng = Engine(EngineConfig(**cfg)), Engine(EngineConfig(**cfg))
        p_agent = KVTransferAgent(f"bench-p-{mode}", p_eng.cache, ucx_env=LOOPBACK_UCX_ENV, send_state=True)
        d_agent = KVTransferAgent(f"bench-d-{mode}", d_eng.cache, ucx_env=LOOPBACK_UCX_ENV,
                                  send_state=mode == "send")
        p_agent.add_peer(d_agent.name, d_agent.metadata(), d_agent.pool_layout())
        prefill, decode = PrefillCore(p_eng, p_agent), DecodeCore(d_eng, d_agent, d_agent.name)
        vocab = p_eng.model_config.vocab_size
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        _one(prefill, decode, "warmup", list(range(2, 66)), params)
        per_len = {}
        for L in args.prompt_lens:
            g = torch.Generator().manual_seed(args.seed + L)
            rows = []
            for i in range(args.requests):
                prompt = torch.randint(2, vocab, (L,), generator=g).tolist()
                r = _one(prefill, decode, f"{mode}-{L}-{i}", prompt, params)
                outputs.setdefault(f"{L}-{i}", {})[mode] = r.pop("token_ids")
                rows.append(r)
            per_len[L] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        results[mode] = per_len
        p_agent.close()
        d_agent.close()
    equal = all(v["replay"] == v["send"] for v in outputs.values())
    return {"preset": args.preset, "threads": args.threads, "requests": args.requests, "max_tokens": args.max_tokens,
            "machine": platform.processor() or platform.machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "outputs_equal": equal, "results": results}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m deepinfer.benchmarks.bounded_state", description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--checkpoint", default=None, help="existing checkpoint (default: write --preset)")
    parser.add_argument("--prompt-lens", type=lambda s: [int(x) for x in s.split(",")], default=[64, 256, 1024])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.checkpoint or str(make_checkpoint(Path(tmp) / args.preset, preset=args.preset, seed=args.seed))
        out = run(args, path)
    print(f"bounded_state: preset={out['preset']} threads={out['threads']} requests/len={out['requests']} "
          f"outputs equal: {out['outputs_equal']}")
    print("| prompt | mode | decode tokens | decode commit->2nd token ms | NIXL bytes | transfer ms |")
    print("|---:|---|---:|---:|---:|---:|")
    for L in next(iter(out["results"].values())):
        for mode, per_len in out["results"].items():
            r = per_len[L]
            print(f"| {L} | {mode} | {r['decode_tokens']:.0f} | {r['decode_first_s'] * 1e3:.1f} | {r['bytes']:.0f} | "
                  f"{r['transfer_s'] * 1e3:.2f} |")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
