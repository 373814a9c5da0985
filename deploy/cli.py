"""The `deepinfer` command line.

Subcommands so far:
  demo       offline generation with the embedded default model (the README's first command)
  generate   offline generation on a checkpoint, one JSON object per prompt
Cluster commands (`up`, `status`, `scale`, `down`) arrive with the disaggregated-serving stage.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint directory (default: the built-in model)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)


def _run(args, prompts: list) -> int:
    from engine import LLM, InvalidRequestError, SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
        t0 = time.perf_counter()
        llm = LLM(model=args.model, dtype=args.dtype, device=args.device)
        t1 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
    except InvalidRequestError as e:
        print(json.dumps({"error": str(e), "field": e.field}), file=sys.stderr)
        return 2
    t2 = time.perf_counter()
    for o in outs:
        c = o.outputs[0]
        print(json.dumps({
            "prompt_token_ids": o.prompt_token_ids,
            "token_ids": c.token_ids,
            "text": c.text,
            "finish_reason": c.finish_reason,
            "usage": {"prompt_tokens": len(o.prompt_token_ids), "completion_tokens": len(c.token_ids),
                      "cached_prompt_tokens": o.num_cached_tokens},
        }, ensure_ascii=False))
    print(f"# loaded in {t1 - t0:.2f}s, generated in {t2 - t1:.2f}s; compressed KV: "
          f"{llm.engine.bytes_per_token:.1f} bytes/token", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deepinfer", description="Disaggregated serving for DeepSeek-V4 models")
    sub = parser.add_subparsers(dest="cmd", required=True)
    demo = sub.add_parser("demo", help="generate with the embedded default model")
    _add_engine_args(demo)
    gen = sub.add_parser("generate", help="offline generation on a checkpoint")
    _add_engine_args(gen)
    gen.add_argument("--prompt", action="append", default=[], help="a text prompt (repeatable)")
    gen.add_argument("--prompt-ids", action="append", default=[], help="comma-separated token ids (repeatable)")
    args = parser.parse_args(argv)
    if args.cmd == "demo":
        prompts = ["Hello, DeepSeek-V4!", {"prompt_token_ids": [0, 100, 200, 300]}]
        return _run(args, prompts)
    prompts: list = list(args.prompt)
    for s in args.prompt_ids:
        try:
            prompts.append({"prompt_token_ids": [int(x) for x in s.split(",") if x.strip()]})
        except ValueError:
            parser.error(f"--prompt-ids {s!r}: give comma-separated integers")
    if not prompts:
        parser.error("give at least one --prompt or --prompt-ids")
    return _run(args, prompts)


if __name__ == "__main__":
    sys.exit(main())
