"""Sampling at T > 0 (results/2026-12-01-t1-draws-vs-top-tokens): a static tree's draft tokens drawn from
the head's q (Tree.draft) against its top tokens as one-hot proposals (accept_sampling with draft_probs None),
interleaved per prompt, same seeds. Run from the repository root: compare.py [TREE] [TEMPERATURE]."""
import statistics
import sys

sys.path.insert(0, ".")
sys.path.insert(0, "scripts")
import torch
import generate as g
import benchmark as b
from tree import Tree

torch.set_num_threads(1)
args = g.parse_args(["--eagle", "--quantize", "int4", "--tree", sys.argv[1] if len(sys.argv) > 1 else "chain-1"])
model, tok, head, tree = g.load(args)

class OneHot(Tree):
    def draft(self, session, root_token, root, sampling):
        return super().draft(session, root_token, root, g.Sampling())  # top tokens; draft_probs None

one_hot = OneHot(**{f: getattr(tree, f) for f in tree.__dataclass_fields__})
items = b.select_questions(b.load_dataset("mtbench"), None, 2)  # 16 first turns
s_q, s_1 = g.Session(model, 1200, head, tree), g.Session(model, 1200, head, one_hot)
samp = g.Sampling(float(sys.argv[2]) if len(sys.argv) > 2 else 1.0)
res = {"q": [], "onehot": []}
times = {"q": [], "onehot": []}
for i, item in enumerate(items):
    prompt = b.render(tok, item.turns[:1], [])
    for name, s in (("q", s_q), ("onehot", s_1)) if i % 2 == 0 else (("onehot", s_1), ("q", s_q)):
        for seed in range(2):
            torch.manual_seed(100 * i + seed)
            s.reset()
            out, st = s.generate(prompt, 128, samp, tok.stop_ids)
            res[name].append(st.accept_lengths)
            times[name].append(st.phase_ms())
for name in res:
    acc = [a for r in res[name] for a in r]
    print(name, "cycles", len(acc), "tau", round(1 + sum(acc) / len(acc), 3),
          "depth>=1", round(sum(a >= 1 for a in acc) / len(acc), 3),
          {k: round(statistics.mean(t[k] for t in times[name]), 2) for k in times[name][0]})
