"""The speed of this checkout against an earlier commit, in one run: each version in a worker process of its own
(a git worktree of the commit beside this one), both pinned to the same core at one thread and driven in turn,
prompt by prompt, so that machine drift hits both alike.

    python scripts/compare_versions.py --baseline e433e46 --out results/DATE-compare    # int4 compiled, 24 prompts

Single sequences (Session.generate; vanilla, EAGLE chain-1 and the paper tree): the median over prompts of
tokens/s (prefill included, as generate.py reports it) and of decode tokens/s (after the first token). Batches
(--batch_sizes; vanilla and EAGLE chain-1, greedy): every prompt at B rows at once, continuous batching, as the
baseline's batched session and this checkout's engine run them; throughput after a warm-up, median of --reps.
Every greedy text of both versions is compared. Both versions load the same weights (this checkout's
checkpoint, quantized in memory by each version's own quantize.py) and the same head.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
SINGLE = ["vanilla", "chain-1", "paper"]


def worker(tree: Path, checkpoint: Path, head_dir: Path, precision: str, max_seq_len: int, kinds: list):
    """Serve requests (JSON lines on stdin) with the code of `tree`; answers are JSON lines on stdout."""
    sys.path.insert(0, str(tree))
    os.chdir(tree)
    import torch

    torch.set_num_threads(1)
    import generate
    import quantize
    from eagle_head import load_head
    from model import Transformer
    from tree import parse_tree

    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    model = Transformer.from_checkpoint(checkpoint, dtype=dtype)
    head = load_head(head_dir, dtype=dtype)
    if precision in ("int8", "int4"):
        quantize.quantize_model(model, quantize.handler_for(precision), quantize_lm_head=True)
        quantize.quantize_head_like(head, model)
    try:
        import engine  # this checkout: rows on the engine
        from tuning import COMPILE_KINDS
    except ImportError:  # before the engine: batched.py's session, generate's compile kinds
        engine, COMPILE_KINDS = None, getattr(generate, "COMPILE_KINDS", {"default": None})
    steps = {kind: generate.Steps.compiled("cpu", inductor_config=COMPILE_KINDS[kind]) for kind in kinds
             if kind == "default" or engine is not None}
    sessions, batches = {}, {}

    def session(config: str):
        if config not in sessions:
            tree_ = None if config == "vanilla" else parse_tree(config)
            sessions[config] = generate.Session(model, max_seq_len, None if tree_ is None else head, tree_,
                                                steps["default"])
        return sessions[config]

    def batch(config: str, rows: int, kind: str, prompt: list):
        key = config, rows, kind
        if key not in batches:
            tree_ = None if config == "vanilla" else parse_tree(config)
            h = None if tree_ is None else head
            if engine is not None:
                b = engine.Engine(model, max_seq_len, rows, h, tree_, steps=steps[kind])
                b.warm_up(prompt, max_new_tokens=8)
            else:
                import batched
                b = batched.BatchedSession(model, max_seq_len, rows, h, tree_, compile=True)
                b.generate([prompt] * rows, 8, generate.Sampling())
            batches[key] = b
        return batches[key]

    for line in sys.stdin:
        req = json.loads(line)
        if req["cmd"] == "single":
            s = session(req["config"])
            s.reset()
            out, stats = s.generate(req["prompt"], req["n"], generate.Sampling(), frozenset(req["stop"]))
            answer = {"out": out, "total_s": stats.total_s, "prefill_s": stats.prefill_s}
        elif req["cmd"] == "warm":
            s = session(req["config"])
            s.generate(req["prompt"], 8, generate.Sampling())
            answer = {}
        else:
            b = batch(req["config"], req["rows"], req["kind"], req["prompts"][0])
            b.setup_caches()
            start = time.perf_counter()
            outs, stats = b.generate(req["prompts"], req["n"], generate.Sampling(), frozenset(req["stop"]))
            answer = {"outs": outs, "total_s": time.perf_counter() - start}
        print(json.dumps(answer), flush=True)


class Worker:
    def __init__(self, name: str, tree: Path, args):
        self.name = name
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(tree), "--checkpoint",
               str(args.checkpoint), "--head", str(args.head), "--precision", args.precision,
               "--max_seq_len", str(args.max_seq_len), "--kinds", *args.kinds]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                     preexec_fn=lambda: os.sched_setaffinity(0, {args.core}))

    def ask(self, **request) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.name} worker stopped (its stderr above)")
        return json.loads(line)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", default="e433e46", help="the commit to compare with")
    p.add_argument("--precision", default="int4", choices=["fp32", "bf16", "int8", "int4"])
    p.add_argument("--prompts", type=int, default=3, help="MT-bench first turns per category (8 categories)")
    p.add_argument("--max_new_tokens", type=int, default=256)
    p.add_argument("--batch_sizes", type=int, nargs="*", default=[2, 4, 8])
    p.add_argument("--kinds", nargs="+", default=["default"], help="compile kinds of this checkout's batches "
                   "(tuning.COMPILE_KINDS; the baseline's batches compile by default only)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--skip_single", action="store_true", help="batches only (no single-sequence comparison)")
    p.add_argument("--core", type=int, default=0, help="the core both workers are pinned to")
    p.add_argument("--out", type=Path, help="the results folder (required)")
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--checkpoint", type=Path, default=REPO_ROOT / "checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct/model.pth")
    p.add_argument("--head", type=Path, default=REPO_ROOT / "heads/SmolLM2-135M-Instruct-eagle")
    p.add_argument("--max_seq_len", type=int, default=1280)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.checkpoint, args.head, args.precision, args.max_seq_len, args.kinds)
    if args.out is None:
        p.error("--out DIR is required: the folder the comparison is written to")

    sys.path.insert(0, str(REPO_ROOT))
    from scripts.bench_common import git_state, load_dataset, machine_info, render, select_questions
    from tokenizer import Tokenizer

    tokenizer = Tokenizer.load(args.checkpoint.parent)
    items = select_questions(load_dataset("mtbench"), None, args.prompts)
    prompts = [render(tokenizer, item.turns[:1], []) for item in items]
    stop = sorted(tokenizer.stop_ids)
    base_tree = REPO_ROOT / ".worktrees" / args.baseline
    if not base_tree.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(base_tree), args.baseline], cwd=REPO_ROOT, check=True)
    workers = {"baseline": Worker("baseline", base_tree, args), "this": Worker("this", REPO_ROOT, args)}
    result = {"machine": machine_info("cpu"), "code": git_state(), "baseline": args.baseline,
              "args": {k: str(v) for k, v in vars(args).items()}, "questions": [i.question_id for i in items],
              "single": {}, "batches": {}}
    args.out.mkdir(parents=True, exist_ok=True)
    order = list(workers)
    singles = [] if args.skip_single else SINGLE
    for config in singles:  # compile first, outside the timings
        for w in workers.values():
            w.ask(cmd="warm", config=config, prompt=prompts[0])
    for i, prompt in enumerate(prompts if singles else []):
        for config in singles:
            order.reverse()  # who goes first alternates
            for name in order:
                r = workers[name].ask(cmd="single", config=config, prompt=prompt, n=args.max_new_tokens, stop=stop)
                n = len(r["out"])
                result["single"].setdefault(config, {}).setdefault(name, []).append(
                    {"tokens": n, "tokens_per_s": n / r["total_s"],
                     "decode_tokens_per_s": (n - 1) / max(r["total_s"] - r["prefill_s"], 1e-9), "out": r["out"]})
        print(f"prompt {i + 1}/{len(prompts)}", file=sys.stderr, flush=True)
    for rows in args.batch_sizes:
        for config in ("vanilla", "chain-1"):
            for kind in args.kinds:
                names = [n for n in order if kind == "default" or n == "this"]
                for _ in range(args.reps):
                    names.reverse()
                    for name in names:
                        r = workers[name].ask(cmd="batch", config=config, rows=rows, kind=kind, prompts=prompts,
                                              n=args.max_new_tokens, stop=stop)
                        tokens = sum(map(len, r["outs"]))
                        result["batches"].setdefault(f"{config} B={rows} {kind}", {}).setdefault(name, []).append(
                            {"tokens_per_s": tokens / r["total_s"], "outs": r["outs"]})
                print(f"batch {config} B={rows} {kind} done", file=sys.stderr, flush=True)
        (args.out / "compare.json").write_text(json.dumps(result))
    summary = summarize(result)
    (args.out / "compare.json").write_text(json.dumps(result))
    (args.out / "summary.md").write_text(summary)
    print(summary)


def summarize(result: dict) -> str:
    m = result["machine"]
    lines = [f"# This checkout ({result['code'].get('commit', '?')[:7]}) against {result['baseline']}", "",
             f"{m.get('processor', '?')} (CPU {m.get('cpu_family', '?')}, {m.get('isa', '?')}), one thread, both workers on one core; "
             f"{result['args']['precision']}, {len(result['questions'])} MT-bench first turns, "
             f"{result['args']['max_new_tokens']} new tokens at most, greedy.", ""]
    if result["single"]:  # none with --skip_single
        lines += ["| single sequence | baseline tokens/s | this | ratio | baseline decode tokens/s | this | ratio "
                  "| same text |", "|---|---|---|---|---|---|---|---|"]
    for config, by in result["single"].items():
        med = {n: statistics.median(r["tokens_per_s"] for r in rs) for n, rs in by.items()}
        dec = {n: statistics.median(r["decode_tokens_per_s"] for r in rs) for n, rs in by.items()}
        same = sum(a["out"] == b["out"] for a, b in zip(by["baseline"], by["this"]))
        lines.append(f"| {config} | {med['baseline']:.1f} | {med['this']:.1f} | {med['this'] / med['baseline']:.3f} "
                     f"| {dec['baseline']:.1f} | {dec['this']:.1f} | {dec['this'] / dec['baseline']:.3f} "
                     f"| {same}/{len(by['this'])} |")
    lines += [""] * bool(result["single"]) + ["| batch (every prompt, B rows) | baseline tokens/s | this | ratio |",
                                               "|---|---|---|---|"]
    for key, by in result["batches"].items():
        med = {n: statistics.median(r["tokens_per_s"] for r in rs) for n, rs in by.items()}
        base = f"{med['baseline']:.1f}" if "baseline" in med else "-"
        ratio = f"{med['this'] / med['baseline']:.3f}" if "baseline" in med else "-"
        lines.append(f"| {key} | {base} | {med['this']:.1f} | {ratio} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
