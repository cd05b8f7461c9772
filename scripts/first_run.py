"""A user's first run of `generate.py --eagle --compile` against the same flags without --eagle, per precision,
--autotune setting and temperature: does adding --eagle ever make the answer come later? (issue 48)

    python scripts/first_run.py --precisions fp32 bf16 int8 int4 --autotune off on --temperatures 0 1
    python scripts/first_run.py --quick     # tiny random model and head, a few tokens (tests)

Each configuration runs as a user would type it: one generate.py process per command, vanilla first and then
the same flags with --eagle (the default --tree auto: the adaptation, and the calibration where this machine has
no cost profile), over the same --limit MT-bench first turns one after another (--prompt_file), --max_new_tokens
each. generate.py warms up (compiles) before it answers, so its per-prompt lines leave the compile out; the
process wall time, which holds it, is reported apart. A prompt's speed is its decode rate, (tokens - 1) / (time
after the first token): at T > 0, or where low-precision texts part, EAGLE and vanilla write different lengths,
and a rate that counts the prefill would compare unlike things. The ratio is EAGLE's decode rate over vanilla's,
per prompt; the table gives their median and minimum.

Writes <out>/first_run.json, first_run.md and each process's stderr (logs/).
"""
import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
from engine import UsageError  # noqa: E402
from scripts.bench_common import (build_quick_checkpoint, default_out, git_state, load_dataset,  # noqa: E402
                                  machine_info, select_questions)

STATS = re.compile(r"^(\d+) tokens in ([\d.]+) s: [\d.]+ tokens/s, time to first token (\d+) ms")
PLAIN = re.compile(r"^(\d+) of (\d+) steps decoded plainly")  # the adaptation's line under a prompt's stats
FORWARDS = re.compile(r"(\d+) target \+ \d+ head forwards")  # EAGLE's tau line: its steps (cycles and plain)
PREDICTED = re.compile(r"predicted tau [\d.]+, ([\d.]+)x over")  # --tree auto's choice line
CHOICES = ("tree auto", "compile:", "Compiling", "precision", "calibrat", "adaptation")  # stderr lines worth keeping


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--precisions", nargs="+", choices=["fp32", "bf16", "int8", "int4", "w8a8"], default=["int4"])
    p.add_argument("--autotune", nargs="+", choices=["off", "freeze", "on", "auto"], default=["off"],
                   help="generate.py --autotune settings")
    p.add_argument("--temperatures", nargs="+", type=float, default=[0.0])
    p.add_argument("--limit", type=int, help="the first N MT-bench first turns (default 4; --quick 2)")
    p.add_argument("--max_new_tokens", type=int, help="default 256 (--quick 8)")
    p.add_argument("--threads", type=int, help="generate.py --threads (default: its own choice)")
    p.add_argument("--out", type=Path, help="output folder (default: results/<date>-<machine>-first-run)")
    p.add_argument("--quick", action="store_true", help="tiny random model and head, eager-sized, a few tokens")
    p.add_argument("--resume", action="store_true", help="keep the commands <out>/first_run.json holds")
    args = p.parse_args(argv)
    args.limit = (2 if args.quick else 4) if args.limit is None else args.limit
    args.max_new_tokens = (8 if args.quick else 256) if args.max_new_tokens is None else args.max_new_tokens
    if min(args.limit, args.max_new_tokens) < 1 or min(args.temperatures) < 0:
        raise UsageError("--limit and --max_new_tokens must be >= 1, --temperatures >= 0")
    return args


def prompt_file(path: Path, limit: int) -> list:
    """The first `limit` MT-bench first turns, written one per line as generate.py --prompt_file reads them."""
    prompts = [q.turns[0] for q in select_questions(load_dataset("mtbench"), limit, None)]
    path.write_text("".join(p.replace("\\", "\\\\").replace("\n", "\\n") + "\n" for p in prompts))
    return prompts


def run_generate(flags: list, log: Path, work: Path) -> dict:
    """One generate.py process: its per-prompt stats, its wall time and the choice lines it printed (its flags
    recorded with the temporary files named relative to work, e.g. prompts.txt)."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, str(REPO_ROOT / "generate.py"), *flags], cwd=REPO_ROOT,
                          capture_output=True, text=True)
    wall = time.perf_counter() - start
    log.write_text(done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"generate.py {' '.join(flags)} failed: {done.stderr.strip().splitlines()[-1:]}")
    choices = [line.strip() for line in done.stderr.splitlines() if line.strip().startswith(CHOICES)]
    return {"flags": [f.replace(f"{work}/", "") for f in flags], "wall_s": round(wall, 1),
            "prompts": parse(done.stderr), "choices": choices, "text": done.stdout}


def parse(stderr: str) -> list:
    """generate.py's per-prompt statistics: tokens, times, decode rate and the adaptation's plain steps."""
    prompts = []
    for line in stderr.splitlines():
        m, plain, forwards = STATS.match(line.strip()), PLAIN.match(line.strip()), FORWARDS.search(line)
        if m:
            tokens, total_s, ttft_s = int(m[1]), float(m[2]), int(m[3]) / 1000
            decode_s = total_s - ttft_s
            prompts.append({"tokens": tokens, "total_s": total_s, "ttft_s": ttft_s, "plain_steps": 0,
                            "decode_rate": (tokens - 1) / decode_s if tokens > 1 and decode_s > 0 else None})
        elif forwards and prompts:
            prompts[-1]["steps"] = int(forwards[1])
        elif plain and prompts:
            prompts[-1]["plain_steps"] = int(plain[1])
    return prompts


def summarize(vanilla: dict, eagle: dict) -> dict:
    ratios = [e["decode_rate"] / v["decode_rate"] for v, e in zip(vanilla["prompts"], eagle["prompts"])
              if v["decode_rate"] and e["decode_rate"]]
    rate = lambda run: statistics.median(p["decode_rate"] for p in run["prompts"] if p["decode_rate"])  # noqa: E731
    return {"vanilla_rate": round(rate(vanilla), 1), "eagle_rate": round(rate(eagle), 1),
            "ratios": [round(r, 3) for r in ratios], "median": round(statistics.median(ratios), 3),
            "min": round(min(ratios), 3), "vanilla_wall_s": vanilla["wall_s"], "eagle_wall_s": eagle["wall_s"],
            "same_text": vanilla["text"] == eagle["text"], "predicted": predicted(eagle)}


def predicted(eagle: dict):
    """The speedup --tree auto predicted before the first token (None: a tree given, or no prediction printed)."""
    found = [PREDICTED.search(line) for line in eagle["choices"]]
    return next((float(m[1]) for m in found if m), None)


def markdown(result: dict) -> str:
    m = result["metadata"]
    lines = [f"# First runs: `generate.py --compile` with and without `--eagle` ({m['date']})", "",
             f"Machine: {m['machine']['processor']} ({m['machine']['isa']}, {m['machine']['cpu_family']}), "
             f"{m['machine']['cpu_count']} cores, torch {m['machine']['torch']}; code "
             f"{m['git'].get('commit')}{' (uncommitted changes)' if m['git'].get('dirty') else ''}; "
             f"{m['prompts']} MT-bench first turns, {m['max_new_tokens']} new tokens each, one process per command.",
             "", "| precision | --autotune | T | vanilla tokens/s | --eagle tokens/s | EAGLE / vanilla median (min) "
             "| predicted | steps plain | same text | process wall s vanilla / eagle | EAGLE's choices |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        s, guess = r["summary"], r["summary"]["predicted"]
        plain = [p.get("plain_steps", 0) / p["steps"] for p in r["eagle"]["prompts"] if p.get("steps")]
        lines.append(f"| {r['precision']} | {r['autotune']} | {r['temperature']:g} | {s['vanilla_rate']} | "
                     f"{s['eagle_rate']} | {s['median']:.2f}x ({s['min']:.2f}) | "
                     f"{'–' if guess is None else f'{guess:.2f}x'} | "
                     f"{'–' if not plain else f'{statistics.median(plain):.0%}'} | "
                     f"{'yes' if s['same_text'] else 'no'} | {s['vanilla_wall_s']:.0f} / {s['eagle_wall_s']:.0f} | "
                     f"{'; '.join(r['eagle']['choices'])[:200]} |")
    lines += ["", "tokens/s: a prompt's decode rate, (tokens - 1) / time after its first token, median over the "
              "prompts; the ratio per prompt. predicted: `--tree auto`'s speedup over vanilla, printed before the "
              "first token. steps plain: the median share of a prompt's steps the adaptation decoded plainly. "
              "same text: the two processes printed the same answers (greedy fp32 must; T > 0 draws differently, "
              "and low precisions part at near-ties). The process wall time holds loading, the warm-up (compile) "
              "and the calibration where there was one."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    info = machine_info("cpu")
    out = args.out or default_out(info, args.quick, "-first-run")
    (out / "logs").mkdir(parents=True, exist_ok=True)
    json_path = out / "first_run.json"
    before = json.loads(json_path.read_text()) if args.resume and json_path.is_file() else {"runs": []}
    done = {(r["precision"], r["autotune"], r["temperature"]): r for r in before["runs"]}
    # the run's own record (its date, code and command), kept by a resume; a resume that runs commands too says so
    first = before.get("metadata") or {"date": time.strftime("%Y-%m-%d"), "git": git_state(),
                                       "command": "python scripts/first_run.py " + " ".join(argv or sys.argv[1:])}
    with tempfile.TemporaryDirectory(prefix="first-run-") as work:
        work = Path(work)
        prompts_path = work / "prompts.txt"
        prompts = prompt_file(prompts_path, args.limit)
        base = ["--prompt_file", str(prompts_path), "--max_new_tokens", str(args.max_new_tokens)]
        if args.quick:
            checkpoint, head = build_quick_checkpoint(work / "quick")
            base += ["--checkpoint", str(checkpoint), "--eagle_head", str(head)]
        if args.threads:
            base += ["--threads", str(args.threads)]
        planned = [(p, a, t) for t in args.temperatures for a in args.autotune for p in args.precisions]
        runs = [r for key, r in done.items() if key not in planned]  # an earlier run's other commands stay
        if done and any(key not in done for key in planned):
            first["resumed"] = first.get("resumed", []) + [{"date": time.strftime("%Y-%m-%d"), "git": git_state()}]
        for key in planned:  # greedy first, then each --autotune setting over the precisions
            precision, autotune, temperature = key
            stem = f"{precision}-{autotune}-t{temperature:g}"
            if key in done:  # its logs are the record: parsed and summarized again (a field added since is filled in)
                for side in ("vanilla", "eagle"):
                    log = out / "logs" / f"{stem}-{side}.txt"
                    if log.is_file():
                        done[key][side]["prompts"] = parse(log.read_text())
                done[key]["summary"] = summarize(done[key]["vanilla"], done[key]["eagle"])
                runs.append(done[key])
                continue
            flags = base + ["--compile", "--autotune", autotune, "--precision", precision,
                            "--temperature", str(temperature)]
            vanilla = run_generate(flags, out / "logs" / f"{stem}-vanilla.txt", work)
            eagle = run_generate(flags + ["--eagle"], out / "logs" / f"{stem}-eagle.txt", work)
            runs.append({"precision": precision, "autotune": autotune, "temperature": temperature,
                         "vanilla": vanilla, "eagle": eagle, "summary": summarize(vanilla, eagle)})
            s = runs[-1]["summary"]
            print(f"{stem}: vanilla {s['vanilla_rate']} tokens/s, eagle {s['eagle_rate']}, "
                  f"{s['median']:.2f}x (min {s['min']:.2f})", file=sys.stderr)
            write(out, args, first, info, len(prompts), runs)  # after each command: a stopped run resumes
    print(f"wrote first_run.json and first_run.md to {out}", file=sys.stderr)
    return write(out, args, first, info, len(prompts), runs)


def write(out: Path, args, first: dict, info: dict, prompts: int, runs: list) -> dict:
    result = {"metadata": {**first, "machine": info, "prompts": prompts, "max_new_tokens": args.max_new_tokens,
                           "quick": args.quick},
              "runs": runs}
    (out / "first_run.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "first_run.md").write_text(markdown(result))
    return json.loads((out / "first_run.json").read_text())


if __name__ == "__main__":
    try:
        main()
    except (UsageError, RuntimeError) as e:  # RuntimeError: a generate.py process failed (its log is kept)
        sys.exit(f"first_run.py: {e}")
