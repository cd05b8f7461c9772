"""Where does the head's first-draft accuracy go between the held-out ShareGPT answers (fp32 target: top-1 0.71)
and the 80 MT-bench first turns (int4 target: depth-1 acceptance 0.51)? Teacher-forced top-1 of a head's draft
against the target's own argmax, with 0..3 chained predicted features (train_eagle.chained_accuracy), for one
head under each precision of the target (features and LM head of that precision) and with the head itself
in float or quantized as generate.py runs it, on two sets of text:

- held-out: the target's greedy answers to held-out ShareGPT conversations (data/heldout, all turns);
- mtbench: the 80 MT-bench first turns with the int4 target's greedy answers (256 tokens, batched, eager).

    python results/2026-12-03-head-capacity-avx512-bf16/precision_gap.py --head heads/SmolLM2-135M-Instruct-eagle-v10 \
        --records 20 --precisions fp32 int4 --threads 1 --out results/2026-12-03-head-capacity-avx512-bf16/precision-gap-v10.json
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import quantize  # noqa: E402
from eagle_head import load_head  # noqa: E402
from model import Transformer  # noqa: E402
from scripts import benchmark, train_eagle  # noqa: E402
from scripts.make_data import weights_hash  # noqa: E402
from tokenizer import Tokenizer, ensure_default_model  # noqa: E402

torch.set_grad_enabled(False)


class AsFloat(nn.Module):
    """Run a low-precision module on float inputs: cast in to its dtype, the result back to fp32."""

    def __init__(self, module: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.module, self.dtype = module, dtype

    def forward(self, x):
        return self.module(x.to(self.dtype) if x.is_floating_point() else x).float()


class TargetView:
    """What chained_accuracy / head_inputs read of the target, in fp32."""

    def __init__(self, target: Transformer, dtype: torch.dtype):
        self.output, self.tok_embeddings = AsFloat(target.output, dtype), AsFloat(target.tok_embeddings, dtype)


def head_for(head_dir: str, target: Transformer, as_run: bool):
    """The head as generate.py runs it on this target (as_run: in the target's dtype, int4 on an int4 target),
    else in fp32, bound to the target's LM head rows (dequantized for a quantized target)."""
    dtype = target.tok_embeddings.weight.dtype if as_run else torch.float32
    head = load_head(head_dir, dtype=dtype)
    if target.quantization is None:
        head.bind(target.output.weight)
    elif as_run:
        quantize.quantize_head_like(head, target)
    else:
        head.bind(quantize.dequantized(target.output.weight).float())
    if dtype != torch.float32:  # run it in its own dtype on fp32 inputs
        forward, draft_logits = head.forward, head.draft_logits
        head.forward = lambda e, f, *a, **k: forward(e.to(dtype), f.to(dtype), *a, **k).float()
        head.draft_logits = lambda h: draft_logits(h.to(dtype)).float()
    return head


def accuracy(target, head, sequences, dtype) -> list:
    view, records = TargetView(target, dtype), train_eagle.heldout_records(target, sequences)
    accs, weight = torch.zeros(4), 0
    for r in records:
        n = int(r["loss_mask"][1:].sum())
        head.max_seq_len = 0
        head.setup_rope(len(r["tokens"]))
        head.clear_kv_caches()
        accs += torch.tensor(train_eagle.chained_accuracy(view, head, r, 3, "cpu")) * n
        weight += n
    return [round(a, 4) for a in (accs / weight).tolist()]


def mtbench_sequences(checkpoint, tokenizer, limit: int, max_new_tokens: int, batch: int = 16) -> list:
    model = benchmark.load_target(checkpoint, "int4", "cpu")
    items = benchmark.select_questions(benchmark.load_dataset("mtbench"), limit, None)
    prompts = [benchmark.render(tokenizer, item.turns[:1], []) for item in items]
    stop = tokenizer.stop_ids
    out = []
    for i in range(0, len(prompts), batch):
        for ids, _, n_prompt in train_eagle.batch_generate(model, prompts[i:i + batch], max_new_tokens, stop):
            out.append({"tokens": ids, "loss_mask": [False] * n_prompt + [True] * (len(ids) - n_prompt)})
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--head", required=True)
    p.add_argument("--records", type=int, default=100)
    p.add_argument("--mtbench", type=int, default=80)
    p.add_argument("--max_new_tokens", type=int, default=256)
    p.add_argument("--precisions", nargs="+", default=["fp32", "bf16", "int8", "int4f", "int4"])
    p.add_argument("--threads", type=int)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    checkpoint = ensure_default_model()
    tokenizer = Tokenizer.load(checkpoint.parent)
    fp32 = Transformer.from_checkpoint(checkpoint)
    result = json.loads(args.out.read_text()) if args.out.exists() else {"head": args.head, "rows": []}
    seq_path = args.out.with_name("mtbench-int4-answers.json")
    if not seq_path.exists():
        t0 = time.perf_counter()
        seq_path.write_text(json.dumps(mtbench_sequences(checkpoint, tokenizer, args.mtbench, args.max_new_tokens)))
        print(f"mtbench answers {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    sets = {"held-out": train_eagle.answer_sequences(Path("data") / "heldout", weights_hash(fp32), 1024,
                                                     temperature=0.0)[: args.records],
            "mtbench": json.loads(seq_path.read_text())}
    done = {(r["precision"], r["head"], r["set"]) for r in result["rows"]}
    for precision in args.precisions:
        target = fp32 if precision == "fp32" else benchmark.load_target(checkpoint, precision, "cpu")
        dtype = target.tok_embeddings.weight.dtype
        for as_run in ([True] if precision == "fp32" else [True, False]):
            kind = "as run" if as_run else "fp32"
            for name, sequences in sets.items():
                if (precision, kind, name) in done:
                    continue
                t0 = time.perf_counter()
                top1 = accuracy(target, head_for(args.head, target, as_run), sequences, dtype)
                row = {"precision": precision, "head": kind, "set": name, "sequences": len(sequences),
                       "answer_tokens": sum(sum(s["loss_mask"][1:]) for s in sequences), "top1": top1,
                       "s": round(time.perf_counter() - t0, 1)}
                print(json.dumps(row), file=sys.stderr)
                result["rows"].append(row)
                args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
