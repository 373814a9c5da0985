"""The step-cost table: seconds of one target forward by (requests, verified tokens), profiled per device.

The verify scheduler (`verify_schedule.choose_verify_lengths`) trades expected accepted tokens
against step time; how a step's time grows with the verified tokens depends on the device and the
model (on a GPU a decode batch is memory bound, so a few more tokens per request are nearly free; on
a CPU every token costs). `profile_step_cost` measures it on the current device: for each number of
requests `B` and drafts per request `d`, one verify forward over `B` chunks of `1 + d` tokens after
`context` tokens each (the batched verify path where the attention backend has it), its logits at
every verified position and their argmax (a small model with a 129k vocabulary spends much of a step
there), best of `repeats`; and, per B, the drafter's step (`draft_seconds`: the MTP's committed pass and
chained drafts with their logits), which every step pays whatever it verifies (`StepCostTable.cost_fn`
adds it; it dilutes what verifying more costs). The host work of a step is in neither. The table is a
grid `seconds[i][j]` over `num_reqs[i]` x `tokens_per_req[j]` (`1 + d`).

File (JSON, `StepCostTable.save` / `load`):

    {"format": "deepinfer-step-cost", "version": 1, "device": ..., "model": ..., "context": ...,
     "date": ..., "num_reqs": [1, 2, 4, ...], "tokens_per_req": [1, 2, 3, 4],
     "draft_seconds": [...], "seconds": [[...], ...]}

`StepCostTable.seconds(num_reqs, num_tokens)` interpolates linearly in tokens per request and in the
number of requests, and beyond the largest profiled batch scales the last row in proportion to the
requests. NOTE: a step whose requests verify different numbers of drafts is priced at its mean tokens
per request (the batched verify path pads every chunk to the longest, so such a step can cost more).
`default_cost_table_path()` is the table shipped with deepinfer (`step_cost_cpu.json`,
the built-in model on the 2-core development VM's CPU); `benchmarks/speculative.py --profile-cost
--json FILE` writes one for the device at hand, and `EngineConfig.verify_cost_table` points the
engine at it.
"""

from __future__ import annotations

import bisect
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

FORMAT = "deepinfer-step-cost"


def default_cost_table_path() -> Path:
    """The CPU table shipped beside this module (the built-in model; 2-core VM)."""
    return Path(__file__).resolve().parent / "step_cost_cpu.json"


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear y(x) through the points, extended linearly past both ends (at least one point)."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass
class StepCostTable:
    """Seconds of one target forward over `num_reqs[i]` requests of `tokens_per_req[j]` tokens each."""

    num_reqs: list[int]
    tokens_per_req: list[int]
    seconds: list[list[float]]
    """[len(num_reqs)][len(tokens_per_req)]."""
    draft_seconds: list[float] | None = None
    """Per `num_reqs[i]`: the step's drafting (the MTP's committed pass and chained drafts with their logits),
    which every step pays whatever it verifies; None = not measured (0)."""
    meta: dict = field(default_factory=dict)
    """Where it was measured: device, model, context, date (informational)."""

    def __post_init__(self) -> None:
        if not self.num_reqs or not self.tokens_per_req:
            raise ValueError("a step-cost table needs at least one batch size and one token count")
        if list(self.num_reqs) != sorted(set(self.num_reqs)) or list(self.tokens_per_req) != sorted(
                set(self.tokens_per_req)):
            raise ValueError("num_reqs and tokens_per_req must be strictly increasing")
        if self.num_reqs[0] < 1 or self.tokens_per_req[0] < 1:
            raise ValueError("num_reqs and tokens_per_req start at 1 or more")
        if len(self.seconds) != len(self.num_reqs) or any(len(r) != len(self.tokens_per_req) for r in self.seconds):
            raise ValueError(f"seconds must be a {len(self.num_reqs)} x {len(self.tokens_per_req)} grid")
        if any(not s > 0 for r in self.seconds for s in r):
            raise ValueError("step costs are positive seconds")
        if self.draft_seconds is not None and (len(self.draft_seconds) != len(self.num_reqs)
                                               or any(s < 0 for s in self.draft_seconds)):
            raise ValueError(f"draft_seconds must be {len(self.num_reqs)} non-negative seconds")

    def seconds_for(self, num_reqs: int, num_tokens: int) -> float:
        """Estimated seconds of a forward over `num_tokens` tokens of `num_reqs` requests (interpolated)."""
        if num_reqs < 1 or num_tokens < num_reqs:
            raise ValueError(f"need num_reqs >= 1 and num_tokens >= num_reqs, got {num_reqs}, {num_tokens}")
        per_req = num_tokens / num_reqs
        rows = [max(_interp(self.tokens_per_req, r, per_req), 1e-9) for r in self.seconds]
        top = self.num_reqs[-1]
        if num_reqs > top:
            return rows[-1] * num_reqs / top
        return max(_interp(self.num_reqs, rows, num_reqs), 1e-9)

    def draft_seconds_for(self, num_reqs: int) -> float:
        """The step's drafting time at `num_reqs` requests (interpolated; 0 when not measured)."""
        if self.draft_seconds is None:
            return 0.0
        top = self.num_reqs[-1]
        if num_reqs > top:
            return self.draft_seconds[-1] * num_reqs / top
        return max(_interp(self.num_reqs, self.draft_seconds, num_reqs), 0.0)

    def cost_fn(self, num_reqs: int):
        """`step_cost(num_tokens)` for a step of `num_reqs` requests (what `choose_verify_lengths` takes): the
        verify forward plus the drafting every step pays (it dilutes what verifying more costs)."""
        draft = self.draft_seconds_for(num_reqs)
        return lambda num_tokens: self.seconds_for(num_reqs, num_tokens) + draft

    def to_dict(self) -> dict:
        d = {"format": FORMAT, "version": 1, **self.meta, "num_reqs": list(self.num_reqs),
             "tokens_per_req": list(self.tokens_per_req)}
        if self.draft_seconds is not None:
            d["draft_seconds"] = [round(x, 7) for x in self.draft_seconds]
        return {**d, "seconds": [list(r) for r in self.seconds]}

    def save(self, path: str | Path) -> None:
        """Write the JSON of the module docstring (one line per field, one row of seconds per line)."""
        d = self.to_dict()
        rows = ",\n  ".join(json.dumps([round(x, 7) for x in r]) for r in d.pop("seconds"))
        body = ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in d.items())
        with open(path, "w") as f:
            f.write("{\n" + body + f',\n "seconds": [\n  {rows}\n ]\n}}\n')

    @classmethod
    def from_dict(cls, d: dict) -> StepCostTable:
        if d.get("format") != FORMAT:
            raise ValueError(f"not a step-cost table (format {d.get('format')!r}); write one with "
                             "`python -m deepinfer.benchmarks.speculative --profile-cost --json FILE`")
        keys = ("format", "version", "num_reqs", "tokens_per_req", "seconds", "draft_seconds")
        meta = {k: v for k, v in d.items() if k not in keys}
        draft = d.get("draft_seconds")
        return cls([int(b) for b in d["num_reqs"]], [int(t) for t in d["tokens_per_req"]],
                   [[float(s) for s in r] for r in d["seconds"]], None if draft is None else [float(x) for x in draft],
                   meta)

    @classmethod
    def load(cls, path: str | Path) -> StepCostTable:
        """The table in the JSON file `path`; ValueError naming the file when it is not one (bad JSON, a missing
        or malformed field, a grid that does not fit its axes)."""
        try:
            with open(path) as f:
                d = json.load(f)
            if not isinstance(d, dict):
                raise ValueError("not a JSON object")
            return cls.from_dict(d)
        except (ValueError, KeyError, TypeError) as e:  # json.JSONDecodeError is a ValueError
            what = f"missing field {e}" if isinstance(e, KeyError) else str(e)
            hint = "" if "--profile-cost" in what else (
                "; write one with `python -m deepinfer.benchmarks.speculative --profile-cost --json FILE`")
            raise ValueError(f"{path}: not a valid step-cost table ({what}){hint}") from None


@torch.inference_mode()
def profile_step_cost(model, num_reqs: Sequence[int], max_drafts: int, context: int = 256, repeats: int = 3,
                      seed: int = 0, log=None) -> StepCostTable:
    """Blocks while measuring one verify forward per (B in `num_reqs`, 1 + d tokens, d = 0 .. `max_drafts`).

    `model`: a loaded target (`Engine.model`). Each B gets a fresh cache whose B slots hold `context`
    random tokens; then every (B, d) cell restores that state and times `build_attention_metadata`,
    the batched-verify regrouping (when the attention backend has it and B > 1), the forward and the logits
    (+ argmax) of every position; the best of `repeats` interleaved runs counts (wall time on a GPU, the
    process's CPU time on the CPU: run it with one torch thread there), and each row is made
    non-decreasing in tokens per request (noise can put a cell below its left neighbour). With the
    model's MTP layer, `draft_seconds[i]` times the drafter's step for B requests (`MTPDrafter.propose`
    of `max_drafts` drafts after one committed position each). Cells are in seconds."""
    from deepinfer.engine.cache.kv_cache import V4KVCache
    from deepinfer.engine.forward_batch import ForwardBatch, SeqChunk
    from deepinfer.engine.spec_decode.verify_rows import batch_verify_chunks

    mc = model.config
    device = model.model.embed_tokens.weight.device
    dtype = model.model.embed_tokens.weight.dtype
    supports = any(getattr(getattr(m, "backend", None), "supports_verify_rows", False) for m in model.modules())
    from deepinfer.engine.cache.layout import default_block_size

    bs = default_block_size(mc.compress_rates.values())
    g = torch.Generator().manual_seed(seed)
    vocab_hi = min(mc.vocab_size, 5000)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    # NOTE: on the CPU, the process's CPU time: on a shared host, wall time mostly measures the neighbours
    clock = time.perf_counter if device.type == "cuda" else time.process_time

    sizes = [int(b) for b in num_reqs]
    tokens = list(range(1, max_drafts + 2))
    grid, draft_seconds = [], []
    for B in sizes:
        per_seq = -(-(context + max_drafts + 1) // bs)
        cache = V4KVCache(mc, per_seq * B, bs, B, dtype=dtype, device=device)
        tables = [list(range(per_seq * s, per_seq * (s + 1))) for s in range(B)]
        for s in range(B):
            ids = torch.randint(10, vocab_hi, (context,), generator=g).tolist()
            model(ForwardBatch.build([ids], [SeqChunk(s, tables[s], 0, context, 0)], device=device), cache)
        state = {k: v.clone() for k, v in cache.state_tensors().items()}
        best = [float("inf")] * len(tokens)
        for _ in range(repeats):
            for j, n in enumerate(tokens):
                batch = ForwardBatch.build([torch.randint(10, vocab_hi, (n,), generator=g).tolist() for _ in range(B)],
                                           [SeqChunk(s, tables[s], context, n, 0) for s in range(B)], device=device)
                for k, v in cache.state_tensors().items():
                    v.copy_(state[k])
                sync()
                t0 = clock()
                meta = model.build_attention_metadata(batch, cache)
                if supports and n > 1 and B > 1:
                    batch_verify_chunks(meta, set(range(B)))
                hidden = model(batch, cache, meta)  # [B * n, H]
                model.compute_logits(hidden).argmax(dim=-1)  # every verified position is sampled
                sync()
                best[j] = min(best[j], clock() - t0)
        # NOTE: more tokens never cost less; on a noisy host a cell can come out below its left neighbour
        grid.append([max(best[:j + 1]) for j in range(len(best))])
        if getattr(model, "mtp", None):
            draft_seconds.append(_time_drafting(model, B, max_drafts, context, repeats, clock, sync, g, vocab_hi))
        if log is not None:
            log({"num_reqs": B, "tokens_per_req": tokens, "ms": [round(s * 1e3, 3) for s in best],
                 "draft_ms": round(draft_seconds[-1] * 1e3, 3) if draft_seconds else None})
    meta = {"device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
            "context": context, "repeats": repeats, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    return StepCostTable(sizes, tokens, grid, draft_seconds or None, meta)


def _time_drafting(model, B: int, num_drafts: int, context: int, repeats: int, clock, sync, g, vocab_hi: int) -> float:
    """Best-of-`repeats` seconds of `MTPDrafter.propose` for B requests at one committed position each."""
    from deepinfer.engine.spec_decode.mtp_drafter import DraftSeq, MTPDrafter

    drafter = MTPDrafter(model, B, num_drafts)
    mc = model.config
    weight = model.model.embed_tokens.weight
    streams = torch.randn(B, mc.hc_mult, mc.hidden_size, generator=g).to(weight)  # [B, hc, H]
    seqs = [DraftSeq(b, context, [b], [int(torch.randint(10, vocab_hi, (1,), generator=g))], context, True)
            for b in range(B)]
    best = float("inf")
    for _ in range(repeats):
        sync()
        t0 = clock()
        drafter.propose(streams, seqs)
        sync()
        best = min(best, clock() - t0)
    return best


def load_cost_table(spec: str | None, device: str = "cpu") -> StepCostTable | None:
    """`EngineConfig.verify_cost_table` resolved: a path -> that table; "linear" -> None (the linear
    stand-in); None -> the shipped CPU table on a CPU device (when present), else None."""
    if spec == "linear":
        return None
    if spec is not None:
        if not Path(spec).is_file():
            raise ValueError(f"verify_cost_table={spec!r} is not a file; write one with `python -m "
                             "deepinfer.benchmarks.speculative --profile-cost --json FILE` or leave it unset")
        return StepCostTable.load(spec)
    path = default_cost_table_path()
    if torch.device(device).type == "cpu" and path.is_file():
        return StepCostTable.load(path)
    return None
