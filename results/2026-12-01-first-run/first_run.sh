#!/usr/bin/env bash
# First and second run of the quickstart's command 1 and its variants, as a new user meets them: each
# configuration gets a fresh model folder (the converted model.pth linked in, no quantized file) and a
# fresh inductor cache; its second run reuses both. Prints each run's status lines, statistics and wall time.
#   bash results/2026-12-01-first-run/first_run.sh > results/2026-12-01-first-run/output.txt 2>&1
set -euo pipefail
cd "$(dirname "$0")/../.."
python generate.py --raw --prompt "warm the page cache" --max_new_tokens 1 > /dev/null 2>&1  # converts once
src=checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct
prompt="Explain speculative decoding in two sentences."
echo "machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores," \
     "flags: $(grep -o 'avx2\|avx512_bf16\|amx_bf16' /proc/cpuinfo | sort -u | xargs), load: $(cut -d' ' -f1-3 /proc/loadavg)"
for config in "--eagle --quantize int4 --compile" "--eagle --quantize int4" \
              "--eagle --quantize int4 --compile --compile_prefill" "--quantize int4 --compile" ""; do
    tmp=$(mktemp -d)
    mkdir "$tmp/model"
    for f in "$src"/*; do case "$(basename "$f")" in model_*) ;; *) ln -s "$PWD/$f" "$tmp/model/";; esac; done
    for run in first second; do
        echo "== generate.py ${config:-(fp32 eager vanilla)}: $run run"
        start=$(date +%s.%N)
        TORCHINDUCTOR_CACHE_DIR="$tmp/inductor" python generate.py --checkpoint "$tmp/model" \
            --eagle_head heads/SmolLM2-135M-Instruct-eagle $config --threads 2 --max_new_tokens 128 \
            --prompt "$prompt" 2>&1 >/dev/null
        echo "wall $(echo "$(date +%s.%N) - $start" | bc | xargs printf '%.1f') s"
    done
    rm -rf "$tmp"
done
