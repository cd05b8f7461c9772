"""Training's target pass, before and after (commit 9a2d57e), in one process, interleaved: the packed rows with
the row's document mask (before: one forward over [B, 1024], logits everywhere, autocast casting the fp32
weights) against train_eagle.target_pass (each sequence alone with causal attention, logits where a draft is
scored, linears_in_bf16). Two packed rows of data/ (one holding several sequences, one a single sequence).

    python results/2026-12-02-v10-ttt-own-answers/target_pass_ab.py
"""
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from eagle_head import load_head  # noqa: E402
from model import Transformer  # noqa: E402
from scripts.make_data import read_chunk  # noqa: E402
from scripts.train_eagle import (conversation_sequences, document_mask, linears_in_bf16, pack_rows,  # noqa: E402
                                 packed_batch, target_pass)
from tokenizer import ensure_default_model  # noqa: E402

torch.set_num_threads(1)
target = Transformer.from_checkpoint(ensure_default_model()).requires_grad_(False)
head = load_head("heads/SmolLM2-135M-Instruct-eagle")
records = [r for p in sorted(Path("data").glob("sharegpt-c0002*.json")) for r in read_chunk(p)]
sequences = [{"tokens": t[:1024], "loss_mask": m[:1024]} for t, m in conversation_sequences(records)]
rows = pack_rows([len(s["tokens"]) for s in sequences], 1024)
batch = packed_batch(sequences, [r for r in rows if len(r) > 1][:1] + [r for r in rows if len(r) == 1][:1])


@torch.no_grad()
def before(model, head, batch):
    tokens = batch["tokens"]
    B, T = tokens.shape
    model.setup_caches(B, T)
    logits, features = model(tokens, torch.arange(T), mask=document_mask(batch["doc"]))
    draft = logits.index_select(-1, head.draft_vocab)
    return {"features": features, "target_top": logits.argmax(-1), "target_p": draft.float().softmax(-1)}


bf16_copy = linears_in_bf16(target)
times = {"before": [], "after": []}
with torch.autocast("cpu", dtype=torch.bfloat16):
    for rep in range(4):
        t0 = time.perf_counter()
        old = before(target, head, batch)
        t1 = time.perf_counter()
        new = target_pass(bf16_copy, head, batch)
        t2 = time.perf_counter()
        if rep:  # the first is a warm-up
            times["before"].append(t1 - t0)
            times["after"].append(t2 - t1)
with torch.no_grad():
    reference = before(target, head, batch)  # fp32
scored, real = batch["loss_mask"], batch["doc"] >= 0
print(f"tokens {int(real.sum())} in {tuple(batch['tokens'].shape)}, scored {int(scored.sum())}")
for name in times:
    print(f"{name}: median {sorted(times[name])[len(times[name]) // 2]:.2f} s ({', '.join(f'{t:.2f}' for t in times[name])})")
for name, x in (("before", old), ("after", new)):
    err = (x["features"][real] - reference["features"][real]).abs()
    agree = (x["target_top"][scored] == reference["target_top"][scored]).float().mean()
    print(f"{name} (bf16) against fp32: feature error mean {err.mean():.4f} max {err.max():.3f}, greedy token agrees {agree:.4f}")
