#!/bin/bash
# the input-representation ablation: four heads, same data (shards 0-9), same steps, from scratch
cd "$(dirname "$0")/../.."  # the repository root; data/ablation links train-generated shards 0-9 and the eval shard of data/eagle
for mode in shifted unshifted feature token; do
  python scripts/train_eagle.py train --input-mode $mode --data data/ablation --out runs/ablation-$mode \
    --lr 1e-3 --warmup 20 --max_steps 150 --batch_size 8 --eval_every 150 --save_every 25 --eval_records 20 \
    --eval_sets generated --threads 1 --save_head runs/ablation-$mode/head
done
