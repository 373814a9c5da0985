"""Weight averages ("model soups") of demo-model runs that share a starting point, scored on the held-out sets.

    python -m deepinfer.tools.demo_model.soup --data DATA --model E=engine/builtin_model --model A=A.pt \\
        --mix E:1,A:1 --sets tool/direct tool/think --limit 42 [--extra TOOL.pt] [--save E:1,A:1=SOUP.pt]

Models are compact models (`train.py --save-compact`) or exported checkpoint directories (loaded into
the compact vocabulary of `--data`). Each `--mix` is a weighted average of their tensors (weights
normalized); every single model and every mix is scored with the training script's compact greedy
evaluation (`train.evaluate_compact`: exact match of the whole held-out completion). `--save` writes a
mix as a compact model, which `train.py --from-compact` exports.

`--render-tool-sets F` (needs deepseek-recipe) renders every held-out place with every phrasing of
the weather question, in both modes, to F; `--extra F` adds those sets (`tool-all/direct`,
`tool-all/think`) to the scoring.

NOTE: why averages: two runs from one model that each call the tool right for about 30 of the 42
held-out prompts averaged to 41 of 42 (model card, stages 15-17); this searches such averages
among runs that all keep the other tasks.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from deepinfer.tools.demo_model import data as D
from deepinfer.tools.demo_model import train as T


def load_state(path: Path, used: list[int], seed: int) -> dict[str, torch.Tensor]:
    """fp32 compact state dict of a compact model file or an exported checkpoint directory."""
    if path.is_dir():
        model = T.DemoModel(len(used), seed, used.index(T.IMAGE_TOKEN_ID))
        T.init_from_checkpoint(model, path, used, seed, everything=True)
        return {k: v.detach().float() for k, v in model.state_dict().items()}
    saved = torch.load(path)
    if saved["used_ids"] != used:
        raise SystemExit(f"{path}: its vocabulary differs from the dataset's; use the data it was trained on")
    return {k: v.float() if v.is_floating_point() else v for k, v in saved["state_dict"].items()}


def parse_mix(text: str) -> list[tuple[str, float]]:
    """'E:1,A:0.5' -> [('E', 1.0), ('A', 0.5)]."""
    out = []
    for part in text.split(","):
        name, _, weight = part.partition(":")
        out.append((name, float(weight or 1.0)))
    return out


def _label(mix: list[tuple[str, float]]) -> str:
    return ",".join(f"{n}:{w:g}" for n, w in mix)


def average(states: dict[str, dict], mix: list[tuple[str, float]]) -> dict[str, torch.Tensor]:
    """Weighted average of the floating-point tensors (weights normalized); integer tensors (the
    hash-routing table) must agree and are taken from the first model."""
    total = sum(w for _, w in mix)
    first = states[mix[0][0]]
    out = {}
    for key, tensor in first.items():
        if not tensor.is_floating_point():
            if any(not torch.equal(states[n][key], tensor) for n, _ in mix):
                raise ValueError(f"{key} differs between the averaged models")
            out[key] = tensor
        else:
            out[key] = sum(states[n][key] * (w / total) for n, w in mix)
    return out


def write_compact(path: Path, used: list[int], state: dict[str, torch.Tensor], mix: list[tuple[str, float]]) -> None:
    """Save an average as a compact model (`train.save_compact`'s format), the tied output table stored once."""
    state = dict(state)
    if "lm.lm_head.weight" in state and "lm.model.embed_tokens.weight" in state:
        state["lm.lm_head.weight"] = state["lm.model.embed_tokens.weight"]  # tied: averaged to the same values
    torch.save({"used_ids": used, "state_dict": state, "steps_done": None, "mix": _label(mix)}, path)
    print(f"wrote {path} ({_label(mix)})", flush=True)


def render_tool_sets(path: Path) -> None:
    """Every held-out place x every question phrasing, thinking and not, as compact-eval items."""
    renderer = D.ChatRenderer()
    rng = random.Random(5)
    sets = {}
    for thinking in (False, True):
        sets[f"tool-all/{'think' if thinking else 'direct'}"] = [
            (renderer.prompt_ids(ex), renderer.completion_ids(ex), ex.answer, [])
            for ex in D.held_out_tool_examples(rng, thinking)]
    torch.save(sets, path)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m deepinfer.tools.demo_model.soup", description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, help="dataset of train.py --save-data (vocabulary and held-out sets)")
    p.add_argument("--model", action="append", default=[], help="NAME=PATH (compact .pt or checkpoint directory)")
    p.add_argument("--mix", action="append", default=[], help="NAME:W,NAME:W,... (a weighted average to score)")
    p.add_argument("--sets", nargs="*", help="eval sets to score (default: all), e.g. tool/direct")
    p.add_argument("--limit", type=int, help="items per set (default all)")
    p.add_argument("--extra", type=Path, help="more eval sets (--render-tool-sets)")
    p.add_argument("--no-singles", action="store_true", help="score only the mixes")
    p.add_argument("--save", action="append", default=[], help="MIX=PATH: write that average as a compact model")
    p.add_argument("--keep", nargs=2, metavar=("K", "DIR"),
                   help="write the best K candidates (by the sum of their scores on the sets) to DIR as compact models")
    p.add_argument("--json", type=Path, help="also write the scores here")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=D.SEED)
    p.add_argument("--render-tool-sets", type=Path, help="render the all-phrasings tool sets to this file and exit")
    args = p.parse_args(argv)
    if args.render_tool_sets:
        render_tool_sets(args.render_tool_sets)
        return
    dataset = T.load_dataset(args.data)
    used = dataset["used_ids"]
    evals = dict(dataset["evals"])
    if args.extra:
        evals.update(torch.load(args.extra))
    if args.sets:
        evals = {k: evals[k] for k in args.sets}
    states = {}
    for spec in args.model:
        name, _, path = spec.partition("=")
        states[name] = load_state(Path(path), used, args.seed)
    candidates = [] if args.no_singles else [[(n, 1.0)] for n in states]
    candidates += [parse_mix(m) for m in args.mix]
    results = {}
    model = T.DemoModel(len(used), args.seed, used.index(T.IMAGE_TOKEN_ID)).eval().to(args.device) if candidates else None
    for mix in candidates:
        label = _label(mix)
        model.load_state_dict(average(states, mix))
        start = time.time()
        scores = T.evaluate_compact(model, evals, used, args.device, args.limit, dataset["eval_images"])
        results[label] = scores
        print(label, json.dumps({k: round(v, 3) for k, v in scores.items()}), f"{time.time() - start:.0f}s", flush=True)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1) + "\n")
    if args.keep:
        k, out_dir = int(args.keep[0]), Path(args.keep[1])
        out_dir.mkdir(parents=True, exist_ok=True)
        best = sorted(candidates, key=lambda mix: -sum(v for n, v in results[_label(mix)].items() if n in evals))[:k]
        for rank, mix in enumerate(best):
            write_compact(out_dir / f"best{rank}.pt", used, average(states, mix), mix)
    for spec in args.save:
        mix_text, _, path = spec.partition("=")
        mix = parse_mix(mix_text)
        write_compact(Path(path), used, average(states, mix), mix)


if __name__ == "__main__":
    main()
