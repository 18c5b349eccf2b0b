#!/usr/bin/env bash
# Everything owed to a GPU, in one call of the device tool (results land in $OUT, then are copied
# into benchmarks/results/ and committed with date and device):
#   run(command="bash benchmarks/device_run.sh", carry=[".whl"])
# .whl/ (git-ignored) holds the peers' wheels, fetched beforehand on a machine with PyPI:
#   pip download --no-deps -d .whl liger-kernel cut-cross-entropy
set -euo pipefail
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
python -m pip install -q -e ".[test]" 2>&1 | tail -1 || true
python -m pip install -q --no-deps .whl/*.whl 2>&1 | tail -1 || true
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT/device.txt"
# 1. kernels vs float64 at LLM shapes (P1), and N*V > 2^31
python benchmarks/gpu_suite.py --out "$OUT" 2>&1 | tail -20
python benchmarks/gpu_suite.py --tokens 16800 --heads 1 --dtypes bfloat16 --out "$OUT" 2>&1 | tail -5
# 2. peers (P6)
python benchmarks/peers.py --out "$OUT" 2>&1 | tail -60
