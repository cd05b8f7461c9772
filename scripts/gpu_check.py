"""One command for the minutes a lent GPU gives: the device tests, the benchmark and a short head-training
run, each with a time limit, everything written under one folder.

    python scripts/gpu_check.py                               # on CUDA: under 8 minutes
    python scripts/gpu_check.py --device cpu --quick          # the same logic on CPU, reduced sizes (a test)

Steps (each a subprocess with its own time limit; a failing or timed-out step is recorded and the next
one still runs; the exit status is 1 if any step failed):
  tests      pytest -m device --device DEV: the tests that make sense on any device (the model against
             transformers' logits, greedy EAGLE == vanilla in fp32 and on one quantized model, the sampling
             G-tests, no recompiles of the compiled steps, with CUDA graphs on CUDA)
  benchmark  scripts/benchmark.py on the 8 MT-bench first turns (one per category), 128 tokens, greedy:
             vanilla and EAGLE (chain-1, chain-3, the paper tree, the dynamic tree) in bf16 and int4,
             compiled (--quick: the tiny random model)
  train      scripts/train_eagle.py online from the shipped head (the EAGLE-3 recipe's training-time test
             on ShareGPT with online target features), its record and head under OUT/train
Writes OUT/summary.json and OUT/summary.md (device, torch, each step's status, wall time and log file).
Default OUT: results/<date>-gpu-check-<device name>/.
"""
import argparse
import datetime
import json
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
SHIPPED_HEAD = "heads/SmolLM2-135M-Instruct-eagle"


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    flags = set(re.findall(r"\b(avx2|avx512_bf16|amx_bf16)\b", Path("/proc/cpuinfo").read_text())) \
        if Path("/proc/cpuinfo").is_file() else set()
    return f"{platform.processor() or platform.machine()} cpu ({' '.join(sorted(flags)) or 'no avx2'})"


def steps(device: str, quick: bool, out: Path) -> list:
    """(name, command, time limit in seconds) of each step."""
    py = sys.executable
    tests = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "device", "--device", device,
             "--junitxml", str(out / "tests.xml")]
    bench = [py, "scripts/benchmark.py", "--device", device, "--out", str(out / "benchmark"), "--temperatures", "0"]
    train = [py, "scripts/train_eagle.py", "online", "--init", SHIPPED_HEAD, "--out", str(out / "train"),
             "--save_head", str(out / "train" / "head")]
    if quick:
        tests += ["-k", "tiny and copycat"]  # the broken-verifier G-test runs in the suite itself (2 min on CPU)
        bench += ["--quick", "--modes", "eager", "--trees", "chain-1", "paper"]
        train += ["--conversations", "4", "--max_steps", "2", "--pack_len", "256", "--batch_size", "1",
                  "--eval_records", "2", "--eval_every", "2", "--threads", "1"]
        return [("tests", tests, 600), ("benchmark", bench, 300), ("train", train, 300)]
    bench += ["--threads", "8", "--datasets", "mtbench", "--per_category", "1", "--turns", "1",
              "--max_new_tokens", "128", "--dtypes", "bf16", "int4", "--modes", "compiled",
              "--trees", "chain-1", "chain-3", "paper", "dynamic-8-4-16"]
    train += ["--conversations", "2000", "--max_steps", "200", "--batch_size", "8", "--eval_every", "100"]
    return [("tests", tests, 120), ("benchmark", bench, 240), ("train", train, 120)]


def run_step(name: str, command: list, limit: int, out: Path) -> dict:
    log = REPO_ROOT / out / f"{name}.log"
    start = time.perf_counter()
    with open(log, "w") as f:
        try:
            status = "passed" if subprocess.run(command, cwd=REPO_ROOT, stdout=f, stderr=subprocess.STDOUT,
                                                timeout=limit).returncode == 0 else "failed"
        except subprocess.TimeoutExpired:
            status = f"timed out after {limit} s"
    wall = time.perf_counter() - start
    print(f"{name}: {status} in {wall:.0f} s (log {log.name})", file=sys.stderr)
    return {"step": name, "status": status, "wall_s": round(wall, 1), "log": log.name, "command": command[1:]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="reduced sizes (the CPU test of this script)")
    p.add_argument("--out", type=Path, help="output folder (default: results/<date>-gpu-check-<device>)")
    p.add_argument("--only", nargs="+", choices=["tests", "benchmark", "train"], help="run only these steps")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("error: --device cuda asked for, but this machine has no CUDA device; use --device cpu")
    name = device_name(args.device)
    out = args.out or REPO_ROOT / "results" / (
        f"{datetime.date.today()}-gpu-check-{re.sub(r'[^a-z0-9]+', '-', name.lower()).strip('-')}")
    out.mkdir(parents=True, exist_ok=True)
    out = out.resolve()
    if out.is_relative_to(REPO_ROOT):  # the commands (and so summary.json) name no path of this machine
        out = out.relative_to(REPO_ROOT)
    print(f"gpu_check on {name}, writing {out}", file=sys.stderr)
    results = [run_step(step, command, limit, out) for step, command, limit in steps(args.device, args.quick, out)
               if args.only is None or step in args.only]
    summary = {"device": name, "torch": torch.__version__, "date": str(datetime.date.today()),
               "quick": args.quick, "steps": results}
    (REPO_ROOT / out / "summary.json").write_text(json.dumps(summary, indent=1))
    lines = [f"# gpu_check on {name}", "", f"torch {torch.__version__}, {summary['date']}" + (", --quick" if args.quick
             else ""), "", "| step | status | wall s | log |", "|---|---|---|---|"]
    lines += [f"| {r['step']} | {r['status']} | {r['wall_s']} | [{r['log']}]({r['log']}) |" for r in results]
    (REPO_ROOT / out / "summary.md").write_text("\n".join(lines) + "\n")
    return 0 if all(r["status"] == "passed" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
