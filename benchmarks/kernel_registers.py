"""Compile Triton kernels for a GPU target on a machine without one, and report registers and spills.

    python -m deepinfer.benchmarks.kernel_registers [--arch 90] [--only prefill,attn_proj]

`TRITON_INTERPRET=1` runs a kernel's Python on the CPU but never lowers it: a kernel can pass every
interpreter test and still fail to compile, or spill registers at V4-Flash's widths. This compiles each
listed configuration ahead of time (`triton.compile` of an `ASTSource` for `GPUTarget("cuda", arch, 64)`,
no driver needed; pointers 16-byte aligned, as a launch with torch tensors specializes them) and runs the ptxas
bundled with Triton (`ptxas-blackwell`, new enough for the PTX Triton 3.9 emits) with Triton's own flags and `-v` on
the PTX: registers per thread, spill stores / loads in bytes; and from the PTX the warpgroup MMAs (`wgmma`, Hopper),
Ampere-style `mma.sync`, `cp.async` copies (a pipelined load) and the shared memory the kernel takes.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

BF16, I64, F32 = "*bf16", "*i64", "*fp32"


def _ptxas() -> str | None:
    import triton

    root = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for name in ("ptxas-blackwell", "ptxas"):
        path = os.path.join(root, name)
        if os.path.exists(path):
            return path
    return None


def compile_report(fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int = 2,
                   arch: int = 90) -> dict:
    """Compile `fn` for `sm_<arch>a`; returns {"registers", "spill_stores", "spill_loads"} (ptxas -v)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    # NOTE: a launch with torch-allocated tensors specializes every pointer as 16-byte aligned (`tt.divisibility`),
    # and every integer argument whose value is a multiple of 16 (marked "i32%16" in `signature`); without those
    # hints no load is vectorized or pipelined (cp.async) and the figures are not the launched kernel's
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k, v in signature.items()
             if v.startswith("*") or v.endswith("%16")}
    signature = {k: v.removesuffix("%16") for k, v in signature.items()}
    src = ASTSource(fn=fn, signature={**signature, **{k: "constexpr" for k in constexprs}}, constexprs=constexprs,
                    attrs=attrs)
    ck = triton.compile(src, target=GPUTarget("cuda", arch, 64),
                        options={"num_warps": num_warps, "num_stages": num_stages})
    ptxas = _ptxas()
    if ptxas is None:
        raise RuntimeError("no ptxas next to triton's nvidia backend")
    ptx = ck.asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        # the flags triton's own `make_cubin` passes (3.9): its register allocation, not ptxas' default
        run = subprocess.run([ptxas, "-lineinfo", "-v", "--regAllocOptLevel=2", "--gpu-name", f"sm_{arch}a", f.name,
                              "-o", os.devnull], capture_output=True, text=True, check=True)
    finally:
        os.unlink(f.name)
    text = run.stdout + run.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return {"registers": int(regs.group(1)) if regs else -1,
            "spill_stores": int(spills.group(1)) if spills else 0, "spill_loads": int(spills.group(2)) if spills else 0,
            "wgmma": len(re.findall(r"wgmma\.mma_async", ptx)), "mma_sync": len(re.findall(r"mma\.sync", ptx)),
            "cp_async": len(re.findall(r"cp\.async\.c[ag]", ptx)), "shared_bytes": ck.metadata.shared}


def configurations():
    """(name, kernel, signature, constexprs, num_warps) of the attention kernels at V4-Flash widths, as
    their wrappers launch them by default (bf16)."""
    from deepinfer.kernels import attn_proj, prefill_attention

    out = []
    psig = dict(q_ptr=BF16, kv_ptr=BF16, ring_ptr=BF16, comp_ptr=BF16, idx_ptr=I64, sink_ptr=F32, out_ptr=BF16,
                tab_ptr=I64, NH="i32%16", K="i32%16", scale="fp32")  # V4-Flash: 64 heads, top-512 (0 for SWA/HCA)
    for kind, has_comp, sparse, rate in (("swa", False, False, 1), ("hca", True, False, 128), ("csa", True, True, 4)):
        out.append((f"prefill_attention {kind}", prefill_attention._prefill_attn_kernel, psig,
                    dict(D=512, W=128, RATE=rate, HAS_COMP=has_comp, SPARSE=sparse, NCOL=6, NUM_HG=2, BLOCK_N=32,
                         BLOCK_H=32, BLOCK_D=512, IEEE=False, ALIGNED=False), 8))
    for kind, has_comp, sparse, rate in (("swa", False, False, 1), ("hca", True, False, 128), ("csa", True, True, 4)):
        out.append((f"prefill_attention legacy_aligned {kind}", prefill_attention._prefill_attn_kernel, psig,
                    dict(D=512, W=128, RATE=rate, HAS_COMP=has_comp, SPARSE=sparse, NCOL=6, NUM_HG=2, BLOCK_N=32,
                         BLOCK_H=32, BLOCK_D=512, IEEE=False, ALIGNED=True), 8))
    for kind, has_comp, sparse, rate in (("swa", False, False, 1), ("hca", True, False, 128), ("csa", True, True, 4)):
        out.append((f"prefill_attn_m64 {kind}", prefill_attention._prefill_attn_m64_kernel, psig,
                    dict(D=512, W=128, RATE=rate, HAS_COMP=has_comp, SPARSE=sparse, NCOL=6, NUM_HG=1,
                         BLOCK_N=prefill_attention.M64_BLOCK_N, BLOCK_H=64, BLOCK_D=512, IEEE=False, ALIGNED=True,
                         OFF64=False), 8))
    out.append(("attn_norm_rope kv + ring", attn_proj._norm_rope_kernel,
                dict(x_ptr=BF16, w_ptr=F32, cos_ptr=F32, sin_ptr=F32, y_ptr=BF16, ring_ptr=BF16, slots_ptr=I64,
                     pos_ptr=I64, R="i32", NH="i32", eps="fp32", num_slots="i32", W="i32"),
                dict(D=512, HALF=32, HAS_W=True, WRITE=True, BLOCK_R=4, BLOCK_D=512), 4))
    osig = dict(o_ptr=BF16, cos_ptr=F32, sin_ptr=F32, w_ptr=BF16, y_ptr=BF16, T="i32", R="i32", KG="i32", NHD="i32",
                GR="i32")
    for name, bm, br, bk in (("decode", 16, 64, 64), ("prefill", 64, 128, 32)):
        out.append((f"attn_out_proj {name}", attn_proj._out_proj_kernel, osig,
                    dict(D=512, HALF=32, BLOCK_M=bm, BLOCK_R=br, BLOCK_K=bk, IEEE=False), 8))
    return out + quantized_gemm_configurations()


def quantized_gemm_configurations():
    """The FP8 dense GEMM (wq_b: K 1024) and the FP4 MoE up / down GEMMs (V4-Flash: H 4096, I 2048) at a decode
    config, plain and swap-AB (`SWAP`: the weight tile as the dot's A operand, which lowers to wgmma); the FP8
    GEMM over row groups (the grouped wo_a)."""
    from deepinfer.kernels import fp8_gemm, moe_gemm

    u8, i32 = "*u8", "*i32"
    fsig = dict(x_ptr=BF16, w_ptr=u8, s_ptr=u8, out_ptr=BF16, part_ptr=F32, lock_ptr=i32, M="i32", N="i32%16",
                K="i32%16", stride_xm="i32%16", stride_wn="i32%16", stride_sn="i32", stride_om="i32%16")
    usig = dict(x_ptr=BF16, w_ptr=u8, s_ptr=u8, pairs_ptr=i32, counts_ptr=i32, act_ptr=BF16, E="i32", N="i32%16",
                limit="fp32", stride_xm="i32%16", stride_we="i32%16", stride_wn="i32%16", stride_se="i32%16",
                stride_sn="i32%16", stride_am="i32%16")
    dsig = dict(a_ptr=BF16, w_ptr=u8, s_ptr=u8, pairs_ptr=i32, counts_ptr=i32, tw_ptr=F32, y_ptr=BF16, E="i32",
                N="i32%16", stride_am="i32%16", stride_we="i32%16", stride_wn="i32%16", stride_se="i32%16",
                stride_sn="i32%16", stride_ym="i32%16")
    fp4 = dict(E_POW2=64, WFMT=moe_gemm.WFMT_FP4, SCALE_BLOCK=32, BN_SCALE=1, SCALE_E8M0=True, IEEE_DOT=False,
               BLOCK_M=16, BLOCK_K=128)
    out = []
    for swap in (False, True):
        kind = "swap" if swap else "plain"
        out.append((f"fp8_gemm decode {kind}", fp8_gemm._fp8_gemm_kernel, fsig,
                    dict(K_SLICE=256, BN_SCALE=128, BK_SCALE=128, SCALE_E8M0=True, IEEE_DOT=False, SPLIT=4, BLOCK_M=16,
                         BLOCK_N=64, BLOCK_K=128, SWAP=swap, GROUP_N=0), 4))
        out.append((f"moe_up fp4 decode {kind}", moe_gemm._moe_up_kernel, usig,
                    dict(K=4096, TOPK=6, BLOCK_N=64 if swap else 32, SWAP=swap, **fp4), 4))
        out.append((f"moe_down fp4 decode {kind}", moe_gemm._moe_down_kernel, dsig,
                    dict(K=2048, BLOCK_N=64, SWAP=swap, **fp4), 4))
    # the grouped wo_a (8 groups of 1024 rows) in one launch
    out.append(("fp8_gemm decode row groups", fp8_gemm._fp8_gemm_kernel, fsig,
                dict(K_SLICE=512, BN_SCALE=128, BK_SCALE=128, SCALE_E8M0=True, IEEE_DOT=False, SPLIT=8, BLOCK_M=16,
                     BLOCK_N=64, BLOCK_K=128, SWAP=False, GROUP_N=1024), 4))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--only", default="", help="comma-separated name prefixes")
    args = ap.parse_args()
    only = [p for p in args.only.split(",") if p]
    print(f"| kernel (sm_{args.arch}a) | warps | registers | spill stores B | spill loads B | wgmma | mma.sync | "
          f"cp.async | shared B |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, fn, sig, consts, warps in configurations():
        if only and not any(name.startswith(p) for p in only):
            continue
        r = compile_report(fn, sig, consts, warps, arch=args.arch)
        print(f"| {name} | {warps} | {r['registers']} | {r['spill_stores']} | {r['spill_loads']} | {r['wgmma']} | "
              f"{r['mma_sync']} | {r['cp_async']} | {r['shared_bytes']} |")


if __name__ == "__main__":
    main()
