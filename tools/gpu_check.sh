#!/usr/bin/env bash
# One prepared GPU check for a session lent a device (the brief: CUDA tests, then benchmarks/gpu.py,
# in one call that fits the device time). Everything it prints also lands under $OUT.
#
#   bash tools/gpu_check.sh            # on the device machine, from the repository root
#
# Wheels the device image lacks travel in .whl/ (see the device tool's README); each stage has its
# own time limit so that a slow stage cannot eat the next one's figures.
set -u
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import sys, torch, fedsub; print(sys.version.split()[0], torch.__version__, \
torch.cuda.get_device_name(), torch.cuda.device_count())"
    nproc
} 2>&1 | tee "$OUT/device.txt"

echo "== CUDA tests"
timeout "${TESTS_S:-200}" python3 -m pytest -q -p no:cacheprovider -rfEs --durations=15 \
    --junitxml="$OUT/cuda-tests.xml" \
    tests/test_cuda.py tests/test_deterministic.py tests/test_device.py tests/test_host_syncs.py \
    tests/test_table_placement.py tests/test_captured_step.py tests/test_cuda_graphs.py tests/test_float32.py tests/test_dp_cuda.py 2>&1 | tee "$OUT/cuda-tests.log"

echo "== backend equivalence on cuda"
FEDSUB_TEST_DEVICE=cuda timeout "${BACKENDS_S:-90}" python3 -m pytest -q -p no:cacheprovider \
    -rfE tests/test_backends.py 2>&1 | tee "$OUT/backends-cuda.log"

echo "== benchmarks/gpu.py"
timeout "${BENCH_S:-250}" python3 benchmarks/gpu.py --device cuda --only "${FIGURES:-g1,g4,g5,g6}" ${BENCH_ARGS:---graphs} \
    2>&1 | tee "$OUT/gpu.log"
echo "== done"
