"""Where a scripts/make_data.py Engine run spends its time: decode steps, one-row prefills, row regrouping.

    python results/2026-12-02-engine-profile-avx512-bf16/profile_engine.py BATCH SECONDS

ShareGPT conversations 10,600-10,899 (every user turn, greedy, answers up to 512 tokens, loop cut on), one
thread, bf16 where the CPU has it; the clock starts after 30 steps (the graph built) and stops SECONDS later.
Run from a checkout (REPO=path to time another one).
"""
import collections
import os
import sys
import time

import torch

sys.path.insert(0, os.environ.get("REPO", os.path.join(os.path.dirname(__file__), "..", "..")))
from generate import Sampling  # noqa: E402
from model import Transformer  # noqa: E402
from scripts import make_data as md  # noqa: E402
from scripts.train_eagle import sharegpt_conversations  # noqa: E402
from tokenizer import Tokenizer, ensure_default_model  # noqa: E402

torch.set_num_threads(1)
batch, seconds = int(sys.argv[1]), float(sys.argv[2])
checkpoint = ensure_default_model()
model = Transformer.from_checkpoint(checkpoint).to(md.default_dtype())
tokenizer = Tokenizer.load(checkpoint.parent)


class Budget:
    max_prompt_len, max_len, max_new_tokens = 512, 1024, 512


queue = [md.Conversation(i, [m["content"] for m in c if m["role"] == "user"])
         for i, c in enumerate(list(sharegpt_conversations(11000))[10600:10900])]
spent = collections.Counter()
engine = md.Engine(model, batch, 1024, compile=True, cut_loops=True)


def timed(name, f):
    def run(*args):
        t = time.perf_counter()
        out = f(*args)
        spent[name] += time.perf_counter() - t
        spent["n_" + name] += 1
        return out
    return run


engine.step, engine.prefill, engine.sort_rows = (timed("step", engine.step), timed("prefill", engine.prefill),
                                                 timed("sort", engine.sort_rows))


def next_request(_cached):
    while queue:
        request = md.conversation_requests(queue.pop(0), tokenizer, Budget, Sampling(0.0))
        if request:
            return request
    return None


def on_done(request, answer, reason):
    conv = request.key
    conv.records.append(1)
    conv.messages = conv.messages + [{"role": "assistant", "content": tokenizer.decode(answer)}]
    return md.conversation_requests(conv, tokenizer, Budget, Sampling(0.0))


start, at_start = {}, {}


def on_step(e):
    if e.steps == 30:
        start["t"] = time.perf_counter()
        at_start.update(spent, answer_tokens=e.answer_tokens, prefill_tokens=e.prefill_tokens)


engine.run(next_request, on_done, tokenizer.stop_ids, on_step=on_step,
           should_stop=lambda: "t" in start and time.perf_counter() - start["t"] > seconds)
elapsed = time.perf_counter() - start["t"]
d = {k: spent[k] - at_start.get(k, 0) for k in spent}
print(f"batch {batch}: {elapsed:.0f} s, {(engine.answer_tokens - at_start['answer_tokens']) / elapsed:.1f} answer tokens/s, "
      f"{engine.prefill_tokens - at_start['prefill_tokens']} prefill tokens; seconds in steps {d['step']:.1f} "
      f"({1e3 * d['step'] / d['n_step']:.1f} ms a step), prefills {d['prefill']:.1f}, regrouping {d['sort']:.2f}")
