#!/usr/bin/env bash
# Everything owed to a GPU, in three calls of the device tool (10 minutes each), from any directory:
#   run(command="bash benchmarks/device_run.sh tune",  carry=[".whl"])   # correctness + tile sweep
#   (put the sweep's winners into hf_mhce/ops/triton_tile.py's _GPU_DEFAULTS, then)
#   run(command="bash benchmarks/device_run.sh peers llama3", carry=[".whl"])           # the P6 table with
#   run(command="bash benchmarks/device_run.sh peers gpt2 mistral7b", carry=[".whl"])   # those tiles
# peers also takes token counts (default 4096 16384 32768): `peers llama3 32768` finishes a shape that a
# call cut short, under its own record name (peers.py names every option that differs from its default).
# What lands in $OUT (the tool returns at most 8 files, and a stage writes up to 10 records):
# device.txt, log.txt (every table is printed there too), failures.txt (only if a step failed) and
# records.tar.gz (each record's .json and .md, repacked after every step so that a run cut short
# keeps what it finished). Unpack with `tar -xzkf records.tar.gz -C benchmarks/results` (-k: an
# existing record is never replaced) and commit them with date and device.
# The device image has torch, triton, transformers, peft and accelerate but no network: hf_mhce runs
# from the checkout (PYTHONPATH), and the peers travel as wheels in .whl/ (git-ignored), fetched
# beforehand where PyPI is reachable:  pip download --no-deps -d .whl liger-kernel cut-cross-entropy
set -uo pipefail  # no -e: one failing step must not cost the others (failures.txt says which)
usage() {
  echo "usage: bash benchmarks/device_run.sh tune | peers [gpt2|mistral7b|llama3 ...] [TOKENS ...]   (needs an" \
       "NVIDIA GPU; results in \$OUT, default a new folder under /tmp)" >&2
  exit 2
}
die() { echo "device_run.sh: $*" >&2; exit 1; }

# Arguments first, then the GPU: nothing is written before both are known to be good.
STAGE=${1:-}
case "$STAGE" in
  tune) [ $# -eq 1 ] || usage ;;
  peers) for arg in "${@:2}"; do case "$arg" in gpt2|mistral7b|llama3) ;; ''|0*|*[!0-9]*) usage ;; esac; done ;;
  *) usage ;;
esac
shift
OUT=${OUT:-/tmp/device_run-$STAGE-$(date +%Y%m%d-%H%M%S)}
case "$OUT" in /*) ;; *) OUT="$PWD/$OUT" ;; esac  # relative to where it was called, before the cd
cd "$(dirname "$0")/.." || die "cannot cd to the repository root"
command -v nvidia-smi >/dev/null || die "nvidia-smi not found: this needs a machine with an NVIDIA GPU"
GPU=$(nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv) || die "nvidia-smi failed: no usable GPU"
python3 -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' \
  || die "python3's torch sees no CUDA GPU (torch.cuda.is_available() is not True)"
[ -e "$OUT/records.tar.gz" ] && die "$OUT already holds records.tar.gz: use a fresh \$OUT"

mkdir -p "$OUT" || die "cannot create $OUT"
RECORDS=$(mktemp -d) || die "mktemp failed"  # outside $OUT, so that only the packed records go back
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
echo "$GPU" | tee "$OUT/device.txt"
python3 -c 'import torch, triton; from hf_mhce.ops.triton_backward import accumulation_mode as a
print("torch", torch.__version__, "triton", triton.__version__, "float32 accumulation:", a(torch.ones(1, device="cuda")) or "upcast")' \
  2>&1 | tee -a "$OUT/device.txt"
pack() {  # the records so far, as one file
  [ -n "$(ls -A "$RECORDS")" ] || return 0
  tar -czf "$RECORDS.tar.gz" -C "$RECORDS" . && mv -f "$RECORDS.tar.gz" "$OUT/records.tar.gz"
}
trap 'pack && rm -rf "$RECORDS"' EXIT  # the loose records are kept where packing failed
# The device tool kills the call at its limit (600 s) with everything in it, this script's packing
# too: a step still running then is stopped here in time, so that what it wrote is packed.
BUDGET_S=${DEVICE_RUN_BUDGET_S:-570}
SWEEP_MARGIN_S=60 SWEEP_MIN_S=20  # tile sweep: its budget under step's limit, and the least it is given
step() {  # step NAME COMMAND...: run, log, record a failure without stopping, pack the records
  local name=$1 left=$((BUDGET_S - SECONDS)); shift
  if [ "$left" -le 0 ]; then echo "$name not started: time budget spent" | tee -a "$OUT/failures.txt"; return; fi
  timeout -k 10 "$left" "$@" 2>&1 | tee -a "$OUT/log.txt"
  case "${PIPESTATUS[0]}" in
    0) ;;
    124|137) echo "$name stopped: time budget spent (${BUDGET_S} s)" | tee -a "$OUT/failures.txt" ;;
    *) echo "$name failed" | tee -a "$OUT/failures.txt" ;;
  esac
  pack
}
case "$STAGE" in
  tune)
    # 1. kernels vs float64 at LLM shapes (P1), and N*V > 2^31
    step gpu_suite python3 benchmarks/gpu_suite.py --out "$RECORDS"
    step gpu_suite_2pow31 python3 benchmarks/gpu_suite.py --tokens 16800 --heads 1 --dtypes bfloat16 --out "$RECORDS"
    step gpu_suite_lora python3 benchmarks/gpu_suite.py --tokens 4096 --heads 1 4 --dtypes bfloat16 --lora-rank 16 \
      --reps 3 --out "$RECORDS"
    # gradients in the forward (6NDV): N = 8192 in one chunk for H = 1 (H = 4: 3-4 chunks), and N = 16800
    # in two chunks with the float32 dW
    step gpu_suite_grad_in_forward python3 benchmarks/gpu_suite.py --workspace-mb 8192 --heads 1 4 --reps 3 \
      --out "$RECORDS"
    step gpu_suite_grad_in_forward_chunks python3 benchmarks/gpu_suite.py --workspace-mb 8192 --tokens 16800 \
      --heads 1 --dtypes bfloat16 --reps 3 --out "$RECORDS"
    # a softcap (Gemma-2's 30): the backward's derivative costs registers (NOTES change 12), against the H = 1 bf16 row
    step gpu_suite_softcap python3 benchmarks/gpu_suite.py --heads 1 --dtypes bfloat16 --softcap 30 --reps 3 \
      --out "$RECORDS"
    # rank ties with duplicated target rows (the target logit rounds like the sweep's tiles)
    step gpu_ties python3 benchmarks/gpu_ties.py --out "$RECORDS"
    # a softcap with several heads: the rank kernel's c * tanh must round as the target's (an fma once fused it)
    step gpu_ties_softcap python3 benchmarks/gpu_ties.py --softcap 30 --heads 4 --out "$RECORDS"
    # confident tokens at Llama-3's vocabulary: the loss's relative error, ours and eager (NOTES change 13)
    step confident_large_vocab python3 benchmarks/confident_large_vocab.py --vocab 128256
    # confident tokens (log p_t from the sweep's own maximum), a saturated softcap (its derivative) and
    # non-finite logits (NaN, as eager) on the GPU's kernels, if the image has pytest; before the sweep, which
    # takes all the time left
    step accuracy_on_gpu env HF_MHCE_TEST_DEVICE=cuda TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider \
      tests/losses/test_confident_tokens.py tests/losses/test_confident_large_vocab.py tests/losses/test_softcap_saturated.py \
      tests/losses/test_nonfinite_logits.py
    # 2. tile sweep (P6), bounded so that the call ends inside its 10 minutes: step stops it at what is left
    # of BUDGET_S, so its own budget is that less SWEEP_MARGIN_S for what runs outside or past it (process
    # start, building the problems, the setting in flight, re-timing the fastest); it writes its record
    # after every stage and on step's SIGTERM
    sweep_s=$((BUDGET_S - SECONDS - SWEEP_MARGIN_S)); [ "$sweep_s" -ge "$SWEEP_MIN_S" ] || sweep_s=$SWEEP_MIN_S
    step tile_sweep python3 benchmarks/tile_sweep.py --heads 1 --budget-s "$sweep_s" --out "$RECORDS"
    ;;
  peers)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      || echo "peer wheels not installed" | tee -a "$OUT/failures.txt"
    shapes=() tokens=()
    for arg in "$@"; do case "$arg" in *[!0-9]*) shapes+=("$arg") ;; *) tokens+=("$arg") ;; esac; done
    step peers python3 benchmarks/peers.py --out "$RECORDS" ${shapes[0]:+--shapes "${shapes[@]}"} \
      ${tokens[0]:+--tokens "${tokens[@]}"}
    ;;
esac
echo "results in $OUT"
[ ! -s "$OUT/failures.txt" ]  # the exit status says whether every step passed
