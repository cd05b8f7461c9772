"""Top-1 agreement with fp32 and perplexity of the benchmark's quantized precisions on the default model:
int4 g32 with the LM head in int4 too (benchmark `int4`), with the LM head in bf16 (`int4f`, quantize.py's
default file), int8 (LM head included), and plain bf16. Teacher-forced on 40 held-out ShareGPT answers
(conversations 200-299, first exchange, user turn cut to 200 characters, answer to 64 tokens).

    python results/2026-11-30-lm-head-agreement/agreement.py > results/2026-11-30-lm-head-agreement/output.txt
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from model import Transformer  # noqa: E402
from scripts import benchmark  # noqa: E402
from scripts.convert_gguf import ensure_default_model  # noqa: E402
from tests.test_quantize import answer_logits, perplexity, sharegpt_exchanges  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402

torch.set_grad_enabled(False)
checkpoint = ensure_default_model()
tokenizer = Tokenizer.load(checkpoint.parent)
held_out = [(tokenizer.encode_chat([{"role": "user", "content": user[:200]}]), tokenizer.encode(answer)[:64])
            for user, answer in sharegpt_exchanges(200, 100)][:40]
tokens = sum(len(a) for _, a in held_out)
reference = answer_logits(Transformer.from_checkpoint(checkpoint), held_out)
print(f"{len(held_out)} answers, {tokens} tokens; fp32 perplexity {perplexity(reference, held_out):.3f}")
for precision in ("bf16", "int8", "int4f", "int4"):
    model = benchmark.load_target(checkpoint, precision, "cpu")
    logits = answer_logits(model, held_out)
    agree = torch.cat([(q.argmax(-1) == f.argmax(-1)) for q, f in zip(logits, reference)]).float().mean().item()
    print(f"{precision:6s} top-1 agreement with fp32 {agree:.4f}, perplexity {perplexity(logits, held_out):.3f}")
