"""The op registry: the model's small fused ops, each with named implementations.

An *op* is one small piece of model arithmetic that has several implementations (the mHC Sinkhorn
normalisation first). Each implementation registers under `(op_name, impl_name)`; every op has a
`"torch"` implementation, the readable reference and the oracle the others are tested against.
A model picks its implementations ONCE, at construction (`OpTable`), from the device its weights
live on; hot loops call `ops.<op_name>(...)` and never test the device or a mode.

Adding an implementation (a Triton or TileLang kernel, say): write it in `kernels/<op>.py` beside
the torch reference, with a wrapper that checks shapes, dtypes and contiguity; decorate the wrapper
with `@register_op("<op>", "<impl>")`; test it against the reference on random data (Triton kernels
also under `TRITON_INTERPRET=1` on the CPU); and make it the op's device default
(`register_default_impl`) only where it matches the reference bit for bit.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])

_IMPLS: dict[str, dict[str, Callable[..., Any]]] = {}
_DEFAULTS: dict[str, Callable[[torch.device], str]] = {}
_MODULE_OPS: set[str] = set()
"""Ops picked by the modules that use them (per device, e.g. a quantized linear), not by a model's `OpTable`."""


def register_op(op_name: str, impl_name: str, *, in_op_table: bool = True) -> Callable[[F], F]:
    """Decorator: register `fn` as implementation `impl_name` of op `op_name`.

    `in_op_table=False` marks a *module op*: the modules that run it (e.g. `engine.quant.Fp8Linear`) pick its
    implementation once per device with `default_impl` / `get_op` themselves, and a model's `OpTable`
    does not list it.
    """

    def wrap(fn: F) -> F:
        if not in_op_table:
            _MODULE_OPS.add(op_name)
        impls = _IMPLS.setdefault(op_name, {})
        if impl_name in impls and impls[impl_name] is not fn:
            raise ValueError(f"op {op_name!r} already has an implementation named {impl_name!r}")
        impls[impl_name] = fn
        return fn

    return wrap


def register_default_impl(op_name: str) -> Callable[[Callable[[torch.device], str]], Callable[[torch.device], str]]:
    """Decorator: register `pick(device) -> impl_name`, the op's default implementation on a device."""

    def wrap(pick: Callable[[torch.device], str]) -> Callable[[torch.device], str]:
        _DEFAULTS[op_name] = pick
        return pick

    return wrap


def op_names() -> list[str]:
    """The registered ops, sorted."""
    return sorted(_IMPLS)


def op_impl_names(op_name: str) -> list[str]:
    """The implementations registered for `op_name`, sorted (CLI choices); a ValueError for an unknown op."""
    return sorted(_impls_of(op_name))


def get_op(op_name: str, impl_name: str) -> Callable[..., Any]:
    """The implementation `impl_name` of op `op_name`; a ValueError naming the known ones otherwise."""
    impls = _impls_of(op_name)
    if impl_name not in impls:
        raise ValueError(f"op {op_name!r} has no implementation {impl_name!r}; known: {', '.join(sorted(impls))}")
    return impls[impl_name]


def default_impl(op_name: str, device: torch.device | str) -> str:
    """The implementation op `op_name` uses on `device` unless told otherwise ("torch" where none is registered)."""
    _impls_of(op_name)
    pick = _DEFAULTS.get(op_name)
    return pick(torch.device(device)) if pick is not None else "torch"


def _impls_of(op_name: str) -> dict[str, Callable[..., Any]]:
    if op_name not in _IMPLS:
        raise ValueError(f"unknown op {op_name!r}; known ops: {', '.join(op_names()) or '(none)'}")
    return _IMPLS[op_name]


class OpTable:
    """The op implementations one model uses: `ops.sinkhorn(comb, iters, eps)`.

    Built once at model construction for a device (each op's `default_impl` there, or the name in
    `overrides`); `select(device)` re-picks them when the weights turn out to live elsewhere (called by
    the model's `prepare_for_inference`). A plain object, not an `nn.Module`: it holds no tensors.
    """

    def __init__(self, device: torch.device | str, overrides: Mapping[str, str] | None = None) -> None:
        self.overrides = dict(overrides or {})
        for op_name in self.overrides:
            _impls_of(op_name)
        self.impl_names: dict[str, str] = {}
        """op name -> the implementation picked."""
        self.select(device)

    def select(self, device: torch.device | str) -> None:
        """Pick every op's implementation for `device` (overrides win)."""
        for op_name in op_names():
            if op_name in _MODULE_OPS:
                continue
            impl = self.overrides.get(op_name) or default_impl(op_name, device)
            setattr(self, op_name, get_op(op_name, impl))
            self.impl_names[op_name] = impl

    def __repr__(self) -> str:
        return f"OpTable({self.impl_names})"


def check_triton_launch(name: str, x: torch.Tensor, operands: str, *weights: torch.Tensor, block: int,
                        block_what: str = "scale block", min_block: int = 2) -> None:
    """The checks every quantized-GEMM Triton wrapper makes before a launch, with messages naming `name`:
    x's rows contiguous and `weights` contiguous (`operands` names them), `block` a power of two
    >= `min_block`, and x on CUDA (or the CPU under `TRITON_INTERPRET=1`)."""
    if x.stride(1) != 1 or not all(w.is_contiguous() for w in weights):
        raise ValueError(f"{name}: {operands} must be contiguous (call .contiguous())")
    if block < min_block or block & (block - 1):
        raise ValueError(f"{name}: the {block_what} must be a power of two >= {min_block}, got {block}")
    if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"{name} needs a CUDA tensor (or TRITON_INTERPRET=1), got {x.device}")

