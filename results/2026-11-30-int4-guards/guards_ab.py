"""Runs against the code of commit 7a1cc90 (`git checkout 7a1cc90`): it calls generate.py's functions as they were
before the cycle was reshaped into Steps / CacheWindow.

In-process A/B: compiled int4 decode and chain-2 verify with torchao's Int4OpaqueTensor linears (a)
vs Int4CPULinear (b), same weights, separate compiled code objects, interleaved. Run with dynamo's guard
log to see each compiled step's guard evaluation time (frames in order: decode a, verify a, decode b,
verify b); the timings are from a busy machine and are not a result:

    TORCH_LOGS=guards python results/2026-11-30-int4-guards/guards_ab.py 5 2>&1 | grep -E "latency|equal"
"""
import sys, time, types, torch
sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[2]))
torch.set_num_threads(1); torch.set_grad_enabled(False)
import generate, quantize
from generate import causal_mask, tree_attention_mask, live
from scripts.benchmark import load_target
from pathlib import Path
from tree import parse_tree
ck = Path('checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct/model.pth')
orig = quantize.use_cpu_kernels
quantize.use_cpu_kernels = lambda m: None
ma = load_target(ck, 'int4', 'cpu')
quantize.use_cpu_kernels = orig
mb = load_target(ck, 'int4', 'cpu')
print(type(ma.output).__name__, type(mb.output).__name__)
def clone(f): return types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__ + '_c')
opts = dict(fullgraph=True, dynamic=False)
fns = {}
for name, m in (('a', ma), ('b', mb)):
    m.setup_caches(1, 768)
    fns[name] = (m, torch.compile(clone(generate.decode_one_token), **opts), torch.compile(clone(generate.verify), **opts))
B = 300
tok = torch.tensor([[5]]); pos = torch.tensor([B])
tr = parse_tree('chain-2'); base = torch.tensor(B)
out = {}
for _ in range(3):
    for name, (m, d, v) in fns.items():
        out[name] = (d(m, tok, pos, live(causal_mask(pos, B + 1), True))[0], v(m, torch.tensor([5, 6, 7]), base, tr.depths, live(tree_attention_mask(base, tr.tree_mask, B + 3), True))[0])
print('decode equal', torch.equal(out['a'][0], out['b'][0]), 'verify equal', torch.equal(out['a'][1], out['b'][1]))
ts = {}
for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 40):
    for name, (m, d, v) in fns.items():
        a = time.perf_counter(); d(m, tok, pos, live(causal_mask(pos, B + 1), True)); ts.setdefault(('dec', name), []).append(time.perf_counter() - a)
        a = time.perf_counter(); v(m, torch.tensor([5, 6, 7]), base, tr.depths, live(tree_attention_mask(base, tr.tree_mask, B + 3), True)); ts.setdefault(('ver', name), []).append(time.perf_counter() - a)
for k, x in sorted(ts.items()):
    x.sort(); print(k, 'median %.2f ms  p25 %.2f' % (x[len(x)//2] * 1e3, x[len(x)//4] * 1e3), flush=True)
