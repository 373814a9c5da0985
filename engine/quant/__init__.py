"""engine.quant: weights kept quantized in memory (the published DeepSeek-V4 checkpoints' FP8 and FP4).

How quantized weights are held: a quantized linear is an `nn.Module` that replaces an `nn.Linear` and
keeps the checkpoint's tensors *as published*, under the checkpoint's names, so `state_dict()` round
trips with the files:

  * `linear.Fp8Linear`: `weight` float8_e4m3fn [out, in] and `scale` [ceil(out/128), ceil(in/128)]
    (float8_e8m0fnu, or float32 in the `*-Base` checkpoints);
  * `linear.Fp4Linear`: `weight` int8 [out, in/2] (two E2M1 codes a byte) and `scale` float8_e8m0fnu
    [out, in/32].

Their `forward(x)` never materialises the whole dequantized layer: on the CPU an exact reference
dequantizes one block at a time inside the matmul; on CUDA Triton kernels (`deepinfer.kernels.fp8_gemm`,
`deepinfer.kernels.fp4_gemm`) dequantize in registers. The implementation is picked once per device
through the kernel op registry (`kernels/registry.py`). `resident_nbytes()` counts weight + scale bytes.
Routed FP4 experts run grouped through the `"fp4"` MoE backend (`engine/moe/fp4_backend.py`).

DeepSeek-V4.1 (`engine.models.deepseek_v41`'s loader): its 32 x 32-block FP8 linears are `Fp8Linear(block=(32,
32))`; `v41` holds the passes that keep its MXFP4 routed experts (`Fp4Linear`) and FP8 Engram tables
(`engram.Fp8EngramTable`: lazily mapped from the shards, gathered row by row then dequantized, placed on the
device or in pinned host memory as `engine.fit` decides) as published.

`formats` holds the number formats themselves (E2M1 table, UE8M0 reinterpretation, packing, block
quantize/dequantize), exact and documented.

Where a new format goes (V4.1's 32 x 32 FP8 blocks, an MXFP4 variant, int4): its codes and exact
dequantization in `formats.py` with round-trip tests; a module in `linear.py` (or a new file here)
holding the published tensors under the published names with a CPU block-wise reference forward; its
kernel in `kernels/` beside a torch reference, registered as an op; then the loader maps the
checkpoint's `quant_method` / dtype to the module (refusing what it cannot honour).

NOTE: this package imports only torch (and triton where present, through `deepinfer.kernels`), never
pydantic or the model, so kernels and benchmarks can use it on a bare GPU machine.
"""

from deepinfer.engine.quant.formats import (
    E2M1_VALUES,
    dequant_fp4,
    dequant_fp8_block,
    e8m0_to_float,
    float_to_e8m0,
    pack_fp4,
    quantize_fp4,
    quantize_fp8_block,
    unpack_fp4,
)
from deepinfer.engine.quant.linear import Fp4Linear, Fp8Linear

__all__ = ["E2M1_VALUES", "Fp4Linear", "Fp8Linear", "dequant_fp4", "dequant_fp8_block", "e8m0_to_float",
           "float_to_e8m0", "pack_fp4", "quantize_fp4", "quantize_fp8_block", "unpack_fp4"]
