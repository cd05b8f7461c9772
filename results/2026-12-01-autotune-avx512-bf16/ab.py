"""Interleaved A/B in one process: inductor default vs max-autotune (CPP,ATEN) + freezing, target forward of n rows."""
import sys, time, statistics, torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from model import causal_mask
from quantize import load_quantized
from model import Transformer
torch.set_num_threads(1)
torch.set_grad_enabled(False)
mode = sys.argv[1]; rows = [int(x) for x in sys.argv[2].split(",")]
d = str(__import__("pathlib").Path(__file__).resolve().parents[2]) + "/checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct/"
m = load_quantized(d + "model_int4.g32.pth") if mode == "int4" else Transformer.from_checkpoint(d + "model.pth", dtype=torch.bfloat16)
m.setup_caches(1, 400)
def step(tokens, pos, mask):
    logits, feats = m(tokens, pos, mask=mask)
    return logits.float().argmax(-1)
auto = dict(max_autotune=True, max_autotune_gemm_backends="CPP,ATEN", freezing=True)
fs = {"default": torch.compile(step, fullgraph=True, dynamic=False),
      "autotune": torch.compile(step, fullgraph=True, dynamic=False, options=auto)}
base = 300
for n in rows:
    tokens = torch.randint(0, 1000, (1, n)); pos = torch.arange(base, base + n); mask = causal_mask(pos, base + n)
    for name, f in fs.items():
        t0 = time.perf_counter(); out = f(tokens, pos, mask); print(f"{name} rows={n} compile {time.perf_counter()-t0:.0f} s", flush=True)
    assert torch.equal(fs["default"](tokens, pos, mask), fs["autotune"](tokens, pos, mask)) or print("argmax differs")
    ts = {k: [] for k in fs}
    for _ in range(15):
        for name, f in fs.items():
            t0 = time.perf_counter(); f(tokens, pos, mask); ts[name].append(time.perf_counter() - t0)
    print(f"{mode} rows={n}: " + ", ".join(f"{k} {1000*statistics.median(v):.2f} ms" for k, v in ts.items()), flush=True)
