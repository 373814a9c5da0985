"""Train the built-in demo DeepSeek-V4 checkpoint (developer-run; CI never trains).

    python -m deploy.demo_model.train [--out engine/testing/demo_model] [--steps 2400] [--threads 2]

Trains a tiny DeepSeek-V4 (4 layers: sliding / CSA / HCA / sliding, hyper-connections, hash and
learned-router MoE, one MTP layer) from `--seed` on the synthetic chat data of
`deploy/demo_model/data.py`, with Hugging Face transformers' `DeepseekV4ForCausalLM` as the
training implementation (plain PyTorch autograd; transformers is a dev/test dependency, never a
runtime one), then writes the checkpoint in deepinfer's format (config.json + model.safetensors,
official tensor names, bf16) and prints held-out accuracies.

Compact vocabulary (exact, not an approximation): the data uses about a thousand of the 129280
token ids. Training runs on a model whose vocabulary is those ids plus ONE shared row `v` that
stands for every other id. With tied embeddings, the exported model gives every unused id the
embedding (and output row) `v`, so its full softmax over 129280 ids equals the compact softmax in
which `v`'s logit gets `+ log(num_unused_ids)`; that is the loss trained here. The hash-routed
layer's `tid2eid` table is expanded the same way (unused ids share `v`'s row).

Multi-token prediction (stored as `mtp.0.*`, see engine/models/deepseek_v4_weights.py): at
position i the MTP layer takes the main model's final hyper-connection streams at i and the
embedding of token i+1 (`x = e_proj(enorm(emb)) + h_proj(hnorm(streams))` per stream), runs one
sliding-window decoder layer with a learned router, collapses with its own `hc_head`, applies its
`norm` and the shared (tied) output head, and predicts token i+2. Its loss is added with weight
`MTP_LOSS_WEIGHT`.

Two-phase use (e.g. to train on another machine without deepseek-recipe): `--save-data F` renders
the dataset and exits; `--data F` trains from that file. `--save-compact F` / `--from-compact F`
keep or reuse the compact trained weights; export and evaluation need deepseek-recipe only for
the held-out prompts.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from deploy.demo_model import data as D

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
VOCAB_SIZE = 129280
ARCH: dict = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 128,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "head_dim": 64,
    "q_lora_rank": 64,
    "o_groups": 2,
    "o_lora_rank": 32,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "hc_mult": 2,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "index_n_heads": 4,
    "index_head_dim": 32,
    "index_topk": 128,
    "sliding_window": 128,
    "compress_rates": {CSA: 4, HCA: 16},
    "layer_types": [SLIDING, CSA, HCA, SLIDING],
    "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
    "partial_rotary_factor": 0.25,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": True,
    "bos_token_id": 0,
    "eos_token_id": 1,
}
"""The exported architecture (transformers-style config dict)."""
CHAT_ENCODING = "v4"
MTP_LOSS_WEIGHT = 0.3
# (task, thinking) -> (share of steps, examples per step)
BUCKETS: dict[tuple[str, bool], tuple[float, int]] = {
    ("add", False): (0.22, 96),
    ("add", True): (0.12, 24),
    ("copy", False): (0.08, 64),
    ("copy", True): (0.05, 24),
    ("reverse", False): (0.15, 64),
    ("reverse", True): (0.07, 24),
    ("tool", False): (0.18, 8),
    ("tool", True): (0.13, 8),
}
# Later stages (`--stage N --init-from PREVIOUS`): the same buckets, weighted towards the content
# tasks (copy, reverse, add) that stage 1 leaves at a format-only plateau; stage 2 leaves the
# (long, slow) tool prompts out, stage 3 brings them back.
STAGE_SHARES: dict[int, dict[tuple[str, bool], float]] = {
    2: {("add", False): 0.20, ("add", True): 0.05, ("copy", False): 0.30, ("copy", True): 0.05,
        ("reverse", False): 0.35, ("reverse", True): 0.05, ("tool", False): 0.0, ("tool", True): 0.0},
    3: {("add", False): 0.15, ("add", True): 0.05, ("copy", False): 0.20, ("copy", True): 0.05,
        ("reverse", False): 0.25, ("reverse", True): 0.05, ("tool", False): 0.15, ("tool", True): 0.10},
}


# --------------------------------------------------------------------------------- data


def build_dataset(steps: int, seed: int, stage: int = 1) -> dict:
    """Render `steps` batches of training examples plus the held-out prompts (token ids)."""
    renderer = D.ChatRenderer()
    rng = random.Random(seed + stage - 1)
    held = D.held_out()
    keys = list(BUCKETS)
    shares = [BUCKETS[k][0] if stage == 1 else STAGE_SHARES[stage][k] for k in keys]
    batches = []
    for _ in range(steps):
        task, thinking = rng.choices(keys, shares)[0]
        batch = []
        for _ in range(BUCKETS[(task, thinking)][1]):
            ex = D.make_example(task, D.training_items(rng, task, held), rng, thinking)
            batch.append((renderer.prompt_ids(ex), renderer.completion_ids(ex)))
        batches.append(batch)
    evals = eval_sets(renderer, held, per_task=None)
    used = {i for b in batches for p, c in b for i in p + c}
    used |= {i for items in evals.values() for p, c, _ in items for i in p + c}
    used = sorted(used | {renderer.eos_id, 0})
    to_compact = {t: i for i, t in enumerate(used)}
    packed = [
        {
            "ids": torch.tensor([to_compact[t] for p, c in b for t in p + c], dtype=torch.int16),
            "prompt_lens": torch.tensor([len(p) for p, _ in b], dtype=torch.int32),
            "lens": torch.tensor([len(p) + len(c) for p, c in b], dtype=torch.int32),
        }
        for b in batches
    ]
    return {"batches": packed, "evals": evals, "used_ids": used}


def eval_sets(renderer: D.ChatRenderer, held: dict, per_task: int | None, seed: int = 7) -> dict:
    """Held-out (prompt ids, completion ids, example) per (task, thinking) evaluation set."""
    rng = random.Random(seed)
    out = {}
    for task in D.TASKS:
        items = held[task]
        if task == "tool":  # every held-out place with every phrasing
            items = [p for p in items for _ in D.TOOL_TEMPLATES]
        for thinking in (False, True):
            chosen = items if per_task is None else items[:per_task]
            exs = [D.make_example(task, item, rng, thinking) for item in chosen]
            out[f"{task}/{'think' if thinking else 'direct'}"] = [
                (renderer.prompt_ids(ex), renderer.completion_ids(ex), ex.answer) for ex in exs
            ]
    return out


# --------------------------------------------------------------------------------- model


def hf_config(vocab_size: int, **changes):
    from transformers import DeepseekV4Config

    return DeepseekV4Config(**{**ARCH, "vocab_size": vocab_size, **changes})


class DemoModel(nn.Module):
    """transformers' DeepseekV4 with a compact vocabulary, plus the MTP layer; training forward only."""

    def __init__(self, num_used: int, seed: int) -> None:
        from transformers import DeepseekV4ForCausalLM
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4DecoderLayer, DeepseekV4HyperHead

        super().__init__()
        torch.manual_seed(seed)
        self.num_used = num_used
        vocab = num_used + 1  # + the shared row of every unused id
        self.config = hf_config(vocab)
        self.lm = DeepseekV4ForCausalLM(self.config)
        self.mtp_config = hf_config(vocab, num_hidden_layers=1, layer_types=[SLIDING], mlp_layer_types=["moe"])
        # the standalone layer dispatches attention / experts like the main model's layers
        self.mtp_config._attn_implementation = self.lm.config._attn_implementation
        self.mtp_config._experts_implementation = getattr(self.lm.config, "_experts_implementation", None)
        h = ARCH["hidden_size"]
        self.mtp_layer = DeepseekV4DecoderLayer(self.mtp_config, 0)
        self.mtp_e_proj = nn.Linear(h, h, bias=False)
        self.mtp_h_proj = nn.Linear(h, h, bias=False)
        self.mtp_enorm = nn.Parameter(torch.ones(h))
        self.mtp_hnorm = nn.Parameter(torch.ones(h))
        self.mtp_norm = nn.Parameter(torch.ones(h))
        self.mtp_hc_head = DeepseekV4HyperHead(self.mtp_config)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for module in [self.mtp_layer, self.mtp_hc_head, self.mtp_e_proj, self.mtp_h_proj]:
                for name, p in module.named_parameters():
                    if name.endswith(("base",)):
                        p.zero_()
                    elif name.endswith("scale") or "norm" in name:
                        p.fill_(1.0)
                    else:
                        p.copy_(torch.randn(p.shape, generator=g) * 0.02)
            for buf in self.mtp_layer.buffers():
                buf.zero_()  # the router's score-correction bias
            e, k = ARCH["n_routed_experts"], ARCH["num_experts_per_tok"]
            for layer in self.lm.model.layers:
                if hasattr(layer.mlp.gate, "tid2eid"):
                    table = torch.rand(vocab, e, generator=g).argsort(dim=1)[:, :k]
                    layer.mlp.gate.tid2eid.copy_(table)
        self.log_unused = math.log(VOCAB_SIZE - num_used)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out = hidden @ self.lm.model.embed_tokens.weight.T
        bias = torch.zeros(out.shape[-1], dtype=out.dtype, device=out.device)
        bias[-1] = self.log_unused
        return out + bias

    def context(self, like: torch.Tensor) -> dict:
        """Causal sliding-window mask and rotary tables for inputs shaped like `like` [B, T, H]."""
        from transformers.masking_utils import create_sliding_window_causal_mask

        m = self.lm.model
        pos = torch.arange(like.shape[1], device=like.device)[None]
        mask = create_sliding_window_causal_mask(config=self.config, inputs_embeds=like, attention_mask=None,
                                                 cache=None, position_ids=pos)
        pe = {"main": m.rotary_emb(like, position_ids=pos, layer_type="main"),
              "compress": m.rotary_emb(like, position_ids=pos, layer_type="compress")}
        return {"mask": mask, "pe": pe, "pos": pos}

    def streams(self, ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """Main model forward up to the final hyper-connection streams [B, T, hc, H]."""
        m = self.lm.model
        emb = m.embed_tokens(ids)
        ctx = self.context(emb)
        x = emb.unsqueeze(2).expand(-1, -1, self.config.hc_mult, -1).contiguous()
        for layer in m.layers:
            x = layer(x, position_embeddings=ctx["pe"], position_ids=ctx["pos"], attention_mask=ctx["mask"],
                      input_ids=ids, cache=None)
        return x, ctx

    def main_hidden(self, streams: torch.Tensor) -> torch.Tensor:
        return self.lm.model.norm(self.lm.model.hc_head(streams))

    def mtp_hidden(self, streams: torch.Tensor, next_ids: torch.Tensor, ctx: dict) -> torch.Tensor:
        """MTP at positions 0..T-2: streams [B, T-1, hc, H] and ids of the next tokens [B, T-1]."""
        eps = ARCH["rms_norm_eps"]
        e = self.mtp_e_proj(_rms(self.lm.model.embed_tokens(next_ids), self.mtp_enorm, eps))
        h = self.mtp_h_proj(_rms(streams, self.mtp_hnorm, eps))
        x = e.unsqueeze(2) + h
        n = x.shape[1]
        mask = ctx["mask"]
        if isinstance(mask, torch.Tensor):
            mask = mask[..., :n, :n]
        pe = {k: (c[:, :n], s[:, :n]) for k, (c, s) in ctx["pe"].items()}
        x = self.mtp_layer(x, position_embeddings=pe, position_ids=ctx["pos"][:, :n], attention_mask=mask,
                           input_ids=next_ids, cache=None)
        return _rms(self.mtp_hc_head(x), self.mtp_norm, eps)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (w * xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def collate(batch: dict, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded compact ids [B, T] and the loss mask of completion positions (predicting ids[t+1])."""
    lens, plens = batch["lens"].tolist(), batch["prompt_lens"].tolist()
    ids = torch.zeros(len(lens), max(lens), dtype=torch.long)
    mask = torch.zeros(len(lens), max(lens), dtype=torch.bool)
    for i, seq in enumerate(batch["ids"].long().split(lens)):
        ids[i, : len(seq)] = seq
        mask[i, plens[i] - 1: len(seq) - 1] = True  # position t predicts token t+1
    return ids.to(device), mask.to(device)


def save_compact(model: DemoModel, used: list[int], path: Path, steps_done: int) -> None:
    torch.save({"used_ids": used, "state_dict": {k: v.cpu() for k, v in model.state_dict().items()},
                "train_seconds": getattr(model, "train_seconds", None), "steps_done": steps_done}, path)


def train(dataset: dict, seed: int, lr: float, device: str, log_every: int = 50,
          checkpoint: Path | None = None, init: dict | None = None, stop_after: int | None = None) -> DemoModel:
    model = DemoModel(len(dataset["used_ids"]), seed)
    if init is not None:
        if init["used_ids"] != dataset["used_ids"]:
            raise ValueError("--init-from model was trained on another vocabulary; render the data with the same seed")
        model.load_state_dict(init["state_dict"])
    model = model.to(device)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.98))
    batches = dataset["batches"]
    steps, warmup = len(batches), min(100, len(batches) // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s / steps, 1.0)))))
    start, run_loss, run_mtp = time.time(), 0.0, 0.0
    for step, batch in enumerate(batches):
        ids, mask = collate(batch, device)
        streams, ctx = model.streams(ids)
        logits = model.logits(model.main_hidden(streams))
        loss = F.cross_entropy(logits[:, :-1][mask[:, :-1]], ids[:, 1:][mask[:, :-1]])
        mtp_mask = mask[:, :-2]  # MTP at t (given token t+1) predicts token t+2
        mtp_logits = model.logits(model.mtp_hidden(streams[:, :-2], ids[:, 1:-1], ctx))
        mtp_loss = F.cross_entropy(mtp_logits[mtp_mask], ids[:, 2:][mtp_mask])
        (loss + MTP_LOSS_WEIGHT * mtp_loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        run_loss += loss.item()
        run_mtp += mtp_loss.item()
        if (step + 1) % log_every == 0 or step + 1 == steps:
            n = (step % log_every) + 1
            print(f"step {step + 1}/{steps} loss {run_loss / n:.4f} mtp {run_mtp / n:.4f} "
                  f"{time.time() - start:.0f}s", flush=True)
            run_loss, run_mtp = 0.0, 0.0
        if stop_after is not None and step + 1 >= stop_after:
            break
        if checkpoint is not None and (step + 1) % 100 == 0:
            save_compact(model, dataset["used_ids"], checkpoint, step + 1)
    model.eval()
    model.train_seconds = time.time() - start
    return model


# --------------------------------------------------------------------------------- eval (compact)


@torch.no_grad()
def greedy_compact(model: DemoModel, prompts: list[list[int]], used: list[int], max_new: int, device) -> list:
    """Greedy continuations (full ids) of `prompts` with the compact model, stopping at EOS; also
    returns, per generated token after the first, whether the MTP's top-1 from the previous
    position agreed with it."""
    to_compact = torch.full((VOCAB_SIZE,), len(used), dtype=torch.long)
    to_compact[torch.tensor(used)] = torch.arange(len(used))
    used_t = torch.tensor(used + [2])  # the shared row never wins in a trained model; map it to a visible id
    outs, agree = [], []
    for start in range(0, len(prompts), 32):
        chunk = [list(p) for p in prompts[start: start + 32]]
        gen = [[] for _ in chunk]
        done = [False] * len(chunk)
        mtp_prev: list = [None] * len(chunk)
        for _ in range(max_new):
            seqs = [p + g for p, g in zip(chunk, gen)]
            T = max(map(len, seqs))
            ids = torch.zeros(len(seqs), T, dtype=torch.long)
            for i, s in enumerate(seqs):
                ids[i, : len(s)] = to_compact[torch.tensor(s)]
            ids = ids.to(device)
            streams, ctx = model.streams(ids)
            last = torch.tensor([len(s) - 1 for s in seqs], device=device)
            rows = torch.arange(len(seqs), device=device)
            nxt = model.logits(model.main_hidden(streams[rows, last][:, None])[:, 0]).argmax(-1)
            # MTP at the last position needs the token just chosen
            ids2 = torch.cat([ids, torch.zeros_like(ids[:, :1])], dim=1)
            ids2[rows, last + 1] = nxt
            ctx2 = model.context(streams[:, :, 0])  # T positions, like the main forward
            mtp = model.logits(model.mtp_hidden(streams, ids2[:, 1:], ctx2)[rows, last]).argmax(-1)
            for i in range(len(seqs)):
                if done[i]:
                    continue
                tok = int(used_t[nxt[i]])
                if mtp_prev[i] is not None:
                    agree.append(mtp_prev[i] == tok)
                gen[i].append(tok)
                mtp_prev[i] = int(used_t[mtp[i]])
                done[i] = tok == 1
            if all(done):
                break
        outs.extend(gen)
    return outs, agree


def evaluate_compact(model: DemoModel, evals: dict, used: list[int], device, limit: int | None = None) -> dict:
    """Exact-match rate of the held-out completions per eval set, plus MTP agreement."""
    result, agree_all = {}, []
    for name, items in evals.items():
        items = items if limit is None else items[:limit]
        gens, agree = greedy_compact(model, [p for p, _, _ in items], used, 72, device)
        result[name] = sum(g == c for g, (_, c, _) in zip(gens, items)) / len(items)
        agree_all += agree
    result["mtp_top1_agreement"] = sum(agree_all) / max(len(agree_all), 1)
    return result


# --------------------------------------------------------------------------------- export


def _hf_named_tensors(module: nn.Module, config) -> dict[str, torch.Tensor]:
    """Checkpoint (official) names of a transformers DeepseekV4 model's tensors, via save_pretrained."""
    from safetensors.torch import load_file
    from transformers import DeepseekV4ForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        if not isinstance(module, DeepseekV4ForCausalLM):
            raise TypeError("expected a DeepseekV4ForCausalLM")
        module.save_pretrained(tmp, safe_serialization=True)
        out = {}
        for f in sorted(Path(tmp).glob("*.safetensors")):
            out.update(load_file(f))
    return out


def export(model: DemoModel, used: list[int], out: Path, dtype: str = "bfloat16") -> Path:
    """Write the full-vocabulary checkpoint (deepinfer's format) to `out`."""
    from transformers import DeepseekV4ForCausalLM
    from transformers.utils import logging as hf_logging

    from engine.config import ModelConfig
    from engine.models.deepseek_v4_weights import checkpoint_spec, mtp_checkpoint_spec
    from engine.testing.make_checkpoint import _write_ours

    hf_logging.set_verbosity_error()
    model = model.cpu().float()
    idx = torch.tensor(used)
    n_used = len(used)

    def expand(t: torch.Tensor) -> torch.Tensor:  # [n_used + 1, ...] -> [VOCAB_SIZE, ...]
        full = t[n_used: n_used + 1].expand(VOCAB_SIZE, *t.shape[1:]).clone()
        full[idx] = t[:n_used]
        return full

    main = _hf_named_tensors(model.lm, model.config)
    tensors = {}
    for name, t in main.items():
        if name == "model.embed_tokens.weight" or name.endswith(".tid2eid"):
            t = expand(t)
        tensors[name] = t
    # the MTP layer: names of a one-layer transformers model, moved under `mtp.0.`
    one = DeepseekV4ForCausalLM(model.mtp_config)
    one.model.layers[0] = model.mtp_layer
    for name, t in _hf_named_tensors(one, model.mtp_config).items():
        if name.startswith("model.layers.0."):
            tensors["mtp.0." + name.removeprefix("model.layers.0.")] = t
    extra = {
        "mtp.0.e_proj.weight": model.mtp_e_proj.weight, "mtp.0.h_proj.weight": model.mtp_h_proj.weight,
        "mtp.0.enorm.weight": model.mtp_enorm, "mtp.0.hnorm.weight": model.mtp_hnorm,
        "mtp.0.norm.weight": model.mtp_norm, "mtp.0.hc_head_fn": model.mtp_hc_head.hc_fn,
        "mtp.0.hc_head_base": model.mtp_hc_head.hc_base, "mtp.0.hc_head_scale": model.mtp_hc_head.hc_scale,
    }
    tensors.update({k: v.detach() for k, v in extra.items()})
    config = ModelConfig.from_hf_dict(ARCH)
    spec = {**checkpoint_spec(config, dtype), **mtp_checkpoint_spec(config, dtype)}
    missing, unexpected = sorted(set(spec) - set(tensors)), sorted(set(tensors) - set(spec))
    if missing or unexpected:
        raise RuntimeError(f"export does not match the checkpoint spec: missing {missing[:5]}, unexpected {unexpected[:5]}")
    tensors = {name: tensors[name].to(spec[name].dtype).contiguous() for name in spec}
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.safetensors"):
        old.unlink()
    hf = {**ARCH, "deepinfer": {"chat_encoding": CHAT_ENCODING}}
    _write_ours(out, hf, tensors, getattr(torch, dtype), 1 << 40)
    return out


# --------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point (see the module docstring)."""
    default_out = Path(__file__).resolve().parents[2] / "engine" / "testing" / "demo_model"
    p = argparse.ArgumentParser(prog="python -m deploy.demo_model.train", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=default_out, help="checkpoint directory to write")
    p.add_argument("--steps", type=int, default=2400, help="optimizer steps")
    p.add_argument("--seed", type=int, default=D.SEED, help="seed of the data stream and the initial weights")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW, cosine to 10%%)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--device", default="cpu", help="torch device to train on")
    p.add_argument("--save-data", type=Path, help="render the dataset to this file and exit")
    p.add_argument("--data", type=Path, help="train from a dataset written by --save-data")
    p.add_argument("--save-compact", type=Path, help="also save the compact trained model here")
    p.add_argument("--from-compact", type=Path, help="skip training: export this compact model")
    p.add_argument("--stage", type=int, default=1, choices=[1, 2, 3], help="data mix (see STAGE_SHARES)")
    p.add_argument("--init-from", type=Path, help="continue training this compact model (stages 2, 3)")
    p.add_argument("--stop-after", type=int, help="stop after this many steps (the schedule still spans --steps)")
    p.add_argument("--eval-limit", type=int, default=None, help="held-out examples per eval set (default all)")
    p.add_argument("--no-export", action="store_true", help="train and evaluate only")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.time()
    if (args.stage > 1) != bool(args.init_from or args.from_compact):
        p.error("--stage 2 and 3 continue a previous stage: give --init-from (and only they take it)")
    dataset = torch.load(args.data) if args.data else build_dataset(args.steps, args.seed, args.stage)
    dataset["batches"] = dataset["batches"][: args.steps]
    print(f"dataset: {len(dataset['batches'])} batches, {len(dataset['used_ids'])} used ids, "
          f"{time.time() - t0:.0f}s", flush=True)
    if args.save_data:
        torch.save(dataset, args.save_data)
        return
    if args.from_compact:
        saved = torch.load(args.from_compact)
        model = DemoModel(len(saved["used_ids"]), args.seed)
        model.load_state_dict(saved["state_dict"])
        model.eval()
        model.train_seconds = saved.get("train_seconds", float("nan"))
        if saved["used_ids"] != dataset["used_ids"]:
            raise SystemExit("--from-compact model and dataset have different vocabularies; use the same --seed/--data")
    else:
        init = torch.load(args.init_from) if args.init_from else None
        model = train(dataset, args.seed, args.lr, args.device, checkpoint=args.save_compact, init=init,
                      stop_after=args.stop_after)
        print(f"trained in {model.train_seconds:.0f}s", flush=True)
        if args.save_compact:
            save_compact(model, dataset["used_ids"], args.save_compact, args.stop_after or len(dataset["batches"]))
    if args.eval_limit != 0:
        scores = evaluate_compact(model, dataset["evals"], dataset["used_ids"], args.device, args.eval_limit)
        print("held-out exact match:", json.dumps(scores, indent=1), flush=True)
    if not args.no_export:
        out = export(model, dataset["used_ids"], args.out)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
