#!/usr/bin/env bash
# The GPU checks of one session, in one call (on a machine with a CUDA GPU and jax[cuda]):
#
#     OUT=runs/gpu bash scripts/gpu_checks.sh [BENCH_SECONDS [TEST_SECONDS]]
#
# 1. scripts/bench_gpu.py: the Pallas kernels checked against the XLA spec on the GPU and timed
#    against XLA and cuDNN (table in OUT/bench.log, rows in OUT/bench.json);
#    then its MoE section (--moe --quick: 30B-A3B experts, ours against HF's on the same GPU);
# 2. the kernel tests compiled for the GPU (tests/test_kernels.py, tests/test_kernels_model.py):
#    verbose, so each test's name and outcome is printed as it finishes, and stopped with SIGINT at
#    the time limit, so pytest still prints the failures it has seen (OUT/pytest.log).
# Each step has its own time limit (default 300 s and 240 s), so the whole call fits a lease.
set -o pipefail
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv 2>&1 | tee "$OUT/gpu.txt"
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())" 2>&1 | tee -a "$OUT/gpu.txt"
timeout -s INT -k 20 "${1:-300}" python3 scripts/bench_gpu.py --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
bench=$?
# The MoE experts (with tokamax when installed; its absl autotuning warnings left out of the log).
timeout -s INT -k 20 150 python3 scripts/bench_gpu.py --moe --quick --json "$OUT/moe.json" 2>&1 \
    | grep -v "^WARNING:absl" | tee "$OUT/moe.log"
moe=$?
timeout -s INT -k 20 "${2:-240}" python3 -m pytest -v -m "slow or not slow" -p no:cacheprovider -W ignore::DeprecationWarning -rf --tb=short \
    tests/test_kernels.py tests/test_kernels_model.py 2>&1 | tee "$OUT/pytest.log" | grep -E "PASSED|FAILED|ERROR|passed|failed|Error"
tests=$?
echo "bench_gpu exit $bench, bench_gpu --moe exit $moe, pytest exit $tests (124: stopped at its time limit)"
