"""Which operations a decode step launches, per layer, with the CUDA default implementations — on the CPU.

    TRITON_INTERPRET=1 python -m deepinfer.benchmarks.op_inventory [--batch 1] [--context 64] [--json OUT]

Issue 22 asks for fewer than 50 kernels a layer in a decode step; the H200 profile (`gpu_roofline`) counts
them but needs the GPU and names cuBLAS' kernels, not our code. This tool answers "where do a layer's launches
come from" on any machine: the `gpu_roofline` V4-Flash-shaped 4-layer stack (SWA, SWA, CSA, HCA; hc 4; the
Triton attention and MoE backends; every op of the model's `OpTable` and the attention backend's decode ops
set to their CUDA default, the Triton kernels interpreted) at small widths (launches depend on the structure,
not on the widths), in `--dtype` (bfloat16, as on the GPU: its casts count), one decode step of `--batch` requests after
`--context` tokens, counted per decoder layer:

* every Triton kernel launch, by kernel name;
* every ATen operator the forward dispatches outside those launches, by name, except those that launch no
  kernel on a GPU (views, reshapes, `empty`, a `to` that converts nothing — `to` is counted only when it
  changes the dtype or the device).

NOTE: an ATen operator is not exactly one GPU kernel: cuBLAS may add a split-K reduction to a `linear`
(the H200 profile shows ~8 a step at batch 1), `rms_norm` is one kernel, `index_put_` can be two. Read the
figures as the launch sites our Python owns; the GPU profile remains the measurement.
"""

from __future__ import annotations

import argparse
import collections
import json
import os

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_NO_KERNEL = {
    "view", "_unsafe_view", "as_strided", "t", "transpose", "unsqueeze", "expand", "slice", "select", "permute",
    "reshape", "alias", "detach", "squeeze", "split", "unbind", "chunk", "_reshape_alias", "split_with_sizes",
    "lift_fresh", "unflatten", "flatten", "narrow", "view_as_real", "view_as_complex", "movedim", "diagonal",
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "sym_size", "sym_stride", "dim",
    "is_same_size", "_local_scalar_dense",
}
"""ATen operators that launch no GPU kernel (metadata, allocation)."""


def small_v4_flash_4l() -> dict:
    """`gpu_roofline`'s V4-Flash-shaped stack at small widths (same layer kinds, hc, top-k structure)."""
    from deepinfer.benchmarks import gpu_roofline as gr

    cfg = gr.v4_flash_4l()
    cfg.update(vocab_size=512, hidden_size=128, moe_intermediate_size=64, num_attention_heads=4, head_dim=64,
               qk_rope_head_dim=16, q_lora_rank=64, o_groups=2, o_lora_rank=32, n_routed_experts=8,
               index_n_heads=4, index_head_dim=32, index_topk=16, sliding_window=16,
               compress_rates={gr.CSA: 4, gr.HCA: 16}, max_position_embeddings=4096)
    return cfg


class _Counter(TorchDispatchMode):
    """Counts ATen operators by (where, name); paused while a Triton kernel runs (the interpreter's own ops)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.where = "top"
        self.active = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        if self.active and name not in _NO_KERNEL and not (name in ("to", "_to_copy") and not _converts(args, kwargs)):
            self.counts[(self.where, "aten." + name)] += 1
        return func(*args, **kwargs)


def _converts(args, kwargs) -> bool:
    """Whether a `to` / `_to_copy` call changes the tensor's dtype or device (a kernel on a GPU)."""
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor):
        return True
    dtype = kwargs.get("dtype") or next((a for a in args[1:] if isinstance(a, torch.dtype)), None)
    device = kwargs.get("device") or next((a for a in args[1:] if isinstance(a, (torch.device, str))), None)
    return (dtype is not None and dtype != x.dtype) or (device is not None and torch.device(device) != x.device)


def inventory(batch: int = 1, context: int = 64, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Per-layer launch counts of one decode step (module docstring); needs `TRITON_INTERPRET=1` off a GPU."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("run with TRITON_INTERPRET=1 (the Triton kernels are counted as the interpreter runs them)")
    import triton.runtime.interpreter as interp

    from deepinfer.benchmarks import gpu_roofline as gr
    from deepinfer.engine.attention.triton_backend import TritonAttentionBackend
    from deepinfer.engine.config import ModelConfig
    from deepinfer.engine.models.deepseek_v4 import DeepseekV4ForCausalLM
    from deepinfer.kernels.registry import _MODULE_OPS, default_impl, op_names

    cuda_ops = {n: default_impl(n, "cuda") for n in op_names() if n not in _MODULE_OPS}
    init = DeepseekV4ForCausalLM.__init__

    def init_with_cuda_ops(self, *a, **k):  # the OpTable of a CUDA model, on the CPU
        init(self, *a, **{**k, "op_impls": cuda_ops})

    DeepseekV4ForCausalLM.__init__ = init_with_cuda_ops
    try:
        model = gr.build_model(ModelConfig.from_hf_dict(small_v4_flash_4l()), torch.device("cpu"), dtype,
                               "triton", "triton")
    finally:
        DeepseekV4ForCausalLM.__init__ = init
    attn = TritonAttentionBackend("triton")  # the CUDA decode kernels whatever the device
    model.model.attention_backend = attn
    for layer in model.model.layers:
        layer.attn.backend = attn
    loop = gr.DecodeLoop(model, batch, context, 4, torch.device("cpu"), graphs=False)
    loop.step()  # a first step: lazily built state out of the count

    counter = _Counter()
    run = interp.InterpretedFunction.run

    def counted_run(self, *a, **k):
        counter.counts[(counter.where, "triton." + self.fn.__name__)] += 1
        counter.active = False
        try:
            return run(self, *a, **k)
        finally:
            counter.active = True

    hooks = []
    for i, layer in enumerate(model.model.layers):
        hooks.append(layer.register_forward_pre_hook(lambda m, a, i=i: setattr(counter, "where", f"layer{i}")))
        hooks.append(layer.register_forward_hook(lambda m, a, o: setattr(counter, "where", "top")))
    interp.InterpretedFunction.run = counted_run
    try:
        batch_ = loop.prepare()
        with torch.no_grad(), counter:
            model.step(batch_, loop.cache).argmax(dim=-1)
    finally:
        interp.InterpretedFunction.run = run
        for h in hooks:
            h.remove()
    kinds = ["layer0 (SWA)", "layer1 (SWA)", "layer2 (CSA)", "layer3 (HCA)"]
    report: dict = {"batch": batch, "context": context, "dtype": str(dtype).removeprefix("torch."), "op_impls": cuda_ops, "layers": {}}
    for where in sorted({w for w, _ in counter.counts}):
        ops = {n: c for (w, n), c in sorted(counter.counts.items(), key=lambda kv: -kv[1]) if w == where}
        label = kinds[int(where[5:])] if where.startswith("layer") else "outside the layers (embed, head)"
        report["layers"][label] = {"total": sum(ops.values()), "triton": sum(c for n, c in ops.items()
                                                                            if n.startswith("triton.")),
                                   "ops": ops}
    report["total"] = sum(v["total"] for v in report["layers"].values())
    return report


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                    help="the weights' dtype (bfloat16: the casts a GPU model runs are counted)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    report = inventory(args.batch, args.context, getattr(torch, args.dtype))
    for label, v in report["layers"].items():
        print(f"{label}: {v['total']} launches ({v['triton']} Triton): "
              + ", ".join(f"{n} x{c}" for n, c in v["ops"].items()))
    print(f"total: {report['total']} launches a step")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
