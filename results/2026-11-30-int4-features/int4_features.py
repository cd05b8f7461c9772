"""Held-out top-1 of an EAGLE head (set (b), 20 sequences) when the target's features come from its int4
g32 weights (LM head too, bf16 before quantizing, as generate.py and benchmark.py run it), against fp32.
The int4 weights are dequantized so the forward runs as a fast fp32 one on the same values.

    python results/2026-11-30-int4-features/int4_features.py heads/SmolLM2-135M-Instruct-eagle int4fake fp32
"""
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
torch.set_num_threads(1)
from eagle_head import EagleHead  # noqa: E402
from model import Transformer  # noqa: E402
from quantize import dequantized, handler_for, quantize_model  # noqa: E402
from scripts.convert_gguf import ensure_default_model  # noqa: E402
from scripts.train_eagle import heldout_accuracy  # noqa: E402
head_dir = sys.argv[1]
seqs = json.loads((Path(head_dir) / "heldout-generated.json").read_text())[:20]
for cfg in sys.argv[2:]:
    t0 = time.time()
    t = Transformer.from_checkpoint(ensure_default_model())
    if cfg == "int4fake":  # int4 g32 weights (LM head too), as deployed, dequantized: fp32 math on int4 values
        t = t.to(torch.bfloat16)
        quantize_model(t, handler_for("int4", 32), quantize_lm_head=True)
        with torch.no_grad():
            for name, m in t.named_modules():
                if isinstance(m, nn.Linear):
                    m.weight = nn.Parameter(dequantized(m.weight).float(), requires_grad=False)
        t = t.float()
    h = EagleHead.load(head_dir)
    h.bind(t.output.weight)
    print(cfg, json.dumps(heldout_accuracy(t, h, seqs)), round(time.time() - t0), flush=True)
