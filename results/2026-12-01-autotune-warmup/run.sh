#!/usr/bin/env bash
# First and second run of quickstart command 1 with --autotune off and on, each pair with a fresh inductor
# cache (TORCHINDUCTOR_CACHE_DIR); 2 threads, the int4 file made beforehand. Prints the warm-up line, the
# speed line and the whole command's wall time. Run from the repository root, alone on the machine.
set -euo pipefail
for autotune in off on; do
  cache=$(mktemp -d)
  for run in first second; do
    start=$(date +%s.%N)
    TORCHINDUCTOR_CACHE_DIR=$cache python generate.py --eagle --quantize int4 --compile --autotune $autotune \
      --threads 2 --max_new_tokens 128 --prompt "Explain speculative decoding in two sentences." \
      > /dev/null 2> "$cache/$run.err"
    end=$(date +%s.%N)
    echo "autotune $autotune, $run run: $(python -c "print(f'{$end - $start:.0f}')") s in all"
    grep -E "Compiling|tokens in|tree auto" "$cache/$run.err" | sed 's/^/  /'
  done
  rm -rf "$cache"
done
