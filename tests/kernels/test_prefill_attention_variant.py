"""The prefill attention kernel variants (`kernels.prefill_attention.VARIANTS`, DEEPINFER_PREFILL_ATTN_VARIANT):
"m64" (`_prefill_attn_m64_kernel`) and "legacy_aligned" against the torch reference: on the CPU under
`TRITON_INTERPRET=1` (a subprocess: the variable must be set before triton is imported), ahead of time for sm_90a
(warpgroup MMAs, pipelined loads, registers), and on CUDA at V4-Flash head shapes beside the legacy kernel.

Covered under the interpreter: every layer kind (HCA: every visible entry; CSA: a selection in any order, -1 padded;
sliding: no entries), several chunks and decode rows in one launch, chunks starting mid-sequence that read the ring's
history, history before the state start, windows shorter and longer than a key tile (and not a multiple of one), head
counts that are not powers of two and more heads than one program takes, unaligned rows (no alignment hint), int64
key offsets, the per-head sink, rows of no chunk left alone, and the variant knob.
"""

from __future__ import annotations

import os
import textwrap

import pytest
import torch

from deepinfer.kernels import prefill_attention as pa
from tests.kernels._interp import prefetch_interpreted, run_interpreted
from tests.kernels.test_prefill_attention import _variant, make_case

_INTERPRETED = textwrap.dedent("""
    import os
    os.environ["DEEPINFER_PREFILL_ATTN_VARIANT"] = "m64"  # before the kernel module is imported
    import torch
    from tests.kernels._kernel_checks import assert_refused
    from tests.kernels.test_prefill_attention import make_case, _variant
    from deepinfer.kernels import prefill_attention as pa
    assert pa.VARIANT == "m64", pa.VARIANT  # the knob, read at import
    worst = 0.0
    cases = [  # (seed, case, block_h, block_n)
        (0, {}, None, 16),
        (1, dict(chunks=((5, 0, 0),)), None, 32),
        (2, dict(chunks=((20, 5, 3),), W=32, K=5), None, 16),  # two window tiles
        (3, dict(NH=20, D=24, chunks=((7, 40, 36),), rate=8), 16, 16),  # two head groups, the second partial
        (4, dict(W=4, chunks=((9, 2, 0),), rate=2, K=6), None, 16),
        (5, dict(chunks=((7, 0, 0), (12, 30, 25), (3, 9, 0)), gap=2, S=4), None, 16),
        (6, dict(chunks=((6, 17, 0), (9, 0, 0)), gap=1, D=6, W=8), None, 16),  # 24-byte rows: no alignment hint
        (7, dict(chunks=((10, 21, 0), (4, 50, 49)), gap=1, W=12, K=4), None, 16),  # window of 12 in 16-key tiles
    ]
    for seed, kw, bh, bn in cases:
        c = make_case(seed=seed, **kw)
        rows = c["spans"].table[:, 0] + c["spans"].table[:, 2]
        keep = torch.ones(len(c["q"]), dtype=torch.bool)
        keep[rows] = False
        for kind in ("hca", "csa", "sliding"):
            args = _variant(c, kind)
            ref = pa.prefill_attention_torch(**args)
            for variant in (None, "legacy_aligned"):  # None: the knob's ("m64")
                base = torch.full_like(c["q"], 7.0)
                out = pa.prefill_attention_triton(**args, out=base.clone(), block_h=bh, block_n=bn, variant=variant)
                d = (out[rows] - ref[rows]).abs().max().item()
                assert d <= 2e-6, (seed, kind, bn, variant, d)
                assert torch.equal(out[keep], base[keep]), "rows of no chunk were written"
                worst = max(worst, d)
    # int64 key offsets (kv, ring or comp of 2**31 elements and more), forced on a small case
    pa._OFF64_MIN_NUMEL = 0
    c = make_case(seed=8, chunks=((9, 20, 0), (5, 0, 0)), gap=1)
    rows = c["spans"].table[:, 0] + c["spans"].table[:, 2]
    for kind in ("hca", "csa", "sliding"):
        args = _variant(c, kind)
        d = (pa.prefill_attention_triton(**args, block_n=16)[rows] - pa.prefill_attention_torch(**args)[rows]).abs()
        assert d.max().item() <= 2e-6, (kind, d.max().item())
    c = make_case()
    assert_refused(lambda: pa.prefill_attention_triton(**c, variant="m128"), "variant must be one of")
    assert_refused(lambda: pa.prefill_attention_triton(**c, block_n=24), "block_n must be")
    # the benchmark times both kernels side by side (a smoke run: tiny shapes, float32 on the CPU)
    import contextlib, io, sys
    from deepinfer.benchmarks import prefill_attention as bench
    bench.NH, bench.D, bench.W, bench.TOPK = 4, 32, 8, 3
    sys.argv = ["prefill_attention", "--device", "cpu", "--chunks", "6", "--starts", "0,13", "--reps", "1",
                "--kernels", "legacy,legacy_aligned,m64:n16:s3"]
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        bench.main()
    rows = [r.split("|") for r in text.getvalue().splitlines() if r.startswith("| ") and r[2:5] in ("swa", "csa", "hca")]
    assert len(rows) == 18 and {r[4].strip() for r in rows} == {"legacy", "legacy_aligned", "m64:n16:s3"}, \
        text.getvalue()
    assert max(float(r[9]) for r in rows) < 1e-5, text.getvalue()
    print("ok", worst)
""")


def test_variants_under_interpreter():
    pytest.importorskip("triton")
    out = run_interpreted(_INTERPRETED, timeout=600)
    assert out.startswith("ok"), out


def test_default_variant_is_m64():
    """Unset, the knob picks the m64 kernel (timed on a GPU: `M64_BLOCK_N`), with 64-key tiles in 16-bit dtypes."""
    if os.environ.get(pa.VARIANT_ENV) is None:
        assert pa.VARIANT == "m64"
    assert pa.M64_BLOCK_N == 64
    assert pa.VARIANTS == ("legacy", "legacy_aligned", "m64")


def test_variants_compile_for_sm90():
    """The variants' launch configurations at V4-Flash widths (`benchmarks.kernel_registers`), compiled ahead of time
    for sm_90a: m64's dots are warpgroup MMAs (no mma.sync), its key tiles are copied with cp.async (pipelined), the
    registers fit, the spills (see `M64_BLOCK_N`) stay bounded;
    legacy_aligned's window tiles are cp.async copies (the legacy kernel's are not)."""
    pytest.importorskip("triton")
    from deepinfer.benchmarks.kernel_registers import _ptxas, compile_report, configurations

    if _ptxas() is None:
        pytest.skip("no ptxas bundled with triton")
    seen = 0
    for name, fn, sig, consts, warps in configurations():
        if name.startswith("prefill_attn_m64"):
            r = compile_report(fn, sig, consts, warps)
            assert r["wgmma"] > 0 and r["mma_sync"] == 0 and r["cp_async"] > 0, (name, r)
            # 64-key tiles spill 96-612 B a thread inside the loops and are still the fastest (`M64_BLOCK_N`)
            assert 0 < r["registers"] <= 255 and r["spill_stores"] <= 768 and r["spill_loads"] <= 768, (name, r)
            seen += 1
        elif name.startswith("prefill_attention legacy_aligned"):  # the window's tiles are cp.async copies too
            r = compile_report(fn, sig, consts, warps)
            assert r["cp_async"] >= 16 * (2 if "swa" not in name else 1) and r["spill_stores"] == 0, (name, r)
            seen += 1
    assert seen == 6


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["hca", "csa", "sliding"])
def test_variants_on_cuda(dtype, kind):
    """V4-Flash head shapes (64 heads x 512, window 128, top-512): a later chunk with history beside a first chunk and
    decode rows, in one launch; the variants against the reference (and within twice its bound of the legacy kernel)."""
    rate = 128 if kind == "hca" else 4
    c = _variant(make_case(chunks=((300, 2100, 0), (150, 0, 0)), NH=64, D=512, S=4, W=128, rate=rate, K=512,
                           gap=3, seed=7, dtype=dtype, device="cuda"), kind)
    rows = c["spans"].table[:, 0] + c["spans"].table[:, 2]
    ref = pa.prefill_attention_torch(**c)[rows]
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    legacy = pa.prefill_attention_triton(**c, variant="legacy")[rows]
    runs = [("legacy_aligned", None)] + [("m64", n) for n in ((16, 32, 64) if dtype == torch.bfloat16 else (None,))]
    for variant, block_n in runs:  # float32: the wrapper's small m64 tiles
        out = pa.prefill_attention_triton(**c, variant=variant, block_n=block_n)[rows]
        torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
        torch.testing.assert_close(out.float(), legacy.float(), atol=2 * tol, rtol=2 * tol)


@pytest.mark.gpu
def test_variants_on_cuda_unaligned_and_many_heads():
    """bf16 rows of 132 elements (264 bytes: no 16-byte alignment hint) and 128 heads (two programs a token)."""
    c = _variant(make_case(chunks=((200, 700, 0), (60, 0, 0)), NH=128, D=132, S=2, W=128, rate=4, K=64, gap=1, seed=3,
                           dtype=torch.bfloat16, device="cuda"), "csa")
    rows = c["spans"].table[:, 0] + c["spans"].table[:, 2]
    ref = pa.prefill_attention_torch(**c)[rows]
    for variant in ("legacy_aligned", "m64"):
        out = pa.prefill_attention_triton(**c, variant=variant)[rows]
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


# the background run of the interpreter script (tests/kernels/_interp.py: CI time)
prefetch_interpreted(_INTERPRETED, tests=("test_variants_under_interpreter",), timeout=600)
