"""Measure the demo checkpoint's held-out accuracies through `engine.LLM` (greedy), for its model card.

    python -m deepinfer.tools.demo_model.evaluate [--model DIR] [--num 200] [--json OUT]

Exact match of the whole completion (reasoning, `</think>`, answer and `<｜end▁of▁sentence｜>` for
thinking mode) against the rendered target, per task and mode, on the fixed held-out items of
`tools/demo_model/data.py` (the tool set: every held-out place with every phrasing; the image tasks:
the first `--num` held-out pictures, through the model's own vision tower). Also reports
how often an answer contains the right sum / city, and whether every output ended with EOS.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from deepinfer.tools.demo_model import data as D


def _score(llm, renderer: D.ChatRenderer, exs: list, prompts: list[dict], max_tokens: int) -> dict:
    """Greedy outputs of `prompts` scored against `exs`' rendered completions."""
    from deepinfer.engine import SamplingParams

    start = time.time()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    exact = contains = eos = 0
    for ex, out in zip(exs, outs):
        ids = list(out.outputs[0].token_ids)
        exact += ids == renderer.completion_ids(ex)
        eos += bool(ids) and ids[-1] == renderer.eos_id
        answer = out.outputs[0].text.split("</think>")[-1]
        contains += (f'"true">{ex.answer}<' in answer) if ex.task == "tool" else (ex.answer in answer)
    n = len(exs)
    return {"n": n, "exact": exact / n, "answer_contains": contains / n, "ends_with_eos": eos / n,
            "seconds": round(time.time() - start, 1)}


def evaluate(model: str | None, num: int, tasks: list[str] | None = None) -> dict:
    """Blocks while generating; returns {set name: metrics} (`tasks`: only these, default all)."""
    from deepinfer.engine import LLM

    llm = LLM(model=model)
    renderer = D.ChatRenderer()
    held = D.held_out()
    pics = D.held_out_pictures()[:num]
    results = {}
    for task in tasks or (*D.TASKS, *D.IMAGE_TASKS):
        for thinking in (False, True):
            rng = random.Random(11)
            if task in D.TASKS:
                if task == "tool":  # every held-out place with every phrasing
                    exs = D.held_out_tool_examples(rng, thinking)
                else:
                    exs = [D.make_example(task, item, rng, thinking) for item in held[task][:num]]
                prompts = [{"prompt_token_ids": renderer.prompt_ids(ex)} for ex in exs]
                name = f"{task}/{'thinking' if thinking else 'direct'}"
            else:
                groups = [(pic, pics[(i * 7 + 3) % len(pics)]) if task == "two" else (pic,)
                          for i, pic in enumerate(pics)]
                exs = [D.make_image_example(task, group, rng, thinking, with_history=i % 4 == 3)
                       for i, group in enumerate(groups)]
                prompts = [{"prompt_token_ids": renderer.prompt_ids(ex),
                            "multi_modal_data": {"image": [p.png() for p in ex.pictures]}} for ex in exs]
                name = f"image-{task}/{'thinking' if thinking else 'direct'}"
            results[name] = _score(llm, renderer, exs, prompts, 96 if task in D.TASKS else 48)
            print(name, json.dumps(results[name]), flush=True)
    return results


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m deepinfer.tools.demo_model.evaluate", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: the built-in demo model)")
    p.add_argument("--num", type=int, default=200, help="held-out items per addition/list set")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--tasks", nargs="+", choices=[*D.TASKS, *D.IMAGE_TASKS], help="only these tasks (default all)")
    args = p.parse_args(argv)
    results = evaluate(args.model, args.num, args.tasks)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
