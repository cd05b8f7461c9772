"""scripts/gpu_check.py end to end on the CPU (--quick): the logic a lent GPU will run, known good first."""
import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_runs_every_step_on_cpu(tmp_path):
    out = tmp_path / "check"
    proc = subprocess.run([sys.executable, "scripts/gpu_check.py", "--device", "cpu", "--quick", "--out", str(out)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=1200)
    summary = json.loads((out / "summary.json").read_text())
    assert proc.returncode == 0, proc.stderr + "".join((out / r["log"]).read_text()[-2000:] for r in summary["steps"])
    assert [r["step"] for r in summary["steps"]] == ["tests", "benchmark", "train"]
    assert all(r["status"] == "passed" for r in summary["steps"]) and "cpu" in summary["device"]
    tests = (out / "tests.log").read_text()
    assert " passed" in tests and "failed" not in tests and "deselected" in tests  # the device subset ran
    assert (out / "benchmark" / "benchmark.json").is_file() and (out / "train" / "head" / "config.json").is_file()
    assert "| tests | passed |" in (out / "summary.md").read_text()


def test_a_failing_or_slow_step_is_recorded_and_the_next_runs(tmp_path):
    """run_step records a non-zero exit as failed and a step past its limit as timed out, with its log."""
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    import gpu_check

    failed = gpu_check.run_step("bad", [sys.executable, "-c", "print('boom'); raise SystemExit(3)"], 60, tmp_path)
    slow = gpu_check.run_step("slow", [sys.executable, "-c", "import time; time.sleep(30)"], 1, tmp_path)
    ok = gpu_check.run_step("ok", [sys.executable, "-c", "pass"], 60, tmp_path)
    assert (failed["status"], slow["status"], ok["status"]) == ("failed", "timed out after 1 s", "passed")
    assert "boom" in (tmp_path / "bad.log").read_text() and slow["wall_s"] < 20
