#!/usr/bin/env bash
# The GPU check, run on a machine with a CUDA GPU from the repository root:
#   bash benchmarks/gpu_check.sh [REPORT_DIR]
# the cuda tests, the Triton kernels' tests (on the GPU), then gpu_bench.py.
# Each stage runs even if one before failed; logs and gpu_report.json go to REPORT_DIR
# (default benchmarks/results). Exits non-zero if any stage failed.
set -uo pipefail
cd "$(dirname "$0")/.."
report_dir=${1:-benchmarks/results}
mkdir -p "$report_dir"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
failed=0

stage() {
    local name=$1
    shift
    echo "== $name"
    local start=$SECONDS
    "$@" 2>&1 | tee "$report_dir/$name.log"
    local status=${PIPESTATUS[0]}
    echo "== $name: exit $status in $((SECONDS - start)) s"
    [ "$status" -eq 0 ] || failed=1
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
"$python" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
stage cuda_tests "$python" -m pytest -p no:cacheprovider -q -m cuda -rs tests/inference/test_cuda_path.py
stage triton_kernels "$python" -m pytest -p no:cacheprovider -q tests/kernels/test_triton_ops.py tests/inference/test_attention.py -k "triton or test_triton_ops"
stage gpu_bench "$python" benchmarks/gpu_bench.py --out "$report_dir/gpu_report.json"
exit $failed
