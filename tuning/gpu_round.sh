#!/usr/bin/env bash
# One round of the GPU measurements the open goals need, in one go on a machine with an NVIDIA GPU
# (its own torch), each step's output in OUT/<step>.log and a summary of exit codes in OUT/steps.txt.
# The sm_90 kernels must be built (build/sm_90: python -m rdnattention_gen.cli build --targets sm_90);
# nothing is compiled here. A step that fails does not stop the others.
#
#     bash tuning/gpu_round.sh OUT [STEP ...]      # default: every step, in this order
#
# Steps: install, score (softcap/ALiBi/sinks cost), bwd (backward vs torch), tests (GPU tests of the
# backward, score transforms and integrations), generate (HF generate() beside sdpa), overhead
# (eager host cost of the decode and kvcache paths beside SDPA, with each one's GPU time). Each step
# may take minutes (its limit is below): where a command's time is limited, run the steps in separate
# commands, each with its own OUT (OUT/steps.txt is started afresh), e.g. `bash tuning/gpu_round.sh out/a install tests`.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:?usage: bash tuning/gpu_round.sh OUT [STEP ...]}"
shift
STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(install score bwd tests generate overhead)
PYTHON="${PYTHON:-python3}"
mkdir -p "$OUT"
: > "$OUT/steps.txt"

run() {  # run STEP SECONDS COMMAND...
  local step=$1 limit=$2
  shift 2
  local start=$SECONDS
  timeout "$limit" "$@" > "$OUT/$step.log" 2>&1
  local rc=$?
  echo "$step rc=$rc $((SECONDS - start))s: $*" | tee -a "$OUT/steps.txt"
}

for step in "${STEPS[@]}"; do
  case "$step" in
    install) run install 300 "$PYTHON" -m pip install --no-deps --no-build-isolation -e . ;;
    score) run score 600 "$PYTHON" -m tuning.bench --score-only --out "$OUT/score" ;;
    bwd) run bwd 600 "$PYTHON" -m tuning.bench_bwd --out "$OUT/bwd" ;;
    tests) run tests 900 "$PYTHON" -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_backward.py \
             tests/kernels/test_backward_varlen.py tests/gpu/test_cuda.py tests/runtime/test_transformers.py \
             tests/runtime/test_sdpa_clients.py tests/runtime/test_sdpa_patch.py ;;
    generate) run generate 900 "$PYTHON" -m tuning.generate --rounds 2 ;;
    overhead) run overhead 600 "$PYTHON" -m tuning.overhead --device cuda --only kvcache,decode,transformers,sdpa.patched --kernel-time --cold --host ;;
    *) echo "unknown step $step (install score bwd tests generate overhead)" | tee -a "$OUT/steps.txt" ;;
  esac
done
