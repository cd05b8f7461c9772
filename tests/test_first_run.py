"""scripts/first_run.py: generate.py --compile with and without --eagle, as a user runs them, one process each."""
import json
import subprocess
import sys
from pathlib import Path

from scripts.first_run import STATS, main

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_stats_line_is_generate_pys():
    m = STATS.match("64 tokens in 1.25 s: 51.2 tokens/s, time to first token 250 ms")
    assert m and (m[1], m[2], m[3]) == ("64", "1.25", "250")


def test_quick_first_runs_compare_decode_rates_and_fp32_greedy_texts(tmp_path):
    result = main(["--quick", "--precisions", "fp32", "--out", str(tmp_path / "out")])
    (run,) = result["runs"]
    s = run["summary"]
    assert (run["precision"], run["autotune"], run["temperature"]) == ("fp32", "off", 0.0)
    assert len(run["vanilla"]["prompts"]) == len(run["eagle"]["prompts"]) == 2 == len(s["ratios"])
    assert s["same_text"] and run["vanilla"]["text"].strip()  # lossless: greedy fp32 EAGLE prints vanilla's answers
    assert "prompts.txt" in run["vanilla"]["flags"]  # the temporary folder is not recorded
    assert s["vanilla_rate"] > 0 and s["eagle_rate"] > 0 and s["min"] <= s["median"]
    assert any(line.startswith("Compiling") for line in run["eagle"]["choices"])  # compiled before it answered
    assert "| fp32 | off | 0 |" in (tmp_path / "out" / "first_run.md").read_text()
    resumed = main(["--quick", "--precisions", "fp32", "--out", str(tmp_path / "out"), "--resume"])
    assert resumed["runs"] == json.loads(json.dumps(result["runs"]))  # nothing ran again
    assert resumed["metadata"]["git"] == result["metadata"]["git"] and "resumed" not in resumed["metadata"]


def test_bad_arguments_fail_in_one_line():
    done = subprocess.run([sys.executable, "scripts/first_run.py", "--limit", "0"], cwd=REPO_ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 1 and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
