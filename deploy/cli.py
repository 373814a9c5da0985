"""The `deepinfer` command line.

  demo       the main job (the README's first command): a local cluster with the built-in model
             answers chat requests end to end, then goes down; `--offline` runs the offline engine instead
  generate   generation: on the running cluster's entrypoint, or offline on a checkpoint
  up         launch a cluster on Ray: balancers, (vision +) prefill + decode instances, entrypoint (+ HTTP front)
  status     a table of the cluster's instances: state, health, load, KV cache use
  scale      change instance counts live: `deepinfer scale prefill=2 decode=3 vision=2` (`decode.GROUP=N` per group)
  down       stop the cluster

`up` with no arguments starts a local Ray cluster on loopback with the built-in default model, one
prefill and one decode instance (plus one vision instance when the model has a vision tower), the
stage balancers, the entrypoint and (when `entrypoint.http` is installed) the HTTP front; `--config FILE.yaml` describes other layouts (`deploy/configs/`), and
`--address HOST:PORT|auto` joins a running Ray cluster instead. It prints one JSON line with the
addresses and records them in `$DEEPINFER_HOME/cluster.json` for the other commands.

Attached or detached: `up` stays attached by default — it serves until Ctrl-C / SIGTERM, then
takes the cluster down (a local Ray cluster started by `up` lives exactly as long as `up`). With
`--address` (a Ray cluster that outlives it) `--detach` returns at once, the cluster keeps running
under its detached controller actor, and `deepinfer down` stops it.

Which `generate` wins: `--entrypoint ADDR` talks to that entrypoint; otherwise `--offline` or
`--model CKPT` runs the offline engine in this process; otherwise the cluster recorded by `up` is
used when its entrypoint answers, and the offline engine with the built-in model when none does.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="checkpoint directory or Hugging Face repo id (default: the built-in model)")
    p.add_argument("--revision", default=None, help="hub revision (branch, tag, commit) of a repo id --model")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)


def _run(args, prompts: list) -> int:
    from deepinfer.engine import LLM, InvalidRequestError, SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                                structured_output=getattr(args, "structured_output", None))
        t0 = time.perf_counter()
        llm = LLM(model=args.model, dtype=args.dtype, device=args.device, revision=args.revision)
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


DEMO_QUESTIONS = ("Reverse these words: red green blue", "Repeat these words: cat river song")
"""Chat requests the demo sends (tasks the built-in model learned well; see its model card)."""
DEMO_PICTURE_QUESTION = "What colour is the shape?"
"""Asked about a drawn blue circle when the model has a vision tower (through the vision stage)."""


def _demo_picture() -> bytes:
    """A blue circle on white, as PNG bytes."""
    import io

    from PIL import Image, ImageDraw

    img = Image.new("RGB", (96, 96), (255, 255, 255))
    ImageDraw.Draw(img).ellipse((16, 16, 80, 80), fill=(30, 60, 220))
    out = io.BytesIO()
    img.save(out, "PNG")
    return out.getvalue()


def _cmd_demo(args) -> int:
    """A local Ray cluster (1 prefill + 1 decode, balancers, entrypoint) on the built-in model
    answers `DEMO_QUESTIONS` rendered in the model's chat format; prints one JSON line each."""
    import deepseek_recipe as recipe
    import ray

    from deepinfer.deploy.config import ClusterConfig
    from deepinfer.deploy.launcher import connect_ray, start_cluster, stop_cluster
    from deepinfer.engine.hub import resolve_model
    from deepinfer.engine.tokenizer import load_chat_encoding, load_tokenizer
    from deepinfer.entrypoint.client import Client

    model = str(resolve_model(args.model, args.revision))  # a repo id: its snapshot, which the workers then find cached
    encoding = load_chat_encoding(model)
    tokenizer = load_tokenizer(model)
    config = ClusterConfig.model_validate({"name": "deepinfer-demo", "model": model, "http": {"enabled": False}})
    t0 = time.perf_counter()
    connect_ray(None, num_cpus=max(os.cpu_count() or 1, 8))
    controller = start_cluster(config)
    code = 0
    try:
        addresses = ray.get(controller.up.remote())
        t1 = time.perf_counter()
        has_vision = "vision" in config.active_stages()
        print(f"# local cluster up in {t1 - t0:.1f}s: entrypoint {addresses['entrypoint']}, "
              f"{'1 vision + ' if has_vision else ''}1 prefill + 1 decode instance (separate processes, "
              f"{'image embeddings and ' if has_vision else ''}KV over NIXL)", file=sys.stderr, flush=True)
        asks = [(q, q, []) for q in DEMO_QUESTIONS]  # (shown, message text, images)
        if has_vision:  # the picture part then the question, as recipe renders an API message of both
            asks.append((f"[picture of a blue circle] {DEMO_PICTURE_QUESTION}",
                         recipe.SpecialToken.Image.default_str() + "\n\n" + DEMO_PICTURE_QUESTION, [_demo_picture()]))
        with Client(addresses["entrypoint"], timeout_s=REMOTE_TIMEOUT_S) as client:
            for shown, text, images in asks:
                message = recipe.UserMessage(text, image_sources=[recipe.BytesImageSource(b) for b in images])
                prompt = encoding.encode(recipe.Conversation([message], thinking_mode=False))
                out = client.generate(prompt, max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                                      images=images or None)
                answer = tokenizer.decode(out["token_ids"], skip_special_tokens=True)
                print(json.dumps({"question": shown, "answer": answer, "token_ids": out["token_ids"],
                                  "finish_reason": out["finish_reason"], "usage": out["usage"]}, ensure_ascii=False),
                      flush=True)
    except Exception as e:
        print(f"deepinfer demo: {e}", file=sys.stderr)
        code = 1
    finally:
        stop_cluster(controller)
        ray.shutdown()
    return code


REMOTE_TIMEOUT_S = 3600.0
"""Longest a `generate` call on a cluster may take (a bound on a stuck cluster, not a speed target)."""


def _print_result(prompt_token_ids: list[int], out: dict) -> None:
    print(json.dumps({"prompt_token_ids": prompt_token_ids, "token_ids": out["token_ids"], "text": out["text"],
                      "finish_reason": out["finish_reason"], "usage": out["usage"]}, ensure_ascii=False))


def _run_remote(args, address: str, prompts: list) -> int:
    """Generate each prompt on the entrypoint at `address` (concurrently); one JSON line per prompt."""
    import grpc

    from deepinfer.entrypoint.client import Client, GenerateError

    if any(not isinstance(p, dict) for p in prompts):
        print(json.dumps({"error": "the entrypoint takes token ids: give --prompt-ids (or --offline for text)",
                          "field": "prompt"}), file=sys.stderr)
        return 2
    kwargs = dict(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                  structured_output=args.structured_output)
    t0 = time.perf_counter()
    with Client(address, timeout_s=REMOTE_TIMEOUT_S) as client, ThreadPoolExecutor(min(32, len(prompts))) as pool:
        futures = [pool.submit(client.generate, p["prompt_token_ids"], **kwargs) for p in prompts]
        code = 0
        for prompt, fut in zip(prompts, futures):
            try:
                _print_result(prompt["prompt_token_ids"], fut.result())
            except GenerateError as e:
                print(json.dumps({"error": e.message, "code": e.code.name, "field": e.field}), file=sys.stderr)
                code = max(code, 2 if e.code == grpc.StatusCode.INVALID_ARGUMENT else 1)
    print(f"# generated on the entrypoint {address} in {time.perf_counter() - t0:.2f}s", file=sys.stderr)
    return code


def _running_entrypoint() -> str | None:
    """The entrypoint recorded by `deepinfer up`, if it answers Health within a second."""
    import grpc

    from deepinfer.deploy.launcher import read_state
    from deepinfer.protos import common_pb2, entrypoint_pb2_grpc

    state = read_state()
    address = (state or {}).get("entrypoint")
    if not address:
        return None
    try:
        with grpc.insecure_channel(address) as channel:
            entrypoint_pb2_grpc.EntrypointStub(channel).Health(common_pb2.HealthRequest(), timeout=1.0)
        return address
    except grpc.RpcError:
        print(f"# the cluster recorded in the state file ({address}) does not answer; generating offline",
              file=sys.stderr)
        return None


def _add_ray_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=None,
                   help="Ray cluster (host:port or auto); default: the one `deepinfer up` recorded, else auto")
    p.add_argument("--name", default=None, help="cluster name (default: the recorded one, else deepinfer)")


def _connect(args):
    """Join the Ray cluster that runs the named controller; returns the controller handle."""
    from deepinfer.deploy.launcher import connect_ray, find_controller, read_state

    state = read_state() or {}
    connect_ray(args.address or state.get("ray_address") or "auto")
    return find_controller(args.name or state.get("name") or "deepinfer")


def _cmd_up(args, parser) -> int:
    import ray

    from deepinfer.deploy.config import ClusterConfig
    from deepinfer.deploy.launcher import connect_ray, remove_state, start_cluster, stop_cluster, write_state

    if args.detach and args.address is None:
        parser.error("--detach needs --address: a local Ray cluster started by `up` lives only as long as `up`")
    try:
        config = ClusterConfig.load(args.config) if args.config else ClusterConfig()
        if args.model or args.revision:
            update = {k: v for k, v in (("model", args.model), ("revision", args.revision)) if v}
            config = ClusterConfig.model_validate({**config.model_dump(), **update})
    except ValueError as e:
        parser.error(str(e))
    needed = sum(g.num_instances * g.num_ranks * g.resources_per_rank.get("CPU", 0)
                 for s in config.active_stages() for g in config.stage(s).groups)
    num_cpus = args.num_cpus or max(os.cpu_count() or 1, 2 * int(needed + 0.999), 8)
    started_ray = connect_ray(args.address, num_cpus=num_cpus, resources=args.resources)
    controller = start_cluster(config)
    stopped = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopped.set())
    try:
        addresses = ray.get(controller.up.remote())
    except ray.exceptions.RayTaskError as e:
        stop_cluster(controller)
        print(f"deepinfer up: {e.cause if isinstance(e.cause, Exception) else e}", file=sys.stderr)
        return 1
    except BaseException:
        stop_cluster(controller)
        raise
    state = {"name": config.name, "ray_address": ray.get_runtime_context().gcs_address, **addresses,
             "pid": os.getpid(), "is_detached": bool(args.detach)}
    write_state(state)
    print(json.dumps(state), flush=True)
    print(f"# deepinfer cluster {config.name!r} up: entrypoint {addresses['entrypoint']}"
          + (f", HTTP {addresses['http']}" if "http" in addresses else ""), file=sys.stderr, flush=True)
    if args.detach:
        return 0
    print("# attached: Ctrl-C (or `deepinfer down`) takes it down", file=sys.stderr, flush=True)
    is_alive = True
    try:
        while is_alive and not stopped.wait(2.0):
            try:  # `deepinfer down` from another shell ends this one too
                ray.get(controller.num_instances.remote(), timeout=30)
            except ray.exceptions.RayActorError:
                is_alive = False
            except ray.exceptions.GetTimeoutError:
                pass
    finally:
        if is_alive:
            stop_cluster(controller)
        remove_state(config.name)
        if started_ray:
            ray.shutdown()
    return 0


def _fmt_status(status: dict) -> str:
    cols = ["STAGE", "INSTANCE", "DC", "STATE", "HEALTHY", "RUNNING", "WAITING", "KV BLOCKS", "CACHE", "HB MS", "PID"]
    rows = []
    order = {"vision": 0, "prefill": 1, "decode": 2}
    for r in sorted(status["instances"], key=lambda r: (order.get(r["stage"], 3), r["instance_id"])):
        total = r.get("num_kv_blocks_total", 0)
        used = r.get("num_kv_blocks_used", 0)
        rows.append([r["stage"], r["instance_id"], r.get("datacenter") or "-", r["state"],
                     {True: "yes", False: "NO"}.get(r.get("is_healthy"), "?"),
                     str(r.get("num_running_requests", "-")), str(r.get("num_waiting_requests", "-")),
                     f"{used}/{total}" if total else "-", f"{100 * used / total:.0f}%" if total else "-",
                     str(r.get("heartbeat_age_ms", "-")), str(r.get("pid", "-"))])
    widths = [max(len(c), *(len(row[i]) for row in rows)) if rows else len(c) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in rows]
    for stage, value in status["balance"].items():
        counts = sum(r["stage"] == stage and r["state"] == "serving" for r in status["instances"])
        shown = "unreachable" if value is None else f"{value:.2f}"
        lines.append(f"{stage}: {counts} serving, balance (max/mean load) {shown}")
    lines += [f"{role}: {address}" for role, address in status["addresses"].items()]
    return "\n".join(lines)


def _parse_targets(parser, items: list[str]) -> dict[str, int]:
    targets = {}
    for item in items:
        key, sep, value = item.partition("=")
        try:
            targets[key] = int(value)
        except ValueError:
            sep = ""
        if not sep or not key:
            parser.error(f"{item!r}: write STAGE=N or STAGE.GROUP=N, e.g. prefill=2 decode=3")
    if not targets:
        parser.error("give at least one STAGE=N, e.g. `deepinfer scale decode=3`")
    return targets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deepinfer", description="Disaggregated serving for DeepSeek-V4 models")
    sub = parser.add_subparsers(dest="cmd", required=True)
    demo = sub.add_parser("demo", help="a local cluster with the built-in model answers chat requests, then stops")
    _add_engine_args(demo)
    demo.add_argument("--offline", action="store_true", help="generate with the offline engine instead of a cluster")
    gen = sub.add_parser("generate", help="generate on the running cluster, or offline on a checkpoint")
    _add_engine_args(gen)
    gen.add_argument("--prompt", action="append", default=[], help="a text prompt (repeatable; offline only)")
    gen.add_argument("--prompt-ids", action="append", default=[], help="comma-separated token ids (repeatable)")
    gen.add_argument("--entrypoint", default=None, help="host:port of a cluster's entrypoint (wins over the rest)")
    gen.add_argument("--offline", action="store_true", help="run the offline engine even when a cluster is up")
    gen.add_argument("--structured-output", type=json.loads, default=None, metavar="JSON",
                     help='constrain the output, e.g. \'{"json_schema": "{\\"type\\": \\"object\\"}"}\' or '
                          '\'{"regex": "[0-9]+"}\' (fields of SamplingParams.structured_output)')
    up = sub.add_parser("up", help="launch a cluster on Ray (default: local, built-in model, 1 prefill + 1 decode)")
    up.add_argument("--config", default=None, help="cluster YAML (deploy/configs/*.yaml); default: laptop layout")
    up.add_argument("--address", default=None, help="join this Ray cluster (host:port or auto) instead of a local one")
    up.add_argument("--model", default=None,
                    help="checkpoint directory or Hugging Face repo id (overrides the config's model)")
    up.add_argument("--revision", default=None, help="hub revision of a repo id --model (overrides the config's)")
    up.add_argument("--detach", action="store_true", help="return once up (needs --address); `deepinfer down` stops it")
    up.add_argument("--num-cpus", type=int, default=None, help="logical CPUs of a local Ray cluster")
    up.add_argument("--resources", type=json.loads, default=None,
                    help='custom resources of a local Ray cluster (JSON), e.g. \'{"datacenter_dc-a": 100}\'')
    status = sub.add_parser("status", help="instances per stage: state, health, load, KV cache use")
    _add_ray_args(status)
    status.add_argument("--json", action="store_true", help="print the raw status as JSON")
    scale = sub.add_parser("scale", help="set instance counts live: prefill=N decode=M (or STAGE.GROUP=N)")
    _add_ray_args(scale)
    scale.add_argument("targets", nargs="+", metavar="STAGE=N")
    down = sub.add_parser("down", help="stop the cluster")
    _add_ray_args(down)
    args = parser.parse_args(argv)

    if args.cmd == "up":
        return _cmd_up(args, parser)
    if args.cmd in ("status", "scale", "down"):
        import ray

        from deepinfer.deploy.launcher import ClusterNotFound, remove_state, stop_cluster

        targets = _parse_targets(parser, args.targets) if args.cmd == "scale" else None
        try:
            controller = _connect(args)
        except (ClusterNotFound, ConnectionError) as e:
            print(f"deepinfer {args.cmd}: {e}", file=sys.stderr)
            return 1
        if args.cmd == "status":
            st = ray.get(controller.status.remote())
            print(json.dumps(st) if args.json else _fmt_status(st))
        elif args.cmd == "scale":
            try:
                print(json.dumps(ray.get(controller.scale.remote(targets))))
            except ray.exceptions.RayTaskError as e:
                cause = e.cause if isinstance(e.cause, Exception) else e
                print(f"deepinfer scale: {cause}", file=sys.stderr)
                return 2 if isinstance(cause, (ValueError, KeyError)) else 1
        else:
            stop_cluster(controller)
            remove_state(args.name)
            print("# cluster down", file=sys.stderr)
        return 0
    if args.cmd == "demo":
        if not args.offline:
            return _cmd_demo(args)
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
    if args.entrypoint:
        return _run_remote(args, args.entrypoint, prompts)
    if not args.offline and args.model is None:
        address = _running_entrypoint()
        if address is not None:
            return _run_remote(args, address, prompts)
    return _run(args, prompts)


if __name__ == "__main__":
    sys.exit(main())
