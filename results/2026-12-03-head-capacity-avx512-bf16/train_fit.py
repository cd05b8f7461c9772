"""Does the head underfit or overfit? Its depth-1 top-1 (true features, fp32 target) on 40 greedy answers it was
trained on (the first two T=0 chunks of data/, seen by v8 and everything warm-started from it) against 40 held-out
greedy answers (data/heldout). A head that memorises its data scores far higher on the first; one that lacks
capacity scores about the same on both.

    python results/2026-12-03-head-capacity-avx512-bf16/train_fit.py heads/SmolLM2-135M-Instruct-eagle-v10
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from eagle_head import load_head  # noqa: E402
from model import Transformer  # noqa: E402
from scripts import train_eagle  # noqa: E402
from scripts.make_data import weights_hash  # noqa: E402
from tokenizer import ensure_default_model  # noqa: E402

torch.set_grad_enabled(False)
torch.set_num_threads(1)
target = Transformer.from_checkpoint(ensure_default_model())
target_hash = weights_hash(target)
head = load_head(sys.argv[1])
head.bind(target.output.weight)


def top1(sequences) -> tuple:
    hits = weight = 0
    for r in train_eagle.heldout_records(target, sequences):
        n = int(r["loss_mask"][1:].sum())
        head.max_seq_len = 0
        head.setup_rope(len(r["tokens"]))
        head.clear_kv_caches()
        hits += train_eagle.chained_accuracy(target, head, r, 0, "cpu")[0] * n
        weight += n
    return round(hits / weight, 4), weight


held = train_eagle.answer_sequences(Path("data/heldout"), target_hash, 1024, temperature=0.0)[:40]
seen = train_eagle.answer_sequences(Path("data"), target_hash, 1024, temperature=0.0,
                                    names=["sharegpt-c000200-t0", "sharegpt-c000264-t0"])[:40]
print("held-out", top1(held))  # (top-1, answer tokens)
print("train", top1(seen))
