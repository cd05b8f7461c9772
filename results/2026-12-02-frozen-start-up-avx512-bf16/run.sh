#!/usr/bin/env bash
# Start-up of quickstart command 1 with --autotune off and on: a first run with a fresh inductor cache
# (TORCHINDUCTOR_CACHE_DIR) and two later runs on the cache it left; the int4 file made beforehand.
# Prints the status lines (autotune, tree, warm-up), the speed line and the whole command's wall time.
# Run from the repository root: bash results/2026-12-02-frozen-start-up-avx512-bf16/run.sh [THREADS] [EXTRA ARGS]
set -euo pipefail
threads=${1:-1}
shift || true
for autotune in off on; do
  cache=$(mktemp -d)
  for run in first second third; do
    start=$(date +%s.%N)
    TORCHINDUCTOR_CACHE_DIR=$cache python generate.py --eagle --quantize int4 --compile --autotune $autotune \
      --threads "$threads" --max_new_tokens 128 --prompt "Explain speculative decoding in two sentences." "$@" \
      > /dev/null 2> "$cache/$run.err"
    end=$(date +%s.%N)
    echo "autotune $autotune, $run run: $(python -c "print(f'{$end - $start:.0f}')") s in all"
    grep -E "Compiling|tokens in|tree auto|max-autotune" "$cache/$run.err" | sed 's/^/  /'
  done
  rm -rf "$cache"
done
