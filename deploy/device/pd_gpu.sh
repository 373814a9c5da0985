#!/usr/bin/env bash
# Issue 22 §7 in one device call: a prefill and a decode worker as two processes on one GPU, KV VRAM -> VRAM
# through NIXL. From the repository root, with the carried wheels (.whl-min, .whl-nixl: deploy/device/trim_nixl_wheel.sh):
#   bash deploy/device/pd_gpu.sh [all|test|bench|small]   # all = test + bench (default)
#     test : tests/e2e/test_pd_gpu.py (greedy outputs == the offline engine's on the GPU; every KV byte VRAM -> VRAM)
#     bench: benchmarks/pd_gpu.py on the V4-Flash-shaped 4-layer checkpoint (flash-kv-4l), prompts 512 / 2k / 8k:
#            per request the KV transfer time and TTFT, cluster vs one colocated instance
#     small: the same benchmark on the `small` preset (a call of its own, or after `all` when time is left)
# Installs the wheels with `pip install --no-deps --target "$SITE"` (nothing else is downloaded: the device reaches
# no network) and puts "$SITE" and the checkout on PYTHONPATH. UCX: the workers' --loopback-ucx picks
# UCX_TLS=cuda_copy,cuda_ipc,tcp,self for a CUDA device (kv_transfer.loopback_ucx_env); the same is exported here
# for anything else that starts a NIXL agent. NVLink multicast stays off, as the device docs require (set here,
# never unset, inherited by every process). Each step runs under its own `timeout`, so a hung step leaves time
# and output for the next. Logs and JSON go to $OUT, the JSON and worker logs as one tarball (few files come back).
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export UCX_TLS="${UCX_TLS:-cuda_copy,cuda_ipc,tcp,self}" UCX_NET_DEVICES="${UCX_NET_DEVICES:-lo}"
OUT="${OUT:-/tmp/pd_gpu}"
RES="$OUT/res"
SITE="${SITE:-/tmp/site}"
mkdir -p "$RES"
what="${1:-all}"
T_INSTALL="${T_INSTALL:-90}"
T_TEST="${T_TEST:-240}"
T_BENCH="${T_BENCH:-270}"
T_SMALL="${T_SMALL:-150}"
DEV="${PD_GPU_DEVICE:-cuda:0}" DTYPE="${PD_GPU_DTYPE:-bfloat16}" LENS="${PD_GPU_LENS:-512,2048,8192}"
CFG="${PD_GPU_CONFIG:-flash-kv-4l}"  # PD_GPU_*: a dry run of this script on the CPU (cpu, float32, tiny, 16,40)

step() {  # step NAME SECONDS CMD...
    local name="$1" secs="$2"; shift 2
    echo "=== $name ($(date -u +%H:%M:%S), limit ${secs}s): $*"
    local t0=$SECONDS
    timeout --kill-after=10 "$secs" "$@"
    local rc=$?
    echo "=== $name rc=$rc in $((SECONDS - t0))s"
    return $rc
}

{
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv
# The entrypoint renders chat with deepseek-recipe (carry .whl/deepseek_recipe-*.whl), and the generated gRPC stubs
# need grpcio >= 1.85.1 where the device image has 1.84 (carry a grpcio 1.85 cp312 wheel in .whl-nixl:
# `pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 grpcio==1.85.3`).
step install "$T_INSTALL" python3 -m pip install -q --no-deps --no-index --target "$SITE" .whl-min/*.whl .whl-nixl/*.whl \
    $(ls .whl/deepseek_recipe-*.whl 2>/dev/null)
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import torch, triton, nixl; from importlib.metadata import version; \
print('torch', torch.__version__, 'triton', triton.__version__, 'nixl-cu13', version('nixl-cu13'), torch.cuda.get_device_name())"
} > "$RES/setup.log" 2>&1
cat "$RES/setup.log"
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"

if [[ "$what" == test || "$what" == all ]]; then
    per_test=(); python3 -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout "$((T_TEST - 15))")
    step pd_gpu_test "$T_TEST" python3 -m pytest -q -s -m gpu -p no:cacheprovider "${per_test[@]}" \
        --junitxml "$RES/pd_gpu_tests.xml" tests/e2e/test_pd_gpu.py 2>&1 | tee "$OUT/tests.log"
fi
if [[ "$what" == bench || "$what" == all ]]; then
    step pd_gpu_bench "$T_BENCH" python3 -m deepinfer.benchmarks.pd_gpu --config "$CFG" --device "$DEV" \
        --dtype "$DTYPE" --prompt-lens "$LENS" --reps 3 --max-tokens 8 --json "$RES/pd_gpu_$CFG.json" \
        --keep-logs "$RES/logs_$CFG" 2>&1 | tee "$OUT/bench.log"
fi
if [[ "$what" == small ]]; then
    step pd_gpu_small "$T_SMALL" python3 -m deepinfer.benchmarks.pd_gpu --config small --device "$DEV" \
        --dtype "$DTYPE" --prompt-lens "$LENS" --reps 3 --max-tokens 8 --json "$RES/pd_gpu_small.json" \
        --keep-logs "$RES/logs_small" 2>&1 | tee "$OUT/bench_small.log"
fi
tar -C "$OUT" -czf "$OUT/res.tgz" res && rm -rf "$RES"
