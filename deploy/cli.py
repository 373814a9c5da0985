"""The `deepinfer` command line.

  demo       the main job (the README's first command): a local cluster with the built-in model
             answers chat requests end to end, then goes down; `--offline` runs the offline engine instead
  generate   generation: on the running cluster's entrypoint, or offline on a checkpoint
  up         launch a cluster on Ray: balancers, (vision +) prefill + decode instances, entrypoint (+ HTTP front)
  serve      `serve MODEL`: `up` with the model as its argument (vLLM-style flags: --host --port --api-key
             --served-model-name --max-model-len --prefill N --decode N), one instance per stage by default
  ls         the recorded clusters and whether each is up, starting or stale
  logs       the log tail of a stage's processes (`deepinfer logs decode`), on the cluster's head node
  status     a table of the cluster's instances (state, health, load, KV cache use) and services (address, pid),
             and the persistent KV store's figures (blocks, bytes and TTL per traffic class)
  store      the persistent KV store: `deepinfer store stats|evict|clear` (the cluster's embedded store, or --dir)
  scale      change instance counts live: `deepinfer scale prefill=2 decode=3 vision=2` (`decode.GROUP=N` per group)
  down       stop the cluster

`up` with no arguments starts a local Ray cluster on loopback with the built-in default model, one
prefill and one decode instance (plus one vision instance when the model has a vision tower), the
stage balancers, the entrypoint and (when `entrypoint.http` is installed) the HTTP front; `--config FILE.yaml` describes other layouts (`deploy/configs/`), and
`--address HOST:PORT|auto` joins a running Ray cluster instead. It prints one JSON line with the
addresses and records them in `$DEEPINFER_HOME/clusters/<name>.json` for the other commands, which
pick a cluster by `--name` (default: $DEEPINFER_CLUSTER, else the only recorded one, else
`deepinfer`). Before starting anything `up` checks the model path, that no cluster of that name
runs and that its fixed ports are free, and refuses with the reason; it reports success only once
the entrypoint is healthy and the HTTP front answers /health. Other commands answer within seconds
when the named cluster is not recorded, still starting, or gone (a stale record is removed). Each
start generates a cluster secret that every internal gRPC call carries (`serving.auth`); it is
kept in the (user-only) record so that `generate` can reach the entrypoint.

The prefill stage keeps prompts' compressed KV in the embedded persistent store (`kvstore`), and the decode
stage writes finished conversation turns there, unless the worker settings say `kv_store: "off"` (or the YAML
`kv_store_dir: off`, or `up --kv-store-dir off`): by default in `$DEEPINFER_HOME/kvstore/<name>`
(`ClusterConfig.kv_store_dir`, recorded as `kv_store_dir`), which outlives `down` / `up` and machine restarts;
`--kv-store-dir PATH` or the YAML's `kv_store_dir` name another; `fresh` takes a new directory for one start,
removed when the cluster goes down (the demo's).

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
    config = ClusterConfig.model_validate({"name": "deepinfer-demo", "model": model, "http": {"enabled": False},
                                           "kv_store_dir": "fresh"})  # a demo leaves no store behind
    t0 = time.perf_counter()
    print(f"# starting a local cluster for {model}: Ray, the balancers, 1 prefill + 1 decode instance (loading the "
          "model), the entrypoint", file=sys.stderr, flush=True)
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
                                      images=images or None,
                                      image_placeholder_id=getattr(encoding, "image_placeholder_id", None))
                answer = tokenizer.decode(out["token_ids"], skip_special_tokens=True)
                print(json.dumps({"question": shown, "answer": answer, "token_ids": out["token_ids"],
                                  "finish_reason": out["finish_reason"], "usage": out["usage"]}, ensure_ascii=False),
                      flush=True)
    except Exception as e:
        print(f"deepinfer demo: {e}", file=sys.stderr)
        code = 1
    finally:
        stop_cluster(controller)
        _remove_fresh_store(_kv_store_dirs(config))  # the demo's per-start KV store goes with it
        ray.shutdown()
    return code


REMOTE_TIMEOUT_S = 3600.0
"""Longest a `generate` call on a cluster may take (a bound on a stuck cluster, not a speed target)."""


def _print_result(prompt_token_ids: list[int], out: dict) -> None:
    print(json.dumps({"prompt_token_ids": prompt_token_ids, "token_ids": out["token_ids"], "text": out["text"],
                      "finish_reason": out["finish_reason"], "usage": out["usage"]}, ensure_ascii=False))


def _run_remote(args, address: str, prompts: list, secret: str | None = None) -> int:
    """Generate each prompt (token ids) on the entrypoint at `address` (concurrently); one JSON line per
    prompt. `secret`: the cluster's (from its record); None = this process's (`serving.auth`)."""
    import grpc

    from deepinfer.entrypoint.client import Client, GenerateError

    kwargs = dict(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                  structured_output=args.structured_output)
    t0 = time.perf_counter()
    with Client(address, timeout_s=REMOTE_TIMEOUT_S, secret=secret) as client, \
            ThreadPoolExecutor(min(32, len(prompts))) as pool:
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


def _recorded_cluster(name: str | None) -> dict | None:
    """The recorded cluster `generate` may use: live and answering Health within a second, else None
    (saying why on stderr when one is recorded)."""
    import grpc

    from deepinfer.deploy.launcher import ClusterNotFound, default_cluster_name, find_state
    from deepinfer.protos import common_pb2, entrypoint_pb2_grpc
    from deepinfer.serving.auth import secure_channel

    cluster_name = default_cluster_name(name)
    try:
        state = find_state(cluster_name)
    except ClusterNotFound as e:
        if "no cluster named" not in str(e):
            print(f"# {e}; generating offline", file=sys.stderr)
        return None
    address = state.get("entrypoint")
    if not address:
        return None
    try:
        _use_tls(state.get("tls") or {})
        with secure_channel(address, secret="") as channel:  # Health needs no cluster secret; TLS as recorded
            entrypoint_pb2_grpc.EntrypointStub(channel).Health(common_pb2.HealthRequest(), timeout=1.0)
        return state
    except (grpc.RpcError, RuntimeError) as e:
        why = str(e) if isinstance(e, RuntimeError) else "does not answer"
        print(f"# the cluster {cluster_name!r} recorded in {_state_file(cluster_name)} ({address}): {why}; "
              "generating offline", file=sys.stderr)
        return None


def _running_entrypoint(name: str | None = None) -> str | None:
    """The entrypoint of the recorded cluster, if it answers Health within a second."""
    state = _recorded_cluster(name)
    return None if state is None else state["entrypoint"]


def _state_file(name: str) -> str:
    from deepinfer.deploy.launcher import state_path

    return str(state_path(name))


def _tokenize_prompts(prompts: list, model: str | None, revision: str | None) -> list:
    """Text prompts as token ids of the cluster's model (the entrypoint takes token ids)."""
    if all(isinstance(p, dict) for p in prompts):
        return prompts
    from deepinfer.engine.engine import default_model_path
    from deepinfer.engine.hub import resolve_model
    from deepinfer.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model(model, revision) if model else default_model_path())
    # NOTE: as the offline engine encodes a text prompt (`LLM`): no special tokens added
    return [p if isinstance(p, dict) else {"prompt_token_ids": tokenizer.encode(p, add_special_tokens=False).ids}
            for p in prompts]


def _add_ray_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=None,
                   help="Ray cluster (host:port or auto); default: the one `deepinfer up` recorded for --name")
    p.add_argument("--name", default=None,
                   help="cluster name (default: $DEEPINFER_CLUSTER, else the only recorded cluster, else deepinfer)")


def _connect(args):
    """Join the Ray cluster that runs the named controller; returns (controller handle, cluster name).

    Raises ClusterNotFound within seconds when no cluster of that name is recorded, it is still
    starting, its record is stale, or the given --address does not answer.
    """
    from deepinfer.deploy.launcher import (
        ClusterNotFound,
        accepts,
        connect_ray,
        default_cluster_name,
        find_controller,
        find_state,
    )

    name = default_cluster_name(args.name)
    if args.address:
        if args.address != "auto" and not accepts(args.address):
            raise ClusterNotFound(f"no Ray cluster answers at {args.address}")
        address = args.address
    else:
        address = find_state(name)["ray_address"]
    connect_ray(address)
    return find_controller(name), name


def _config_from_args(args, parser):
    """The cluster config of `up` / `serve`: the YAML (or the default layout) with the flags applied."""
    from deepinfer.deploy.config import ClusterConfig

    try:
        config = ClusterConfig.load(args.config) if args.config else ClusterConfig()
    except ValueError as e:
        parser.error(str(e))
    data = config.model_dump()
    from deepinfer.deploy.config import cluster_store_dir

    if args.name and data["kv_store_dir"] == str(cluster_store_dir(config.name)):
        data["kv_store_dir"] = None  # the default store follows the name (resolved again below)
    if getattr(args, "kv_store_dir", None):
        data["kv_store_dir"] = args.kv_store_dir
    for key in ("name", "model", "revision"):
        if getattr(args, key, None):
            data[key] = getattr(args, key)
    if args.host:
        data["host"] = data["http"]["host"] = args.host
    if args.port is not None:
        data["http"]["port"] = args.port
    if args.api_key:
        data["http"]["api_keys"] = [k.strip() for keys in args.api_key for k in keys.split(",") if k.strip()]
    if args.no_http:
        data["http"]["enabled"] = False
    if getattr(args, "batch_invariant", False):
        data["batch_invariant"] = True
    spec = {k: getattr(args, k, None) for k in ("speculative", "num_draft_tokens", "speculative_tokens",
                                                "speculative_method", "verify_schedule", "verify_floor",
                                                "verify_cost_table")}
    spec = {k: v for k, v in spec.items() if v is not None}
    if spec:  # speculative decoding: a decode-stage worker setting; the flags override the YAML's, name by name
        from deepinfer.engine.spec_decode.config import resolve_speculative_fields

        try:  # both in canonical names first (the YAML or the flags may use the aliases)
            worker = resolve_speculative_fields(data["decode"]["worker"], fill_default=False)
            flags = resolve_speculative_fields(spec, fill_default=False)
        except ValueError as e:
            parser.error(str(e))
        data["decode"]["worker"] = {**worker, **flags}
        # the prefill drafts the first block, sent with the KV, when the flags turn speculation on (the YAML: set
        # `speculative` in the prefill worker settings too)
        first = {k: flags[k] for k in ("speculative", "num_draft_tokens") if k in flags}
        if first:
            data["prefill"]["worker"] = {**data["prefill"]["worker"], **first}
    if getattr(args, "engram_placement", None):  # V4.1's Engram tables: a setting of both stages' workers
        for stage in ("prefill", "decode"):
            data[stage]["worker"] = {**data[stage]["worker"], "engram_placement": args.engram_placement}
    thinking = None if args.default_thinking is None else args.default_thinking == "on"
    front = {k: v for k, v in (("served_model_name", args.served_model_name), ("max_model_len", args.max_model_len),
                               ("log_level", args.log_level), ("log_format", getattr(args, "log_format", None)),
                               ("default_thinking", thinking))
             if v is not None}
    if front:
        data["http"]["settings"] = {**data["http"]["settings"], **front}
    for stage in ("prefill", "decode"):
        count = getattr(args, stage)
        if count is not None:
            if len(data[stage]["groups"]) != 1:
                parser.error(f"--{stage} N: the config has several {stage} groups; set their num_instances in the YAML")
            data[stage]["groups"][0]["num_instances"] = count
    if args.cluster_secret_file:
        data["cluster_secret_file"] = args.cluster_secret_file
    tls = {k: v for k, v in (("cert_file", getattr(args, "tls_cert", None)), ("key_file", getattr(args, "tls_key", None)),
                             ("ca_file", getattr(args, "tls_ca", None))) if v}
    if tls:  # the flags override the YAML's `tls:` field by field
        data["tls"] = {**(data.get("tls") or {}), **tls}
    try:
        return ClusterConfig.model_validate(data)
    except ValueError as e:
        parser.error(str(e))


def _check_model(model: str | None, revision: str | None) -> str | None:
    """Why `model` cannot be served (checked before anything starts), or None."""
    if model is None:
        return None
    from pathlib import Path

    from deepinfer.engine.hub import looks_like_repo_id

    path = Path(model).expanduser()
    if path.is_dir():
        return None if (path / "config.json").is_file() else f"--model {model}: the directory has no config.json"
    if path.exists():
        return f"--model {model}: not a checkpoint directory"
    if not looks_like_repo_id(model):
        return f"--model {model}: no such directory (and not a Hugging Face repo id like org/name)"
    try:
        from deepinfer.engine.hub import resolve_model

        resolve_model(model, revision)
    except Exception as e:  # not cached and not downloadable: the hub's own message says what to do
        return f"--model {model}: {e}"
    return None


def _refusal(config, is_local: bool) -> str | None:
    """Why `up` must not start this cluster now (a live one of that name, a taken port), or None."""
    from deepinfer.deploy.launcher import is_port_free, read_state, remove_state, state_liveness

    state = read_state(config.name)
    if state is not None:
        liveness = state_liveness(state)
        if liveness in ("up", "starting"):
            return (f"a cluster named {config.name!r} is {'running' if liveness == 'up' else 'starting'} "
                    f"(`deepinfer up`, pid {state.get('pid')}; entrypoint {state.get('entrypoint', '-')}, "
                    f"HTTP {state.get('http', '-')}); stop it with `deepinfer down --name {config.name}` or "
                    "start this one with another --name")
        remove_state(config.name)  # stale: its `up` is gone
    if is_local:
        ports = [("the HTTP front", config.http.host, config.http.port)] if config.http.enabled else []
        ports += [(f"the {s} balancer", config.host, config.stage(s).balancer.port) for s in ("prefill", "decode")]
        ports += [("the entrypoint", config.host, int(config.entrypoint.get("port", 0)))]
        from deepinfer.deploy.network import resolve_host

        for what, host, port in ports:
            try:
                host = resolve_host(host)  # a network: this node's address in it
            except RuntimeError as e:
                return str(e)
            if port and not is_port_free(host, port):
                return (f"port {port} on {host} (for {what}) is taken, by another cluster or program; "
                        "pick another with --port (HTTP) or in the config, or stop what holds it")
    return None


def _cluster_secret(config) -> str:
    """The secret of this cluster's internal calls: the YAML's file, else a fresh random one."""
    import secrets
    from pathlib import Path

    if config.cluster_secret_file:
        try:
            secret = Path(config.cluster_secret_file).read_text().strip()
        except OSError as e:
            raise ValueError(f"cluster_secret_file {config.cluster_secret_file}: {e.strerror}") from None
        if not secret:
            raise ValueError(f"cluster_secret_file {config.cluster_secret_file} is empty")
        return secret
    return secrets.token_urlsafe(32)


def _role_secrets(config, secret: str, is_local: bool) -> dict:
    """How the roles get the cluster secret and the front its API keys (`start_cluster` arguments).

    NOTE: as file paths where the files can be read by every role: the YAML's `cluster_secret_file`
    (on every node), or user-only files `up` writes for a local cluster. Only a generated secret for a
    cluster `up` joined with --address travels as a value (Ray's runtime-env agent logs it; give
    `cluster_secret_file` there).
    """
    from deepinfer.deploy.controller import API_KEY_FILE_ENV
    from deepinfer.deploy.launcher import write_private_file
    from deepinfer.serving.auth import SECRET_FILE_ENV

    env: dict[str, str] = {}
    if config.cluster_secret_file:
        env[SECRET_FILE_ENV] = str(config.cluster_secret_file)
    elif is_local:
        env[SECRET_FILE_ENV] = write_private_file(config.name, "secret", secret)
    if is_local and config.http.api_keys:
        env[API_KEY_FILE_ENV] = write_private_file(config.name, "api_keys", ",".join(config.http.api_keys))
    if config.tls is not None:
        env.update(config.tls.env())  # every role serves and dials TLS (serving.auth)
    return {"secret": None if SECRET_FILE_ENV in env else secret, "role_env": env}


def _use_tls(env: dict[str, str]) -> None:
    """Make a cluster's TLS settings (`TlsConfig.env()`, as `up` records them) this process's, so its
    clients (health checks, `generate`) dial TLS; RuntimeError naming a missing or bad file."""
    from deepinfer.serving.auth import TLS_ENVS, tls_settings

    for key in TLS_ENVS:
        if env.get(key):
            os.environ[key] = env[key]
        else:
            os.environ.pop(key, None)
    tls_settings()


def _https_context(url: str):
    """The SSL context an https URL of the cluster is checked with: the cluster's CA (`DEEPINFER_TLS_CA`)."""
    if not url.startswith("https://"):
        return None
    import ssl

    from deepinfer.serving.auth import TLS_CA_ENV

    return ssl.create_default_context(cafile=os.environ.get(TLS_CA_ENV) or None)


def _log_env(args) -> dict[str, str]:
    """`--log-level` / `--log-format` for every role, as the environment `serving.logs` reads."""
    from deepinfer.serving.logs import FORMAT_ENV, LEVEL_ENV

    env = {}
    if getattr(args, "log_level", None):
        env[LEVEL_ENV] = args.log_level
    if getattr(args, "log_format", None):
        env[FORMAT_ENV] = args.log_format
    return env


def _wait_healthy(addresses: dict, secret: str, expect_healthy: bool, timeout_s: float = 120.0) -> str | None:
    """Blocks until the entrypoint answers Health, healthy when `expect_healthy` (every stage has an
    instance: each serves), and the HTTP front answers /health; returns what did not, or None."""
    import urllib.request

    from deepinfer.entrypoint.client import Client

    deadline = time.monotonic() + timeout_s
    with Client(addresses["entrypoint"], secret=secret) as client:
        while True:
            try:
                health = client.health()
                if health["is_healthy"] or not expect_healthy:
                    break
                why = health.get("message") or "not healthy"
            except Exception as e:
                why = str(e)
            if time.monotonic() > deadline:
                return f"the entrypoint did not report healthy within {timeout_s:.0f} s: {why}"
            time.sleep(0.5)
    if "http" in addresses:
        base = addresses["http"] if "://" in addresses["http"] else "http://" + addresses["http"]
        url = base.rstrip("/") + "/health"
        while True:
            try:
                with urllib.request.urlopen(url, timeout=2.0, context=_https_context(url)) as r:
                    if r.status == 200:
                        return None
            except (OSError, ValueError) as e:
                why = str(e)
            if time.monotonic() > deadline:
                return f"the HTTP front ({url}) did not answer within {timeout_s:.0f} s: {why}"
            time.sleep(0.5)
    return None


def _ray_log_dir() -> str | None:
    """This Ray session's log folder (every role's stdout / stderr), when Ray runs on this host."""
    try:
        import ray

        return os.path.join(ray._private.worker._global_node.get_session_dir_path(), "logs")
    except Exception:
        return None


def _cmd_up(args, parser) -> int:
    import ray

    from deepinfer.deploy.launcher import (
        connect_ray,
        is_loopback,
        remove_private_files,
        remove_state,
        start_cluster,
        stop_cluster,
        write_state,
    )

    if args.detach and args.address is None:
        parser.error("--detach needs --address: a local Ray cluster started by `up` lives only as long as `up`")
    config = _config_from_args(args, parser)
    why = _check_model(config.model, config.revision)
    if why is not None:
        print(f"deepinfer {args.cmd}: {why}", file=sys.stderr)
        return 2
    is_local = args.address is None or is_loopback(args.address)
    why = _refusal(config, is_local)
    if why is not None:
        print(f"deepinfer {args.cmd}: {why}", file=sys.stderr)
        return 1
    try:
        secret = _cluster_secret(config)
        _use_tls(config.tls.env() if config.tls is not None else {})  # checked before anything starts
    except (ValueError, RuntimeError) as e:
        print(f"deepinfer {args.cmd}: {e}", file=sys.stderr)
        return 2
    pid = os.getpid()
    write_state({"name": config.name, "status": "starting", "pid": pid, "is_detached": bool(args.detach)})
    needed = sum(g.num_instances * g.num_ranks * g.resources_per_rank.get("CPU", 0)
                 for s in config.active_stages() for g in config.stage(s).groups)
    num_cpus = args.num_cpus or max(os.cpu_count() or 1, 2 * int(needed + 0.999), 8)
    # NOTE: during start-up SIGTERM interrupts like Ctrl-C, so the half-started cluster is taken down
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    stages = " + ".join(f"{n} {s}" for s, n in config.num_instances().items())
    started_ray = controller = None
    try:
        print(f"# starting cluster {config.name!r}: Ray, balancers, {stages} (loading weights), entrypoint"
              + (", HTTP front" if config.http.enabled else ""), file=sys.stderr, flush=True)
        started_ray = connect_ray(args.address, num_cpus=num_cpus, resources=args.resources)
        roles = _role_secrets(config, secret, is_local)
        roles["role_env"].update(_log_env(args))
        controller = start_cluster(config, **roles)
        addresses = ray.get(controller.up.remote())
        print("# every role serves; waiting for health checks", file=sys.stderr, flush=True)
        why = _wait_healthy(addresses, secret, expect_healthy=all(n > 0 for n in config.num_instances().values()))
        if why is not None:
            raise RuntimeError(why)
    except BaseException as e:
        if controller is not None:
            try:
                stop_cluster(controller)
            except Exception:
                pass
        remove_state(config.name, pid)
        remove_private_files(config.name)
        _remove_fresh_store(_kv_store_dirs(config))
        if started_ray:
            ray.shutdown()
        if isinstance(e, KeyboardInterrupt):
            print(f"deepinfer {args.cmd}: interrupted; everything started was stopped", file=sys.stderr)
            return 130
        if isinstance(e, ray.exceptions.RayTaskError):
            e = e.cause if isinstance(e.cause, Exception) else e
        if isinstance(e, Exception):
            print(f"deepinfer {args.cmd}: {e}", file=sys.stderr)
            return 1
        raise
    state = {"name": config.name, "status": "up", "ray_address": ray.get_runtime_context().gcs_address,
             **addresses, "pid": pid, "is_detached": bool(args.detach), "model": config.model,
             "revision": config.revision, "log_dir": _ray_log_dir(), "kv_store_dir": _kv_store_dirs(config)}
    if config.tls is not None:  # how later commands dial the cluster (`_use_tls`)
        state["tls"] = config.tls.env()
    write_state({**state, "cluster_secret": secret})
    print(json.dumps(state), flush=True)
    print(f"# deepinfer cluster {config.name!r} up: entrypoint {addresses['entrypoint']}"
          + (f", HTTP {addresses['http']}" if "http" in addresses else "")
          + (f"; logs in {state['log_dir']} (`deepinfer logs`)" if state["log_dir"] else ""), file=sys.stderr, flush=True)
    if args.detach:
        return 0
    print("# attached: Ctrl-C (or `deepinfer down`) takes it down", file=sys.stderr, flush=True)
    stopped = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopped.set())
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
        remove_state(config.name, pid)
        remove_private_files(config.name)
        _remove_fresh_store(_kv_store_dirs(config))
        if started_ray:
            ray.shutdown()
    return 0


def _cmd_ls() -> int:
    from deepinfer.deploy.launcher import list_states, state_liveness

    states = list_states()
    if not states:
        print("# no cluster recorded; start one with `deepinfer up` or `deepinfer serve MODEL`", file=sys.stderr)
        return 0
    rows = [["NAME", "STATUS", "PID", "ENTRYPOINT", "HTTP", "MODEL"]]
    for st in states:
        rows.append([st["name"], state_liveness(st), str(st.get("pid", "-")), st.get("entrypoint", "-"),
                     st.get("http", "-"), str(st.get("model") or "-")])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
    return 0


def _cmd_logs(args) -> int:
    """Print the log tail of a stage's processes (every role when no stage is given), on this host."""
    from pathlib import Path

    from deepinfer.deploy.launcher import ClusterNotFound, default_cluster_name, find_state

    name = default_cluster_name(args.name)
    try:
        state = find_state(name)
    except ClusterNotFound as e:
        print(f"deepinfer logs: {e}", file=sys.stderr)
        return 1
    log_dir = state.get("log_dir")
    if not log_dir or not Path(log_dir).is_dir():
        print(f"deepinfer logs: the logs of {name!r} are not on this host (Ray session logs of its head node)",
              file=sys.stderr)
        return 1
    import ray

    try:
        controller, _ = _connect(argparse.Namespace(address=None, name=name))
        status = ray.get(controller.status.remote(), timeout=30)
    except Exception as e:
        print(f"deepinfer logs: {e}", file=sys.stderr)
        return 1
    services = [(r["stage"], r["instance_id"], r.get("pid")) for r in status["instances"]]
    services += [(s["role"], s["role"], s.get("pid")) for s in status.get("services", [])]
    wanted = [x for x in services if args.stage in (None, x[0], x[1], x[0].removesuffix("_lb"))]
    if not wanted:
        print(f"deepinfer logs: no process of {args.stage!r}; stages and roles: "
              f"{sorted({x[0] for x in services})}", file=sys.stderr)
        return 2
    for _stage, instance_id, pid in wanted:
        files = sorted(Path(log_dir).glob(f"worker-*-{pid}.err")) + sorted(Path(log_dir).glob(f"worker-*-{pid}.out"))
        files += [Path(s["log"]) for s in status.get("services", []) if s.get("pid") == pid and s.get("log")]
        print(f"==> {instance_id} (pid {pid}): {', '.join(str(f) for f in files) or 'no log file found'}")
        for f in files:
            lines = f.read_text(errors="replace").splitlines()[-args.lines:]
            print("\n".join(lines))
    return 0


def _kv_store_dirs(config) -> str:
    """The prefill stage's embedded KV store directories (comma-separated), "" when it runs without one."""
    worker = config.role_config("prefill", instance_id="prefill-check", lb_address="127.0.0.1:1")
    return worker.kv_store_dirs if worker.kv_store == "embedded" else ""


def _remove_fresh_store(dirs: str | None) -> None:
    """Delete a per-start store directory (`config.is_fresh_store_dir`) once its cluster is down; a directory
    the YAML named is kept (it is meant to outlive the cluster)."""
    import shutil

    from deepinfer.deploy.config import fresh_store_root, is_fresh_store_dir

    for d in (dirs or "").split(","):
        if is_fresh_store_dir(d.strip()):
            shutil.rmtree(d.strip(), ignore_errors=True)
            for parent in (fresh_store_root(), fresh_store_root().parent):  # and the folders it made, once empty
                try:
                    parent.rmdir()
                except OSError:
                    break


def _store_figures(name: str) -> dict | None:
    """`KVStore.stats()` of the recorded cluster `name`'s embedded store (None: none recorded, or nothing stored)."""
    from deepinfer.deploy.launcher import read_state
    from deepinfer.kvstore.cli import store_stats

    dirs = ((read_state(name) or {}).get("kv_store_dir") or "").split(",")
    try:
        return store_stats(tuple(d.strip() for d in dirs if d.strip()))
    except Exception as e:  # the figures are extra: a store that cannot be read never fails `status`
        print(f"# the KV store in {dirs[0]} cannot be read: {e}", file=sys.stderr)
        return None


def _cmd_store(args) -> int:
    """`deepinfer store stats|evict|clear`: on --dir, else on the recorded cluster's embedded store (`--name`,
    default as `status`), else on that cluster's default store (`config.cluster_store_dir`: it outlives `down`)."""
    from deepinfer.kvstore.cli import run_store

    if args.backend == "embedded" and not args.dirs:
        from deepinfer.deploy.launcher import default_cluster_name, read_state

        name = default_cluster_name(args.name)
        state = read_state(name)
        if state is not None and state.get("kv_store_dir"):
            args.dirs = state["kv_store_dir"]
        elif state is None:  # not up: its default store, which outlives it (`config.cluster_store_dir`)
            from deepinfer.deploy.config import cluster_store_dir

            args.dirs = str(cluster_store_dir(name))
        else:
            print(f"deepinfer store: the cluster {name!r} has no embedded KV store recorded; give --dir",
                  file=sys.stderr)
            return 1
    return run_store(args)


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
        for rk in r.get("ranks", ()):  # a multi-rank instance: one line per rank (its requests, its KV pool)
            total, used = rk["num_kv_blocks_total"], rk["num_kv_blocks_used"]
            rows.append(["", f"  rank {rk['rank']}", "", "", "", str(rk["num_running_requests"]),
                         str(rk["num_waiting_requests"]), f"{used}/{total}" if total else "-",
                         f"{100 * used / total:.0f}%" if total else "-", "", ""])
    widths = [max(len(c), *(len(row[i]) for row in rows)) if rows else len(c) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in rows]
    for stage, value in status["balance"].items():
        counts = sum(r["stage"] == stage and r["state"] == "serving" for r in status["instances"])
        shown = "unreachable" if value is None else f"{value:.2f}"
        lines.append(f"{stage}: {counts} serving, balance (max/mean load) {shown}")
    services = {s["role"]: s for s in status.get("services", [])}
    for role, address in status["addresses"].items():
        svc = services.get(role)
        lines.append(f"{role}: {address}" + (f" (pid {svc.get('pid') or '-'}, {svc.get('state')})" if svc else ""))
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


def _add_up_args(p: argparse.ArgumentParser, *, is_serve: bool) -> None:
    if is_serve:
        p.add_argument("model", help="checkpoint directory or Hugging Face repo id")
    else:
        p.add_argument("--model", default=None,
                       help="checkpoint directory or Hugging Face repo id (overrides the config's model)")
    p.add_argument("--config", default=None, help="cluster YAML (deploy/configs/*.yaml); default: laptop layout")
    p.add_argument("--name", default=None, help="cluster name (overrides the config's; default deepinfer)")
    p.add_argument("--address", default=None, help="join this Ray cluster (host:port or auto) instead of a local one")
    p.add_argument("--revision", default=None, help="hub revision of a repo id --model (overrides the config's)")
    p.add_argument("--host", default=None, help="interface every server binds, the HTTP front's included")
    p.add_argument("--port", type=int, default=None, help="HTTP port (default: the config's, 8000)")
    p.add_argument("--api-key", action="append", default=[],
                   help="API key the HTTP front requires (repeatable or comma-separated: any one is accepted); "
                        "each may carry its policy: KEY;name=N;class=agent|chat;max_concurrent=C;rpm=R")
    p.add_argument("--served-model-name", default=None, help="model name clients send and /v1/models lists")
    p.add_argument("--max-model-len", type=int, default=None, help="context length the HTTP front accepts")
    p.add_argument("--prefill", type=int, default=None, metavar="N", help="prefill instances")
    p.add_argument("--decode", type=int, default=None, metavar="N", help="decode instances")
    p.add_argument("--default-thinking", choices=["on", "off"], default=None,
                   help="thinking mode of chat requests that name none (default on, as DeepSeek's API)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default=None,
                   help="log level of every process (HTTP front, entrypoint, balancers, workers)")
    p.add_argument("--log-format", choices=["text", "json"], default=None,
                   help="log lines as text or one JSON object each (every process; request ids on both)")
    p.add_argument("--no-http", action="store_true", help="no HTTP front (the token entrypoint only)")
    p.add_argument("--kv-store-dir", default=None, metavar="PATH|fresh|off",
                   help="the KV store's directory (default: $DEEPINFER_HOME/kvstore/NAME, kept across down/up); "
                        "fresh: a new one removed at down; off: no store")
    p.add_argument("--batch-invariant", action="store_true",
                   help="batch-invariant numerics on every prefill and decode worker (bit-identical outputs whatever "
                        "the batch; slower)")
    p.add_argument("--speculative", choices=["mtp", "dspark"], default=None,
                   help="speculative decoding on the decode stage (lossless; the prefill drafts the first block): mtp = "
                        "DeepSeek-V4's MTP layer, dspark = DeepSeek-V4.1's DSpark stages (their window rings travel "
                        "with the KV); default: the config's, off")
    p.add_argument("--num-draft-tokens", type=int, default=None, metavar="N",
                   help="drafts per request per step with --speculative (default: the config's, else 3)")
    p.add_argument("--speculative-tokens", type=int, default=None, metavar="K",
                   help="alias: --speculative mtp --num-draft-tokens K (0 = off)")
    p.add_argument("--speculative-method", choices=["mtp", "dspark"], default=None, help="alias of --speculative")
    p.add_argument("--engram-placement", choices=["auto", "device", "pinned_host"], default=None,
                   help="DeepSeek-V4.1: where the prefill and decode workers keep the Engram tables (device memory, or "
                        "pinned host memory gathered over PCIe; auto: the fit check decides; default: the config's)")
    p.add_argument("--verify-schedule", choices=["full", "confidence"], default=None,
                   help="drafts verified per request: all (full) or a prefix chosen by confidence")
    p.add_argument("--verify-floor", type=int, choices=[0, 1], default=None,
                   help="drafts every request verifies at least under the confidence schedule (default 1)")
    p.add_argument("--verify-cost-table", default=None, metavar="FILE",
                   help="step-cost table (JSON, benchmarks/speculative.py --profile-cost) of the confidence schedule; "
                        "'linear' = the linear stand-in (default: the shipped CPU table on a CPU)")
    p.add_argument("--cluster-secret-file", default=None,
                   help="file holding the secret of internal calls (default: a fresh one per start)")
    p.add_argument("--tls-cert", default=None, metavar="PATH",
                   help="PEM certificate every gRPC service and the HTTP front present: TLS everywhere (with --tls-key)")
    p.add_argument("--tls-key", default=None, metavar="PATH", help="PEM private key of --tls-cert")
    p.add_argument("--tls-ca", default=None, metavar="PATH",
                   help="PEM CA bundle clients check the services' certificates against (default: the system roots)")
    p.add_argument("--detach", action="store_true", help="return once up (needs --address); `deepinfer down` stops it")
    p.add_argument("--num-cpus", type=int, default=None, help="logical CPUs of a local Ray cluster")
    p.add_argument("--resources", type=json.loads, default=None,
                   help='custom resources of a local Ray cluster (JSON), e.g. \'{"datacenter_dc-a": 100}\'')


def build_parser() -> argparse.ArgumentParser:
    """The `deepinfer` argument parser (every subcommand)."""
    parser = argparse.ArgumentParser(prog="deepinfer", description="Disaggregated serving for DeepSeek-V4 models")
    sub = parser.add_subparsers(dest="cmd", required=True)
    demo = sub.add_parser("demo", help="a local cluster with the built-in model answers chat requests, then stops")
    _add_engine_args(demo)
    demo.add_argument("--offline", action="store_true", help="generate with the offline engine instead of a cluster")
    gen = sub.add_parser("generate", help="generate on the running cluster, or offline on a checkpoint")
    _add_engine_args(gen)
    gen.add_argument("--prompt", action="append", default=[], help="a text prompt (repeatable)")
    gen.add_argument("--prompt-ids", action="append", default=[], help="comma-separated token ids (repeatable)")
    gen.add_argument("--entrypoint", default=None, help="host:port of a cluster's entrypoint (wins over the rest)")
    gen.add_argument("--name", default=None, help="the recorded cluster to use (default: as `status`)")
    gen.add_argument("--offline", action="store_true", help="run the offline engine even when a cluster is up")
    gen.add_argument("--structured-output", type=json.loads, default=None, metavar="JSON",
                     help='constrain the output, e.g. \'{"json_schema": "{\\"type\\": \\"object\\"}"}\' or '
                          '\'{"regex": "[0-9]+"}\' (fields of SamplingParams.structured_output)')
    up = sub.add_parser("up", help="launch a cluster on Ray (default: local, built-in model, 1 prefill + 1 decode)")
    _add_up_args(up, is_serve=False)
    serve = sub.add_parser("serve", help="serve MODEL: a local cluster (1 prefill + 1 decode) and the HTTP front")
    _add_up_args(serve, is_serve=True)
    sub.add_parser("ls", help="the recorded clusters: name, status (up / starting / stale), addresses")
    logs = sub.add_parser("logs", help="the log tail of a stage's processes (all when no stage is given)")
    logs.add_argument("stage", nargs="?", default=None, help="vision, prefill, decode, an instance id, a balancer, "
                      "entrypoint or http")
    logs.add_argument("--name", default=None, help="cluster name (default: as `status`)")
    logs.add_argument("-n", "--lines", type=int, default=40, help="lines per file")
    status = sub.add_parser("status", help="every service: instances per stage (state, health, load, KV cache use), "
                            "balancers, entrypoint, HTTP front")
    _add_ray_args(status)
    status.add_argument("--json", action="store_true", help="print the raw status as JSON")
    scale = sub.add_parser("scale", help="set instance counts live: prefill=N decode=M (or STAGE.GROUP=N)")
    _add_ray_args(scale)
    scale.add_argument("targets", nargs="+", metavar="STAGE=N")
    down = sub.add_parser("down", help="stop the cluster")
    _add_ray_args(down)
    from deepinfer.kvstore.cli import add_store_parser

    store = add_store_parser(sub)
    store.add_argument("--name", default=None, help="the recorded cluster whose store to use (default: as `status`)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)

    if args.cmd in ("up", "serve"):
        return _cmd_up(args, parser)
    if args.cmd == "ls":
        return _cmd_ls()
    if args.cmd == "logs":
        return _cmd_logs(args)
    if args.cmd == "store":
        return _cmd_store(args)
    if args.cmd in ("status", "scale", "down"):
        from deepinfer.deploy.launcher import ClusterNotFound, remove_private_files, remove_state, stop_cluster

        targets = _parse_targets(parser, args.targets) if args.cmd == "scale" else None
        try:
            controller, name = _connect(args)
        except (ClusterNotFound, ConnectionError) as e:
            print(f"deepinfer {args.cmd}: {e}", file=sys.stderr)
            return 1
        import ray

        if args.cmd == "status":
            st = ray.get(controller.status.remote())
            kv = _store_figures(name)
            if args.json:
                print(json.dumps({**st, "kv_store": kv}))
            else:
                from deepinfer.kvstore.cli import format_instance_figures, format_stats

                live = format_instance_figures(st["instances"])
                print(_fmt_status(st) + ("" if kv is None else "\n" + format_stats(kv)) + (live and "\n" + live))
        elif args.cmd == "scale":
            try:
                print(json.dumps(ray.get(controller.scale.remote(targets))))
            except ray.exceptions.RayTaskError as e:
                cause = e.cause if isinstance(e.cause, Exception) else e
                print(f"deepinfer scale: {cause}", file=sys.stderr)
                return 2 if isinstance(cause, (ValueError, KeyError)) else 1
        else:
            from deepinfer.deploy.launcher import read_state

            recorded = read_state(name) or {}
            stop_cluster(controller)
            remove_state(name)
            remove_private_files(name)
            _remove_fresh_store(recorded.get("kv_store_dir"))
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
    if args.model is not None:
        why = _check_model(args.model, args.revision)
        if why is not None:
            print(json.dumps({"error": why, "field": "model"}), file=sys.stderr)
            return 2
    if args.entrypoint:
        return _run_remote(args, args.entrypoint, _tokenize_prompts(prompts, None, None))
    if not args.offline and args.model is None:
        state = _recorded_cluster(args.name)
        if state is not None:
            prompts = _tokenize_prompts(prompts, state.get("model"), state.get("revision"))
            return _run_remote(args, state["entrypoint"], prompts, secret=state.get("cluster_secret"))
    return _run(args, prompts)


if __name__ == "__main__":
    sys.exit(main())
