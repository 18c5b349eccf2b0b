#!/usr/bin/env bash
# Everything owed to a GPU, in two calls of the device tool (10 minutes each; results land in $OUT,
# then are copied into benchmarks/results/ and committed with date and device):
#   run(command="bash benchmarks/device_run.sh tune",  carry=[".whl"])   # correctness + tile sweep
#   (put the sweep's winners into hf_mhce/ops/triton_tile.py's _GPU_DEFAULTS, then)
#   run(command="bash benchmarks/device_run.sh peers llama3", carry=[".whl"])           # the P6 table with
#   run(command="bash benchmarks/device_run.sh peers gpt2 mistral7b", carry=[".whl"])   # those tiles
# The device image has torch, triton, transformers, peft and accelerate but no network: hf_mhce runs
# from the checkout (PYTHONPATH), and the peers travel as wheels in .whl/ (git-ignored), fetched
# beforehand where PyPI is reachable:  pip download --no-deps -d .whl liger-kernel cut-cross-entropy
set -uo pipefail  # no -e: one failing step must not cost the others (failures.txt says which)
STAGE=${1:-tune}
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT/device.txt"
step() {  # step NAME COMMAND...: run, log, record a failure without stopping
  local name=$1; shift
  "$@" 2>&1 | tee -a "$OUT/log.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || echo "$name failed" >> "$OUT/failures.txt"
}
case "$STAGE" in
  tune)
    # 1. kernels vs float64 at LLM shapes (P1), and N*V > 2^31
    step gpu_suite python3 benchmarks/gpu_suite.py --out "$OUT"
    step gpu_suite_2pow31 python3 benchmarks/gpu_suite.py --tokens 16800 --heads 1 --dtypes bfloat16 --out "$OUT"
    step gpu_suite_lora python3 benchmarks/gpu_suite.py --tokens 4096 --heads 1 4 --dtypes bfloat16 --lora-rank 16 \
      --reps 3 --out "$OUT"
    # rank ties with duplicated target rows (the target logit rounds like the sweep's tiles)
    step gpu_ties python3 benchmarks/gpu_ties.py --out "$OUT"
    # 2. tile sweep (P6), bounded so that the call ends inside its 10 minutes
    step tile_sweep python3 benchmarks/tile_sweep.py --heads 1 --budget-s 300 --out "$OUT"
    ;;
  peers)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      || echo "peer wheels not installed" >> "$OUT/failures.txt"
    shift
    step peers python3 benchmarks/peers.py --out "$OUT" ${1:+--shapes "$@"}
    ;;
  *) echo "usage: device_run.sh tune|peers" >&2; exit 2 ;;
esac
