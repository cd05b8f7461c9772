"""--tree auto's prediction for chain-1 / chain-2 at T=1 and T=0 with the shipped head's acceptance.json and the
shipped AVX-512 BF16 one-thread reference cost profile (int4, autotuned), as generate.auto_tree_choice scores them.

    python results/2026-12-02-amd-epyc-2cpu-avx512-bf16-mtbench80-v10/predict_t1.py
"""
import json
import sys
from pathlib import Path

root = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(root))
from generate import DEFAULT_HEAD, acceptance_p  # noqa: E402
from tree import CycleCosts, predict  # noqa: E402

acceptance = json.loads((DEFAULT_HEAD / "acceptance.json").read_text())
profile = json.loads((DEFAULT_HEAD / "cost_profiles" / "avx512_bf16-t1.json").read_text())
costs = CycleCosts.from_profile(profile, "int4", kind="autotuned")
print(f"T=1 model measured on {acceptance['sampled']['set']}, greedy on {acceptance['set']}")
for greedy in (False, True):
    for spec in ("chain-1", "chain-2"):
        tau, speedup = predict(spec, acceptance_p(acceptance, greedy), costs)
        print(f"T={0 if greedy else 1} {spec}: predicted tau {tau:.2f}, {speedup:.2f}x over vanilla int4 autotuned")
