"""Head v8 itself under the online trainer's held-out evaluation (train_eagle.evaluate_unrolled), the
step-0 row of curve.json's runs from --init v8.

    python results/2026-12-01-eagle1-ttt-from-v8/baseline.py > results/2026-12-01-eagle1-ttt-from-v8/baseline.json
"""
import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]
import train_eagle  # noqa: E402
from eagle_head import load_head  # noqa: E402
from model import Transformer  # noqa: E402

torch.set_num_threads(1)
torch.set_grad_enabled(False)
target = Transformer.from_checkpoint(REPO / "checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct/model.pth")
head = load_head(REPO / "heads/SmolLM2-135M-Instruct-eagle")
head.bind(target.output.weight)
args = argparse.Namespace(shards=None, checkpoint=REPO / "checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct/model.pth",
                          conversations=0, pack_len=1024, eval_records=20,
                          eval_json=[str(REPO / "heads/SmolLM2-135M-Instruct-eagle/heldout-generated.json")])
_, evals = train_eagle.online_sequences(args)
head.setup_rope(max(len(s["tokens"]) for seqs in evals.values() for s in seqs) + train_eagle.EVAL_STEPS + 1)
print(json.dumps({"step": 0, **{name: train_eagle.evaluate_unrolled(target, head, seqs) for name, seqs in evals.items()}}))
