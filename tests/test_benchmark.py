"""scripts/benchmark.py: --quick end to end (files, every metric present and finite), its numbers against
counts made from the per-run cycle logs, and the eager/compiled step swapping (with a stand-in compiler)."""
import importlib.util
import json
import math
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import engine
import generate
from scripts import bench_common, benchmark

REPO_ROOT = Path(__file__).resolve().parent.parent
QUICK_TREES = {"chain-5": (6, 5), "paper": (26, 5), "dynamic-4-3-8": (9, 3)}  # tree -> (nodes, depth)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("benchmark") / "quick"
    proc = subprocess.run([sys.executable, "scripts/benchmark.py", "--quick", "--threads", "1", "--out", str(out)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, json.loads((out / "benchmark.json").read_text())


def is_finite(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def test_quick_writes_every_file_and_metric(quick):
    out, result = quick
    plots = ["speedup.png", "speedup-dist.png", "tau.png"]
    assert sorted(p.name for p in out.iterdir()) == sorted(["benchmark.json", "benchmark.md"] + plots)
    assert all((out / name).stat().st_size > 0 for name in plots)
    text = (out / "benchmark.md").read_text()
    assert all(f"![{name}]({name})" in text for name in plots)  # the plots beside it
    meta = result["metadata"]
    for key in ("machine", "threads", "command", "git", "max_new_tokens", "cache_len", "reference_method", "methods"):
        assert key in meta
    assert meta["threads"] == 1 and meta["max_new_tokens"] == 16 and meta["reference_method"] == "vanilla-fp32-eager"
    methods = {m["name"]: m for m in meta["methods"]}
    expected = {f"vanilla-{d}-eager" for d in ("fp32", "bf16")} | \
        {f"eagle-{t}-{d}-eager" for t in QUICK_TREES for d in ("fp32", "bf16")}
    assert set(methods) == expected
    assert [h["input_mode"] for h in meta["heads"]] == ["shifted"]  # the quick head, recorded once
    assert meta["plots"] == plots
    assert "## EAGLE heads" in text
    assert text.count("| method | decode | sample | draft | verify | accept | commit |") == 2
    assert len(result["runs"]) == len(methods) * 2 * 2 * 2  # methods x 2 questions x 2 turns x 2 temperatures
    assert [(g["dataset"], g["temperature"]) for g in result["summary"]] == [("mtbench", 0.0), ("mtbench", 1.0)]
    for g in result["summary"]:
        assert g["baseline"] in methods and methods[g["baseline"]]["kind"] == "vanilla"
        assert set(g["methods"]) == set(methods)
        assert set(g["categories"]) == {r["category"] for r in result["runs"]}
        for name, s in g["methods"].items():
            m = methods[name]
            numbers = [s["wall_s"], s["peak_rss_mb"], s["peak_rss_increase_mb"], s["tau"], s["target_forwards"],
                       s["head_forwards"], *s["tokens_per_s"].values(), *s["speedup"].values()]
            assert all(is_finite(x) for x in numbers), (name, s)
            assert s["runs"] == 4 and s["new_tokens"] == 4 * 16
            phases = {"eagle": ["draft", "verify", "accept", "commit"], "vanilla": ["decode", "sample"]}[m["kind"]]
            assert list(s["phase_ms"]) == phases and all(is_finite(t) and t > 0 for t in s["phase_ms"].values())
            if m["kind"] == "eagle":
                assert (m["num_nodes"], m["max_depth"]) == QUICK_TREES[m["tree"]]
                assert len(s["acceptance_by_depth"]) == m["max_depth"]
                assert all(is_finite(a) for a in s["acceptance_by_depth"] + [s["mean_accept_length"]])
                assert s["tau"] > 1  # the quick head is built to be often right
            if m["tree"] == "chain-5":  # alpha_n is undefined only when no cycle accepted n tokens
                accept = [a for r in result["runs"] if r["method"] == name and r["temperature"] == g["temperature"]
                          for a in r["accept_lengths"]]
                assert len(s["n_alpha"]) == 5
                for n, alpha in enumerate(s["n_alpha"]):
                    assert (is_finite(alpha) and 0 <= alpha <= 1) if any(a >= n for a in accept) else alpha is None
                if g["temperature"] == 0:
                    assert all(is_finite(a) for a in s["n_alpha"])
            if g["temperature"] == 0 and name != "vanilla-fp32-eager" and name != "vanilla-bf16-eager":
                assert s["outputs_match_vanilla"]["compared"] == 4
                assert s["outputs_match_vanilla"]["reference"] == f"vanilla-{m['dtype']}-eager"
    for r in result["runs"]:
        assert all(is_finite(r[k]) for k in ("time_s", "prefill_s", "tokens_per_s", "speedup", "peak_rss_mb"))


def test_greedy_eagle_reproduces_vanilla_fp32(quick):
    _, result = quick
    greedy = next(g for g in result["summary"] if g["temperature"] == 0)
    for name, s in greedy["methods"].items():
        if name.startswith("eagle") and "-fp32-" in name:
            assert s["outputs_match_vanilla"]["matched"] == s["outputs_match_vanilla"]["compared"], name
    for r in result["runs"]:
        if r["match_vanilla"]:
            assert r["match_prefix"] == r["new_tokens"]


def test_tau_and_acceptance_agree_with_cycle_logs(quick):
    _, result = quick
    methods = {m["name"]: m for m in result["metadata"]["methods"]}
    for r in result["runs"]:
        m = methods[r["method"]]
        if m["kind"] == "vanilla":  # one token per decode forward, after the prefill's
            assert r["committed"] == r["target_forwards"] == r["new_tokens"] - 1 and r["tau"] == 1.0
            continue
        accept = r["accept_lengths"]
        assert len(accept) == r["target_forwards"]  # one verify per cycle
        assert all(0 <= a <= m["max_depth"] for a in accept)
        assert r["committed"] == sum(a + 1 for a in accept)
        assert r["tau"] == pytest.approx(r["committed"] / r["target_forwards"])
        # the committed tokens after the prefill's cover the output; only the last cycle may overshoot
        assert r["committed"] - (accept[-1] + 1) < r["new_tokens"] - 1 <= r["committed"]
        # head forwards: the prompt catch-up, per cycle one per drafted level (max_depth - 1) and the commit
        # update (the last cycle's too: its row keeps the tokens for a follow-up)
        assert r["head_forwards"] == 1 + len(accept) * (m["max_depth"] - 1) + len(accept)
    for g in result["summary"]:
        for name, s in g["methods"].items():
            runs = [r for r in result["runs"] if r["method"] == name and r["temperature"] == g["temperature"]
                    and r["dataset"] == g["dataset"]]
            assert s["target_forwards"] == sum(r["target_forwards"] for r in runs)
            assert s["tau"] == pytest.approx(sum(r["committed"] for r in runs) / s["target_forwards"])
            if methods[name]["kind"] != "eagle":
                continue
            accept = [a for r in runs for a in r["accept_lengths"]]
            assert s["mean_accept_length"] == pytest.approx(np.mean(accept))
            assert sum(s["acceptance_by_depth"]) == pytest.approx(s["mean_accept_length"])  # E[a] = sum P(a >= d)
            assert s["tau"] == pytest.approx(1 + s["mean_accept_length"])
            if s["n_alpha"]:
                # alpha_n = #(a >= n+1) / #(a >= n); their running product is the acceptance at depth n+1
                for n, alpha in enumerate(s["n_alpha"]):
                    reached = sum(a >= n for a in accept)
                    assert alpha == (pytest.approx(sum(a >= n + 1 for a in accept) / reached) if reached else None)
                    if alpha is not None:
                        assert np.prod(s["n_alpha"][: n + 1]) == pytest.approx(s["acceptance_by_depth"][n])


def test_speedups_are_per_prompt_ratios_over_the_fastest_vanilla(quick):
    _, result = quick
    for g in result["summary"]:
        runs = [r for r in result["runs"] if r["temperature"] == g["temperature"] and r["dataset"] == g["dataset"]]
        medians = {name: np.median([r["tokens_per_s"] for r in runs if r["method"] == name]) for name in g["methods"]}
        assert g["baseline"] == max((n for n in medians if n.startswith("vanilla")), key=medians.get)
        base = {(r["question_id"], r["turn"]): r["tokens_per_s"] for r in runs if r["method"] == g["baseline"]}
        for r in runs:
            assert r["tokens_per_s"] == pytest.approx(r["new_tokens"] / r["time_s"])
            assert r["speedup"] == pytest.approx(r["tokens_per_s"] / base[r["question_id"], r["turn"]])
        for name, s in g["methods"].items():
            speedups = [r["speedup"] for r in runs if r["method"] == name]
            assert s["speedup"]["median"] == pytest.approx(np.median(speedups))
            assert s["speedup"]["min"] == pytest.approx(min(speedups))
        assert g["methods"][g["baseline"]]["speedup"]["median"] == pytest.approx(1.0)


def test_per_category_takes_the_first_questions_of_each_category():
    questions = benchmark.load_dataset("mtbench")
    picked = benchmark.select_questions(questions, None, 2)
    categories = list(dict.fromkeys(q.category for q in questions))
    assert len(categories) == 8 and len(picked) == 16
    # in the dataset's order, each question whose category had fewer than two before it
    assert picked == [q for i, q in enumerate(questions) if sum(p.category == q.category for p in questions[:i]) < 2]
    assert benchmark.select_questions(questions, 3, None) == questions[:3]
    assert benchmark.select_questions(questions, 5, 1) == picked[::2][:5]


def test_sharegpt_later_turns_are_held_out_second_turns_after_their_first_exchange():
    """--datasets sharegpt: held-out conversations only (never trained on), each timed at its second user turn with
    the conversation's own first exchange before it, the prompt rendered in that order."""
    from scripts.make_data import HELD_OUT, sharegpt_conversations
    from tokenizer import Tokenizer, ensure_default_model

    items = benchmark.load_dataset("sharegpt")
    assert len(items) >= 40 and len({i.question_id for i in items}) == len(items)
    held_out = list(sharegpt_conversations(HELD_OUT))
    tokenizer = Tokenizer.load(ensure_default_model().parent)
    for item in items[:40]:
        conversation = held_out[int(item.question_id.removeprefix("sharegpt-"))]
        assert item.history == conversation[:2] and item.turns == [conversation[2]["content"]]
        prompt = bench_common.render(tokenizer, item.turns, [], item.history)
        assert prompt == tokenizer.encode_chat(conversation[:3]) and len(prompt) <= 1024


def test_turns_keeps_the_first_turns_of_each_question(tmp_path):
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "math", "turns": ["What is 2+2?", "And 3+3?"]}))
    threads = torch.get_num_threads()
    try:
        result = benchmark.main(["--quick", "--questions", str(questions), "--turns", "1", "--modes", "eager",
                                 "--dtypes", "fp32", "--methods", "vanilla-fp32-eager", "--temperatures", "0",
                                 "--max_new_tokens", "4", "--threads", "1", "--out", str(tmp_path / "t")])
    finally:
        torch.set_num_threads(threads)
    assert [run["turn"] for run in result["runs"]] == [1]


@pytest.mark.parametrize("same_length", [False, True])
def test_same_length_runs_ignore_the_stop_tokens(tmp_path, monkeypatch, same_length):
    """--same_length: every run is given no stop token (each writes --max_new_tokens), recorded in benchmark.md;
    without it the runs stop at the tokenizer's stop tokens."""
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "math", "turns": ["What is 2+2?"]}))
    given = []
    real = benchmark.timed_run
    monkeypatch.setattr(benchmark, "timed_run", lambda runner, prompt, n, sampling, stop_ids, device:
                        given.append(set(stop_ids)) or real(runner, prompt, n, sampling, stop_ids, device))
    threads = torch.get_num_threads()
    try:
        benchmark.main(["--quick", "--questions", str(questions), "--modes", "eager", "--dtypes", "fp32",
                        "--methods", "vanilla-fp32-eager", "--temperatures", "1", "--max_new_tokens", "4",
                        "--threads", "1", "--out", str(tmp_path / "t")] + (["--same_length"] if same_length else []))
    finally:
        torch.set_num_threads(threads)
    assert given and all((s == set()) == same_length for s in given)
    assert ("--same_length: stop tokens ignored" in (tmp_path / "t" / "benchmark.md").read_text()) == same_length


def test_n_alpha_and_acceptance_helpers():
    accept = [0, 1, 2, 5]
    assert benchmark.n_alpha(accept, 4) == [3 / 4, 2 / 3, 1 / 2, 1.0, 1.0]
    assert benchmark.n_alpha([0, 0], 2) == [0.0, None, None]  # undefined, never a division by zero
    s = benchmark.acceptance_summary(accept, 5)
    assert s["tau"] == 3.0 and s["acceptance_by_depth"] == [3 / 4, 2 / 4, 1 / 4, 1 / 4, 1 / 4]


def test_compiled_methods_use_the_compiled_steps_and_categories(tmp_path, monkeypatch):
    """A stand-in for torch.compile: compiled (frozen, autotuned) methods must call the compiled steps, eager ones
    never, frozen ones with inductor's freezing on, autotuned ones with max-autotune too, and generate's eager steps
    are its module functions throughout. Also --questions with categories."""
    calls, frozen_calls = [], []

    def fake_compile(fn, **options):
        def compiled(*args, **kwargs):
            calls.append(fn.__name__)
            frozen_calls.append((torch._inductor.config.freezing, torch._inductor.config.max_autotune))
            return fn(*args, **kwargs)
        return compiled

    ran = []
    original_run = benchmark.OurRunner.run

    def run(self, *args, **kwargs):
        before = len(calls)
        result = original_run(self, *args, **kwargs)
        ran.append((self.method.name, len(calls) - before, set(frozen_calls[before:])))
        return result

    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(benchmark.OurRunner, "run", run)
    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps(q) for q in [
        {"question_id": 1, "category": "math", "turns": ["What is 2+2?", "And 3+3?"]},
        {"question_id": 2, "category": "poetry", "turns": ["A haiku about owls."]}]))
    threads = torch.get_num_threads()
    try:
        result = benchmark.main(["--quick", "--questions", str(questions), "--modes", "eager", "compiled", "frozen", "autotuned",
                                 "--dtypes", "fp32", "--trees", "chain-3", "--temperatures", "0",
                                 "--max_new_tokens", "6", "--threads", "1", "--out", str(tmp_path / "c")])
    finally:
        torch.set_num_threads(threads)
    eager = generate.EAGER
    assert (eager.decode, eager.verify, eager.draft, eager.head_update, eager.prefill, eager.head_prefill) == (
        engine.decode_rows, engine.verify_rows, engine.draft_step, engine.update_rows, engine.prefill_row,
        engine.update_rows)
    assert {name for name, *_ in ran} == {f"{kind}-fp32-{mode}" for kind in ("vanilla", "eagle-chain-3")
                                          for mode in ("eager", "compiled", "frozen", "autotuned")}
    settings = {"eager": set(), "compiled": {(False, False)}, "frozen": {(True, False)}, "autotuned": {(True, True)}}
    for name, n_calls, config in ran:
        assert (n_calls > 0) == (not name.endswith("eager")), (name, n_calls)
        assert config == settings[name.rsplit("-", 1)[1]], (name, config)
    group = result["summary"][0]
    assert group["dataset"] == "q" and set(group["categories"]) == {"math", "poetry"}
    assert len(result["runs"]) == 8 * 3  # 8 methods x (2 + 1 turns)
    assert {r["match_reference"] for r in result["runs"] if r["method"] == "eagle-chain-3-fp32-frozen"} == {
        "vanilla-fp32-frozen"}
    assert all(s["outputs_match_vanilla"]["matched"] == 3
               for name, s in group["methods"].items() if name != "vanilla-fp32-eager")


def quick_with(monkeypatch, tmp_path, add, argv) -> dict:
    """benchmark.main --quick on one question, 8 new tokens, 1 thread, into tmp_path/a, after add(checkpoint,
    head, config) has put files beside the quick model it builds (a profile, another head)."""
    real_build = benchmark.build_quick_checkpoint

    def build(out_dir):
        checkpoint, head = real_build(out_dir)
        add(checkpoint, head, generate.ModelArgs.from_checkpoint_dir(Path(checkpoint).parent))
        return checkpoint, head

    monkeypatch.setattr(benchmark, "build_quick_checkpoint", build)
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "x", "turns": ["Name three owls."]}))
    threads = torch.get_num_threads()
    try:
        return benchmark.main(["--quick", "--questions", str(questions), *argv, "--max_new_tokens", "8",
                               "--threads", "1", "--out", str(tmp_path / "a")])
    finally:
        torch.set_num_threads(threads)


def test_auto_tree_and_its_prediction_against_measurement(tmp_path, monkeypatch):
    """--trees auto takes generate.py's --tree auto choice at each precision (this machine's cost profile
    under $HOME, the head's acceptance.json); every compiled static tree gets its predicted tau and speedup
    over vanilla beside the measured ones. torch.compile is stood in for (no inductor build)."""
    import tuning

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(torch, "compile", lambda fn, **options: fn)
    rows = {"1": 10.0, "64": 12.0}
    profile = {"precisions": {"fp32": {"verify_ms": rows, "draft_ms": {"1": 0.5, "64": 0.6},
                                       "update_ms": {"1": 0.5, "9": 0.6}, "move_ms": {"1": 0.1, "9": 0.2}}}}
    p, joint = [[0.7, 0.1]] * 4, [[50, 0, 0, 30], [20, 0, 10, 10]] + [[10, 0, 0, 20]] * 3
    tuning.cost_profile_path(1).parent.mkdir(parents=True)

    def add(checkpoint, head, config):
        Path(head, "acceptance.json").write_text(json.dumps({"p": p, "lookup": {"joints": [joint] * 3}}))
        tuning.cost_profile_path(1).write_text(json.dumps({**profile, "model": tuning.profile_model(config)}))

    result = quick_with(monkeypatch, tmp_path, add, ["--modes", "compiled", "--dtypes", "fp32", "--trees", "auto",
                                                     "c1l2=chain-1+lookup-2", "--temperatures", "0", "1"])
    chosen = tuning.auto_tree(p, tuning.CycleCosts.from_profile(profile, "fp32"), margin=tuning.AUTO_TREE_MARGIN,
                            lookup_joints=[joint] * 3)
    predicted = result["summary"][0]["predicted"]
    assert set(predicted) == {"eagle-auto-fp32-compiled", "eagle-c1l2-fp32-compiled"}
    auto = predicted["eagle-auto-fp32-compiled"]
    assert auto["tree"] == chosen.spec and auto["predicted_tau"] == pytest.approx(chosen.tau)
    assert auto["predicted_speedup"] == pytest.approx(chosen.speedup) and auto["over"] == "vanilla-fp32-compiled"
    assert all(q["measured_tau"] >= 1 and q["measured_speedup"] > 0 for q in predicted.values())
    assert all(s["outputs_match_vanilla"]["matched"] == 1 for name, s in result["summary"][0]["methods"].items()
               if name.startswith("eagle"))
    assert "| eagle-c1l2-fp32-compiled | `chain-1+lookup-2` |" in (tmp_path / "a" / "benchmark.md").read_text()
    # at temperature > 0 auto runs the tree generate.py takes there: no context branch
    sampled = tuning.auto_tree(p, tuning.CycleCosts.from_profile(profile, "fp32"), margin=tuning.AUTO_TREE_MARGIN)
    assert "+lookup-" in chosen.spec and sampled.spec != chosen.spec
    trees_run = {(r["temperature"], r["tree"]) for r in result["runs"] if r["method"] == "eagle-auto-fp32-compiled"}
    assert trees_run == {(0.0, chosen.spec), (1.0, sampled.spec)}
    assert f"`{chosen.spec}` greedy, `{sampled.spec}` at temperature > 0" in (tmp_path / "a" / "benchmark.md").read_text()


def test_tensor_mb_counts_every_quantized_weight():
    """torchao weights are wrapper tensors with no storage of their own: their inner tensors count."""
    from torchao.quantization import quantize_

    import quantize

    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 64, bias=False))
    quantize_(model, quantize.handler_for("int8").config("cpu"))
    size = benchmark.tensor_mb(model) * 2 ** 20
    assert 2 * 64 * 64 <= size <= 2 * (64 * 64 + 64 * 8)  # int8 rows plus a scale per row, both weights


def test_head_record_reads_the_training_budget():
    """The shipped head's budget and held-out accuracy come from its training_record.json."""
    record = json.loads((generate.DEFAULT_HEAD / "training_record.json").read_text())
    row = benchmark.head_record(str(generate.DEFAULT_HEAD), generate.EagleHead.load(generate.DEFAULT_HEAD))
    assert row["input_mode"] == "shifted" and row["draft_vocab"] == 16384
    assert row["steps"] == record["warm_start"]["total_steps"]  # all runs of a warm-started head
    assert row["tokens_seen"] > 0 and row["wall_s"] > 0 and len(row["heldout_top1"]) == 4


def test_paths_under_the_repository_are_written_relative_to_it(tmp_path):
    assert benchmark.repo_relative(generate.DEFAULT_HEAD) == "heads/SmolLM2-135M-Instruct-eagle"
    assert benchmark.repo_relative(REPO_ROOT / "checkpoints" / "m" / "model.pth") == "checkpoints/m/model.pth"
    assert benchmark.repo_relative(tmp_path) == str(tmp_path.resolve())  # outside it: absolute


def test_default_out_is_a_new_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_common, "REPO_ROOT", tmp_path)
    info = {"processor": "AMD EPYC", "cpu_affinity": 2, "cpu_count": 2, "isa": "avx2"}
    first = benchmark.default_out(info, quick=False)
    assert first.parent == tmp_path / "results" and first.name.endswith("-amd-epyc-2cpu-avx2")
    first.mkdir(parents=True)
    assert benchmark.default_out(info, quick=False) == first.with_name(first.name + "-2")
    assert benchmark.default_out(info, quick=True).parent == tmp_path / "results" / "quick"


def test_instruction_set_names_the_widest_matmul_instruction_set():
    from tuning import instruction_set

    assert instruction_set("model name : X\nflags : fpu avx2 fma avx512f avx512_bf16\n") == "avx512_bf16"
    assert instruction_set("flags : fpu avx2 avx512f amx_tile amx_bf16\n") == "amx"
    assert instruction_set("flags : fpu sse avx2 fma\n") == "avx2"
    assert instruction_set("processor : 0\n") == (platform.machine() or "unknown")
    assert instruction_set("flags : fpu avx2\nvmx flags : avx512f\n") == "avx2"  # the CPU's own flags only
    slug = bench_common.machine_slug({"processor": "AMD EPYC", "cpu_affinity": 2, "cpu_count": 2, "isa": "avx2"})
    assert slug == "amd-epyc-2cpu-avx2"


@pytest.mark.parametrize("precision, lm_head_quantized", [("int4", True), ("int4f", False), ("int8", True)])
def test_quantized_precisions_differ_only_in_the_lm_head(tmp_path, precision, lm_head_quantized):
    """int4 quantizes the LM head too (the fastest), int4f keeps it in bf16 (quantize.py's default file)."""
    import quantize
    from model import ModelArgs, Transformer
    from tests.test_quantize import TINY_CONFIG

    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    torch.save(Transformer(ModelArgs.from_config(TINY_CONFIG)).state_dict_for_save(), tmp_path / "model.pth")
    model = benchmark.load_target(tmp_path / "model.pth", precision, "cpu")
    assert model.quantization["mode"] == precision[:4] and model.quantization["lm_head"] == lm_head_quantized
    assert isinstance(model.output, quantize.CPUKernelLinear) == lm_head_quantized
    assert isinstance(model.layers[0].attention.wqkv, quantize.CPUKernelLinear)


def test_missing_llama_cpp_peer_is_skipped_with_its_install_command(tmp_path, monkeypatch, capsys, default_checkpoint):
    """--peers adds llama.cpp's two methods; without llama-cpp-python (the test command never installs it)
    the benchmark drops them, says how to install it, and runs the rest."""
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "math", "turns": ["What is 2+2?"]}))
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else find_spec(name, *a))
    threads = torch.get_num_threads()
    try:
        result = benchmark.main(["--questions", str(questions), "--modes", "eager", "--dtypes", "fp32", "--peers",
                                 "--methods", "vanilla-fp32-eager", "llamacpp*", "--temperatures", "0",
                                 "--max_new_tokens", "2", "--threads", "1", "--out", str(tmp_path / "t")])
    finally:
        torch.set_num_threads(threads)
    err = capsys.readouterr().err
    assert "llamacpp peers skipped: llama_cpp is not installed (pip install llama-cpp-python==" in err
    assert {run["method"] for run in result["runs"]} == {"vanilla-fp32-eager"}


def test_benchmark_frozen_methods_compile_frozen_graphs(tmp_path):
    """benchmark --modes compiled frozen: the frozen methods run graphs of their own with the weights frozen, not
    the default graphs of the same step functions compiled just before in the process (Dynamo keeps graphs on a
    function's code object and handed those over, until generate.compile_step gave each setting its own copy)."""
    from torch._inductor.utils import run_and_get_code

    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "math", "turns": ["What is 2+2?"]}))
    threads = torch.get_num_threads()
    try:
        result, code = run_and_get_code(benchmark.main, [
            "--quick", "--questions", str(questions), "--modes", "compiled", "frozen", "--dtypes", "fp32",
            "--methods", "vanilla-*", "--temperatures", "0", "--max_new_tokens", "4", "--threads", "1",
            "--out", str(tmp_path / "b")])
    finally:
        torch.set_num_threads(threads)
        torch._dynamo.reset()
    assert sum("_frozen_param" in c for c in code) >= 1 and sum("_frozen_param" not in c for c in code) >= 1


def test_a_stopped_run_resumes_where_it_stopped(tmp_path, monkeypatch):
    """--resume keeps the prompts a stopped run finished (each prompt's methods ran together) and runs the rest;
    the whole run's results are those of one straight run's kind; another command's run is refused."""
    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps({"question_id": i, "category": "math", "turns": [f"What is {i}+2?", "And?"]})
                                   for i in range(2)))
    argv = ["--quick", "--questions", str(questions), "--modes", "eager", "--dtypes", "fp32", "--methods",
            "vanilla-fp32-eager", "eagle-chain-5-fp32-eager", "--temperatures", "0", "--max_new_tokens", "4",
            "--threads", "1", "--out", str(tmp_path / "run")]
    real_run, calls = benchmark.timed_run, []

    def stops_midway(*a, **k):  # two prompts (turns) done with both methods, the third stopped midway
        calls.append(1)
        if len(calls) == 6:
            raise KeyboardInterrupt
        return real_run(*a, **k)

    threads = torch.get_num_threads()
    monkeypatch.setattr(benchmark, "timed_run", stops_midway)
    try:
        with pytest.raises(KeyboardInterrupt):
            benchmark.main(argv)
        partial = (tmp_path / "run" / benchmark.PARTIAL).read_text().splitlines()
        assert len(partial) == 1 + 1 + 2  # the command and machine, the warm-up, then the two finished prompts
        first_two = [r for line in partial[2:] for r in json.loads(line)["runs"]]
        with pytest.raises(generate.UsageError, match="another command"):
            benchmark.main(argv[:-2] + ["--max_new_tokens", "5", "--out", str(tmp_path / "run"), "--resume"])
        calls.clear()
        result = benchmark.main(argv + ["--resume"])
    finally:
        torch.set_num_threads(threads)
    assert len(calls) == 2 * (4 - 2)  # the two prompts left, two methods each
    assert len(result["runs"]) == 2 * 4  # the first two prompts' runs as the stopped run measured them
    assert [{k: r[k] for k in first_two[0]} for r in result["runs"][:4]] == first_two
    assert [(r["question_id"], r["turn"]) for r in result["runs"][::2]] == [(str(i), t) for i in range(2) for t in (1, 2)]
    assert result["metadata"]["resumed_prompts"] == 2 and not (tmp_path / "run" / benchmark.PARTIAL).exists()
    assert all(r["match_vanilla"] for r in result["runs"] if r["method"].startswith("eagle"))


def test_shards_gathered_give_the_unsharded_run(tmp_path, monkeypatch):
    """--shard K/N runs every N-th question into its own partial file; the same command with --resume and
    without --shard then writes the results: the same runs (method orders, seeds, outputs) as one process.
    A machine of another CPU family may not continue them."""
    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps({"question_id": i, "category": "math", "turns": [f"What is {i}+2?", "And?"]})
                                   for i in range(2)))
    argv = ["--quick", "--questions", str(questions), "--modes", "eager", "--dtypes", "fp32", "--methods",
            "vanilla-fp32-eager", "eagle-chain-5-fp32-eager", "--temperatures", "0", "1", "--max_new_tokens", "4",
            "--threads", "1"]
    threads = torch.get_num_threads()
    try:
        whole = benchmark.main(argv + ["--out", str(tmp_path / "whole")])
        sharded = argv + ["--out", str(tmp_path / "sharded")]
        assert benchmark.main(sharded + ["--shard", "1/2"]) is None
        assert benchmark.main(sharded + ["--shard=0/2"]) is None
        assert sorted(p.name for p in (tmp_path / "sharded").glob("runs.partial*")) == \
            ["runs.partial-0-of-2.jsonl", "runs.partial-1-of-2.jsonl"]
        with pytest.raises(generate.UsageError, match="another command"):
            benchmark.main(argv[:-4] + ["--max_new_tokens", "5", "--threads", "1", "--out", str(tmp_path / "sharded"),
                                        "--resume"])
        machine_info = benchmark.machine_info
        with monkeypatch.context() as m:
            other_family = lambda device: {**machine_info(device), "cpu_family": "family 0 model 0"}
            m.setattr(benchmark, "machine_info", other_family)
            with pytest.raises(generate.UsageError, match="another machine"):
                benchmark.main(sharded + ["--resume"])
        gathered = benchmark.main(sharded + ["--resume"])
        with pytest.raises(generate.UsageError, match="K/N"):
            benchmark.parse_args(sharded + ["--shard", "2/2"])
    finally:
        torch.set_num_threads(threads)
    fields = ("temperature", "question_id", "turn", "method", "order", "new_tokens", "output_sha1")
    key = lambda r: (r["temperature"], r["question_id"], r["turn"], r["method"])
    assert sorted([r[f] for f in fields] for r in gathered["runs"]) == sorted([r[f] for f in fields] for r in whole["runs"])
    assert len(gathered["runs"]) == 2 * 2 * 2 * 2 and len({key(r) for r in gathered["runs"]}) == len(gathered["runs"])
    assert gathered["metadata"]["shards"] == [[0, 2], [1, 2]] and gathered["metadata"]["resumed_prompts"] == 8
    assert all(len(s["warmup_s_each_process"]) == 2 and s["warmup_s"] == max(s["warmup_s_each_process"])
               for s in gathered["metadata"]["setup"].values())  # both shards' starts; warmup_s the slowest
    assert not list((tmp_path / "sharded").glob("runs.partial*"))


def test_an_eagle3_head_runs_under_ablation_heads(tmp_path, monkeypatch):
    """--ablation_heads takes an EAGLE-3 head as generate.py does (its config.json's architectures): greedy
    output equals vanilla's (fp32) and the results name the head's kind."""
    from eagle_head import Eagle3Head

    e3 = tmp_path / "e3"

    def add(checkpoint, head, config):
        torch.manual_seed(0)
        Eagle3Head.for_target(config, feature_layers=(0, 1, config.n_layer)).save(e3)

    result = quick_with(monkeypatch, tmp_path, add, ["--modes", "eager", "--dtypes", "fp32", "--ablation_heads",
                                                     f"e3={e3}", "--ablation_tree", "chain-3", "--methods",
                                                     "vanilla-fp32-eager", "eagle@e3-*", "--temperatures", "0"])
    methods = result["summary"][0]["methods"]
    assert methods["eagle@e3-chain-3-fp32-eager"]["outputs_match_vanilla"]["matched"] == 1
    assert [h["kind"] for h in result["metadata"]["heads"]] == ["EAGLE-3"]
    assert "| EAGLE-3, shifted |" in (tmp_path / "a" / "benchmark.md").read_text()
