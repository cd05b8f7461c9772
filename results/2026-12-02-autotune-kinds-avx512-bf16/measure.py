"""The three ways generate.py --compile can compile a step (generate.COMPILE_KINDS: default; weights frozen;
frozen + inductor's max-autotune), timed against each other as scripts/profile_costs.py --autotune times them
(its autotune_table: fixed-shape verifies after 300 cached tokens, round-robin, thread CPU time), with whether
inductor's on-disk cache keeps each kind's graphs and the kind --autotune auto takes. --pause_pid: background
jobs (the data engine, training) stopped with SIGSTOP while timing, so that the timings run alone.

    python results/2026-12-02-autotune-kinds-avx512-bf16/measure.py --threads 1 --pause_pid PID
    python results/2026-12-02-autotune-kinds-avx512-bf16/measure.py --threads 2 --pause_pid PID PID2  # both cores idle
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from scripts.profile_costs import Pieces, autotune_table, paused  # noqa: E402
from tree import instruction_set  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--precisions", nargs="+", default=["int4", "bf16", "int8", "fp32"])
p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
p.add_argument("--reps", type=int, default=15)
p.add_argument("--threads", type=int, default=1)
p.add_argument("--pause_pid", type=int, nargs="*", default=[])
p.add_argument("--out", type=Path)
args = p.parse_args()
torch.set_num_threads(args.threads)
torch.set_grad_enabled(False)


pieces = {precision: Pieces(precision, "eager") for precision in args.precisions}
table = autotune_table(pieces, args.rows, args.reps, lambda: paused(*args.pause_pid))
out = args.out or Path(__file__).with_name(f"autotune-t{args.threads}.json")
out.write_text(json.dumps({"isa": instruction_set(), "torch": torch.__version__, "threads": args.threads,
                           "reps": args.reps, "autotune": table}, indent=1))
print(f"wrote {out}", file=sys.stderr)
