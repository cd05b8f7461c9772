"""How sure is the target itself? Mean top-1 probability of the fp32 target on the answer tokens of the held-out
ShareGPT greedy answers (100 sequences) and of the 80 MT-bench first turns (precision_gap.py's answers): a draft
cannot agree with the target more often than the target's own choice is predictable from the context.

    python results/2026-12-03-head-capacity-avx512-bf16/target_confidence.py > results/2026-12-03-head-capacity-avx512-bf16/target-confidence.txt
"""
import sys, json, torch
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from model import Transformer
from scripts import train_eagle
from scripts.make_data import weights_hash
from tokenizer import ensure_default_model
torch.set_grad_enabled(False); torch.set_num_threads(1)
t = Transformer.from_checkpoint(ensure_default_model())
sets = {"held-out": train_eagle.answer_sequences(Path("data/heldout"), weights_hash(t), 1024, temperature=0.0)[:100],
        "mtbench": json.loads(Path("results/2026-12-03-head-capacity-avx512-bf16/mtbench-int4-answers.json").read_text())}
for name, seqs in sets.items():
    ps = []
    for s in seqs:
        tok = torch.tensor(s["tokens"]); t.setup_caches(1, len(tok))
        logits, _ = t(tok[None], torch.arange(len(tok)))
        p = logits[0, :-1].float().softmax(-1).max(-1).values
        ps.append(p[torch.tensor(s["loss_mask"][1:])])
    p = torch.cat(ps)
    print(name, "mean max-prob", round(p.mean().item(), 3), "share >0.9", round((p > 0.9).float().mean().item(), 3), "share <0.5", round((p < 0.5).float().mean().item(), 3), len(p))
