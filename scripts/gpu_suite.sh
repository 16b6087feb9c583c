#!/usr/bin/env bash
# `pytest -m gpu` in parts that each fit one device call of at most 10 minutes
# (docs/testing.md), from the repository root on a GPU machine:
#
#     bash scripts/gpu_suite.sh serial    # GPU memory to themselves, one process each
#     bash scripts/gpu_suite.sh slow      # the soak and the split GEMM's big operands
#     bash scripts/gpu_suite.sh xdist     # everything else, under pytest-xdist workers
#
# The xdist workers share the GPU's memory: one per 16 GiB, at most 8 (8 on an H200's
# 139 GiB, 4 on an H100's 79: with 8 there, 7 tests ran out of memory). GPU_SUITE_WORKERS
# overrides the count.
# Logs go to $OUT (the device tool's output folder) if set, else to results/.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} HYPOTHESIS_PROFILE=gpu
out=${OUT:-results}
mkdir -p "$out"
# tests that need the GPU's memory to themselves (beside the autotune-log test in a
# process of its own); with the soak and the split GEMM the "slow" part. The
# out-of-memory tests last: on torch 2.11 one of them kills the process (docs/testing.md)
SERIAL=(tests/test_gpu_big_batch.py tests/test_gpu_cuda_graphs.py
        tests/test_gpu.py::test_soak_1000_calls_memory_flat_no_recompiles_bitwise_equal
        tests/test_gpu_properties.py::test_contract_margin_over_batch_sizes
        tests/test_gpu_module.py::test_batch_one_on_autograd_thread_interleaved_with_main_thread_graphs
        tests/test_gpu_errors.py)
SLOW=(tests/test_gpu_soak.py tests/test_gpu_split_gemm.py)

case "${1:-}" in
serial)
    python3 -m pytest -q -m gpu tests/test_gpu_autotune_logs.py >"$out/gpu_autotune_logs.log" 2>&1 &
    autotune=$! status=0
    python3 -m pytest -q -m gpu "${SERIAL[@]}" 2>&1 | tee "$out/gpu_tests_serial.log" || status=$?
    wait "$autotune" || status=$?
    tail -3 "$out/gpu_autotune_logs.log"
    exit "$status" ;;
slow)
    python3 -m pytest -q -m gpu "${SLOW[@]}" 2>&1 | tee "$out/gpu_tests_slow.log" ;;
xdist)
    apart=()
    for test in "${SERIAL[@]}" "${SLOW[@]}" tests/test_gpu_autotune_logs.py; do
        if [[ $test == *::* ]]; then apart+=(--deselect "$test"); else apart+=(--ignore "$test"); fi
    done
    workers=${GPU_SUITE_WORKERS:-$(python3 -c 'import torch
print(max(1, min(8, torch.cuda.get_device_properties(0).total_memory // (16 * 2**30))))')}
    { echo "xdist: $workers workers"
      python3 -m pytest -q -m gpu -n "$workers" "${apart[@]}" 2>&1; } | tee "$out/gpu_tests_xdist.log" ;;
*)
    echo "usage: bash scripts/gpu_suite.sh serial|slow|xdist" >&2; exit 2 ;;
esac
