#!/usr/bin/env bash
# Issue 30's multi-GPU expert-parallel run in one device call (benchmarks/multi_gpu_ep.py), from the repository
# root with the carried wheels installed and PYTHONPATH set (BENCHMARKS.md "Reproduce" notes):
#   bash deploy/device/multi_gpu_ep.sh [--ranks N] [--quick] [any other benchmarks.multi_gpu_ep flag]
# Writes $OUT/multi_gpu_ep.json (rewritten after every step), $OUT/multi_gpu_ep.md (the markdown table) and
# $OUT/multi_gpu_ep.log, plus nvidia-smi's view. NVLink multicast stays off, as the device docs require: a
# program using it can put the shared host's GPUs out of service; these are set here (never unset) and
# inherited by every rank process.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/multi_gpu_ep}"
mkdir -p "$OUT"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
python3 -m deepinfer.benchmarks.multi_gpu_ep --json "$OUT/multi_gpu_ep.json" "$@" 2>&1 | tee "$OUT/multi_gpu_ep.log"
rc=${PIPESTATUS[0]}
# the markdown table again, from the JSON (also when the run was cut short after some steps)
python3 -c "import json, sys; from deepinfer.benchmarks.multi_gpu_ep import format_report; \
print(format_report(json.load(open(sys.argv[1]))))" "$OUT/multi_gpu_ep.json" > "$OUT/multi_gpu_ep.md" 2>&1 || true
exit "$rc"
