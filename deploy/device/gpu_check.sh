#!/usr/bin/env bash
# One device call that checks and measures the GPU path (issue 22 and the kernels other issues added), from the
# repository root with the carried wheels (.whl-min) installed and PYTHONPATH set:
#   bash deploy/device/gpu_check.sh tests   # every `gpu`-marked test (pytest-xdist, 8 workers)
#   bash deploy/device/gpu_check.sh bench   # roofline + kernel benchmarks, each under its own time limit
#   bash deploy/device/gpu_check.sh extra   # the other issues' H200 figures: batch-invariant cost (23), speculative
#                                           # decoding (24), V4.1 prefill with decoder replay on/off (28)
#   bash deploy/device/gpu_check.sh opt     # the prefill attention variants and the roofline with 'legacy';
#                                           # the kernel choices made default on 2026-12-05 (mHC 'split', the MoE
#                                           # grouped_mm prefill route): their benchmarks and the roofline with both
#                                           # off (the 'legacy' comparison)
#   bash deploy/device/gpu_check.sh quick   # the roofline (Triton backends, the CUDA defaults) with bf16 and with the
#                                           # published FP8 / FP4 weights (QUICK_PUB=0 skips those), before the tests
#   bash deploy/device/gpu_check.sh fp4     # the FP4 prefill route + grouped wo_a: GPU tests, crossover, published roofline
#   bash deploy/device/gpu_check.sh all     # tests + bench (extra and mhc need calls of their own)
# Logs and JSON go to $OUT (a tarball of the JSON, since only 8 files come back from a device call).
# Each step has its own `timeout` so that one hung step leaves time (and output) for the rest.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT="${OUT:-/tmp/gpu_check}"
RES="$OUT/res"
mkdir -p "$RES"
what="${1:-all}"
shift || true
T_TESTS="${T_TESTS:-330}"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv > "$RES/nvidia-smi.csv" 2>&1 || true
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" \
    > "$RES/versions.txt" 2>&1 || true

step() {  # step NAME SECONDS CMD...
    local name="$1" secs="$2"; shift 2
    echo "=== $name ($(date -u +%H:%M:%S), limit ${secs}s): $*"
    local t0=$SECONDS
    timeout --kill-after=10 "$secs" "$@"
    local rc=$?
    echo "=== $name rc=$rc in $((SECONDS - t0))s"
}

GPU_TESTS=(
    tests/kernels tests/engine/attention tests/engine/test_cuda_graph.py tests/engine/test_gpu.py
    tests/engine/moe/test_triton_moe.py tests/engine/v41 tests/engine/quant/test_act_quant.py
    tests/engine/test_batch_invariance.py tests/engine/test_batch_invariance_triton.py
    tests/engine/checkpoints/test_published_loader.py tests/engine/spec_decode/test_spec_async.py
    tests/engine/spec_decode/test_verify_graph.py tests/engine/spec_decode/test_draft_graph.py
    tests/engine/moe/test_grouped_mm_route.py tests/engine/moe/test_fp4_dequant_route.py
)

B="python3 -m deepinfer.benchmarks"
ROOF_TRITON=($B.gpu_roofline --config v4-flash-4l --device cuda --batches 1,32,128 --attention-backend triton
             --moe-backend triton)
roofline_legacy() {  # roofline_legacy SECONDS: the Triton roofline with the mHC 'legacy' kernels, no grouped_mm route
    step roofline_legacy "$1" env DEEPINFER_MHC_VARIANT=legacy DEEPINFER_MOE_GROUPED_MM_MIN_ROWS=0 \
        DEEPINFER_PREFILL_ATTN_VARIANT=legacy "${ROOF_TRITON[@]}" \
        --json "$RES/gpu_roofline_legacy.json"
}

if [[ -n "${TESTS:-}" ]]; then read -r -a GPU_TESTS <<< "$TESTS"; fi  # TESTS="a.py b/" runs only those
if [[ "$what" == tests || "$what" == all ]]; then
    step gpu-tests "$T_TESTS" python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider --timeout 240 \
        --junitxml "$RES/gpu_tests.xml" "${GPU_TESTS[@]}" "$@" 2>&1 | tee "$OUT/tests.log"
fi

if [[ "$what" == bench || "$what" == all ]]; then
    {
    step roofline 200 $B.gpu_roofline --config v4-flash-4l --device cuda --batches 1,128 \
        --attention-backend torch,triton --moe-backend torch,triton --json "$RES/gpu_roofline.json"
    step decode_attention 60 $B.decode_attention --indexer --json "$RES/decode_attention.json"
    step prefill_attention 60 $B.prefill_attention --indexer --json "$RES/prefill_attention.json"
    step attn_proj 40 $B.attn_proj --json "$RES/attn_proj.json"
    step moe_kernels 90 $B.moe_kernels --json "$RES/moe_kernels.json"
    step fp8_swap_ab 200 $B.fp8_swap_ab --json "$RES/fp8_swap_ab.json"
    } 2>&1 | tee "$OUT/bench.log"
fi
if [[ "$what" == quick ]]; then
    {
    step roofline_triton "${T_ROOF:-150}" "${ROOF_TRITON[@]}" --json "$RES/gpu_roofline.json"
    [[ ${QUICK_PUB:-1} == 1 ]] && step roofline_published "${T_ROOF:-150}" "${ROOF_TRITON[@]}" --weights published \
        --json "$RES/gpu_roofline_published.json"
    } 2>&1 | tee "$OUT/quick.log"
fi
if [[ "$what" == opt ]]; then
    {
    # the prefill attention variants (kernels/prefill_attention.py; "m64" the default): side by side, then the
    # roofline with the old "legacy" kernel
    step prefill_attention_variants 240 $B.prefill_attention --json "$RES/prefill_attention_variants.json"
    step roofline_pattn_legacy 150 env DEEPINFER_PREFILL_ATTN_VARIANT=legacy "${ROOF_TRITON[@]}" --batches 1 \
        --json "$RES/gpu_roofline_pattn_legacy.json"
    step gpu_mhc 120 $B.gpu_mhc --json "$RES/gpu_mhc.json"
    # the opt-in mHC "fused" long-chunk projection in the whole prefill (kernels/mhc.py LONG_PROJ)
    step roofline_mhc_fused 150 env DEEPINFER_MHC_LONG_PROJ=fused "${ROOF_TRITON[@]}" --batches 1 \
        --json "$RES/gpu_roofline_mhc_fused.json"
    # the opt-in in-place RoPE (kernels/rope.py ROPE_IN_PLACE) in the whole prefill
    step roofline_rope_in_place 150 env DEEPINFER_ROPE_IN_PLACE=1 "${ROOF_TRITON[@]}" --batches 1 \
        --json "$RES/gpu_roofline_rope_in_place.json"
    # FP4 experts at prefill sizes: the four kernels against the dequantize-then-_grouped_mm route (crossover)
    step moe_prefill_fp4 "${T_FP4:-150}" $B.moe_kernels --parts prefill_fp4 --experts 64,256 \
        --json "$RES/moe_prefill_fp4.json"
    step moe_prefill_route 120 $B.moe_kernels --parts prefill,routed --formats bf16 --experts 64 \
        --tokens 256,1024,4096 --json "$RES/moe_grouped_route.json"
    roofline_legacy 240
    } 2>&1 | tee "$OUT/opt.log"
fi

if [[ "$what" == fp4 ]]; then  # the FP4 prefill route and the grouped wo_a: GPU tests, the crossover, the roofline
    {
    step gpu-tests-fp4 150 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider --timeout 120 \
        tests/engine/moe/test_fp4_dequant_route.py tests/engine/moe/test_grouped_mm_route.py \
        tests/kernels/test_quant_gemm.py tests/engine/checkpoints/test_published_loader.py
    step moe_fp4_decode 60 $B.moe_kernels --parts routed --formats fp4 --experts 64 --tokens 1,32,128 \
        --json "$RES/moe_fp4_decode.json"
    step moe_prefill_fp4 "${T_FP4:-150}" $B.moe_kernels --parts prefill_fp4 --experts 64,256 \
        --json "$RES/moe_prefill_fp4.json"
    step roofline_published "${T_ROOF:-150}" "${ROOF_TRITON[@]}" --weights published \
        --json "$RES/gpu_roofline_published.json"
    } 2>&1 | tee "$OUT/fp4.log"
fi
if [[ "$what" == extra ]]; then
    parts=" ${EXTRA:-bi spec v41} "  # EXTRA picks the steps (a call with little time left runs some of them)
    {
    if [[ $parts == *" bi "* ]]; then
        # The mode swaps the backends for its fixed-order variants (engine/batch_invariant.py): on:triton = the Triton
        # path of the mode (explicit triton backends, opt-in), on:torch = its torch path ("auto" in the mode); off =
        # the default fast path (Triton) and the torch backends without the mode.
        for run in ${BI_RUNS:-off:triton on:triton on:torch off:torch}; do  # BI_RUNS picks some
            bi=${run%%:*} be=${run#*:}
            flag=(); [[ $bi == on ]] && flag=(--batch-invariant)
            step "gpu_engine_bi_${bi}_$be" "${T_BI:-150}" $B.gpu_engine --skip-hf --batches 1,32,128 \
                --attention-backend "$be" --moe-backend "$be" "${flag[@]}" --json "$RES/gpu_engine_bi_${bi}_$be.json"
        done
    fi
    [[ $parts == *" spec "* ]] && step speculative "${T_SPEC:-120}" $B.speculative --device cuda --dtype bfloat16 \
        --batch-sizes 1,16,32 --ks 0,3,3e,3c,3ce --repeats 3 --max-tokens 64 --json "$RES/speculative_cuda.json"
    [[ $parts == *" v41 "* ]] && step v41_replay "${T_V41:-200}" $B.v41_decoder_replay --shape flash --device cuda \
        --dtype bfloat16 --prompt-len 8192,32768 --chunk 4096 --layers 10 --experts 8 --reps 2 \
        --json "$RES/v41_replay_flash.json"
    } 2>&1 | tee "$OUT/extra.log"
fi
tar -C "$OUT" -czf "$OUT/res.tgz" res && rm -rf "$RES"
