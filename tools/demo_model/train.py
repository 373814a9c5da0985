"""Train the built-in demo DeepSeek-V4 checkpoint (developer-run; CI never trains).

    python -m deepinfer.tools.demo_model.train [--out engine/builtin_model] [--steps 2400] [--threads 2]

Trains a tiny DeepSeek-V4 (4 layers: sliding / CSA / HCA / sliding, hyper-connections, hash and
learned-router MoE, one MTP layer) from `--seed` on the synthetic chat data of
`tools/demo_model/data.py`, with Hugging Face transformers' `DeepseekV4ForCausalLM` as the
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
import re
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.tools.demo_model import data as D

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
IMAGE_TOKEN_ID = 129264
"""deepseek_recipe.IMAGE_SPECIAL_TOKEN_ID: each image placeholder expands to N of these."""
VISION: dict = {
    "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_channels": 3, "image_size": 546, "patch_size": 14, "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6, "attention_dropout": 0.0, "merge_size": 3, "projector_hidden_size": 256,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
}
"""The vision tower's config block (see engine/models/vision.py for the layout it defines)."""
CHAT_ENCODING = "v4"
MTP_LOSS_WEIGHT = 0.3
PRETRAINED_LR_SCALE = 0.3
"""Learning-rate scale of a warm-started text model's weights (stage 4)."""
# (task, thinking) -> (share of steps, examples per step)
BUCKETS: dict[tuple[str, bool], tuple[float, int]] = {
    ("add", False): (0.20, 96),
    ("add", True): (0.10, 24),
    ("copy", False): (0.06, 64),
    ("copy", True): (0.06, 24),
    ("reverse", False): (0.10, 64),
    ("reverse", True): (0.07, 24),
    ("tool", False): (0.12, 8),
    ("tool", True): (0.10, 8),
    ("image", False): (0.13, 8),
    ("image", True): (0.06, 8),
    ("json", False): (0.0, 48),  # JSON mode: stage 15 onwards
    ("json", True): (0.0, 24),
}
IMAGE_TASK_SHARES = {"colour": 0.25, "shape": 0.35, "describe": 0.2, "two": 0.2}
NUM_TRAIN_PICTURES = 4000
"""Distinct training pictures (each asked about many times); their recipe-preprocessed WEBP bytes
are stored in the dataset."""
# Later stages (`--stage N --init-from PREVIOUS`): the same buckets, weighted towards the content
# tasks (copy, reverse, add) that stage 1 leaves at a format-only plateau; stage 2 leaves the
# (long, slow) tool prompts out, stage 3 brings them back.
STAGE_SHARES: dict[int, dict[tuple[str, bool], float]] = {
    2: {("add", False): 0.20, ("add", True): 0.05, ("copy", False): 0.30, ("copy", True): 0.05,
        ("reverse", False): 0.35, ("reverse", True): 0.05, ("tool", False): 0.0, ("tool", True): 0.0,
        ("image", False): 0.0, ("image", True): 0.0},
    3: {("add", False): 0.15, ("add", True): 0.05, ("copy", False): 0.15, ("copy", True): 0.05,
        ("reverse", False): 0.20, ("reverse", True): 0.05, ("tool", False): 0.12, ("tool", True): 0.08,
        ("image", False): 0.10, ("image", True): 0.05},
    # stage 4 (`--init-from-checkpoint` an exported text model): the vision tower, the wider tool
    # names and the tasks the text model was weakest at
    4: {("add", False): 0.14, ("add", True): 0.09, ("copy", False): 0.03, ("copy", True): 0.06,
        ("reverse", False): 0.03, ("reverse", True): 0.06, ("tool", False): 0.13, ("tool", True): 0.12,
        ("image", False): 0.22, ("image", True): 0.12},
    # stage 5 (`--init-from` a stage-4 model): pictures asked the way the API renders them, shapes
    5: {("add", False): 0.12, ("add", True): 0.08, ("copy", False): 0.03, ("copy", True): 0.06,
        ("reverse", False): 0.03, ("reverse", True): 0.06, ("tool", False): 0.06, ("tool", True): 0.06,
        ("image", False): 0.35, ("image", True): 0.15},
    # stage 6 (`--init-from-checkpoint` a stage-5 export, everything loaded; usually after
    # `--tower-steps`): names in the copy lists, the tool task, thinking mode, addition, shapes
    6: {("add", False): 0.14, ("add", True): 0.10, ("copy", False): 0.04, ("copy", True): 0.08,
        ("reverse", False): 0.04, ("reverse", True): 0.08, ("tool", False): 0.14, ("tool", True): 0.12,
        ("image", False): 0.16, ("image", True): 0.10},
    # stage 7 (like 6, from a stage-6 export): mostly addition
    7: {("add", False): 0.35, ("add", True): 0.10, ("copy", False): 0.04, ("copy", True): 0.05,
        ("reverse", False): 0.04, ("reverse", True): 0.05, ("tool", False): 0.08, ("tool", True): 0.05,
        ("image", False): 0.16, ("image", True): 0.08},
    # stage 8 (like 6, usually with --structured-embeddings): addition, tool calls and thinking mode
    8: {("add", False): 0.18, ("add", True): 0.12, ("copy", False): 0.03, ("copy", True): 0.07,
        ("reverse", False): 0.03, ("reverse", True): 0.07, ("tool", False): 0.14, ("tool", True): 0.12,
        ("image", False): 0.15, ("image", True): 0.09},
    # stage 9 (from scratch, text only): copying across many names (lists, tool calls) and addition
    9: {("add", False): 0.20, ("add", True): 0.10, ("copy", False): 0.10, ("copy", True): 0.08,
        ("reverse", False): 0.08, ("reverse", True): 0.06, ("tool", False): 0.22, ("tool", True): 0.16,
        ("image", False): 0.0, ("image", True): 0.0},
    # stage 10 (from a stage-9 model, `--init-from`): copying first (lists, tool calls), some addition
    10: {("add", False): 0.10, ("add", True): 0.05, ("copy", False): 0.25, ("copy", True): 0.05,
         ("reverse", False): 0.15, ("reverse", True): 0.05, ("tool", False): 0.25, ("tool", True): 0.10,
         ("image", False): 0.0, ("image", True): 0.0},
    # stage 11 (from a stage-10 model, `--init-from`): mostly addition, keeping the copying
    11: {("add", False): 0.40, ("add", True): 0.12, ("copy", False): 0.06, ("copy", True): 0.06,
         ("reverse", False): 0.04, ("reverse", True): 0.06, ("tool", False): 0.14, ("tool", True): 0.12,
         ("image", False): 0.0, ("image", True): 0.0},
    # stage 12 (from a text-only stage-10 / 11 model, `--init-from`, after `--tower-steps`): the
    # pictures, addition, and the copying kept up
    12: {("add", False): 0.20, ("add", True): 0.08, ("copy", False): 0.04, ("copy", True): 0.04,
         ("reverse", False): 0.03, ("reverse", True): 0.04, ("tool", False): 0.09, ("tool", True): 0.06,
         ("image", False): 0.30, ("image", True): 0.12},
    # stage 13 (from a stage-10 model, `--init-from`): like 11 with more copying kept in the mix
    13: {("add", False): 0.30, ("add", True): 0.08, ("copy", False): 0.10, ("copy", True): 0.06,
         ("reverse", False): 0.06, ("reverse", True): 0.06, ("tool", False): 0.20, ("tool", True): 0.14,
         ("image", False): 0.0, ("image", True): 0.0},
    # stage 14 (from a stage-12 model, `--init-from`, low lr): pictures and tool calls polished,
    # addition and the lists kept
    14: {("add", False): 0.10, ("add", True): 0.04, ("copy", False): 0.04, ("copy", True): 0.04,
         ("reverse", False): 0.03, ("reverse", True): 0.03, ("tool", False): 0.18, ("tool", True): 0.10,
         ("image", False): 0.30, ("image", True): 0.14},
    # stage 15 (from a stage-14 model, `--init-from`; its vocabulary may differ from the data's, see
    # `reindex_vocabulary`): JSON mode, thinking-mode sums (restated, not digit by digit), tool calls,
    # everything else kept
    15: {("add", False): 0.08, ("add", True): 0.12, ("copy", False): 0.04, ("copy", True): 0.04,
         ("reverse", False): 0.03, ("reverse", True): 0.05, ("tool", False): 0.16, ("tool", True): 0.12,
         ("image", False): 0.15, ("image", True): 0.10, ("json", False): 0.06, ("json", True): 0.05},
    # stage 16 (from a stage-15 model, `--init-from`): like 15, more JSON mode and thinking mode
    16: {("add", False): 0.06, ("add", True): 0.12, ("copy", False): 0.03, ("copy", True): 0.03,
         ("reverse", False): 0.03, ("reverse", True): 0.03, ("tool", False): 0.16, ("tool", True): 0.14,
         ("image", False): 0.10, ("image", True): 0.06, ("json", False): 0.10, ("json", True): 0.14},
    # stage 17 (from a stage-16 model, `--init-from`, low lr): tool calls, everything else kept
    17: {("add", False): 0.05, ("add", True): 0.08, ("copy", False): 0.04, ("copy", True): 0.03,
         ("reverse", False): 0.03, ("reverse", True): 0.03, ("tool", False): 0.30, ("tool", True): 0.15,
         ("image", False): 0.10, ("image", True): 0.05, ("json", False): 0.06, ("json", True): 0.08},
    # stage 18 (`--init-from-checkpoint` the shipped export, everything loaded; with the guards of
    # `--freeze-known-rows` / `--distill`): JSON mode and the restated thinking-mode sums added to a
    # model that has the rest, every old task kept in the mix
    18: {("add", False): 0.06, ("add", True): 0.14, ("copy", False): 0.03, ("copy", True): 0.04,
         ("reverse", False): 0.03, ("reverse", True): 0.05, ("tool", False): 0.14, ("tool", True): 0.12,
         ("image", False): 0.10, ("image", True): 0.07, ("json", False): 0.10, ("json", True): 0.12},
    # stage 19 (from a stage-18 model, `--init-from`, with `--distill`): like 18, weighted towards the new tasks
    19: {("add", False): 0.05, ("add", True): 0.18, ("copy", False): 0.02, ("copy", True): 0.03,
         ("reverse", False): 0.02, ("reverse", True): 0.04, ("tool", False): 0.12, ("tool", True): 0.10,
         ("image", False): 0.07, ("image", True): 0.05, ("json", False): 0.12, ("json", True): 0.20},
    # stage 20 (from a stage-18 / 19 model, `--init-from`, low lr, `--distill` with the tool buckets in
    # `--distill-skip`): tool calls, everything else held to the initial model
    20: {("add", False): 0.04, ("add", True): 0.08, ("copy", False): 0.04, ("copy", True): 0.03,
         ("reverse", False): 0.03, ("reverse", True): 0.03, ("tool", False): 0.32, ("tool", True): 0.18,
         ("image", False): 0.06, ("image", True): 0.04, ("json", False): 0.06, ("json", True): 0.09},
}
"""Later stages' bucket shares; a bucket a stage leaves out gets none of its steps."""
NEW_TASK_BUCKETS = ("json/direct", "json/think", "add/think")
"""Buckets whose rendering changed after the shipped checkpoint was trained (DATA8 -> DATA9): `--distill`
does not hold the model to its old answers there."""
CONTINUING_STAGES = (2, 3, 5, *range(10, 18), 20)
"""Stages that continue a previous stage's compact model (`--init-from`, and only they take it)."""


# --------------------------------------------------------------------------------- data


POOL_SIZES = {"add": 16000, "copy": 8000, "reverse": 8000, "tool": 6000, "image": 8000, "json": 8000}
"""Rendered training examples per (task, thinking) bucket; training samples its batches from these."""


def build_dataset(seed: int, num_names: int = D.NUM_NAME_POOL, name_share: float = 0.5,
                  pool_sizes: dict[str, int] | None = None, list_names: int = 2) -> dict:
    """Render the training example pools plus the held-out prompts (token ids; image prompts expanded
    to recipe's image token count, their pictures stored as recipe-preprocessed WEBP bytes).
    `num_names`, `name_share`, `list_names`: see `D.name_pool` and `D.training_items`; `pool_sizes` overrides
    entries of `POOL_SIZES`."""
    renderer = D.ChatRenderer()
    rng = random.Random(seed)
    held = D.held_out()
    names = D.name_pool(num_names)
    sizes = {**POOL_SIZES, **(pool_sizes or {})}
    held_pics = set(D.held_out_pictures())
    pictures: list[D.Picture] = []
    while len(pictures) < NUM_TRAIN_PICTURES:
        pic = D.random_picture(random.Random(seed * 7919 + len(pictures)))
        if pic not in held_pics:
            pictures.append(pic)
    infos = [renderer.preprocess(p.png()) for p in pictures]
    image_tasks, image_shares = list(IMAGE_TASK_SHARES), list(IMAGE_TASK_SHARES.values())
    pools: dict[tuple[str, bool], list] = {}
    for task, thinking in BUCKETS:
        pool = pools[(task, thinking)] = []
        for _ in range(sizes[task]):
            if task == "image":
                itask = rng.choices(image_tasks, image_shares)[0]
                idx = [rng.randrange(len(pictures)) for _ in range(2 if itask == "two" else 1)]
                ex = D.make_image_example(itask, tuple(pictures[i] for i in idx), rng, thinking,
                                          with_history=rng.random() < 0.3)
                pool.append((renderer.expand_images(renderer.prompt_ids(ex), [infos[i] for i in idx]),
                             renderer.completion_ids(ex), idx))
            else:
                ex = D.make_example(task, D.training_items(rng, task, held, names, name_share, list_names), rng, thinking)
                pool.append((renderer.prompt_ids(ex), renderer.completion_ids(ex), []))
    evals, eval_images = eval_sets(renderer, held, per_task=None)
    used = {i for pool in pools.values() for p, c, _ in pool for i in p + c}
    used |= {i for items in evals.values() for p, c, _, _ in items for i in p + c}
    used = sorted(used | {renderer.eos_id, 0})
    to_compact = {t: i for i, t in enumerate(used)}
    packed = {
        key: {  # one flat tensor per pool (small to store and ship)
            "ids": torch.tensor([to_compact[t] for p, c, _ in pool for t in p + c], dtype=torch.int16),
            "lens": torch.tensor([len(p) + len(c) for p, c, _ in pool], dtype=torch.int32),
            "prompt_lens": torch.tensor([len(p) for p, _, _ in pool], dtype=torch.int32),
            "image_idx": [idx for _, _, idx in pool],
        }
        for key, pool in pools.items()
    }
    return {"pools": packed, "evals": evals, "used_ids": used, "images": [i.data for i in infos],
            "eval_images": eval_images, "image_labels": _labels(pictures), "eval_image_labels": _labels(D.held_out_pictures())}


def _labels(pictures: list[D.Picture]) -> list[tuple[int, int]]:
    """(colour index, shape index) of each picture, for the tower warm-up."""
    return [(D.COLOURS.index(p.colour), D.SHAPES.index(p.shape)) for p in pictures]


def save_dataset(dataset: dict, path: Path) -> None:
    """torch.save the dataset; `.xz` paths are LZMA-compressed (to ship to a training machine)."""
    if str(path).endswith(".xz"):
        import lzma

        with lzma.open(path, "wb", preset=6) as f:
            torch.save(dataset, f)
    else:
        torch.save(dataset, path)


def load_dataset(path: Path) -> dict:
    """Read a dataset written by `save_dataset`."""
    if str(path).endswith(".xz"):
        import lzma

        with lzma.open(path, "rb") as f:
            return torch.load(f, weights_only=False)
    return torch.load(path, weights_only=False)


def sample_batches(dataset: dict, steps: int, seed: int, stage: int = 1, batch_scale: int = 1):
    """Yield `steps` training batches drawn from the pools (one bucket per step, by stage shares)."""
    rng = random.Random(seed * 31 + stage)
    keys = list(BUCKETS)
    shares = [BUCKETS[k][0] if stage == 1 else STAGE_SHARES[stage].get(k, 0.0) for k in keys]
    seqs_of = {key: pool["ids"].split(pool["lens"].tolist()) for key, pool in dataset["pools"].items()}
    for _ in range(steps):
        key = rng.choices(keys, shares)[0]
        pool = dataset["pools"][key]
        chosen = [rng.randrange(len(pool["lens"])) for _ in range(BUCKETS[key][1] * batch_scale)]
        seqs = [seqs_of[key][i] for i in chosen]
        yield {
            "bucket": f"{key[0]}/{'think' if key[1] else 'direct'}",
            "ids": torch.cat(seqs),
            "prompt_lens": pool["prompt_lens"][chosen],
            "lens": torch.tensor([len(x) for x in seqs], dtype=torch.int32),
            "image_idx": torch.tensor([j for i in chosen for j in pool["image_idx"][i]], dtype=torch.int32),
        }


def eval_sets(renderer: D.ChatRenderer, held: dict, per_task: int | None, seed: int = 7) -> tuple[dict, list]:
    """Held-out (prompt ids, completion ids, answer, image indices) per (task, thinking) evaluation
    set, and the held-out pictures' WEBP bytes the image indices point into."""
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
                (renderer.prompt_ids(ex), renderer.completion_ids(ex), ex.answer, []) for ex in exs
            ]
    pics = D.held_out_pictures()
    infos = [renderer.preprocess(p.png()) for p in pics]
    for itask in D.IMAGE_TASKS:
        for thinking in (False, True):
            items = []
            for i in range(len(pics) if per_task is None else min(per_task, len(pics))):
                idx = [i, (i * 7 + 3) % len(pics)] if itask == "two" else [i]
                ex = D.make_image_example(itask, tuple(pics[j] for j in idx), rng, thinking,
                                          with_history=i % 4 == 3)
                prompt = renderer.expand_images(renderer.prompt_ids(ex), [infos[j] for j in idx])
                items.append((prompt, renderer.completion_ids(ex), ex.answer, idx))
            out[f"image-{itask}/{'think' if thinking else 'direct'}"] = items
    return out, [i.data for i in infos]


# --------------------------------------------------------------------------------- model


class StructuredEmbedding(nn.Module):
    """Training-time parameterization of the (tied) embedding table by what its tokens share.

    A word used both with and without its leading space (" Paris" / "Paris") gets one row per word
    plus a shared spacing vector: e(" X") = w[X] + s, e("X") = w[X] - s. A number token (0-999; the
    V4 tokenizer writes numbers as unspaced tokens of at most three digits) is the sum of one row per
    digit place: e("85") = ones[5] + tens[8] + hundreds[none]. Every other row stays free. Copying a
    name into a tool call (" Paris" in the question -> "Paris" in the call) and carrying digits then
    work for every word and number the same way, instead of per token pair learned one by one.

    A structured row may also carry a per-token residual (the free table's row, see `table()`),
    which training decays towards zero (`--structure-decay`): warm-starting from a trained table
    keeps what it knew at first and moves it onto the shared structure gradually.

    It only shapes training: `table()` builds the ordinary [rows, H] table, which is what is saved
    and exported (the checkpoint format does not change)."""

    NONE = 10  # the digit class of an absent tens / hundreds place

    def __init__(self, tokens: list[str], hidden: int) -> None:
        super().__init__()
        present = set(tokens)
        words: dict[str, int] = {}
        kind, group, sign, digits = [], [], [], []
        for tok in tokens:
            core = tok[1:] if tok.startswith("\u0120") else tok
            if re.fullmatch(r"[0-9]{1,3}", tok) and (tok == "0" or not tok.startswith("0")):
                kind.append(2)
                group.append(0)
                sign.append(0.0)
                d = [int(c) for c in reversed(tok)] + [self.NONE] * (3 - len(tok))
                digits.append(d)
            elif core and "\u0120" + core in present and core in present:
                kind.append(1)
                group.append(words.setdefault(core, len(words)))
                sign.append(1.0 if tok.startswith("\u0120") else -1.0)
                digits.append([self.NONE] * 3)
            else:
                kind.append(0)
                group.append(0)
                sign.append(0.0)
                digits.append([self.NONE] * 3)
        self.register_buffer("kind", torch.tensor(kind + [0]))  # + the shared row of unused ids: free
        self.register_buffer("group", torch.tensor(group + [0]))
        self.register_buffer("sign", torch.tensor(sign + [0.0]))
        self.register_buffer("digits", torch.tensor(digits + [[self.NONE] * 3]))
        self.words = nn.Parameter(torch.zeros(max(len(words), 1), hidden))
        self.space = nn.Parameter(torch.zeros(hidden))
        self.places = nn.Parameter(torch.zeros(3, self.NONE + 1, hidden))
        self.num_words = len(words)

    def table(self, free: torch.Tensor) -> torch.Tensor:
        """The embedding table [rows, H]: free rows from `free`; structured rows built, plus their
        residual (their row of `free`)."""
        word = self.words[self.group] + self.sign[:, None] * self.space
        number = sum(self.places[i][self.digits[:, i]] for i in range(3))
        kind = self.kind[:, None]
        return free + torch.where(kind == 0, 0.0, torch.where(kind == 1, word, number))

    @torch.no_grad()
    def randomize(self, free: torch.Tensor, std: float, seed: int = 0) -> None:
        """From-scratch start: seeded random word / spacing / digit-place rows (a built row has about
        the free rows' scale), structured rows' residual in `free` zeroed."""
        g = torch.Generator().manual_seed(seed)
        self.words.copy_(torch.randn(self.words.shape, generator=g) * std)
        self.space.copy_(torch.randn(self.space.shape, generator=g) * std * 0.5)
        self.places.copy_(torch.randn(self.places.shape, generator=g) * std / math.sqrt(3))
        free[self.kind != 0] = 0.0

    @torch.no_grad()
    def decay_residual(self, free: torch.Tensor, rate: float) -> None:
        """Shrink the structured rows' residual in `free` by `rate` (1: drop it)."""
        free[self.kind != 0] *= 1.0 - rate

    @torch.no_grad()
    def fit(self, table: torch.Tensor) -> float:
        """Least-squares fit of the structured parameters to an existing table (warm start), leaving
        the misfit in `table`'s structured rows as their residual (so `table(table)` equals the
        table it was given); returns the misfit's relative size."""
        n = len(self.kind)
        cols = self.num_words + 1 + 3 * (self.NONE + 1)
        design = torch.zeros(n, cols, dtype=torch.float64)
        rows = torch.arange(n)
        is_word, is_num = self.kind == 1, self.kind == 2
        design[rows[is_word], self.group[is_word]] = 1.0
        design[rows[is_word], self.num_words] = self.sign[is_word].double()
        for i in range(3):
            design[rows[is_num], self.num_words + 1 + i * (self.NONE + 1) + self.digits[is_num, i]] = 1.0
        keep = is_word | is_num
        sol = torch.linalg.lstsq(design[keep], table[keep].double().cpu(), driver="gelsd").solution.to(table)
        self.words.copy_(sol[: self.num_words])
        self.space.copy_(sol[self.num_words])
        self.places.copy_(sol[self.num_words + 1:].view(3, self.NONE + 1, -1))
        total = table[keep].norm()
        table[keep] -= self.table(torch.zeros_like(table))[keep]
        return float(table[keep].norm() / total)


def hf_config(vocab_size: int, **changes):
    from transformers import DeepseekV4Config

    return DeepseekV4Config(**{**ARCH, "vocab_size": vocab_size, **changes})


class DemoModel(nn.Module):
    """transformers' DeepseekV4 with a compact vocabulary, plus the MTP layer; training forward only."""

    def __init__(self, num_used: int, seed: int, image_compact_id: int | None = None) -> None:
        from transformers import DeepseekV4ForCausalLM, SiglipVisionConfig, SiglipVisionModel
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4DecoderLayer, DeepseekV4HyperHead

        from deepinfer.engine.models.vision import VisionConfig, VisionProjector

        super().__init__()
        torch.manual_seed(seed)
        self.num_used = num_used
        self.image_compact_id = image_compact_id
        hf_keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_channels",
                   "image_size", "patch_size", "hidden_act", "layer_norm_eps", "attention_dropout")
        self.vit = SiglipVisionModel(SiglipVisionConfig(**{k: VISION[k] for k in hf_keys}, vision_use_head=False))
        self.vision_config = VisionConfig(**VISION)
        self.projector = VisionProjector(self.vision_config, ARCH["hidden_size"])
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
        self.structure: StructuredEmbedding | None = None

    def embedding_table(self) -> torch.Tensor:
        """The tied embedding / output table [num_used + 1, H] (built from `structure` when set)."""
        free = self.lm.model.embed_tokens.weight
        return free if self.structure is None else self.structure.table(free)

    def structure_embeddings(self, tokens: list[str], fresh: bool = False) -> float:
        """Switch to `StructuredEmbedding` (`tokens`: the used ids' token strings), fitted to the
        current table (`fresh`: a model that has not trained yet gets seeded random structure rows
        instead and its structured rows' residual starts at zero); returns the fit's relative error."""
        self.structure = StructuredEmbedding(tokens, ARCH["hidden_size"]).to(self.lm.model.embed_tokens.weight.device)
        if not fresh:
            return self.structure.fit(self.lm.model.embed_tokens.weight)
        self.structure.randomize(self.lm.model.embed_tokens.weight, std=self.config.initializer_range)
        return 0.0

    @torch.no_grad()
    def materialize_embeddings(self) -> None:
        """Write the structured table into the plain embedding and drop the structure."""
        if self.structure is not None:
            self.lm.model.embed_tokens.weight.copy_(self.embedding_table())
            self.structure = None

    def mtp_head_params(self) -> dict[str, nn.Parameter]:
        """The MTP layer's tensors outside its decoder layer, by checkpoint name under `mtp.0.`."""
        return {"e_proj.weight": self.mtp_e_proj.weight, "h_proj.weight": self.mtp_h_proj.weight,
                "enorm.weight": self.mtp_enorm, "hnorm.weight": self.mtp_hnorm, "norm.weight": self.mtp_norm,
                "hc_head_fn": self.mtp_hc_head.hc_fn, "hc_head_base": self.mtp_hc_head.hc_base,
                "hc_head_scale": self.mtp_hc_head.hc_scale}

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out = hidden @ self.embedding_table().T
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

    def image_embeds(self, pixels: torch.Tensor) -> torch.Tensor:
        """Tower output of equal-size images [n, 3, H, W] (normalized) -> [n * tokens per image, H]."""
        feats = self.vit(pixel_values=pixels, interpolate_pos_encoding=True).last_hidden_state
        rows, cols = pixels.shape[-2] // 42, pixels.shape[-1] // 42
        return self.projector(feats, rows, cols).flatten(0, 1)

    def streams(self, ids: torch.Tensor, image_embeds: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
        """Main model forward up to the final hyper-connection streams [B, T, hc, H]; `image_embeds`
        [num image tokens, H] replace the image token positions in order."""
        m = self.lm.model
        emb = F.embedding(ids, self.embedding_table())
        if image_embeds is not None:
            emb = emb.masked_scatter((ids == self.image_compact_id)[..., None], image_embeds.to(emb.dtype))
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
        e = self.mtp_e_proj(_rms(F.embedding(next_ids, self.embedding_table()), self.mtp_enorm, eps))
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


def init_from_checkpoint(model: DemoModel, path: Path, used: list[int], seed: int,
                         everything: bool = False) -> torch.Tensor:
    """Start the text model from an exported checkpoint (full vocabulary) instead of random weights:
    its layers as they are, its embedding rows of `used` (ids it never used share one row; those get
    small seeded noise so they can part), its shared row as the compact `v` row, and fresh seeded
    hash-routing rows for the ids it never used. The MTP layer and the vision tower start fresh
    unless `everything` (then they are loaded too). Returns which of `used` were new to the checkpoint
    ([len(used)] bool)."""
    from transformers import DeepseekV4ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    full = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    emb = full["model.embed_tokens.weight"]  # [VOCAB_SIZE, H]
    shared = emb[100_000]
    if not torch.equal(shared, emb[100_001]):
        raise ValueError(f"{path}: expected the compact export's shared embedding row for unused ids")
    idx = torch.tensor(used)
    was_unused = (emb[idx] == shared).all(dim=1)  # [n_used]
    g = torch.Generator().manual_seed(seed)
    rows = emb[idx] + was_unused[:, None] * torch.randn(len(used), emb.shape[1], generator=g) * 0.02
    state = model.lm.state_dict()
    for name, t in full.items():
        if name not in state:
            continue
        if name in ("model.embed_tokens.weight", "lm_head.weight"):  # tied
            t = torch.cat([rows, shared[None]])
        elif name.endswith(".tid2eid"):
            fresh = state[name]  # the seeded random table of DemoModel.__init__
            t = torch.cat([t[idx], t[100_000][None]])
            t[:-1][was_unused] = fresh[:-1][was_unused]
        state[name] = t
    model.lm.load_state_dict(state)
    if everything:
        _load_tower_and_mtp(model, path)
    print(f"initialised from {path}{' (everything)' if everything else ''}: {int(was_unused.sum())} of "
          f"{len(used)} ids new to it", flush=True)
    return was_unused


def _load_tower_and_mtp(model: DemoModel, path: Path) -> None:
    """Load an exported checkpoint's vision tower, projector and MTP layer into `model`."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV4ForCausalLM

    tensors = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        tensors.update({k: v.float() for k, v in load_file(f).items()})
    vit = {k.removeprefix("vision_tower."): v for k, v in tensors.items() if k.startswith("vision_tower.")}
    if not any(k in model.vit.state_dict() for k in vit):  # transformers 5 drops the `vision_model.` level
        vit = {k.removeprefix("vision_model."): v for k, v in vit.items()}
    model.vit.load_state_dict(vit)
    model.projector.load_state_dict({k.removeprefix("vision_projector."): v for k, v in tensors.items()
                                     if k.startswith("vision_projector.")})
    extra = model.mtp_head_params()
    with torch.no_grad():
        for name, param in extra.items():
            param.copy_(tensors["mtp.0." + name])
    # the MTP decoder layer: through transformers' loader as layer 0 of a one-layer model (it knows
    # the checkpoint's names), with the main model's embedding / head tensors to complete it
    layer = {"model.layers.0." + k.removeprefix("mtp.0."): v for k, v in tensors.items()
             if k.startswith("mtp.0.") and k.removeprefix("mtp.0.") not in extra}
    rest = {k: v for k, v in tensors.items() if k.startswith("model.") and not k.startswith("model.layers.")}
    tmp = Path(tempfile.mkdtemp())
    try:
        hf_config(VOCAB_SIZE, num_hidden_layers=1, layer_types=[SLIDING], mlp_layer_types=["moe"],
                  num_nextn_predict_layers=0).save_pretrained(tmp)
        save_file({**layer, **rest}, str(tmp / "model.safetensors"))
        one = DeepseekV4ForCausalLM.from_pretrained(tmp, dtype=torch.float32)
        model.mtp_layer.load_state_dict(one.model.layers[0].state_dict())
    finally:
        shutil.rmtree(tmp)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (w * xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class PictureBank:
    """Decoded training / eval pictures kept as uint8 [n, 3, 546, 546] on the training device."""

    def __init__(self, webps: list[bytes], device) -> None:
        import io

        import numpy as np
        from PIL import Image

        arrays = [np.asarray(Image.open(io.BytesIO(b)).convert("RGB")) for b in webps]
        if any(a.shape != (546, 546, 3) for a in arrays):
            raise ValueError("demo training pictures are square (recipe makes them 546x546)")
        self.pixels = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous().to(device)

    def batch(self, idx: torch.Tensor) -> torch.Tensor:
        """Normalized pixels [len(idx), 3, 546, 546] (mean 0.5, std 0.5)."""
        return (self.pixels[idx.long().to(self.pixels.device)].float() / 255.0 - 0.5) / 0.5


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
    """Save the compact model as a plain one (a structured embedding is saved as its built table)."""
    state = {k: v.detach().cpu() for k, v in model.state_dict().items() if not k.startswith("structure.")}
    if model.structure is not None:
        table = model.embedding_table().detach().cpu()
        state["lm.model.embed_tokens.weight"] = state["lm.lm_head.weight"] = table
    torch.save({"used_ids": used, "state_dict": state,
                "train_seconds": getattr(model, "train_seconds", None), "steps_done": steps_done}, path)


def warm_up_tower(model: DemoModel, bank: PictureBank, labels: list, steps: int, lr: float, seed: int,
                  eval_bank: PictureBank | None = None, eval_labels: list = (), batch: int = 64) -> None:
    """Train the vision tower + projector alone to name each picture's colour and shape (linear heads
    on the mean of its image tokens; pictures flipped left-right at random), so the LM stage starts
    from image tokens that carry both. The heads are thrown away."""
    device = bank.pixels.device
    n_colours = len(D.COLOURS)
    head = nn.Linear(ARCH["hidden_size"], n_colours + len(D.SHAPES)).to(device)
    params = [*model.vit.parameters(), *model.projector.parameters(), *head.parameters()]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    g = torch.Generator().manual_seed(seed)
    y = torch.tensor(labels, device=device)
    ey = torch.tensor(list(eval_labels), device=device)

    def predict(b: PictureBank, idx: torch.Tensor, flip: torch.Tensor | None = None) -> torch.Tensor:
        pixels = b.batch(idx)
        if flip is not None:
            pixels = torch.where(flip.to(device)[:, None, None, None], pixels.flip(-1), pixels)
        emb = model.image_embeds(pixels).view(len(idx), -1, ARCH["hidden_size"]).mean(1)
        return head(emb)

    start = time.time()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / steps))
        idx = torch.randint(len(labels), (batch,), generator=g)
        out = predict(bank, idx, torch.rand(batch, generator=g) < 0.5)
        yi = y[idx.to(device)]
        loss = F.cross_entropy(out[:, :n_colours], yi[:, 0]) + F.cross_entropy(out[:, n_colours:], yi[:, 1])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % 100 == 0 or step + 1 == steps:
            msg = f"tower step {step + 1}/{steps} loss {loss.item():.4f} {time.time() - start:.0f}s"
            if eval_bank is not None:
                with torch.no_grad():
                    pred = torch.cat([predict(eval_bank, i) for i in torch.arange(len(ey)).split(batch)])
                    colour = (pred[:, :n_colours].argmax(-1) == ey[:, 0]).float().mean().item()
                    shape = (pred[:, n_colours:].argmax(-1) == ey[:, 1]).float().mean().item()
                msg += f" | held-out colour {colour:.3f} shape {shape:.3f}"
            print(msg, flush=True)


def content_positions(ids: torch.Tensor, mask: torch.Tensor, prompt_lens: torch.Tensor) -> torch.Tensor:
    """Per loss position (`mask[:, :-1]`'s True entries, in order): whether its target token differs
    from the batch's most common target at the same offset into the completion (the answer's content:
    the city of a tool call, the digits of a sum, the words of a list), as opposed to the template
    every example of a bucket shares."""
    rows, cols = mask[:, :-1].nonzero(as_tuple=True)
    offset = cols - (prompt_lens.to(ids.device)[rows] - 1)  # offset into the completion
    target = ids[rows, cols + 1]
    aligned = torch.full((ids.shape[0], int(offset.max()) + 1), -1, dtype=ids.dtype, device=ids.device)
    aligned[rows, offset] = target  # [B, completion offset], -1 past a completion's end
    return target != aligned.mode(dim=0).values[offset]


def reindex_vocabulary(state: dict, old_used: list[int], new_used: list[int], fresh: dict) -> dict:
    """`state` (a compact model over `old_used`) re-indexed to the compact vocabulary `new_used` (data
    whose tasks changed): each vocabulary-sized tensor (the tied embedding / output table, the hash-MoE
    routing table) keeps the rows of the ids both use, under their new positions; ids new to the model
    get `fresh`'s rows (a newly initialized model's state); ids the data no longer uses are dropped (they
    fall into the shared row of unused ids)."""
    where = {t: i for i, t in enumerate(new_used)}
    kept = [(i, where[t]) for i, t in enumerate(old_used) if t in where] + [(len(old_used), len(new_used))]
    src, dst = (torch.tensor(x) for x in zip(*kept))  # the last pair: the shared row of unused ids
    out = {}
    for name, tensor in state.items():
        if tensor.dim() and tensor.shape[0] == len(old_used) + 1 and fresh[name].shape[0] == len(new_used) + 1:
            grown = fresh[name].clone().to(tensor.dtype)
            grown[dst] = tensor[src]
            out[name] = grown
        else:
            out[name] = tensor
    print(f"vocabulary re-indexed from {len(old_used)} to {len(new_used)} used ids: {len(kept) - 1} kept, "
          f"{len(new_used) - len(kept) + 1} new, {len(old_used) - len(kept) + 1} dropped "
          f"({sum(out[k] is not state[k] for k in state)} tensors)", flush=True)
    return out


def train(dataset: dict, steps: int, seed: int, lr: float, device: str, log_every: int = 50,
          checkpoint: Path | None = None, init: dict | None = None, stop_after: int | None = None,
          stage: int = 1, batch_scale: int = 1, max_seconds: float | None = None,
          init_checkpoint: Path | None = None, tower_steps: int = 0, tower_lr: float = 1e-3,
          content_weight: float = 0.0, structured: bool = False, structure_decay: float = 1.0,
          freeze_known_rows: bool = False, freeze: str | None = None, distill: float = 0.0,
          distill_skip: tuple[str, ...] = (), save_every: int = 0) -> DemoModel:
    model = DemoModel(len(dataset["used_ids"]), seed, dataset["used_ids"].index(IMAGE_TOKEN_ID))
    new_rows = None  # [num_used] bool: ids the initial checkpoint never used
    if init_checkpoint is not None:
        new_rows = init_from_checkpoint(model, init_checkpoint, dataset["used_ids"], seed, everything=stage >= 6)
    bank = PictureBank(dataset["images"], device)
    if init is not None:
        state = init["state_dict"]
        if init["used_ids"] != dataset["used_ids"]:
            state = reindex_vocabulary(state, init["used_ids"], dataset["used_ids"], model.state_dict())
        model.load_state_dict(state)
    if structured:
        from deepinfer.engine.tokenizer import load_tokenizer

        tok = load_tokenizer()
        fresh = init is None and init_checkpoint is None
        err = model.structure_embeddings([tok.id_to_token(i) for i in dataset["used_ids"]], fresh=fresh)
        s = model.structure
        print(f"structured embeddings: {s.num_words} words with and without a leading space, "
              f"{int((s.kind == 2).sum())} numbers; " + ("from scratch" if fresh else f"warm-start fit error {err:.3f}"),
              flush=True)
    model = model.to(device)
    model.train()
    # NOTE: continual-learning guards for a stage that adds tasks to a trained model (stage 18): the
    # embedding rows the initial model already had stay as they are (`freeze_known_rows`: the copy of
    # a name into a tool call rests on them), parameters matching `freeze` stay fixed, and `distill`
    # weighs a KL term to the initial model's next-token distributions on the old tasks' buckets
    # (every position, prompt included), so learning the new ones does not rewrite what it knew.
    kept_rows = None
    if freeze_known_rows:
        if new_rows is None:
            raise ValueError("freeze_known_rows needs an initial checkpoint (--init-from-checkpoint)")
        known = torch.cat([~new_rows, torch.tensor([True])]).to(device)  # + the shared row of unused ids
        table = model.lm.model.embed_tokens.weight
        kept_rows = (known, table.detach()[known].clone())
    if freeze:
        frozen = [n for n, p in model.named_parameters() if re.search(freeze, n)]
        for n, p in model.named_parameters():
            if n in frozen:
                p.requires_grad_(False)
        print(f"frozen: {len(frozen)} parameter tensors matching {freeze!r}", flush=True)
    teacher = None
    if distill:
        import copy

        teacher = copy.deepcopy(model).eval()
        for p in teacher.parameters():
            p.requires_grad_(False)
    if tower_steps:
        eval_bank = PictureBank(dataset["eval_images"], device)
        warm_up_tower(model, bank, dataset["image_labels"], tower_steps, tower_lr, seed, eval_bank,
                      dataset["eval_image_labels"])
        del eval_bank
    # NOTE: a warm-started text model (stage 4) learns at PRETRAINED_LR_SCALE x lr and feeds the fresh
    # MTP layer detached streams, so the new parts' large early gradients cannot undo what it knows.
    warm = init_checkpoint is not None and stage == 4
    groups = []
    for is_pretrained in (False, True):
        for is_matrix in (True, False):
            params = [p for n, p in model.named_parameters() if p.requires_grad
                      and (p.dim() >= 2) == is_matrix and (warm and n.startswith("lm.")) == is_pretrained]
            if params:
                groups.append({"params": params, "weight_decay": 0.01 if is_matrix else 0.0,
                               "lr_scale": PRETRAINED_LR_SCALE if is_pretrained else 1.0})
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.98))
    batches = sample_batches(dataset, steps, seed, stage, batch_scale)
    warmup = max(1, min(100, steps // 10))
    start, run_loss, run_mtp, run_kd = time.time(), 0.0, 0.0, 0.0
    by_bucket: dict[str, list[float]] = {}

    def progress(step: int) -> float:
        """Fraction of the schedule done: by steps, or by wall time under --max-seconds (whichever is ahead)."""
        done = step / steps
        return max(done, (time.time() - start) / max_seconds) if max_seconds else done

    for step, batch in enumerate(batches):
        factor = min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress(step), 1.0))))
        for group in opt.param_groups:
            group["lr"] = lr * factor * group["lr_scale"]
        ids, mask = collate(batch, device)
        image_embeds = model.image_embeds(bank.batch(batch["image_idx"])) if len(batch["image_idx"]) else None
        streams, ctx = model.streams(ids, image_embeds)
        logits = model.logits(model.main_hidden(streams))
        per_token = F.cross_entropy(logits[:, :-1][mask[:, :-1]], ids[:, 1:][mask[:, :-1]], reduction="none")
        if content_weight:
            w = 1.0 + content_weight * content_positions(ids, mask, batch["prompt_lens"])
            loss = (w * per_token).sum() / w.sum()
        else:
            loss = per_token.mean()
        mtp_mask = mask[:, :-2]  # MTP at t (given token t+1) predicts token t+2
        mtp_in = streams[:, :-2].detach() if warm else streams[:, :-2]
        mtp_logits = model.logits(model.mtp_hidden(mtp_in, ids[:, 1:-1], ctx))
        mtp_loss = F.cross_entropy(mtp_logits[mtp_mask], ids[:, 2:][mtp_mask])
        total = loss + MTP_LOSS_WEIGHT * mtp_loss
        if teacher is not None and batch["bucket"] not in (*NEW_TASK_BUCKETS, *distill_skip):
            with torch.no_grad():
                t_embeds = teacher.image_embeds(bank.batch(batch["image_idx"])) if len(batch["image_idx"]) else None
                t_logp = F.log_softmax(teacher.logits(teacher.main_hidden(teacher.streams(ids, t_embeds)[0]))[mask], -1)
            kd = F.kl_div(F.log_softmax(logits[mask], -1), t_logp, log_target=True, reduction="batchmean")
            total = total + distill * kd
            run_kd += kd.item()
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if kept_rows is not None:
            with torch.no_grad():  # AdamW's decay and momentum would move them otherwise
                model.lm.model.embed_tokens.weight[kept_rows[0]] = kept_rows[1]
        if model.structure is not None:
            model.structure.decay_residual(model.lm.model.embed_tokens.weight, structure_decay)
        run_loss += loss.item()
        run_mtp += mtp_loss.item()
        by_bucket.setdefault(batch["bucket"], []).append(loss.item())
        if (step + 1) % log_every == 0 or step + 1 == steps:
            n = (step % log_every) + 1
            buckets = " ".join(f"{k}={sum(v) / len(v):.3f}" for k, v in sorted(by_bucket.items()))
            print(f"step {step + 1}/{steps} loss {run_loss / n:.4f} mtp {run_mtp / n:.4f} "
                  + (f"kd {run_kd / n:.4f} " if teacher is not None else "")
                  + f"{time.time() - start:.0f}s | {buckets}", flush=True)
            run_loss, run_mtp, run_kd, by_bucket = 0.0, 0.0, 0.0, {}
        model.steps_done = step + 1
        if stop_after is not None and step + 1 >= stop_after:
            break
        if max_seconds is not None and progress(step + 1) >= 1.0:
            print(f"stopping at step {step + 1}: --max-seconds reached (cosine schedule over wall time)", flush=True)
            break
        if checkpoint is not None and (step + 1) % 100 == 0:
            save_compact(model, dataset["used_ids"], checkpoint, step + 1)
        if checkpoint is not None and save_every and (step + 1) % save_every == 0:  # snapshots to average later
            save_compact(model, dataset["used_ids"], checkpoint.with_suffix(f".s{step + 1}.pt"), step + 1)
    model.eval()
    model.materialize_embeddings()
    model.train_seconds = time.time() - start
    return model


# --------------------------------------------------------------------------------- eval (compact)


@torch.no_grad()
def greedy_compact(model: DemoModel, prompts: list[list[int]], used: list[int], max_new: int, device,
                   images: list[list[int]] | None = None, bank: PictureBank | None = None) -> list:
    """Greedy continuations (full ids) of `prompts` with the compact model, stopping at EOS; also
    returns, per generated token after the first, whether the MTP's top-1 from the previous
    position agreed with it."""
    to_compact = torch.full((VOCAB_SIZE,), len(used), dtype=torch.long)
    to_compact[torch.tensor(used)] = torch.arange(len(used))
    used_t = torch.tensor(used + [2])  # the shared row never wins in a trained model; map it to a visible id
    outs, agree = [], []
    size = 32 if str(device) == "cpu" else 128
    for start in range(0, len(prompts), size):
        chunk = [list(p) for p in prompts[start: start + size]]
        idx = [i for img in (images or [])[start: start + size] for i in img]
        image_embeds = model.image_embeds(bank.batch(torch.tensor(idx))) if idx else None
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
            streams, ctx = model.streams(ids, image_embeds)
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


def evaluate_compact(model: DemoModel, evals: dict, used: list[int], device, limit: int | None = None,
                     eval_images: list[bytes] = ()) -> dict:
    """Exact-match rate of the held-out completions per eval set, plus MTP agreement."""
    result, agree_all = {}, []
    bank = PictureBank(list(eval_images), device) if eval_images else None
    for name, items in evals.items():
        items = items if limit is None else items[:limit]
        gens, agree = greedy_compact(model, [p for p, _, _, _ in items], used, 72, device,
                                     [img for _, _, _, img in items], bank)
        result[name] = sum(g == c for g, (_, c, _, _) in zip(gens, items)) / len(items)
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

    from deepinfer.engine.config import ModelConfig
    from deepinfer.engine.models.deepseek_v4_weights import checkpoint_spec, mtp_checkpoint_spec
    from deepinfer.engine.testing.make_checkpoint import _write_ours

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
    tensors.update({"mtp.0." + k: v.detach() for k, v in model.mtp_head_params().items()})
    # transformers 5 drops SiglipVisionModel's `vision_model.` level; the checkpoint keeps it
    tensors.update({"vision_tower." + (k if k.startswith("vision_model.") else "vision_model." + k): v
                    for k, v in model.vit.state_dict().items()})
    tensors.update({"vision_projector." + k: v for k, v in model.projector.state_dict().items()})
    hf = {**ARCH, "image_token_id": IMAGE_TOKEN_ID, "vision_config": VISION, "deepinfer": {"chat_encoding": CHAT_ENCODING}}
    config = ModelConfig.from_hf_dict(hf)
    spec = {**checkpoint_spec(config, dtype), **mtp_checkpoint_spec(config, dtype)}
    missing, unexpected = sorted(set(spec) - set(tensors)), sorted(set(tensors) - set(spec))
    if missing or unexpected:
        raise RuntimeError(f"export does not match the checkpoint spec: missing {missing[:5]}, unexpected {unexpected[:5]}")
    tensors = {name: tensors[name].to(spec[name].dtype).contiguous() for name in spec}
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.safetensors"):
        old.unlink()
    _write_ours(out, hf, tensors, getattr(torch, dtype), 1 << 40)
    return out


# --------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point (see the module docstring)."""
    default_out = Path(__file__).resolve().parents[2] / "engine" / "testing" / "demo_model"
    p = argparse.ArgumentParser(prog="python -m deepinfer.tools.demo_model.train", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=default_out, help="checkpoint directory to write")
    p.add_argument("--steps", type=int, default=2400, help="optimizer steps")
    p.add_argument("--seed", type=int, default=D.SEED, help="seed of the data stream and the initial weights")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW, cosine to 10%%)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--device", default="cpu", help="torch device to train on")
    p.add_argument("--save-data", type=Path, help="render the dataset to this file and exit")
    p.add_argument("--data", type=Path, help="train from a dataset written by --save-data")
    p.add_argument("--names", type=int, default=D.NUM_NAME_POOL,
                   help="rendering: capitalized names besides the places (tool questions, lists)")
    p.add_argument("--name-share", type=float, default=0.5,
                   help="rendering: share of the lists and tool questions that use a name")
    p.add_argument("--list-names", type=int, default=2, help="rendering: at most this many names in one list")
    p.add_argument("--tool-pool", type=int, help="rendering: tool examples per bucket (default POOL_SIZES)")
    p.add_argument("--save-compact", type=Path, help="also save the compact trained model here")
    p.add_argument("--from-compact", type=Path, help="skip training: export this compact model")
    p.add_argument("--stage", type=int, default=1, choices=[1, *STAGE_SHARES], help="data mix (see STAGE_SHARES)")
    p.add_argument("--init-from-checkpoint", type=Path,
                   help="stage 4: start the text model from this exported checkpoint directory; "
                        "stages 6-8, 18, 19: start everything (text, MTP, vision) from it")
    p.add_argument("--tower-steps", type=int, default=0,
                   help="first train the vision tower alone on colour / shape labels for this many steps")
    p.add_argument("--tower-lr", type=float, default=1e-3, help="peak learning rate of the tower warm-up")
    p.add_argument("--content-weight", type=float, default=0.0,
                   help="extra loss weight of answer-content tokens (see content_positions); 0: plain mean")
    p.add_argument("--structured-embeddings", action="store_true",
                   help="train the embedding table through StructuredEmbedding (spaced / unspaced words "
                        "share a row, numbers are sums of digit rows); the saved table is plain")
    p.add_argument("--structure-decay", type=float, default=1.0,
                   help="per-step decay of the structured rows' per-token residual (1: none kept)")
    p.add_argument("--init-from", type=Path, help="continue training this compact model (the stages of CONTINUING_STAGES)")
    p.add_argument("--stop-after", type=int, help="stop after this many steps (the schedule still spans --steps)")
    p.add_argument("--max-seconds", type=float,
                   help="run the cosine schedule over this much wall time instead (stops then; not bit-reproducible)")
    p.add_argument("--log-every", type=int, default=50, help="print the running losses every N steps")
    p.add_argument("--batch-scale", type=int, default=1, help="examples per step x this (GPU runs)")
    p.add_argument("--eval-limit", type=int, default=None, help="held-out examples per eval set (default all)")
    p.add_argument("--no-export", action="store_true", help="train and evaluate only")
    p.add_argument("--freeze-known-rows", action="store_true",
                   help="keep the embedding rows of ids the --init-from-checkpoint model already used fixed")
    p.add_argument("--freeze", help="keep the parameters whose names match this regular expression fixed")
    p.add_argument("--distill", type=float, default=0.0,
                   help="weight of a KL term to the initial model on the old tasks' buckets (0: none)")
    p.add_argument("--save-every", type=int, default=0,
                   help="also keep a snapshot of the compact model every N steps (--save-compact's name + .sN.pt)")
    p.add_argument("--distill-skip", default="",
                   help="comma-separated buckets (e.g. tool/direct,tool/think) also left out of --distill")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.time()
    if 6 <= args.stage <= 8 or args.stage in (18, 19):
        if bool(args.init_from) == bool(args.init_from_checkpoint):
            p.error("--stage 6, 7, 8, 18 and 19 continue an exported checkpoint (--init-from-checkpoint) or a compact model "
                    "(--init-from): give one of them")
    elif (args.stage in CONTINUING_STAGES) != bool(args.init_from):
        p.error(f"--stage {', '.join(map(str, CONTINUING_STAGES))} continue a previous stage: give --init-from "
                "(and only they take it)")
    elif (args.stage == 4) != bool(args.init_from_checkpoint):
        p.error("--stage 4 starts from an exported checkpoint: give --init-from-checkpoint (and only it takes it)")
    dataset = load_dataset(args.data) if args.data else build_dataset(
        args.seed, args.names, args.name_share, {"tool": args.tool_pool} if args.tool_pool else None,
        args.list_names)
    print(f"dataset: {sum(len(p['lens']) for p in dataset['pools'].values())} examples, "
          f"{len(dataset['images'])} pictures, {len(dataset['used_ids'])} used ids, {time.time() - t0:.0f}s", flush=True)
    if args.save_data:
        save_dataset(dataset, args.save_data)
        return
    if args.from_compact:
        saved = torch.load(args.from_compact)
        model = DemoModel(len(saved["used_ids"]), args.seed, saved["used_ids"].index(IMAGE_TOKEN_ID))
        model.load_state_dict(saved["state_dict"])
        model.eval().to(args.device)
        model.train_seconds = saved.get("train_seconds", float("nan"))
        if saved["used_ids"] != dataset["used_ids"]:
            raise SystemExit("--from-compact model and dataset have different vocabularies; use the same --seed/--data")
    else:
        init = torch.load(args.init_from) if args.init_from else None
        model = train(dataset, args.steps, args.seed, args.lr, args.device, checkpoint=args.save_compact, init=init,
                      stop_after=args.stop_after, stage=args.stage, batch_scale=args.batch_scale,
                      max_seconds=args.max_seconds, log_every=args.log_every,
                      init_checkpoint=args.init_from_checkpoint, tower_steps=args.tower_steps,
                      tower_lr=args.tower_lr, content_weight=args.content_weight,
                      structured=args.structured_embeddings, structure_decay=args.structure_decay,
                      freeze_known_rows=args.freeze_known_rows, freeze=args.freeze, distill=args.distill,
                      distill_skip=tuple(b for b in args.distill_skip.split(",") if b), save_every=args.save_every)
        print(f"trained {model.steps_done} steps in {model.train_seconds:.0f}s", flush=True)
        if args.save_compact:
            save_compact(model, dataset["used_ids"], args.save_compact, model.steps_done)
    if args.eval_limit != 0:
        scores = evaluate_compact(model, dataset["evals"], dataset["used_ids"], args.device, args.eval_limit,
                                  dataset["eval_images"])
        print("held-out exact match:", json.dumps(scores, indent=1), flush=True)
    if not args.no_export:
        out = export(model, dataset["used_ids"], args.out)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
