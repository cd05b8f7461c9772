#!/bin/bash
# Training throughput, old shard path vs online path, same 44 ShareGPT sequences, one thread, 8 steps each.
cd "$(dirname "$0")/../.."
PY=/work/venv/bin/python
export OMP_NUM_THREADS=1
D=runs/e3/data  # made by: python scripts/train_eagle.py data --out runs/e3/data --generated 0 --sharegpt 48 --eval_size 2 --max_new_tokens 64 --batch_size 8 --threads 1
COMMON="--max_steps 8 --warmup 2 --eval_every 1000 --save_every 1000 --threads 1 --draft_vocab 16384"
run_old() { name=$1; shift; rm -rf runs/e3/speed-$name; $PY scripts/train_eagle.py train --data $D --train_sets sharegpt --eval_sets sharegpt --eval_records 2 --batch_size 2 --lr 3e-4 $COMMON --out runs/e3/speed-$name "$@" > runs/e3/speed-$name.log 2>&1; }
run_new() { name=$1; shift; rm -rf runs/e3/speed-$name; mkdir -p runs/e3/speed-$name; cp $D/sharegpt_token_counts.pt runs/e3/speed-$name/; $PY scripts/train_eagle.py online --shards $D --train_sets sharegpt --eval_records 2 --batch_size 2 --pack_len 1024 $COMMON --out runs/e3/speed-$name "$@" > runs/e3/speed-$name.log 2>&1; }
run_old old-fp32
run_old old-bf16 --bf16
run_new e1-k1-bf16 --head eagle --ttt_steps 1
run_new e1-k1-fp32 --head eagle --ttt_steps 1 --no-bf16
run_new e1-k3-bf16 --head eagle --ttt_steps 3
run_new e3-k3-bf16 --head eagle3 --ttt_steps 3
run_new e3-k3-fp32 --head eagle3 --ttt_steps 3 --no-bf16
run_new e3-k1-bf16 --head eagle3 --ttt_steps 1
echo all done
