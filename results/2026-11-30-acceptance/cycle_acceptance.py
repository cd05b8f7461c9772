"""Why is depth-1 acceptance on MT-bench (0.44) so far below the head's held-out top-1 (0.626)?
Runs EAGLE (fp32 target, chain-2, greedy) on the 20 held-out set (b) prompts, whose answers are the fp32
target's own greedy answers (so EAGLE reproduces exactly the sequences the top-1 figure is computed on),
and on the first turns of the 8 MT-bench questions of the benchmark's --per_category 1 run. For each it
prints the per-cycle depth-1 acceptance and tau, next to the per-token top-1 of the draft on the same
held-out sequences (every answer position counts once, with true features).

    python results/2026-11-30-acceptance/cycle_acceptance.py heads/SmolLM2-135M-Instruct-eagle
"""
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
torch.set_num_threads(1)
import generate  # noqa: E402
from eagle_head import EagleHead  # noqa: E402
from model import Transformer  # noqa: E402
from scripts.benchmark import load_dataset, select_questions  # noqa: E402
from scripts.convert_gguf import ensure_default_model  # noqa: E402
from scripts.train_eagle import heldout_accuracy  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402

head_dir = Path(sys.argv[1])
checkpoint = ensure_default_model()
target = Transformer.from_checkpoint(checkpoint)
tokenizer = Tokenizer.load(checkpoint.parent)
head = EagleHead.load(head_dir)
head.bind(target.output.weight)
tree = generate.parse_tree("chain-2")

seqs = json.loads((head_dir / "heldout-generated.json").read_text())[:20]
heldout = [(s["tokens"][: s["loss_mask"].index(True)], s["tokens"][s["loss_mask"].index(True):]) for s in seqs]
mtbench = [(tokenizer.encode_chat([{"role": "user", "content": q.turns[0]}]), None)
           for q in select_questions(load_dataset("mtbench"), None, 1)]


def run(name, items, max_new_tokens):
    accepts, same = [], 0
    for prompt, answer in items:
        n = len(answer) if answer is not None else max_new_tokens
        session = generate.Session(target, len(prompt) + n, head, tree)
        out, stats = session.generate(prompt, n, generate.Sampling(), tokenizer.stop_ids)
        accepts += stats.accept_lengths
        same += answer is not None and out[: len(answer)] == answer
    depth1 = statistics.mean(a >= 1 for a in accepts)
    depth2 = statistics.mean(a >= 2 for a in accepts)
    tau = 1 + statistics.mean(accepts)
    print(f"{name}: {len(items)} prompts, {len(accepts)} cycles, per-cycle acceptance depth 1 {depth1:.3f}, "
          f"depth 2 {depth2:.3f}, tau {tau:.3f}" + (f"; EAGLE reproduced {same} of the stored answers" if
                                                    items[0][1] is not None else ""), flush=True)


top1 = heldout_accuracy(target, head, seqs)["top1"]
print(f"held-out set (b): per-token top-1 after 0..3 chained steps {top1}", flush=True)
run("held-out set (b), fp32 chain-2", heldout, None)
run("MT-bench first turns (8 categories), fp32 chain-2, 128 tokens", mtbench, 128)
