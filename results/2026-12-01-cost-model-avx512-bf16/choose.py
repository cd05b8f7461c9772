"""The tree tree.auto_tree picks for each precision of this machine's cost model (costs.json, from
scripts/profile_costs.py) with the shipped head's acceptance model (its acceptance.json), and the
predicted tau / speedup of the fixed trees the benchmarks ran, for comparison.

    python results/2026-12-01-cost-model-avx512-bf16/choose.py > results/2026-12-01-cost-model-avx512-bf16/choose.txt
"""
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))
from tree import CycleCosts, auto_tree, build_tree, parse_paths, tree_tau  # noqa: E402

FIXED = ["chain-1", "chain-2", "chain-3", "[[0], [1], [0, 0]]", "paper"]

profile = json.loads((Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "costs.json").read_text())
acceptance = json.loads((REPO / "heads" / "SmolLM2-135M-Instruct-eagle" / "acceptance.json").read_text())
p = acceptance["p"]
print(f"cost model: {profile['key']} ({profile['cpu']}), {profile['date']}; overhead {profile['overhead_ms']} ms/cycle, "
      f"{profile['decode_overhead_ms']} ms/vanilla step")
print(f"acceptance: {acceptance['set']}, {acceptance['answer_tokens']} answer tokens, head sha256 "
      f"{acceptance['head_weights_sha256']}, {acceptance['date']}")
for precision in profile["precisions"]:
    costs = CycleCosts.from_profile(profile, precision)
    print(f"\n{precision}: vanilla step {costs.decode_ms:.2f} ms")
    paths, tau, speedup = auto_tree(p, costs)
    t = build_tree(paths)
    widths = [b - a for a, b, _ in t.levels]
    print(f"  auto: {len(paths)} draft nodes, depth {t.max_depth}, level widths {widths}, predicted tau {tau:.3f}, "
          f"cycle {costs.cycle_ms(paths):.2f} ms, speedup {speedup:.3f}")
    print(f"  auto paths: {paths}")
    for spec in FIXED:
        q = parse_paths(spec)
        tau_q = tree_tau(q, p)
        print(f"  {spec:20s} tau {tau_q:.3f}, cycle {costs.cycle_ms(q):6.2f} ms, speedup {tau_q / costs.cycle_ms(q) * costs.decode_ms:.3f}")

# The cost model against measured benchmark runs (T=0): each EAGLE method's measured cycle (sum of its
# phase means) and the vanilla step against the model's, and the speedup the model predicts from the
# run's own measured tau against the measured one; tau predicted from the held-out acceptance model.
RUNS = ["results/2026-11-30-amd-epyc-2cpu-avx512-bf16-mtbench80-v8/benchmark.json",
        "results/2026-12-01-cost-model-avx512-bf16/benchmark-bf16/benchmark.json"]
PRECISION = {"fp32": "fp32", "bf16": "bf16", "int8": "int8", "int4": "int4"}
for run in RUNS:
    path = REPO / run
    if not path.is_file():
        continue
    bench = json.loads(path.read_text())
    trees = {m["name"]: m for m in bench["metadata"]["methods"]}
    print(f"\n{run} (T=0):")
    for s in bench["summary"]:
        if s["temperature"] != 0:
            continue
        base = s["methods"][s["baseline"]]
        costs = CycleCosts.from_profile(profile, PRECISION[trees[s["baseline"]]["dtype"]])
        print(f"  {s['baseline']}: step {sum(base['phase_ms'].values()):.2f} ms measured, {costs.decode_ms:.2f} model")
        for name, m in s["methods"].items():
            meta = trees.get(name)
            if not meta or meta["kind"] != "eagle" or "@" in name or meta["tree"].startswith("dynamic"):
                continue
            q = parse_paths(meta["tree"])
            predicted = m["tau"] / costs.cycle_ms(q) * costs.decode_ms
            print(f"  {name}: cycle {sum(m['phase_ms'].values()):.2f} ms measured, {costs.cycle_ms(q):.2f} model; "
                  f"tau {m['tau']:.3f} measured, {tree_tau(q, p):.3f} held-out model; speedup {m['speedup']['median']:.3f} "
                  f"median / {m['speedup']['pooled']:.3f} pooled measured, {predicted:.3f} model at the measured tau")
