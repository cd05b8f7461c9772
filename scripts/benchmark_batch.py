"""Batched throughput: vanilla and EAGLE decoding at several batch sizes, in one process (the EAGLE paper's Table 7).

    python scripts/benchmark.py --batch_sizes 1 2 4 8                # runs this: int4 compiled, greedy, 1 thread
    python scripts/benchmark_batch.py --batch_sizes 1 2 4 8 --memory_budget_mb 500
    python scripts/benchmark_batch.py --quick                        # tiny random model and head, seconds (tests)

Protocol:
- prompts: the first turns of the MT-bench questions (chat template), --max_new_tokens each, greedy by default;
- per batch size B: a vanilla engine.Engine and an EAGLE one, both continuous batching (a finished row
  takes the next prompt at once); the EAGLE tree is --tree, by default what `generate.py --batch_size B --tree
  auto` takes (this machine's cost profile or quick calibration at batch B; its predicted tau and speedup are
  recorded);
- the prompts are split into --groups groups; each group runs through every (batch size, method) once, in an
  order rotated per group, so machine drift hits all alike; a run is one generate call over the group's
  prompts (prefills included), its throughput = new tokens / wall time; each session first runs an untimed
  warm-up (compilation);
- per batch size: the median over groups of tokens/s, EAGLE's speedup over vanilla at the same batch size
  (paired by group), and EAGLE's throughput over the fastest vanilla configuration of the run; tau = tokens a
  cycle commits per row (accepted drafts + 1); greedy outputs are compared with vanilla batch 1's
  (`outputs_match`: bf16 / int4 kernels may round a batch differently, so a near-tie can flip); where a text
  leaves it, `divergence` records the gap between the target's two best logits there (one forward over the
  prefix) and whether the two texts' tokens are those two;
- memory: the tensors each method holds at batch B (weights, KV caches of B rows of the shared cache length,
  the head and its cache; no features are kept), and the paper's memory-budget comparison: within
  --memory_budget_mb (default: vanilla's memory at the largest batch size), the largest batch size each method
  fits (weights + rows x per-row memory) and, of the measured batch sizes, the largest that fits and its
  throughput.

Writes <out>/benchmark.json and benchmark.md (default out: results/<date>-<machine>-batch).
"""
import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Optional

import torch
from tqdm import tqdm

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
import generate  # noqa: E402
import quantize  # noqa: E402
from engine import Engine  # noqa: E402
from eagle_head import EagleHead  # noqa: E402
from model import causal_mask  # noqa: E402
from scripts.bench_common import (PRECISION_DTYPES, build_quick_checkpoint, default_out, git_state,  # noqa: E402
                                  head_record, json_safe, load_dataset, load_target, machine_info, read_questions,
                                  render, repo_relative, select_questions, tensor_mb)
from tokenizer import Tokenizer  # noqa: E402
from tree import parse_tree  # noqa: E402
import tuning  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch_sizes", nargs="+", type=int, default=[1, 2, 4, 8])
    p.add_argument("--checkpoint", type=Path, help="model.pth or its directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--head", type=Path, help="EAGLE head directory (default: the shipped head)")
    p.add_argument("--precision", choices=list(PRECISION_DTYPES), default="int4",
                   help="the target's precision (benchmark.py's: int4 = int4 weights, bf16 activations)")
    p.add_argument("--mode", choices=["compiled", "eager"], help="default: compiled (--quick: eager)")
    p.add_argument("--tree", default="auto", help="EAGLE tree at every batch size (default auto: chosen per batch size)")
    p.add_argument("--questions", type=Path, help="a JSONL in MT-bench format instead of MT-bench")
    p.add_argument("--limit", type=int, help="the first N questions (default: all 80)")
    p.add_argument("--groups", type=int, default=4, help="prompt groups: the repetitions each median is over")
    p.add_argument("--max_new_tokens", type=int, help="default 256 (--quick: 16)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--memory_budget_mb", type=float, help="default: vanilla's memory at the largest batch size")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", type=Path, help="output folder (default: results/<date>-<machine>-batch)")
    p.add_argument("--quick", action="store_true", help="smoke test: tiny random model and head, 4 prompts, eager")
    args = p.parse_args(argv)
    if args.quick:
        args.limit = args.limit or 4
        args.groups = min(args.groups, 2)
        args.precision = "fp32"
    args.mode = args.mode or ("eager" if args.quick else "compiled")
    args.max_new_tokens = args.max_new_tokens or (16 if args.quick else 256)
    if min(args.batch_sizes) < 1 or args.groups < 1 or args.max_new_tokens < 1 or (args.limit or 1) < 1:
        raise generate.UsageError("--batch_sizes, --groups, --max_new_tokens and --limit must be >= 1")
    if args.temperature < 0:
        raise generate.UsageError("--temperature must be >= 0 (0 = greedy)")
    if args.questions and not args.questions.is_file():
        raise generate.UsageError(f"--questions {args.questions} not found")
    args.batch_sizes = sorted(set(args.batch_sizes))
    return args


def row_mb(session: Engine) -> float:
    """Memory a batch row adds: its KV cache rows (target and head)."""
    caches = session.model.kv_caches() + (session.head.kv_caches() if session.head is not None else [])
    return sum(t.numel() * t.element_size() for c in caches for t in (c.k_cache, c.v_cache)) / session.batch_size / 2**20


def memory(session: Engine) -> dict:
    total = tensor_mb(session.model, *([session.head] if session.head is not None else []))
    per_row = row_mb(session)
    return {"total_mb": total, "per_row_mb": per_row, "fixed_mb": total - per_row * session.batch_size}


def largest_fit(mem: dict, budget_mb: float) -> int:
    """The largest batch size whose fixed memory + rows x per-row memory fits the budget (0: none)."""
    return max(0, int((budget_mb - mem["fixed_mb"]) // mem["per_row_mb"]))


def run_group(session: Engine, prompts: list, args, sampling, stop_ids) -> dict:
    torch.manual_seed(args.seed)
    outs, stats = session.generate(prompts, args.max_new_tokens, sampling, stop_ids)
    return {"outs": outs, "new_tokens": sum(stats.new_tokens), "time_s": stats.total_s,
            "tokens_per_s": stats.tokens_per_s, "target_forwards": stats.target_forwards,
            "tau": stats.pooled_tau}


@torch.no_grad()
def divergence(model, prompt: list, reference: list, out: list) -> Optional[dict]:
    """Where out leaves reference (None: it does not): at the first differing token d, the gap between the
    target's two best logits after prompt + reference[:d] (one forward over the prefix, in the model's own
    precision) and whether the two texts' tokens are those two: a near-tie that rounding can flip."""
    d = next((i for i, (a, b) in enumerate(zip(out, reference)) if a != b), None)
    if d is None:
        return None
    ids = prompt + reference[:d]
    pos = torch.arange(len(ids))
    with model.cache_row(0):
        logits, _ = model(torch.tensor([ids]), pos, mask=causal_mask(pos, len(ids)), logits_at=slice(-1, None))
    top = logits[0, -1].float().topk(2)
    return {"at": d, "top2_gap": float(top.values[0] - top.values[1]),
            "top2_are_the_two": set(top.indices.tolist()) == {reference[d], out[d]}}


def divergence_summary(found: list) -> dict:
    found = [f for f in found if f is not None]
    return {"diverged": len(found), "max_top2_gap": max((f["top2_gap"] for f in found), default=None),
            "median_top2_gap": median([f["top2_gap"] for f in found]),
            "top2_are_the_two": sum(f["top2_are_the_two"] for f in found)}


def median(values: list):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def markdown(result: dict) -> str:
    meta, rows = result["metadata"], result["summary"]["by_batch_size"]
    lines = [f"# Batched throughput, {meta['machine']['processor']} ({meta['machine']['isa']}), {meta['threads']} thread(s)",
             "", f"`{meta['command']}`", "",
             f"{meta['prompts']} prompts ({meta['dataset']}), {meta['max_new_tokens']} new tokens at most, "
             f"T={meta['temperature']:g}, {meta['precision']} {meta['mode']}; medians over {meta['groups']} prompt groups; "
             f"the fastest vanilla configuration: batch {result['summary']['fastest_vanilla_batch_size']}.", "",
             "| batch | vanilla tok/s | EAGLE tok/s | speedup (same batch) | EAGLE / fastest vanilla | tau | tree (predicted tau, speedup) | memory vanilla / EAGLE MB | outputs = vanilla bs 1 | divergences: largest top-2 logit gap |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pred = r["predicted"]
        tree = f"{r['tree']}" + (f" ({pred['tau']:.2f}, {pred['speedup']:.2f}x)" if pred else "")
        lines.append(f"| {r['batch_size']} | {r['vanilla_tokens_per_s']:.1f} | {r['eagle_tokens_per_s']:.1f} | "
                     f"{r['speedup']:.2f}x | {r['eagle_over_fastest_vanilla']:.2f}x | {r['tau']:.2f} | {tree} | "
                     f"{r['memory']['vanilla']['total_mb']:.0f} / {r['memory']['eagle']['total_mb']:.0f} | "
                     f"vanilla {r['outputs_match']['vanilla']}, EAGLE {r['outputs_match']['eagle']} of {meta['prompts']} | "
                     f"{gaps(r['divergence'])} |")
    b = result["summary"]["memory_budget"]
    lines += ["", f"## Within a memory budget of {b['budget_mb']:.0f} MB", "",
              "| method | largest batch that fits | largest measured batch that fits | its tokens/s |", "|---|---|---|---|"]
    for name in ("vanilla", "eagle"):
        m = b[name]
        lines.append(f"| {name} | {m['largest_fit']} | {m['measured_batch_size']} | "
                     f"{m['tokens_per_s']:.1f} |" if m["measured_batch_size"] else f"| {name} | {m['largest_fit']} | none | - |")
    if b["eagle"]["tokens_per_s"] and b["vanilla"]["tokens_per_s"]:
        lines += ["", f"EAGLE / vanilla within the budget: {b['eagle']['tokens_per_s'] / b['vanilla']['tokens_per_s']:.2f}x"]
    return "\n".join(lines) + "\n"


def gaps(divergence: Optional[dict]) -> str:
    if not divergence:
        return "-"
    parts = [f"{name} {d['max_top2_gap']:.3f} ({d['top2_are_the_two']} of {d['diverged']} between the top two)"
             for name, d in divergence.items() if d["diverged"]]
    return ", ".join(parts) or "none"


def run(args, argv) -> dict:
    started = time.perf_counter()
    info = machine_info("cpu")
    out = args.out or default_out(info, args.quick, suffix="-batch")
    checkpoint = args.checkpoint
    if checkpoint is None:
        from tokenizer import ensure_default_model
        checkpoint = ensure_default_model()
    if checkpoint.is_dir():
        checkpoint = checkpoint / "model.pth"
    head_dir = args.head or generate.DEFAULT_HEAD
    tokenizer = Tokenizer.load(checkpoint.parent)
    items = read_questions(args.questions, args.questions.stem) if args.questions else load_dataset("mtbench")
    items = select_questions(items, args.limit, None)
    if not items:
        raise generate.UsageError("the questions file holds no questions")
    prompts = [render(tokenizer, item.turns[:1], []) for item in items]
    groups = [prompts[g::args.groups] for g in range(args.groups) if prompts[g::args.groups]]
    max_seq_len = max(map(len, prompts)) + args.max_new_tokens
    sampling = generate.Sampling(args.temperature)

    model = load_target(checkpoint, args.precision, "cpu")
    head = EagleHead.load(head_dir, dtype=PRECISION_DTYPES[args.precision])
    head.check_fits(model.config, model.config.vocab_size)
    quantize.quantize_head_like(head, model)
    compiled = args.mode == "compiled"
    if compiled:
        for limit in ("recompile_limit", "accumulated_recompile_limit"):  # each batch size its own graphs
            if hasattr(torch._dynamo.config, limit):
                setattr(torch._dynamo.config, limit, max(256, getattr(torch._dynamo.config, limit)))
    sessions, trees, predicted, mem = {}, {}, {}, {}
    for b in args.batch_sizes:
        if args.tree == "auto":
            choice = tuning.auto_tree_choice(head_dir, model, "cpu", sampling.greedy,
                                               (head, "dynamic" if compiled else "eager"), batch_size=b)
            trees[b] = choice.spec if choice else "chain-1"
            predicted[b] = {"tau": choice.tau, "speedup": choice.speedup} if choice else None
        else:
            trees[b], predicted[b] = args.tree, None
        sessions[b, "vanilla"] = Engine(model, max_seq_len, b, compile=compiled)
        sessions[b, "eagle"] = Engine(model, max_seq_len, b, head, parse_tree(trees[b]), compile=compiled)
    # one cache length for every session (the largest), so switching batch sizes reallocates rows only
    cache_len = max(s.cache_len for s in sessions.values())
    head_len = max(s.head_cache_len for s in sessions.values() if s.head_cache_len)
    for (b, name), s in sessions.items():
        s.setup_caches(cache_len, head_len)
        mem[b, name] = memory(s)

    names = ["vanilla", "eagle"]
    warm_s = {}
    for key in tqdm(list(sessions), desc="warm-up", file=sys.stderr):
        start = time.perf_counter()
        sessions[key].warm_up(prompts[0], [sampling], min(32, args.max_new_tokens))  # every bucket of rows
        warm_s[f"{key[0]}-{key[1]}"] = round(time.perf_counter() - start, 1)
    order = [(b, name) for b in args.batch_sizes for name in names]
    runs = []
    for g, group in enumerate(tqdm(groups, desc="groups", file=sys.stderr)):
        for position, key in enumerate(order[g % len(order):] + order[: g % len(order)]):
            r = run_group(sessions[key], group, args, sampling, tokenizer.stop_ids)
            runs.append({"group": g, "batch_size": key[0], "method": key[1], "order": position,
                         "tree": trees[key[0]] if key[1] == "eagle" else None, **r})
    reference = {r["group"]: r["outs"] for r in runs if (r["batch_size"], r["method"]) == (args.batch_sizes[0], "vanilla")}
    if sampling.greedy:  # where each text leaves vanilla's at the smallest batch size, and how close a tie it was
        for r in tqdm(runs, desc="divergences", file=sys.stderr):
            r["divergences"] = [divergence(model, p, ref, o) for p, ref, o in
                                zip(groups[r["group"]], reference[r["group"]], r["outs"])]

    def of(b, name):
        return [r for r in runs if (r["batch_size"], r["method"]) == (b, name)]

    vanilla_tps = {b: median([r["tokens_per_s"] for r in of(b, "vanilla")]) for b in args.batch_sizes}
    fastest = max(vanilla_tps, key=vanilla_tps.get)
    rows = []
    for b in args.batch_sizes:
        eagle, vanilla = of(b, "eagle"), of(b, "vanilla")
        match = {name: sum(o == ref for r in of(b, name) for o, ref in zip(r["outs"], reference[r["group"]]))
                 for name in names}
        rows.append({
            "batch_size": b, "tree": trees[b], "predicted": predicted[b],
            "vanilla_tokens_per_s": vanilla_tps[b], "eagle_tokens_per_s": median([r["tokens_per_s"] for r in eagle]),
            "speedup": median([e["tokens_per_s"] / v["tokens_per_s"] for e, v in zip(eagle, vanilla)]),
            "eagle_over_fastest_vanilla": median([e["tokens_per_s"] for e in eagle]) / vanilla_tps[fastest],
            "tau": median([r["tau"] for r in eagle]),
            "memory": {name: mem[b, name] for name in names}, "outputs_match": match,
            "divergence": {name: divergence_summary([f for r in of(b, name) for f in r.get("divergences", [])])
                           for name in names} if sampling.greedy else None,
            "tokens": {name: sum(r["new_tokens"] for r in of(b, name)) for name in names}})
    largest = args.batch_sizes[-1]
    budget = args.memory_budget_mb or mem[largest, "vanilla"]["total_mb"]
    within = {}
    for name in names:
        fits = [b for b in args.batch_sizes if mem[b, name]["total_mb"] <= budget + 1e-6]
        measured = max(fits) if fits else None
        within[name] = {"largest_fit": largest_fit(mem[largest, name], budget), "measured_batch_size": measured,
                        "tokens_per_s": (vanilla_tps[measured] if name == "vanilla" else
                                         next(r["eagle_tokens_per_s"] for r in rows if r["batch_size"] == measured))
                        if measured else None}
    for r in runs:
        r.pop("outs")
    command = " ".join(shlex.quote(a) for a in ["python", sys.argv[0]] + list(sys.argv[1:] if argv is None else argv))
    result = json_safe({
        "metadata": {"date": date.today().isoformat(), "command": command, "machine": info,
                     "threads": torch.get_num_threads(), "git": git_state(),
                     "checkpoint": "tiny random model (--quick)" if args.quick else repo_relative(checkpoint),
                     "head": head_record(str(head_dir), head), "precision": args.precision, "mode": args.mode,
                     "dataset": repo_relative(args.questions) if args.questions else "mtbench first turns",
                     "prompts": len(prompts), "groups": len(groups), "max_new_tokens": args.max_new_tokens,
                     "temperature": args.temperature, "cache_len": cache_len, "warmup_s": warm_s,
                     "wall_s": round(time.perf_counter() - started, 1)},
        "summary": {"by_batch_size": rows, "fastest_vanilla_batch_size": fastest,
                    "memory_budget": {"budget_mb": budget, **within}},
        "runs": runs})
    out.mkdir(parents=True, exist_ok=True)
    (out / "benchmark.json").write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")
    (out / "benchmark.md").write_text(markdown(result))
    print(markdown(result), file=sys.stderr)
    print(f"wrote benchmark.json and benchmark.md to {out}", file=sys.stderr)
    return result


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    with torch.inference_mode(), tempfile.TemporaryDirectory(prefix="benchmark-batch-quick-") as quick_dir:
        if args.quick:
            args.checkpoint, args.head = build_quick_checkpoint(Path(quick_dir))
        return run(args, argv)


if __name__ == "__main__":
    try:
        main()
    except (generate.UsageError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
