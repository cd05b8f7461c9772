"""Where in an answer does the head miss? Depth-1 top-1 (true features, fp32 target) of a head's draft against the
target's argmax, by the token's position in its answer and by turn (first answer of a conversation or a later one),
on held-out ShareGPT greedy answers (all turns) and on the 80 MT-bench first turns (precision_gap.py's answers).

    python results/2026-12-03-head-capacity-avx512-bf16/by_position.py heads/SmolLM2-135M-Instruct-eagle-v10 \
        > results/2026-12-03-head-capacity-avx512-bf16/by-position-v10.txt
"""
import collections
import json
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
BUCKETS = (0, 16, 64, 256, 10 ** 9)
target = Transformer.from_checkpoint(ensure_default_model())
head = load_head(sys.argv[1])
head.bind(target.output.weight)


def hits_by_bucket(sequences) -> dict:
    counts = collections.defaultdict(lambda: [0, 0])
    for r in train_eagle.heldout_records(target, sequences):
        embeds, feats, true_next, mask = train_eagle.head_inputs(target, head, r, "cpu")
        L = embeds.shape[0]
        head.setup_caches(L)
        pred = head(embeds[None], feats[None], torch.arange(L))[0]
        hit = head.token_ids(head.draft_logits(pred).argmax(-1)) == target.output(true_next).argmax(-1)
        turn, pos = -1, 0
        for i, m in enumerate(mask.tolist()):  # mask[i]: is token i + 1 an answer token
            if not m:
                pos = -1
                continue
            if pos == -1 or turn == -1:
                turn, pos = turn + 1, 0
            bucket = next(f"{a}-{b - 1}" if b < 10 ** 9 else f"{a}+" for a, b in zip(BUCKETS, BUCKETS[1:]) if a <= pos < b)
            for key in (("turn", "first" if turn == 0 else "later"), ("position", bucket), ("all", "")):
                counts[key][0] += int(hit[i])
                counts[key][1] += 1
            pos += 1
    return {f"{k[0]} {k[1]}".strip(): (round(h / n, 4), n) for k, (h, n) in sorted(counts.items())}


target_hash = weights_hash(target)
here = Path(__file__).resolve().parent
sets = {"held-out ShareGPT (100 sequences, all turns)":
        train_eagle.answer_sequences(Path("data/heldout"), target_hash, 1024, temperature=0.0)[:100],
        "MT-bench first turns (80)": json.loads((here / "mtbench-int4-answers.json").read_text())}
for name, sequences in sets.items():
    print(name)
    for key, (top1, n) in hits_by_bucket(sequences).items():
        print(f"  {key:14s} top-1 {top1:.3f}  ({n} tokens)")
