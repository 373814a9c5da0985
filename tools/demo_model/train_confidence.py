"""Train the built-in model's confidence head on its own drafts (`engine.spec_decode.confidence`).

    python -m deepinfer.tools.demo_model.train_confidence [--train 192] [--held-out 96] [--k 3]
        [--epochs 400] [--save engine/builtin_model/confidence_head.safetensors] [--json REPORT]

1. **Data.** In-domain chat prompts of the demo model's tasks (additions, copy / reverse lists, the
   weather question, JSON-mode additions; thinking mode for half of them; the phrasings of
   `tools/demo_model/data.py`), greedy, natural stops, run through `Engine` with `speculative_tokens=k`
   and full-block verification. Every step the drafter keeps each draft's confidence features
   (`MTPDrafter.keep_features`); after the run, draft `j` of a step is labelled against the request's
   final output: it is an example of `c(r, j)` when drafts `0 .. j - 1` equal the output there (the
   target would have accepted them: greedy acceptance is "equals the target's token", and the output is
   the non-speculative one), accepted iff it equals the next output token too. Drafts past the end of
   the output are never verified and are dropped. Training and held-out prompts come from different
   seeds.
2. **Fit.** `ConfidenceHead` (2-layer MLP) by full-batch AdamW on binary cross-entropy.
3. **Calibration** on the held-out prompts: Brier score and ROC AUC of the head against the fallback
   (the draft's MTP probability), per draft position and overall.

The model itself is not changed; the head is written to its own file.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from deepinfer.engine.spec_decode.confidence import CONFIDENCE_HEAD_FILE, MAX_POSITIONS, ConfidenceHead


def prompts(num: int, seed: int) -> list[list[int]]:
    """`num` rendered chat prompts of the demo model's tasks (token ids), fixed by `seed`."""
    import deepseek_recipe as recipe

    from deepinfer.engine.builtin_model import builtin_model_path
    from deepinfer.engine.tokenizer import load_chat_encoding
    from deepinfer.tools.demo_model import data as D

    enc = load_chat_encoding(builtin_model_path())
    rng = random.Random(seed)
    out = []
    for i in range(num):
        kind = i % 5
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        words = " ".join(rng.sample(D.WORDS, rng.randint(3, 5)))
        if kind == 0:
            q = rng.choice(D.ADD_TEMPLATES).format(a=a, b=b)
        elif kind == 1:
            q = rng.choice(D.COPY_TEMPLATES).format(w=words)
        elif kind == 2:
            q = rng.choice(D.REVERSE_TEMPLATES).format(w=words)
        elif kind == 3:
            q = rng.choice(D.TOOL_TEMPLATES).format(c=rng.choice(D.PLACES))
        else:
            q = rng.choice(D.ADD_TEMPLATES).format(a=a, b=b) + rng.choice(D.JSON_SUFFIXES[1:])
        out.append(enc.encode(recipe.Conversation([recipe.UserMessage(q)], thinking_mode=(i // 5) % 2 == 0)))
    return out


def collect(prompt_ids: list[list[int]], k: int, max_tokens: int, max_num_seqs: int = 16
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the built-in model with speculation over the prompts; returns the labelled drafts:
    features [N, F], labels [N] (1 = accepted), draft positions [N], MTP probabilities [N]."""
    from deepinfer.engine import SamplingParams
    from deepinfer.engine.engine import Engine, EngineConfig

    eng = Engine(EngineConfig(max_num_seqs=max_num_seqs, speculative_tokens=k, verify_schedule="full"))
    spec = eng.spec
    spec.drafter.keep_features = True
    records: list[tuple[str, int, list[int], list[float], torch.Tensor]] = []
    sampling_ids: list[str] = []
    prepare, run = spec.prepare, spec.run

    def prepare_and_note(step, out, *args, **kwargs):
        sampling_ids[:] = list(out.sampling_req_ids)
        return prepare(step, out, *args, **kwargs)

    def run_and_record(step):
        res = run(step)
        for rid, toks, drafts, probs, feats in zip(sampling_ids, res.token_ids, res.draft_token_ids,
                                                   res.draft_probs, res.draft_features):
            if drafts and feats is not None:
                n_after = eng.scheduler.get_request(rid).num_tokens + len(toks)
                records.append((rid.split("#")[0], n_after, list(drafts), list(probs), feats.cpu()))
        return res

    spec.prepare, spec.run = prepare_and_note, run_and_record
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    full: dict[str, list[int]] = {}
    for i, p in enumerate(prompt_ids):
        eng.add_request(str(i), p, params)
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                full[o.request_id] = prompt_ids[int(o.request_id)] + list(o.outputs[0].token_ids)
    feats, labels, positions, probs = [], [], [], []
    for rid, n_after, drafts, dprobs, f in records:
        seq = full[rid]
        for j, d in enumerate(drafts):
            if n_after + j >= len(seq):
                break  # past the output's end: never verified
            feats.append(f[j])
            labels.append(float(d == seq[n_after + j]))
            positions.append(j)
            probs.append(dprobs[j])
            if d != seq[n_after + j]:
                break  # the drafts after a rejection are not examples of c(r, j)
    return torch.stack(feats), torch.tensor(labels), torch.tensor(positions), torch.tensor(probs)


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """ROC AUC (ties count one half); nan without both classes."""
    pos, neg = scores[labels == 1], scores[labels == 0]
    if len(pos) == 0 or len(neg) == 0:
        return float("nan")
    greater = (pos[:, None] > neg[None, :]).float().sum()
    ties = (pos[:, None] == neg[None, :]).float().sum()
    return ((greater + 0.5 * ties) / (len(pos) * len(neg))).item()


def calibration(pred: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor) -> dict:
    """Brier score and AUC overall and per draft position."""
    out = {"n": len(labels), "accept_rate": round(labels.mean().item(), 4),
           "brier": round(((pred - labels) ** 2).mean().item(), 4), "auc": round(auc(pred, labels), 4),
           "per_position": []}
    for j in sorted(set(positions.tolist())):
        m = positions == j
        out["per_position"].append({"position": j, "n": int(m.sum()), "accept_rate": round(labels[m].mean().item(), 4),
                                    "brier": round(((pred[m] - labels[m]) ** 2).mean().item(), 4),
                                    "auc": round(auc(pred[m], labels[m]), 4)})
    return out


def fit(feats: torch.Tensor, labels: torch.Tensor, hidden_size: int, epochs: int, lr: float, weight_decay: float,
        seed: int) -> ConfidenceHead:
    """Full-batch AdamW on binary cross-entropy."""
    torch.manual_seed(seed)
    head = ConfidenceHead(hidden_size)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=weight_decay)
    for _ in range(epochs):
        loss = torch.nn.functional.binary_cross_entropy_with_logits(head.logits(feats), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head.eval()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train", type=int, default=192, help="training prompts")
    ap.add_argument("--held-out", type=int, default=96, help="held-out prompts (another seed)")
    ap.add_argument("--k", type=int, default=3, help="drafts per step while collecting")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--epochs", type=int, default=400)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--weight-decay", type=float, default=1e-2)
    ap.add_argument("--seed", type=int, default=7, help="training prompts' seed (held-out: seed + 1000)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--save", default=None, help=f"where to write the head (e.g. engine/builtin_model/{CONFIDENCE_HEAD_FILE})")
    ap.add_argument("--json", default=None, help="write the calibration report here")
    args = ap.parse_args(argv)
    if args.k > MAX_POSITIONS:
        raise SystemExit(f"--k {args.k} exceeds the head's {MAX_POSITIONS} positions")
    torch.set_num_threads(args.threads)
    t0 = time.time()
    with torch.inference_mode():
        tr = collect(prompts(args.train, args.seed), args.k, args.max_tokens)
        te = collect(prompts(args.held_out, args.seed + 1000), args.k, args.max_tokens)
    t1 = time.time()
    tr = tuple(x.clone() for x in tr)  # out of inference mode: autograd needs ordinary tensors
    te = tuple(x.clone() for x in te)
    from deepinfer.engine.spec_decode.confidence import num_features

    hidden_size = tr[0].shape[1] - num_features(0)
    head = fit(tr[0], tr[1], hidden_size, args.epochs, args.lr, args.weight_decay, args.seed)
    with torch.no_grad():
        pred = head(te[0])
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "k": args.k,
        "train_prompts": args.train, "held_out_prompts": args.held_out,
        "train_drafts": len(tr[1]), "collect_s": round(t1 - t0, 1), "fit_s": round(time.time() - t1, 1),
        "held_out_head": calibration(pred, te[1], te[2]),
        "held_out_draft_probability": calibration(te[3], te[1], te[2]),
    }
    print(json.dumps(report, indent=1))
    if args.save:
        head.save(args.save)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
