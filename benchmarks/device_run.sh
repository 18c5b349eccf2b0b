#!/usr/bin/env bash
# Everything owed to a GPU, in one call of the device tool (results land in $OUT, then are copied
# into benchmarks/results/ and committed with date and device):
#   run(command="bash benchmarks/device_run.sh", carry=[".whl"])
# The device image has torch, triton, transformers, peft and accelerate but no network: hf_mhce runs
# from the checkout (PYTHONPATH), and the peers travel as wheels in .whl/ (git-ignored), fetched
# beforehand where PyPI is reachable:  pip download --no-deps -d .whl liger-kernel cut-cross-entropy
set -uo pipefail  # no -e: one failing step must not cost the others (failures.txt says which)
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || echo "peer wheels not installed" >> "$OUT/failures.txt"
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT/device.txt"
# 1. kernels vs float64 at LLM shapes (P1), and N*V > 2^31
python3 benchmarks/gpu_suite.py --out "$OUT" 2>&1 | tee -a "$OUT/log.txt" || echo "gpu_suite failed" >> "$OUT/failures.txt"
python3 benchmarks/gpu_suite.py --tokens 16800 --heads 1 --dtypes bfloat16 --out "$OUT" 2>&1 | tee -a "$OUT/log.txt" \
  || echo "gpu_suite N*V > 2^31 failed" >> "$OUT/failures.txt"
# 2. peers (P6)
python3 benchmarks/peers.py --out "$OUT" 2>&1 | tee -a "$OUT/log.txt" || echo "peers failed" >> "$OUT/failures.txt"
