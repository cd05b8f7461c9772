"""What generate.py --tree auto and --autotune auto choose from this folder's cost profile (costs.json) and the
shipped head's acceptance model, for every precision, compile kind and temperature; beside it, what the matrix
run measured for the kinds it ran (results/2026-12-03-amd-epyc-2cpu-avx512-bf16-matrix, the same CPU family, one
thread: only beside a one-thread profile). Another profile: its path as the argument.

    python results/2026-12-04-cost-model-avx512-bf16-family25/choose.py > results/2026-12-04-cost-model-avx512-bf16-family25/choose.txt
"""
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))
from generate import COMPILE_KINDS, auto_compile_kind, best_tree  # noqa: E402
from tree import CycleCosts  # noqa: E402

profile = json.loads((Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "costs.json").read_text())
acceptance = json.loads((REPO / "heads" / "SmolLM2-135M-Instruct-eagle" / "acceptance.json").read_text())
matrix = json.loads((REPO / "results" / "2026-12-03-amd-epyc-2cpu-avx512-bf16-matrix" / "benchmark.json").read_text())
measured = {(s["temperature"], name): m for s in matrix["summary"] for name, m in s["methods"].items()}
ran = {(r["temperature"], r["method"]): r["tree"] for r in matrix["runs"]}  # the tree each EAGLE method drafted
BENCH_MODE = {"default": "compiled", "autotuned": "autotuned"}  # the kinds the matrix ran, by its mode names

print(f"cost profile: {profile['key']}, CPU {profile['cpu']} {profile['cpu_family']}, {profile['date']}")
for precision in profile["precisions"]:
    print(f"\n{precision}: --autotune auto takes '{auto_compile_kind(profile, precision)}'")
    for kind in COMPILE_KINDS:
        costs = CycleCosts.from_profile(profile, precision, kind=kind)
        for greedy in (True, False):
            best = best_tree(acceptance, costs, greedy)
            choice = best.spec if best.speedup >= 1 else f"plain decoding (best tree {best.spec})"
            line = (f"  {kind:9s} T={0 if greedy else 1}: vanilla step {costs.decode_ms:6.2f} ms, {choice}, "
                    f"predicted tau {best.tau:.2f}, {best.speedup:.2f}x")
            mode = BENCH_MODE.get(kind)
            eagle, vanilla = (measured.get((0.0 if greedy else 1.0, f"{m}-{precision}-{mode}"))
                              for m in ("eagle-auto", "vanilla"))
            if eagle and vanilla and profile["threads"] == 1:
                tree = ran[0.0 if greedy else 1.0, f"eagle-auto-{precision}-{mode}"]
                ratio = eagle["tokens_per_s"]["median"] / vanilla["tokens_per_s"]["median"]
                line += (f"   | matrix ({mode}): {tree} {ratio:.2f}x (median tokens/s over vanilla's), tau {eagle['tau']:.2f}"
                         + (" <- the same tree" if tree == best.spec else ""))
            print(line)
