#!/usr/bin/env bash
# Issue 17's GPU check, prepared for a lent GPU machine (run it once; it takes a few minutes).
#
# The device machine's python3 already has a CUDA torch, triton, transformers, pytest and
# tokenizers, but not msgspec or structlog, and nothing can be fetched there. Before the call,
# in the repo root on the development machine:
#
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl msgspec structlog
#
# then call the device tool with: command "bash loadtest/gpu_check.sh", carry [".whl"],
# timeout_s 540. The default model's wheel (98 MB) is over the 64 MiB a call carries, so the
# step-time and greedy checks use SmolLM2-135M's architecture with random weights
# (--model synthetic); on a machine with `make venv` done, run `.venv/bin/pdserve bench gpu`.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 3
    export PYTHONPATH="/tmp/site:$PWD"
else
    export PYTHONPATH="$PWD"
fi
export PYTHONUNBUFFERED=1
out="${OUT:-/tmp}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$out/nvidia_smi.txt"
python3 -m loadtest.bench_gpu --model "${PD_BENCH_GPU_MODEL:-synthetic}" "$@" 2>&1 | tee "$out/bench_gpu.log"
exit "${PIPESTATUS[0]}"
