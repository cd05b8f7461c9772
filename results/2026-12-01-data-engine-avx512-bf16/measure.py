"""Answer tokens/s of the head's data generation: the old `train_eagle.py data` step (batch_generate: fp32,
eager, batches of 32 left-padded rows that shrink as rows finish, features kept) against scripts/make_data.py's
Engine (bf16 where the CPU has it, compiled, a static batch refilled as rows finish, attention over live slots),
on the same ShareGPT first turns, greedy, the same answer budget, one thread, in one process, the old one first
(on the first --old_prompts of them: its rate does not depend on how many batches of 32 it runs).

    python results/2026-12-01-data-engine-avx512-bf16/measure.py --prompts 128 --max_new_tokens 256
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from generate import Sampling  # noqa: E402
from model import Transformer  # noqa: E402
from scripts.make_data import Engine, Request, default_dtype  # noqa: E402
from scripts.train_eagle import HELD_OUT, batch_generate, sharegpt_conversations  # noqa: E402
from tokenizer import Tokenizer, ensure_default_model  # noqa: E402
from tree import instruction_set  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--prompts", type=int, default=128)
p.add_argument("--max_new_tokens", type=int, default=256)
p.add_argument("--max_prompt_len", type=int, default=256)
p.add_argument("--skip", type=int, default=3000, help="conversations after the held-out ones to skip")
p.add_argument("--old_batch", type=int, default=32)
p.add_argument("--old_prompts", type=int, help="prompts the old step answers (default: all)")
p.add_argument("--batch_sizes", type=int, nargs="+", default=[64])
p.add_argument("--out", type=Path, default=Path(__file__).with_name("engine.json"))
args = p.parse_args()
torch.set_num_threads(1)
torch.set_grad_enabled(False)
checkpoint = ensure_default_model()
tokenizer = Tokenizer.load(checkpoint.parent)
prompts = []
for conv in sharegpt_conversations(HELD_OUT + args.skip + 4 * args.prompts):
    ids = tokenizer.encode_chat(conv[:1])
    if len(ids) <= args.max_prompt_len:
        prompts.append(ids)
prompts = prompts[-args.prompts:]
result = {"isa": instruction_set(), "torch": torch.__version__, "threads": 1, "prompts": len(prompts),
          "max_new_tokens": args.max_new_tokens, "prompt_tokens": sum(map(len, prompts))}

fp32 = Transformer.from_checkpoint(checkpoint)
start, old_tokens = time.perf_counter(), 0
ordered = sorted(prompts[: args.old_prompts], key=len)  # as write_shards: similar lengths share a batch
for i in range(0, len(ordered), args.old_batch):
    rows = batch_generate(fp32, ordered[i: i + args.old_batch], args.max_new_tokens, tokenizer.stop_ids)
    old_tokens += sum(len(ids) - n + 1 for ids, _, n in rows)  # answer tokens (the last one's feature is dropped)
old_s = time.perf_counter() - start
result["old"] = {"what": "train_eagle.batch_generate, fp32 eager, batch 32", "prompts": len(ordered), "answer_tokens": old_tokens,
                 "seconds": round(old_s, 1), "answer_tokens_per_s": round(old_tokens / old_s, 1)}
print(result["old"], flush=True)
del fp32

dtype = default_dtype()
model = Transformer.from_checkpoint(checkpoint).to(dtype)
result["engine"] = {}
for B in args.batch_sizes:
    max_len = args.max_prompt_len + args.max_new_tokens
    engine = Engine(model, B, max_len, compile=True)
    warm = [Request(p, 8, Sampling()) for p in prompts[:B]]
    t = time.perf_counter()
    engine.run(lambda c: warm.pop(0) if warm else None, lambda r, a, why: None, tokenizer.stop_ids)
    compile_s = time.perf_counter() - t
    queue = [Request(p, args.max_new_tokens, Sampling()) for p in prompts]
    engine.steps = engine.answer_tokens = engine.prefill_tokens = 0  # the same engine: its graph is built
    t = time.perf_counter()
    engine.run(lambda c: queue.pop(0) if queue else None, lambda r, a, why: None, tokenizer.stop_ids)
    s = time.perf_counter() - t
    result["engine"][B] = {"dtype": str(dtype).split(".")[-1], "answer_tokens": engine.answer_tokens,
                           "prefill_tokens": engine.prefill_tokens, "steps": engine.steps, "seconds": round(s, 1),
                           "answer_tokens_per_s": round(engine.answer_tokens / s, 1), "warm_up_s": round(compile_s, 1),
                           "speedup_over_old": round(engine.answer_tokens / s / (old_tokens / old_s), 2)}
    print(B, result["engine"][B], flush=True)
    args.out.write_text(json.dumps(result, indent=1))
args.out.write_text(json.dumps(result, indent=1))
