#!/usr/bin/env bash
# The GPU checks, prepared for a lent GPU machine: one call of under ten minutes.
#
#   1. `pdserve profile` of SmolLM2-135M's and Llama-2-7B's architectures with random weights
#      (issue 34: a measured GPU profile for the simulator) into $OUT/profile-*.json;
#   2. `pdserve bench gpu` (issue 17: the Triton kernel tests on the GPU, decode attention
#      bandwidth, CUDA graphs, KV hand-off, greedy equality with transformers).
#
# The device machine's python3 already has a CUDA torch, triton, transformers, pytest and
# tokenizers, but not msgspec, structlog, tenacity, redis, nats-py, llguidance or gguf, and
# its transformers is older than the project's pin; nothing can be fetched there. Before the
# call, in the repo root on the development machine:
#
#   echo /.whl/ >> .git/info/exclude; echo /.gpu/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#       --platform manylinux2014_x86_64 --platform any -d .whl msgspec structlog tenacity redis nats-py "llguidance>=1.7" gguf \
#       "transformers>=5.20,<5.25"
#   mkdir -p .gpu/tokenizer && cp ~/.cache/pdserve/models/SmolLM2-135M-Instruct/tokenizer*.json .gpu/tokenizer/
#
# then call the device tool with: command "bash loadtest/gpu_check.sh" (or "... profiles" for the
# profiles alone), carry [".whl", ".gpu"],
# timeout_s 590. The default model's wheel (98 MB) is over the 64 MiB a call carries, so every
# model here has random weights (engine.model.synthetic); step costs depend on shapes only. On a
# GPU machine with network, `make venv` and run the same commands with .venv/bin/python.
set -uo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
py=python3
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 3
    export PYTHONPATH="/tmp/site:$PWD"
    if ! $py -c "import transformers, msgspec, structlog, tenacity, engine.engine" 2>"${OUT:-/tmp}/import.log"; then
        echo "imports failed with the carried transformers; trying the image's"; tail -3 "${OUT:-/tmp}/import.log"
        rm -rf /tmp/site/transformers /tmp/site/transformers-*
    fi
fi
out="${OUT:-/tmp}"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 | tee "$out/nvidia_smi.txt"
lscpu | grep -E "Model name|^CPU\(s\)" | tee -a "$out/nvidia_smi.txt"

tok=""
[ -f .gpu/tokenizer/tokenizer.json ] && tok="--tokenizer .gpu/tokenizer"
profile() {  # shape, KV pool bytes, max prompt, seconds allowed
    PD_DEVICE=cuda PD_KV_CACHE_MEMORY_BYTES=$2 PD_CUDA_GRAPH_BATCH_SIZES=1,2,4,8,16,32,64,128,256 \
        timeout "$4" $py -m sim.measure --synthetic "$1" $tok --no-bus --max-prompt "$3" --max-batch 256 \
        --name "h200-$1" --out "$out/profile-h200-$1.json" 2>&1 | grep -v -i warn | tee "$out/profile-$1.log"
    echo "== profile $1: rc ${PIPESTATUS[0]} at $((SECONDS - start)) s"
}
profile smollm2-135m $((20 << 30)) 4096 130
profile llama2-7b $((100 << 30)) 4096 230
[ "${1:-all}" = profiles ] && exit 0
left=$((570 - (SECONDS - start)))
echo "== bench gpu with ${left} s left"
timeout "$left" $py -m loadtest.bench_gpu --model synthetic 2>&1 | tee "$out/bench_gpu.log"
echo "== bench gpu: rc ${PIPESTATUS[0]} at $((SECONDS - start)) s"
