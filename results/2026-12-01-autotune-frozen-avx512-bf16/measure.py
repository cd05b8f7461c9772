"""Frozen, autotuned verifies against the default compiled ones, exactly as scripts/profile_costs.py --autotune
times them (its Pieces, compiled() and timed_round_robin), now that compile_step applies the settings on
torch._inductor.config. Also the compile (warm-up) time of each graph. --pause_pid: a background job
(the data engine) stopped with SIGSTOP while timing, so that the timings run alone.

    python results/2026-12-01-autotune-frozen-avx512-bf16/measure.py --precisions bf16 int4 --rows 1 4 16
    python results/2026-12-01-autotune-frozen-avx512-bf16/measure.py --threads 2 --out DIR/autotune.json
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from generate import AUTOTUNE_OPTIONS  # noqa: E402
from scripts.profile_costs import Pieces, compiled, paused, timed_round_robin, verify_rows  # noqa: E402
from tree import instruction_set  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--precisions", nargs="+", default=["bf16", "int4"])
p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
p.add_argument("--reps", type=int, default=15)
p.add_argument("--pause_pid", type=int)
p.add_argument("--threads", type=int, default=1)
p.add_argument("--out", type=Path, default=Path(__file__).with_name("autotune.json"))
args = p.parse_args()
torch.set_num_threads(args.threads)
torch.set_grad_enabled(False)
jobs, warm = {}, {}
for precision in args.precisions:
    pc = Pieces(precision, "eager")
    for n in args.rows:
        for kind, config in (("default", None), ("frozen_autotuned", AUTOTUNE_OPTIONS)):
            fn = compiled(verify_rows, f"{precision}_{kind}_{n}", config)
            jobs[precision, kind, n] = pc.call("verify", n, {"verify": fn}, rows_dynamic=False)
            t = time.perf_counter()
            jobs[precision, kind, n]()
            warm[precision, kind, n] = round(time.perf_counter() - t, 1)
            jobs[precision, kind, n]()
            print(precision, kind, n, "warm-up", warm[precision, kind, n], "s", file=sys.stderr, flush=True)
with paused(args.pause_pid):
    cpu, wall = timed_round_robin(jobs, args.reps)
result = {"isa": instruction_set(), "torch": torch.__version__, "threads": args.threads, "reps": args.reps,
          "settings": AUTOTUNE_OPTIONS, "precisions": {}}
for precision in args.precisions:
    d = [cpu[precision, "default", n] for n in args.rows]
    f = [cpu[precision, "frozen_autotuned", n] for n in args.rows]
    result["precisions"][precision] = {
        "rows": args.rows, "default_ms": d, "frozen_autotuned_ms": f,
        "ratio": round(statistics.geometric_mean([a / b for a, b in zip(f, d)]), 3),
        "warm_up_s": {k: [warm[precision, k, n] for n in args.rows] for k in ("default", "frozen_autotuned")},
        "wall_default_ms": [wall[precision, "default", n] for n in args.rows],
        "wall_frozen_autotuned_ms": [wall[precision, "frozen_autotuned", n] for n in args.rows]}
    print(precision, "default", d, "frozen+autotuned", f, "ratio", result["precisions"][precision]["ratio"])
args.out.write_text(json.dumps(result, indent=1))
