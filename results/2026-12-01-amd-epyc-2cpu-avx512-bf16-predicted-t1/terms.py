"""Split each prediction error of benchmark.json into its two terms: tau (acceptance model) and the cycle's
cost relative to a decode step (cost model), measured = the per-phase means of the run.

    python results/2026-12-01-amd-epyc-2cpu-avx512-bf16-predicted-t1/terms.py
"""
import json
from pathlib import Path

result = json.loads((Path(__file__).parent / "benchmark.json").read_text())
for g in result["summary"]:
    if not g.get("predicted"):
        continue
    print(f"## {g['dataset']}, T={g['temperature']:g}\n")
    print("| method | tree | tau pred / meas | error | cycle / decode pred / meas | error | speedup pred / meas | error |")
    print("|---|---|---|---|---|---|---|---|")
    for name, q in g["predicted"].items():
        decode = sum(g["methods"][q["over"]]["phase_ms"].values())
        cycle = sum(g["methods"][name]["phase_ms"].values())
        ratio_pred = q["predicted_tau"] / q["predicted_speedup"]
        print(f"| {name} | `{q['tree']}` | {q['predicted_tau']:.2f} / {q['measured_tau']:.2f} | "
              f"{q['predicted_tau'] / q['measured_tau'] - 1:+.0%} | {ratio_pred:.2f} / {cycle / decode:.2f} | "
              f"{ratio_pred / (cycle / decode) - 1:+.0%} | {q['predicted_speedup']:.2f} / {q['measured_speedup']:.2f} | "
              f"{q['predicted_speedup'] / q['measured_speedup'] - 1:+.0%} |")
    print()
