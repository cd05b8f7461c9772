"""v10's depth-1 top-1 (true features, fp32 target) on the 80 MT-bench first turns by category.

    python results/2026-12-03-head-capacity-avx512-bf16/by_category.py heads/SmolLM2-135M-Instruct-eagle-v10 > results/2026-12-03-head-capacity-avx512-bf16/by-category-v10.txt
"""
import sys, json, collections, torch
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from model import Transformer
from eagle_head import load_head
from scripts import train_eagle, benchmark
from tokenizer import ensure_default_model
torch.set_grad_enabled(False); torch.set_num_threads(1)
t = Transformer.from_checkpoint(ensure_default_model())
head = load_head(sys.argv[1]); head.bind(t.output.weight)
seqs = json.loads(Path("results/2026-12-03-head-capacity-avx512-bf16/mtbench-int4-answers.json").read_text())
items = benchmark.load_dataset("mtbench")
c = collections.defaultdict(lambda: [0, 0])
for item, r in zip(items, train_eagle.heldout_records(t, seqs)):
    e, f, tn, m = train_eagle.head_inputs(t, head, r, "cpu"); L = e.shape[0]; head.setup_caches(L)
    hit = head.token_ids(head.draft_logits(head(e[None], f[None], torch.arange(L))[0]).argmax(-1)) == t.output(tn).argmax(-1)
    c[item.category][0] += int(hit[m].sum()); c[item.category][1] += int(m.sum())
for k, (h, n) in c.items(): print(k, round(h / n, 3), n)
