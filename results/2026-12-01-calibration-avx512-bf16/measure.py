"""--tree auto's quick calibration (scripts/profile_costs.calibrate) of int4 on the default model, eager and compiled:
wall time and the verify curve.  python results/2026-12-01-calibration-avx512-bf16/measure.py eager dynamic"""
import torch, sys, time
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
torch.set_num_threads(1); torch.set_grad_enabled(False)
import quantize
from eagle_head import load_head
from generate import DEFAULT_HEAD
from scripts.profile_costs import calibrate
m = quantize.load_quantized(str(__import__("pathlib").Path(__file__).resolve().parents[2] / "checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct/model_int4.g32.pth"))
h = load_head(DEFAULT_HEAD, dtype=m.tok_embeddings.weight.dtype); quantize.quantize_head_like(h, m)
for mode in sys.argv[1:]:
    t = time.perf_counter(); p = calibrate(m, h, "int4", mode); print(mode, p["wall_s"], "s", p["precisions"]["int4"]["verify_ms"])
