"""Which part of the frozen, autotuned compile makes a verify faster, and which part keeps it out of inductor's
on-disk cache: the default compile against freezing alone, freezing + max-autotune (generate.AUTOTUNE_OPTIONS),
and both without inductor's oneDNN weight prepacking (cpp.weight_prepack, whose packed weights are mkldnn
tensors that the FX graph cache cannot pickle: 'Bypassing FX Graph Cache because mkldnn tensors unpickleable').
Timed as scripts/profile_costs.py --autotune times them (its Pieces, compiled() and timed_round_robin); each
graph's compile time and whether inductor's FX graph cache could store it.

    python results/2026-12-02-frozen-start-up-avx512-bf16/variants.py --precisions int4 bf16 --rows 1 2 4 --pause_pid PID
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch._dynamo.utils import counters

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from generate import AUTOTUNE_OPTIONS  # noqa: E402
from scripts.profile_costs import Pieces, compiled, paused, timed_round_robin, verify_rows  # noqa: E402
from tree import instruction_set  # noqa: E402

VARIANTS = {
    "default": None,
    "frozen": {"freezing": True},
    "frozen_autotuned": AUTOTUNE_OPTIONS,
    "frozen_no_prepack": {"freezing": True, "cpp.weight_prepack": False},
    "frozen_autotuned_no_prepack": {**AUTOTUNE_OPTIONS, "cpp.weight_prepack": False},
}
p = argparse.ArgumentParser()
p.add_argument("--precisions", nargs="+", default=["int4", "bf16"])
p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
p.add_argument("--variants", nargs="+", default=list(VARIANTS))
p.add_argument("--reps", type=int, default=15)
p.add_argument("--threads", type=int, default=1)
p.add_argument("--pause_pid", type=int)
p.add_argument("--out", type=Path, default=Path(__file__).with_name("variants.json"))
args = p.parse_args()
torch.set_num_threads(args.threads)
torch.set_grad_enabled(False)
jobs, warm, cache = {}, {}, {}
for precision in args.precisions:
    pc = Pieces(precision, "eager")
    for n in args.rows:
        for kind in args.variants:
            fn = compiled(verify_rows, f"{precision}_{kind}_{n}", VARIANTS[kind])
            jobs[precision, kind, n] = pc.call("verify", n, {"verify": fn}, rows_dynamic=False)
            before = dict(counters["inductor"])
            t = time.perf_counter()
            jobs[precision, kind, n]()
            warm[precision, kind, n] = round(time.perf_counter() - t, 1)
            cache[precision, kind, n] = {k: counters["inductor"][k] - before.get(k, 0) for k in
                                         ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass")
                                         if counters["inductor"][k] - before.get(k, 0)}
            jobs[precision, kind, n]()
            print(precision, kind, n, "warm-up", warm[precision, kind, n], "s", cache[precision, kind, n],
                  file=sys.stderr, flush=True)
with paused(args.pause_pid):
    cpu, wall = timed_round_robin(jobs, args.reps)
result = {"isa": instruction_set(), "torch": torch.__version__, "threads": args.threads, "reps": args.reps,
          "variants": {k: VARIANTS[k] for k in args.variants}, "precisions": {}}
for precision in args.precisions:
    result["precisions"][precision] = {"rows": args.rows, **{kind: {
        "ms": [cpu[precision, kind, n] for n in args.rows], "wall_ms": [wall[precision, kind, n] for n in args.rows],
        "warm_up_s": [warm[precision, kind, n] for n in args.rows],
        "fx_cache": [cache[precision, kind, n] for n in args.rows]} for kind in args.variants}}
    for kind in args.variants:
        print(precision, kind, result["precisions"][precision][kind]["ms"])
args.out.write_text(json.dumps(result, indent=1))
