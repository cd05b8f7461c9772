"""Runs against the code of commit 1e339b0 (`git checkout 1e339b0`): it calls generate.py's functions as they were
before the cycle was reshaped into Steps / CacheWindow.

Per-cycle overheads of EAGLE chain-1 on the int4 compiled default model (one thread), the figures the
session-11 note and docs/measurements.md quote:
1. draft top-1 by max against topk (eager, 16,384 draft logits);
2. compiled verify (2 rows) returning greedy tokens (argmax in the graph) against logits + an eager argmax;
3. compiled decode step with and without guard evaluation (set_stance skip_guard_eval_unsafe);
4. the head's update forward (head_extend, compiled) against its draft LM head alone (eager).
A and B are interleaved, medians of 12 repetitions.

    python quantize.py --mode int4 --groupsize 32 --quantize_lm_head
    python results/2026-12-01-cycle-overheads/overheads.py
"""
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
torch.set_num_threads(1)
torch.set_grad_enabled(False)  # as in Session.generate: the compiled steps run without autograd
import generate  # noqa: E402
from generate import Sampling, Session, argmax_tokens, compile_steps, live, load, parse_args  # noqa: E402
from model import causal_mask  # noqa: E402
from tree import parse_tree  # noqa: E402

CK = "checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct/model_int4.g32.pth"


def ab(a, b, reps=12, n=30):
    """Median ms per call of a and b, interleaved."""
    times = ([], [])
    for _ in range(reps):
        for i, f in enumerate((a, b)):
            t = time.perf_counter()
            for _ in range(n):
                f()
            times[i].append((time.perf_counter() - t) / n * 1000)
    return [round(statistics.median(t), 4) for t in times]


x = torch.randn(1, 1, 16384)
print("1. draft top-1, ms: max %s, topk(1) %s" % tuple(ab(lambda: x.max(-1, keepdim=True), lambda: x.topk(1, dim=-1), n=2000)))

model, tokenizer, head, tree = load(parse_args(["--checkpoint", CK, "--eagle", "--eagle_head",
                                                str(generate.DEFAULT_HEAD)]))
compile_steps("cpu", False)
session = Session(model, 1024, head, tree)
prompt = tokenizer.encode_chat([{"role": "user", "content": "Write a persuasive essay about public libraries."}])
session.generate(prompt, 64, Sampling())  # warm-up: compiles the steps
session.generate(prompt, 8, Sampling(0.8))

chain = parse_tree("chain-1")
nodes, L = torch.tensor([5, 7]), 300


def verify(greedy):
    base = torch.tensor(L)
    mask = live(generate.tree_attention_mask(base, chain.tree_mask, L + 2), True)
    out, _ = generate.verify(model, nodes, base, chain.depths, mask, greedy)
    return out.tolist() if greedy else argmax_tokens(out).tolist()


print("2. verify of 2 rows, ms: greedy tokens from the graph %s, logits + eager argmax %s"
      % tuple(ab(lambda: verify(True), lambda: verify(False))))


def decode(unsafe):
    pos = torch.tensor([L])
    mask = live(causal_mask(pos, L + 1), True)
    with torch.compiler.set_stance("default", skip_guard_eval_unsafe=unsafe):
        return generate.decode_one_token(model, torch.tensor([[5]]), pos, mask, True)


print("3. decode step, ms: with guards %s, guards skipped %s" % tuple(ab(lambda: decode(False), lambda: decode(True))))

pad = tree.max_depth + 1
dst = torch.arange(L, L + pad)
feats = torch.randn(1, pad, model.config.dim, dtype=head.fc.weight.dtype)
mask = live(causal_mask(dst, L + pad), True)
hidden = torch.randn(1, 1, model.config.dim, dtype=head.fc.weight.dtype)
print("4. head update forward %s ms, its draft LM head alone %s ms" % tuple(ab(
    lambda: generate.head_extend(model, head, torch.tensor([[5, 7]]), feats, dst, mask, torch.tensor([1]), 1),
    lambda: F.linear(hidden, head.lm_weight))))
