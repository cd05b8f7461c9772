"""scripts/benchmark_batch.py (scripts/benchmark.py --batch_sizes): --quick end to end, its summary against its
own runs, the memory-budget arithmetic and its input errors."""
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from scripts import benchmark_batch

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("benchmark_batch") / "quick"
    proc = subprocess.run([sys.executable, "scripts/benchmark.py", "--batch_sizes", "1", "3", "2", "--quick",
                           "--tree", "paper", "--out", str(out)], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, json.loads((out / "benchmark.json").read_text())


def test_quick_runs_every_batch_size_and_method(quick):
    out, result = quick
    meta, summary = result["metadata"], result["summary"]
    assert (out / "benchmark.md").read_text().startswith("# Batched throughput")
    assert meta["prompts"] == 4 and meta["groups"] == 2 and meta["precision"] == "fp32"
    rows = summary["by_batch_size"]
    assert [r["batch_size"] for r in rows] == [1, 2, 3]
    runs = result["runs"]
    assert len(runs) == 3 * 2 * 2  # batch sizes x methods x groups
    for r in rows:
        assert r["tree"] == "paper" and r["tau"] > 1  # the quick head is often right
        assert r["vanilla_tokens_per_s"] > 0 and r["eagle_tokens_per_s"] > 0
        # fp32 greedy: every prompt's text at every batch size is vanilla batch 1's
        assert r["outputs_match"] == {"vanilla": 4, "eagle": 4}
        assert r["divergence"]["vanilla"]["diverged"] == r["divergence"]["eagle"]["diverged"] == 0
        assert r["tokens"]["vanilla"] == r["tokens"]["eagle"] == rows[0]["tokens"]["vanilla"]
    # memory grows by one row's KV caches per batch row; EAGLE holds the head (and its cache) besides
    m1, m3 = rows[0]["memory"], rows[2]["memory"]
    for name in ("vanilla", "eagle"):
        assert m3[name]["total_mb"] == pytest.approx(m1[name]["total_mb"] + 2 * m1[name]["per_row_mb"], rel=1e-6)
    assert m1["eagle"]["total_mb"] > m1["vanilla"]["total_mb"]


def test_summary_is_made_of_the_runs(quick):
    _, result = quick
    runs, summary = result["runs"], result["summary"]
    fastest = max((r["vanilla_tokens_per_s"], r["batch_size"]) for r in summary["by_batch_size"])
    assert summary["fastest_vanilla_batch_size"] == fastest[1]
    for row in summary["by_batch_size"]:
        of = {name: sorted((r for r in runs if r["batch_size"] == row["batch_size"] and r["method"] == name),
                           key=lambda r: r["group"]) for name in ("vanilla", "eagle")}
        assert row["vanilla_tokens_per_s"] == statistics.median(r["tokens_per_s"] for r in of["vanilla"])
        assert row["speedup"] == pytest.approx(statistics.median(
            e["tokens_per_s"] / v["tokens_per_s"] for e, v in zip(of["eagle"], of["vanilla"])))
        assert row["eagle_over_fastest_vanilla"] == pytest.approx(row["eagle_tokens_per_s"] / fastest[0])
    budget = summary["memory_budget"]  # default: vanilla's memory at the largest batch size, where vanilla fits
    assert budget["budget_mb"] == summary["by_batch_size"][-1]["memory"]["vanilla"]["total_mb"]
    assert budget["vanilla"]["measured_batch_size"] == 3 and budget["vanilla"]["largest_fit"] == 3
    assert budget["eagle"]["largest_fit"] < 3  # the head and its cache take room


def test_divergence_finds_the_first_differing_token_and_its_tie():
    """divergence: None for equal texts; else the first differing index and the target's top-2 logit gap there,
    which (a forward of its own) is the gap of the logits a Session decodes from."""
    import torch

    from test_eagle import tiny_target

    model = tiny_target()
    model.setup_caches(1, 64)
    prompt = [1, 2, 3]
    pos = torch.arange(5)
    with torch.no_grad():
        logits, _ = model(torch.tensor([prompt + [4, 5]]), pos, mask=benchmark_batch.causal_mask(pos, 5))
    top = logits[0, -1].topk(2)
    assert benchmark_batch.divergence(model, prompt, [4, 5, 6], [4, 5, 6]) is None
    found = benchmark_batch.divergence(model, prompt, [4, 5] + [top.indices[0].item()], [4, 5, top.indices[1].item()])
    assert found["at"] == 2 and found["top2_are_the_two"]
    assert found["top2_gap"] == pytest.approx(float(top.values[0] - top.values[1]), abs=1e-5)
    summary = benchmark_batch.divergence_summary([None, found])
    assert summary["diverged"] == 1 and summary["top2_are_the_two"] == 1


def test_largest_fit_is_fixed_memory_plus_rows():
    mem = {"fixed_mb": 100.0, "per_row_mb": 30.0}
    assert benchmark_batch.largest_fit(mem, 100.0) == 0
    assert benchmark_batch.largest_fit(mem, 189.9) == 2 and benchmark_batch.largest_fit(mem, 190.0) == 3


@pytest.mark.parametrize("bad, message", [(["--batch_sizes", "0"], "must be >= 1"),
                                          (["--batch_sizes", "2", "--questions", "missing.jsonl"], "not found")])
def test_bad_input_is_one_line(bad, message):
    proc = subprocess.run([sys.executable, "scripts/benchmark.py", *bad], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0 and message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
