"""Checks several kernel test files share: a wrapper's refusal of bad input and a kernel's worst relative error
against its reference (both importable from the scripts `tests.kernels._interp.run_interpreted` runs), the plain
float64 attention of one query that the attention kernels' references are checked against, the sm_90a compile check
of a kernel family's launch configurations, and the tiny model's logits over a fixed serving plan with chosen op
implementations (its Triton ops run under `TRITON_INTERPRET=1` through `run_on_tiny_model`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import pytest
import torch

from tests.kernels._interp import run_interpreted


def assert_refused(call: Callable[[], object], msg: str) -> None:
    """`call()` raises ValueError and its message contains `msg` (a wrapper's input check names the problem)."""
    try:
        call()
    except ValueError as e:
        assert msg in str(e), str(e)
    else:
        raise AssertionError(msg)


class RelativeErrors:
    """`check(a, b, tol)`: asserts the worst relative error |a - b| / (1 + |b|) (in float32) is below `tol`; `worst`
    is the largest seen so far (a script prints it)."""

    def __init__(self) -> None:
        self.worst = 0.0

    def check(self, a: torch.Tensor, b: torch.Tensor, tol: float) -> None:
        err = ((a.float() - b.float()).abs() / (1 + b.float().abs())).max().item()
        assert err < tol, err
        self.worst = max(self.worst, err)


def attended_entries(entries: torch.Tensor | None, pos: int, rate: int) -> list[int]:
    """The compressed entries a query at `pos` attends: its CSA selection `entries` ([K], -1 padded) without the
    padding, or with no selection (HCA) every entry complete at `pos` (one per `rate` tokens)."""
    return [int(e) for e in entries if e >= 0] if entries is not None else list(range((pos + 1) // rate))


def sink_softmax_attention(q: torch.Tensor, keys: list[torch.Tensor], sink: torch.Tensor) -> torch.Tensor:
    """One query's attention, plainly, in float64: per head a softmax over `keys` (K=V rows [D]) plus the head's sink
    logit, which takes weight but adds no value. q [NH, D] float64; returns [NH, D]."""
    D = q.shape[-1]
    k = torch.stack(keys) if keys else torch.zeros(0, D, dtype=torch.float64)
    logits = torch.cat([q @ k.T * D**-0.5, sink.double()[:, None]], dim=1)
    return logits.softmax(-1)[:, :-1] @ k


def assert_compiles_for_sm90_without_spills(prefix: str) -> None:
    """Every default launch configuration whose name starts with `prefix` (`benchmarks.kernel_registers`),
    compiled ahead of time for sm_90a on the CPU, spills nothing and fits the register file (the interpreter never
    lowers a kernel); skips without triton or its bundled ptxas."""
    pytest.importorskip("triton")
    from deepinfer.benchmarks.kernel_registers import _ptxas, compile_report, configurations

    if _ptxas() is None:
        pytest.skip("no ptxas bundled with triton")
    for name, fn, sig, consts, warps in configurations():
        if name.startswith(prefix):
            r = compile_report(fn, sig, consts, warps)
            assert r["spill_stores"] == 0 and 0 < r["registers"] <= 255, (name, r)


def tiny_model_logits(ckpt, device: str = "cpu", dtype: str = "float32", overrides: Mapping[str, str] | None = None,
                      attention_backend: str = "torch") -> list[torch.Tensor]:
    """Every token's logits of the tiny model over a chunked prefill, a mixed step and decode steps, with the op
    implementations `overrides` (else the device's defaults) picked through the model's `OpTable`."""
    from deepinfer.engine.loader import load_checkpoint
    from deepinfer.engine.testing.model_runner import ModelRunnerForTests

    model = load_checkpoint(ckpt, dtype=dtype, device=device, attention_backend=attention_backend)[0]
    ops = model.model.ops
    ops.overrides.update(overrides or {})
    ops.select(device)
    for layer in model.model.layers:  # one table, shared by every module that calls an op
        assert layer.attn.ops is ops and layer.ffn.ops is ops
        assert getattr(layer.attn, "indexer", None) is None or layer.attn.indexer.ops is ops
    runner = ModelRunnerForTests(model, max_seqs=3, max_len=96)
    ids = torch.randint(2, 500, (60,), generator=torch.Generator().manual_seed(5)).tolist()
    plan = [[(0, ids[:23]), (1, ids[:9])], [(0, ids[23:40]), (1, [7])], [(0, [3]), (1, [4]), (2, ids[:12])]]
    plan += [[(0, [5 + k]), (1, [6 + k]), (2, [7 + k])] for k in range(4)]
    return [runner.run(work, logits="all") for work in plan]


def worst_diff_same_tokens(ref: list[torch.Tensor], got: list[torch.Tensor]) -> float:
    """Asserts the same greedy token at every position of every step (`tiny_model_logits`' lists); returns the worst
    |logit difference|."""
    for a, b in zip(ref, got):
        assert a.argmax(-1).tolist() == b.argmax(-1).tolist()
    return max((a - b).abs().max().item() for a, b in zip(ref, got))


def interpreted_figure(script: str, *args: str, timeout: float = 600) -> float:
    """`script` run under `TRITON_INTERPRET=1` (`run_interpreted`, `args` its arguments); it prints "ok" and a figure
    (a worst difference), which this returns."""
    out = run_interpreted(script, *args, timeout=timeout)
    assert out.startswith("ok"), out
    return float(out.split()[1])


def run_module_interpreted(module: str, *args: str, timeout: float = 300) -> str:
    """`python -m <module> <args>` under `TRITON_INTERPRET=1` (`run_interpreted`); returns its stdout."""
    return run_interpreted(f"import runpy; runpy.run_module({module!r}, run_name='__main__', alter_sys=True)", *args,
                           timeout=timeout)


def run_on_tiny_model(tmp_path: Path, script: str, timeout: float = 600) -> float:
    """`interpreted_figure(script, <directory>)` with a new tiny checkpoint (preset "tiny", seed 6) in `tmp_path`;
    skips without triton."""
    pytest.importorskip("triton")
    from deepinfer.engine.testing.make_checkpoint import make_checkpoint

    ckpt = make_checkpoint(tmp_path / "tiny", preset="tiny", seed=6)
    return interpreted_figure(script, str(ckpt), timeout=timeout)
