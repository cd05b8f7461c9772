"""Cost model of this machine for tuning.auto_tree: what each piece of an EAGLE cycle costs against its rows.

    python scripts/profile_costs.py --threads 1                        # -> ~/.cache/eagle-fast/costs-<key>.json
    python scripts/profile_costs.py --threads 1 --precisions int4 --batch_sizes 2 4 8   # + batched cycles

Per precision (fp32, bf16 = model.pth in float32 / bfloat16; int8 = model_int8.pth; int4 =
model_int4.g32.pth, each quantized from model.pth when missing as generate.py --quantize does), after PREFIX
cached tokens, medians of --reps timings taken round-robin over every precision, piece and row count (so load
on the machine spreads evenly), of this thread's CPU time (a shared machine's other processes stretch wall time,
not it; wall medians are kept too):
- verify_ms[n]: the target's forward over n new rows with the greedy argmax in the graph (a verify of n
  tree nodes; n = 1 is a vanilla decode step);
- draft_ms[m]: a head draft step over m nodes (one tree level) with its draft LM head and top-k;
- update_ms[r]: the head's update forward over r = depth + 1 committed rows, drafting the next root;
- move_ms[r]: moving r accepted rows' KV entries in every layer (trees only; a chain's path is in place).
With --batch_sizes B ..., batches[B][precision] holds the same four for the engine's cycle of B rows (each
piece over n rows in every batch row, at BATCH_ROWS): what --tree auto reads at --batch_size B.
The three forwards are compiled once each with the row count marked dynamic (torch._dynamo.mark_dynamic;
one row is always a graph of its own, as Dynamo specialises size 1): a fixed-shape graph per row count
would take about a minute each to compile. The check block times fixed-shape graphs (what generate.py
compiles for one tree) at --check_rows against the dynamic graph and eager mode, to say whether the
dynamic curve stands for them. The steps timed are the engine's own (engine.verify_rows, draft_step and
update_rows, compiled by engine.compile_step with tuning.COMPILE_KINDS' settings). With --autotune,
fixed-shape verifies compiled each of tuning.COMPILE_KINDS' ways (default; weights frozen; frozen and
inductor's max-autotune) are timed against each other (autotune_table); `autotune[precision].auto`, the fastest
kind at least AUTOTUNE_MARGIN faster than the default among those inductor's on-disk cache keeps, is what
generate.py --compile --autotune auto follows. sampling: the host work of a step and a cycle at T > 0 beyond
greedy's (costs.sampling_costs). overhead_ms and decode_overhead_ms (host work of a cycle / of a vanilla step
beyond these forwards) are arguments, from generate.py's phase times (defaults:
this machine's, see main).

The JSON is keyed by instruction set (amx / avx512_bf16 / avx512 / avx2, from /proc/cpuinfo), thread
count and torch version, the things the curves depend on, and holds the target's shape ("model",
tuning.profile_model): generate.py uses a profile only for a target of that shape. --checkpoint and
--eagle_head measure another model (its model.pth / quantized files, an EAGLE-1 head for it); the latest
profile of a machine key is the one kept. tuning.CycleCosts.from_profile reads it.
"""
import argparse
import contextlib
import json
import os
import signal
import statistics
import sys
import time
from datetime import date
from pathlib import Path
from typing import Optional

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from eagle_head import EagleHead  # noqa: E402
from model import CheckpointError, Transformer  # noqa: E402
from costs import (BATCH_ROWS, DECODE_OVERHEAD_MS, OVERHEAD_MS, PIECES, PREFIX, ROWS, TOP_K, Pieces,  # noqa: E402
                   compiled, head_sampling_costs, piece_costs, rows_of, timed_round_robin, verify_greedy)
from tuning import COMPILE_KINDS, cost_profile_path, cpu_family, cpu_name, instruction_set, profile_model  # noqa: E402

CHECKPOINT_DIR = REPO / "checkpoints" / "HuggingFaceTB" / "SmolLM2-135M-Instruct"
HEAD_DIR = REPO / "heads" / "SmolLM2-135M-Instruct-eagle"
PRECISION_FILES = {"fp32": ("model.pth", torch.float32), "bf16": ("model.pth", torch.bfloat16),
                   "int8": ("model_int8.pth", None), "int4": ("model_int4.g32.pth", None)}
AUTOTUNE_MARGIN = 0.05  # a frozen kind is taken where it is at least 5% faster (it costs compile time)


def load_pieces(precision: str, mode: str, checkpoint_dir: Path = CHECKPOINT_DIR, head_dir: Path = HEAD_DIR) -> Pieces:
    """One precision's target (model.pth, or quantize.py's file) and the head, bound as generate.py binds them, as
    Pieces with all of ROWS."""
    name, dtype = PRECISION_FILES[precision]
    checkpoint = checkpoint_dir / name
    if dtype is None:  # quantize.py's files
        from quantize import load_quantized
        model = load_quantized(checkpoint)
    else:
        model = Transformer.from_checkpoint(checkpoint, dtype=dtype)
    head = EagleHead.load(head_dir, dtype=model.tok_embeddings.weight.dtype)
    head.check_fits(model.config, model.config.vocab_size)
    if getattr(model, "quantization", None) is not None:
        from quantize import quantize_head_like  # as generate.py: binds it; an int4 target's head is int4
        quantize_head_like(head, model)
    else:
        head.bind(model.output.weight)
    pieces = Pieces(model, head, mode, precision, max(ROWS))
    pieces.checkpoint = checkpoint
    return pieces


def shown(path: Path) -> str:
    """A path as the profile records it: relative to the repository where it is inside."""
    path = path.resolve()
    return str(path.relative_to(REPO) if path.is_relative_to(REPO) else path)


@contextlib.contextmanager
def paused(*pids: Optional[int]):
    """Processes `pids` (background jobs, e.g. the data engine) stopped with SIGSTOP for the block, so that timings
    taken in it run alone; None or no pid: nothing."""
    stopped = []
    for pid in filter(None, pids):
        try:
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)
        except ProcessLookupError:  # the job has ended (or was restarted): nothing to stop
            pass
    try:
        yield
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def autotune_table(pieces: dict, rows: list, reps: int, timing=contextlib.nullcontext) -> dict:
    """Per precision, fixed-shape verifies of `rows` rows compiled each of tuning.COMPILE_KINDS' ways, as
    generate.py --compile compiles them: ms per kind, whether inductor's on-disk cache could keep the kind's graphs
    (frozen graphs holding oneDNN-packed weights cannot: they are rebuilt at every start), and `auto`, the kind
    --autotune auto takes: the fastest (geometric mean over rows) at least AUTOTUNE_MARGIN faster than the default
    among those kept, else "default". timing: a context the timings run in (e.g. paused)."""
    from torch._dynamo.utils import counters

    jobs, cached = {}, {}
    for precision, pc in pieces.items():
        for n in rows:
            for kind, config in COMPILE_KINDS.items():
                jobs[precision, kind, n] = pc.call("verify", n, {"verify": compiled(verify_greedy, f"{precision}_{kind}_{n}",
                                                                                     config)}, rows_dynamic=False)
                bypassed = counters["inductor"]["fxgraph_cache_bypass"]
                jobs[precision, kind, n]()
                cached[precision, kind] = cached.get((precision, kind), True) and \
                    counters["inductor"]["fxgraph_cache_bypass"] == bypassed
                jobs[precision, kind, n]()
    with timing():
        timed, _ = timed_round_robin(jobs, reps, seed=2)
    table = {}
    for precision in pieces:
        ms = {kind: [timed[precision, kind, n] for n in rows] for kind in COMPILE_KINDS}
        ratio = {kind: statistics.geometric_mean([t / d for t, d in zip(ms[kind], ms["default"])]) for kind in ms}
        fits = [k for k in ms if k != "default" and cached[precision, k] and ratio[k] < 1 - AUTOTUNE_MARGIN]
        table[precision] = {"rows": rows, **{f"{kind}_ms": v for kind, v in ms.items()},
                            "ratio": {kind: round(r, 3) for kind, r in ratio.items() if kind != "default"},
                            "cached": {kind: cached[precision, kind] for kind in ms if kind != "default"},
                            "auto": min(fits, key=ratio.get) if fits else "default"}
        print(f"{precision}: verify time over the default {table[precision]['ratio']} at rows {rows}, kept by "
              f"inductor's cache {table[precision]['cached']}: --autotune auto takes {table[precision]['auto']}",
              file=sys.stderr)
    return table


def plot(profile: dict, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for precision, c in profile["precisions"].items():
        rows, ms = [int(n) for n in c["verify_ms"]], list(c["verify_ms"].values())
        line, = axes[0].plot(rows, ms, marker="o", ms=3, label=f"{precision} verify")
        axes[1].plot(rows, [v / ms[0] for v in ms], marker="o", ms=3, color=line.get_color(), label=precision)
        axes[2].plot([int(n) for n in c["draft_ms"]], list(c["draft_ms"].values()), marker="o", ms=3,
                     color=line.get_color(), label=f"{precision} draft step")
    axes[0].set(xlabel="rows (tree nodes incl. the root)", ylabel="ms", title="target forward after "
                f"{profile['prefix_len']} cached tokens")
    axes[1].set(xlabel="rows (tree nodes incl. the root)", ylabel="x one row (a vanilla step)",
                title="target forward / its one-row time", xscale="log", yscale="log")
    axes[2].set(xlabel="rows (nodes of one tree level)", ylabel="ms", title="head draft step")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{profile['cpu']} ({profile['isa']}), {profile['threads']} thread(s), torch {profile['torch']}, "
                 f"{profile['mode']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, help="JSON path (default ~/.cache/eagle-fast/costs-<isa>-t<threads>-torch<v>.json)")
    p.add_argument("--checkpoint", type=Path, default=CHECKPOINT_DIR,
                   help="the target's directory (model.pth, quantize.py's files; default: SmolLM2-135M-Instruct)")
    p.add_argument("--eagle_head", type=Path, default=HEAD_DIR, help="an EAGLE-1 head for it (default: the shipped one)")
    p.add_argument("--plot", type=Path, help="also write a plot of the curves here (PNG)")
    p.add_argument("--precisions", nargs="+", default=list(PRECISION_FILES), choices=list(PRECISION_FILES))
    p.add_argument("--mode", choices=["dynamic", "eager"], default="dynamic",
                   help="dynamic: compiled once with the row count dynamic; eager: not compiled")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--check_rows", type=int, nargs="*", default=[4, 16, 48],
                   help="row counts where fixed-shape compiled verifies are timed against the curve")
    # defaults: AVX-512 BF16, int4 compiled, one thread: chain-1's phases (draft 0.1 + verify 16.7 + commit 1.9 ms,
    # results/2026-11-30-amd-epyc-2cpu-avx512-bf16-mtbench80-v8) less its forwards (verify 16.86, head update 1.16,
    # results/2026-12-01-cycle-overheads); vanilla's decode phase 14.0 less its forward 13.76
    p.add_argument("--overhead_ms", type=float, default=OVERHEAD_MS, help="host work of a cycle beyond its forwards")
    p.add_argument("--decode_overhead_ms", type=float, default=DECODE_OVERHEAD_MS,
                   help="host work of a vanilla step beyond its forward")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch_sizes", type=int, nargs="*", default=[], metavar="B",
                   help="also the pieces of batched cycles of B rows each (the engine's; generate.py --batch_size B "
                   "--tree auto reads them), at row counts BATCH_ROWS")
    p.add_argument("--autotune", type=int, nargs="*", metavar="ROWS",
                   help="also time fixed-shape verifies of these row counts (none given: 1 4 16) compiled each of "
                   "tuning.COMPILE_KINDS' ways (default, frozen, frozen + max-autotune): generate.py --autotune auto "
                   "follows the result")
    args = p.parse_args(argv)
    if any(b < 2 for b in args.batch_sizes):
        p.error("--batch_sizes are batch sizes of 2 or more (batch size 1 is the main profile)")
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    start, load_before = time.perf_counter(), os.getloadavg()
    pieces, compile_s = {}, {}
    for precision in args.precisions:
        weights = args.checkpoint / PRECISION_FILES[precision][0]
        if not weights.is_file() and PRECISION_FILES[precision][1] is None and (args.checkpoint / "model.pth").is_file():
            from quantize import quantized_checkpoint  # int8 / int4: quantize.py's file, made once

            quantized_checkpoint(args.checkpoint / "model.pth", precision)
        if not weights.is_file():
            print(f"{precision}: {weights.name} missing, skipped (see quantize.py)", file=sys.stderr)
            continue
        pieces[precision] = load_pieces(precision, args.mode, args.checkpoint, args.eagle_head)
    if not pieces:
        raise CheckpointError(f"no model.pth or quantized file in {args.checkpoint}; give the target's directory")
    jobs, graphs = {}, {}
    counters = torch._dynamo.utils.counters
    for precision, pc in pieces.items():
        t, before = time.perf_counter(), counters["stats"]["unique_graphs"]
        for piece, rows in [(piece, n) for piece in PIECES for n in rows_of(piece)]:
            jobs[precision, piece, rows] = pc.call(piece, rows)
            jobs[precision, piece, rows]()  # compiles (once per piece, and for one row) and warms up
            jobs[precision, piece, rows]()
        compile_s[precision] = round(time.perf_counter() - t, 1)
        graphs[precision] = counters["stats"]["unique_graphs"] - before
        print(f"{precision}: warm in {compile_s[precision]} s, {graphs[precision]} graphs", file=sys.stderr)
    medians, wall = timed_round_robin(jobs, args.reps)
    check = {}
    if args.check_rows:  # fixed-shape graphs (one per row count, as generate.py's) against the curve and eager
        check_jobs = {}
        for precision, pc in pieces.items():
            for n in args.check_rows:
                fixed = {"verify": compiled(verify_greedy, f"{precision}_{n}")}
                check_jobs[precision, "fixed", n] = pc.call("verify", n, fixed, rows_dynamic=False)
                check_jobs[precision, "fixed", n]()
                check_jobs[precision, "fixed", n]()
                check_jobs[precision, "eager", n] = pc.call("verify", n, {"verify": verify_greedy})
                check_jobs[precision, "curve", n] = jobs[precision, "verify", n]
        checked, checked_wall = timed_round_robin(check_jobs, args.reps, seed=1)
        for precision in pieces:
            check[precision] = {"rows": args.check_rows, **{kind: [checked[precision, kind, n] for n in args.check_rows]
                                                           for kind in ("fixed", "curve", "eager")},
                                "wall": {kind: [checked_wall[precision, kind, n] for n in args.check_rows]
                                         for kind in ("fixed", "curve", "eager")}}
    autotune = autotune_table(pieces, args.autotune or [1, 4, 16], args.reps) if args.autotune is not None else {}
    batches = {}
    for batch_size in args.batch_sizes:  # each precision's pieces again, at this batch size (after the others)
        t = time.perf_counter()
        for precision, pc in pieces.items():
            pc.prepare(pc.model, pc.head, args.mode, f"{precision}_b{batch_size}", max(BATCH_ROWS["verify"]), batch_size)
        costs, wall_costs = piece_costs(pieces, BATCH_ROWS, args.reps, seed=3)
        batches[str(batch_size)] = {precision: {**c, "wall_ms": wall_costs[precision]} for precision, c in costs.items()}
        print(f"batch {batch_size}: {time.perf_counter() - t:.0f} s", file=sys.stderr)
    first = next(iter(pieces.values()))
    model, head = first.model, first.head  # the shape and head every precision's pieces share
    profile = {
        "key": cost_profile_path(args.threads).stem.removeprefix("costs-"), "isa": instruction_set(), "cpu": cpu_name(),
        "cpu_family": cpu_family(), "threads": args.threads,
        "torch": torch.__version__, "date": date.today().isoformat(),
        "model": profile_model(model.config), "head": shown(args.eagle_head),
        "command": "python " + " ".join([str(Path(sys.argv[0]).resolve().relative_to(REPO))
                                         if Path(sys.argv[0]).resolve().is_relative_to(REPO) else sys.argv[0]]
                                        + sys.argv[1:]),
        "prefix_len": PREFIX, "reps": args.reps, "top_k": TOP_K,
        "clock": "median thread CPU time per call (wall_ms: median wall time)",
        "mode": "compiled, rows dynamic (1 row: its own graph)" if args.mode == "dynamic" else "eager",
        "overhead_ms": args.overhead_ms, "decode_overhead_ms": args.decode_overhead_ms,
        "sampling": head_sampling_costs(model, head, args.reps),
        "precisions": {precision: {
            "checkpoint": shown(pc.checkpoint), "dtype": str(pc.model.tok_embeddings.weight.dtype),
            **{f"{piece}_ms": {str(n): medians[precision, piece, n] for n in rows_of(piece)} for piece in PIECES},
            "wall_ms": {piece: {str(n): wall[precision, piece, n] for n in rows_of(piece)} for piece in PIECES}}
            for precision, pc in pieces.items()},
        "batches": batches, "check": check, "autotune": autotune, "warm_up_s": compile_s, "graphs": graphs,
        "load_average": {"start": [round(v, 2) for v in load_before], "end": [round(v, 2) for v in os.getloadavg()]},
        "wall_s": round(time.perf_counter() - start, 1),
    }
    out = args.out or cost_profile_path(args.threads)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile, indent=1))
    print(f"wrote {out}", file=sys.stderr)
    if args.plot:
        plot(profile, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)


if __name__ == "__main__":
    try:
        main()
    except CheckpointError as e:
        sys.exit(f"error: {e}")
