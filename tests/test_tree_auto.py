"""tuning.auto_tree and its pieces: the greedy expansion against brute force over every tree of up to 7
draft nodes, the shape of the chosen tree under flat and steep cost curves, and the predicted tau
against a Monte-Carlo simulation of greedy acceptance. Synthetic profiles only; no model runs."""
import json
import random

import pytest

import tree
import tuning
from tree import build_tree
from tuning import CycleCosts, accepted_depth, along, auto_tree, greedy_order, tree_tau


def forests(k: int):
    """Every ordered forest of k nodes, as paths of child ranks (Catalan(k) of them)."""
    if k == 0:
        yield []
        return
    for first in range(1, k + 1):
        for below in forests(first - 1):
            for rest in forests(k - first):
                yield [(0,)] + [(0,) + q for q in below] + [(q[0] + 1,) + q[1:] for q in rest]


def random_acceptance(rng: random.Random, depth: int = 7, ranks: int = 7) -> list:
    """p[d][r], decreasing in rank, each row summing to < 1 (the rest: the target's token is not drafted)."""
    p = []
    for _ in range(depth):
        row = sorted((rng.random() ** 2 for _ in range(ranks)), reverse=True)
        scale = rng.uniform(0.3, 0.97) / sum(row)
        p.append([v * scale for v in row])
    return p


def costs(verify, draft=0.0, update=0.0, move=0.0, overhead=0.0) -> CycleCosts:
    """A CycleCosts from functions of the row count (or constants), sampled at 1..65 rows."""
    f = {name: (v if callable(v) else (lambda n, v=v: v)) for name, v in
         dict(verify=verify, draft=draft, update=update, move=move).items()}
    return CycleCosts(*({n: f[name](n) for n in range(1, 66)} for name in ("verify", "draft", "update", "move")),
                      overhead_ms=overhead)


def test_forests_are_every_valid_tree():
    catalan = [1, 1, 2, 5, 14, 42, 132, 429]
    for k in range(8):
        trees = list(forests(k))
        assert len(trees) == catalan[k] == len({frozenset(t) for t in trees})
        for paths in trees[:50] if k else []:
            build_tree([list(q) for q in paths])  # valid: parents present, ranks contiguous


def test_greedy_order_is_the_best_tau_for_every_size():
    """Under a rank-decreasing positional model, the first n nodes of the greedy expansion have the
    highest tau of all trees of n nodes (brute force up to 7), also under a depth cap."""
    rng = random.Random(0)
    all_trees = {k: list(forests(k)) for k in range(1, 8)}
    for _ in range(20):
        p = random_acceptance(rng)
        for cap in (1, 2, 3, 7):
            order = greedy_order(p, 7, cap)
            assert all(len(q) <= cap for q in order)
            for k in range(1, 8):
                best = max(tree_tau(t, p) for t in all_trees[k] if max(map(len, t)) <= cap)
                assert tree_tau(order[:k], p) == pytest.approx(best, abs=1e-12)
                build_tree(order[:k])


@pytest.mark.parametrize("seed", range(6))
def test_auto_tree_matches_brute_force(seed):
    """With draft costs that do not depend on the level width, auto_tree's tree has the highest predicted
    speedup over all trees of up to 7 draft nodes."""
    rng = random.Random(seed)
    p = random_acceptance(rng)
    decode = 10.0
    slope, curve = rng.uniform(0.0, 3.0), rng.uniform(1.0, 1.6)  # from nearly flat to steep
    c = costs(lambda n: decode + slope * (n - 1) ** curve, draft=rng.uniform(0.2, 3.0), update=rng.uniform(0.5, 2),
              move=lambda n: 0.05 * n, overhead=rng.uniform(0, 1))
    paths, tau, speedup, _ = auto_tree(p, c, max_nodes=7)
    brute = max((tree_tau(t, p) / c.cycle_ms(t) * c.decode_ms, t) for k in range(1, 8) for t in forests(k))
    assert speedup == pytest.approx(brute[0], rel=1e-12)
    assert tau == pytest.approx(tree_tau(paths, p)) and speedup == pytest.approx(tau / c.cycle_ms(paths) * decode)
    build_tree(paths)


def test_flat_costs_choose_a_wide_deep_tree():
    p = [[0.6, 0.15, 0.08, 0.05, 0.03, 0.02, 0.01, 0.01]] * 8
    paths, tau, speedup, _ = auto_tree(p, costs(10.0, draft=0.1, update=0.5), max_nodes=64)
    t = build_tree(paths)
    widths = [b - a for a, b, _ in t.levels]
    assert len(paths) >= 48 and t.max_depth >= 5 and widths[0] >= 4 and max(widths) >= 8
    assert speedup > 2 and tau > 3


def test_steep_costs_choose_a_short_chain():
    """Each node costing most of a decode step: chain-1 (or nothing pays: speedup < 1)."""
    p = [[0.6, 0.15, 0.08, 0.05]] * 8
    paths, tau, speedup, _ = auto_tree(p, costs(lambda n: 10.0 + 6.0 * (n - 1), draft=1.5, update=1.2))
    assert paths == [[0]] and tau == pytest.approx(1.6)
    assert speedup == pytest.approx(1.6 * 10 / (16 + 1.2))  # < 1: the caller should decode plainly
    # cheaper second row, dearer after (the int4 kernel's shape): a chain still
    paths, _, speedup, _ = auto_tree(p, costs(lambda n: 10.0 * (1, 1.1, 1.4, 1.6)[n - 1] if n <= 4 else 4.0 * n,
                                           draft=1.5, update=1.2))
    assert all(r == 0 for q in paths for r in q) and len(paths) <= 2 and speedup > 1


def test_tau_matches_monte_carlo_acceptance():
    """Draw the target's token rank at each depth from p (rank len(p[d]) = none of the drafts), walk the
    chosen tree greedily: the mean committed tokens per cycle agree with tree_tau within 4 standard errors."""
    rng = random.Random(1)
    p = [[a * 0.97 ** d for a in (0.62, 0.14, 0.07, 0.03, 0.02, 0.01)] for d in range(8)]
    paths, tau, _, _ = auto_tree(p, costs(lambda n: 10.0 + 0.3 * n, draft=0.5, update=1.0), max_nodes=40)
    assert len(paths) > 5 and len({q[-1] for q in paths}) > 1  # a real tree, not a chain
    nodes = {tuple(q) for q in paths}
    choices = [list(range(len(row) + 1)) for row in p]
    weights = [row + [1 - sum(row)] for row in p]
    samples = [1 + accepted_depth(nodes, [rng.choices(c, w)[0] for c, w in zip(choices, weights)])
               for _ in range(40000)]
    mean = sum(samples) / len(samples)
    se = (sum((s - mean) ** 2 for s in samples) / len(samples)) ** 0.5 / len(samples) ** 0.5
    assert abs(mean - tau) < 4 * se


def test_accepted_depth_and_along():
    nodes = {(0,), (1,), (0, 0), (0, 1), (0, 0, 0)}
    assert accepted_depth(nodes, [0, 0, 0, 0]) == 3
    assert accepted_depth(nodes, [0, 1, 0]) == 2
    assert accepted_depth(nodes, [1, 0]) == 1
    assert accepted_depth(nodes, [2, 0]) == 0
    points = [(1, 10.0), (2, 11.0), (4, 15.0)]
    assert along(points, 1) == 10.0 and along(points, 3) == 13.0 and along(points, 6) == 19.0
    assert along(points, 0) == 10.0


def test_cycle_cost_counts_levels_and_moves():
    c = costs(lambda n: 10.0 + n, draft=lambda m: 1.0 + 0.1 * m, update=lambda r: 0.5 * r, move=0.25, overhead=0.5)
    # chain-2: verify 3 rows, one draft step of 1 row, update 3 rows, no move
    assert c.cycle_ms([[0], [0, 0]]) == pytest.approx(13 + 1.1 + 1.5 + 0.5)
    # [0], [1], [0, 0], [1, 0]: verify 5, a draft step over the 2 nodes of level 1, update 3, a move
    assert c.cycle_ms([[0], [1], [0, 0], [1, 0]]) == pytest.approx(15 + 1.2 + 1.5 + 0.25 + 0.5)
    assert c.decode_ms == 11.0


def test_from_profile_reads_a_profile_costs_json():
    rows = {"1": 10.0, "2": 11.5, "4": 14.0, "64": 90.0}
    profile = {"overhead_ms": 0.4, "decode_overhead_ms": 0.1, "precisions": {"int4": {
        "verify_ms": rows, "draft_ms": {"1": 1.0, "64": 4.0}, "update_ms": {"2": 1.1, "9": 1.3},
        "move_ms": {"2": 0.2, "9": 0.3}}}}
    c = CycleCosts.from_profile(json.loads(json.dumps(profile)), "int4")
    assert c.decode_ms == pytest.approx(10.1)
    assert c.cycle_ms([[0]]) == pytest.approx(11.5 + 1.1 + 0.4)
    paths, tau, speedup, _ = auto_tree([[0.6, 0.1], [0.5, 0.1]], c)
    assert paths and speedup == pytest.approx(tau / c.cycle_ms(paths) * c.decode_ms)


def test_sampling_host_work_is_priced_at_temperature_above_zero():
    """profile["sampling"] (costs.sampling_costs: the engine's draws and lossless acceptance, timed here) adds to a
    vanilla step and to a cycle by its node count when greedy=False, once per row in a batch; greedy pricing and
    profiles without it are unchanged."""
    import costs

    measured = costs.sampling_costs(512, 128, reps=3)
    assert measured["decode_ms"] >= 0 and set(measured["cycle_ms"]) == {str(n) for n in costs.SAMPLING_NODES}
    assert all(v >= 0 for v in measured["cycle_ms"].values())
    one = {"verify_ms": {"1": 10.0, "4": 11.0}, "draft_ms": {"1": 0.5}, "update_ms": {"2": 1.0, "9": 1.2},
           "move_ms": {"2": 0.1, "9": 0.1}}
    profile = {"overhead_ms": 0.5, "decode_overhead_ms": 0.2, "precisions": {"int4": one},
               "batches": {"2": {"int4": one}}, "sampling": {"decode_ms": 0.3, "cycle_ms": {"2": 0.5, "5": 1.1}}}
    greedy, sampled = (CycleCosts.from_profile(profile, "int4", greedy=g) for g in (True, False))
    assert sampled.decode_ms == pytest.approx(greedy.decode_ms + 0.3)
    assert sampled.cycle_ms([[0]]) == pytest.approx(greedy.cycle_ms([[0]]) + 0.5)  # 2 nodes
    assert sampled.cycle_ms([[0], [0, 0], [0, 0, 0]]) == pytest.approx(greedy.cycle_ms([[0], [0, 0], [0, 0, 0]]) + 0.9)
    two = CycleCosts.from_profile(profile, "int4", 2, greedy=False)
    assert two.decode_ms == pytest.approx(CycleCosts.from_profile(profile, "int4", 2).decode_ms + 2 * 0.3)
    del profile["sampling"]
    assert CycleCosts.from_profile(profile, "int4", greedy=False).cycle_ms([[0]]) == greedy.cycle_ms([[0]])


def test_batched_costs_choose_for_the_batch_size():
    """profile["batches"][B] holds the batched cycle's pieces: from_profile(..., B) reads them and counts the host
    work once per row; where a batch's verify grows with its rows (matmuls no longer spare), the tree chosen for
    batch 8 is smaller than batch 1's, and a batch size the profile lacks is not in it."""
    one = {"verify_ms": {"1": 10.0, "4": 10.6, "8": 11.2, "16": 12.5}, "draft_ms": {"1": 0.5, "8": 0.6},
           "update_ms": {"2": 0.6, "9": 0.7}, "move_ms": {"2": 0.1, "9": 0.1}}
    eight = {"verify_ms": {"1": 14.0, "2": 20.0, "4": 33.0, "8": 60.0, "16": 115.0}, "draft_ms": {"1": 1.0, "8": 3.0},
             "update_ms": {"2": 1.5, "9": 3.0}, "move_ms": {"2": 0.2, "9": 0.4}}
    profile = {"overhead_ms": 0.5, "decode_overhead_ms": 0.2, "precisions": {"int4": one}, "batches": {"8": {"int4": eight}}}
    assert CycleCosts.in_profile(profile, "int4", 8) and not CycleCosts.in_profile(profile, "int4", 4)
    assert not CycleCosts.in_profile(profile, "int8", 8) and not CycleCosts.in_profile(None, "int4")
    c8 = CycleCosts.from_profile(profile, "int4", 8)
    assert c8.decode_ms == pytest.approx(14.0 + 8 * 0.2)
    assert c8.cycle_ms([[0]]) == pytest.approx(20.0 + 1.5 + 8 * 0.5)
    p = [[0.7, 0.1, 0.05, 0.03]] * 6
    best1, best8 = auto_tree(p, CycleCosts.from_profile(profile, "int4")), auto_tree(p, c8)
    assert len(best8.paths) < len(best1.paths) and best1.speedup > best8.speedup


def test_frozen_costs_scale_the_verify_by_the_measured_ratio():
    """--autotune's frozen steps: from_profile(..., kind=K) scales the verify curve by profile_costs.py
    --autotune's K / default ratio at 1, 4 and 16 rows, linear in log(rows) between them and flat outside; a
    kind or precision with no such measurement keeps its curve. A frozen one-row step gains more than
    its rows do here, so the tree chosen frozen is smaller."""
    flat = {"draft_ms": {"1": 0.2, "16": 0.3}, "update_ms": {"2": 0.5, "9": 0.6}, "move_ms": {"2": 0.1, "9": 0.1}}
    profile = {"precisions": {"bf16": {"verify_ms": {"1": 40.0, "2": 60.0, "4": 80.0, "16": 160.0, "32": 320.0}, **flat},
                              "int4": {"verify_ms": {"1": 10.0, "16": 60.0}, **flat}},
               "autotune": {"bf16": {"rows": [1, 4, 16], "default_ms": [40.0, 80.0, 160.0],
                                     "autotuned_ms": [10.0, 40.0, 160.0], "frozen_ms": [20.0, 40.0, 80.0]}}}
    assert tuning.frozen_ratio(profile, "bf16", 1) == pytest.approx(0.25)
    assert tuning.frozen_ratio(profile, "bf16", 2) == pytest.approx(0.375)  # halfway from 1 to 4 rows in log(rows)
    assert tuning.frozen_ratio(profile, "bf16", 8) == pytest.approx(0.75) and tuning.frozen_ratio(profile, "bf16", 32) == 1.0
    assert tuning.frozen_ratio(profile, "int4", 4) == 1.0 and tuning.frozen_ratio(profile, "bf16", 4, "default") == 1.0
    assert tuning.frozen_ratio(profile, "bf16", 16, "frozen") == pytest.approx(0.5)
    default, frozen = (CycleCosts.from_profile(profile, "bf16", kind=k) for k in ("default", "autotuned"))
    assert frozen.decode_ms == pytest.approx(10.0) and default.decode_ms == pytest.approx(40.0)
    assert frozen.verify["2"] == pytest.approx(22.5) and frozen.draft == default.draft
    assert CycleCosts.from_profile(profile, "int4", kind="autotuned").verify == profile["precisions"]["int4"]["verify_ms"]
    p = [[0.8, 0.1]] * 6  # frozen, a step's extra rows cost relatively more (2 rows: 2.25 steps, not 1.5)
    assert len(auto_tree(p, frozen).paths) < len(auto_tree(p, default).paths)


def test_shipped_acceptance_model_is_well_formed():
    """The shipped head's acceptance.json (scripts/train_eagle.py eval) gives probabilities per depth that
    sum to at most 1, from enough nodes, and a tree build_tree accepts."""
    path = tree.__file__.rsplit("/", 1)[0] + "/heads/SmolLM2-135M-Instruct-eagle/acceptance.json"
    try:
        model = json.loads(open(path).read())
    except FileNotFoundError:
        pytest.skip("no acceptance.json beside the shipped head")
    for p, nodes in ((model["p"], model["nodes"]), (model["sampled"]["p"], model["sampled"]["nodes"])):
        assert len(p) >= 4 and all(0 <= v <= 1 for row in p for v in row) and all(sum(row) <= 1 + 1e-9 for row in p)
        assert min(nodes) >= 500
    # sampling accepts a head's first draft less often than its greedy argmax matches (1 - TV(p, q) against p(argmax))
    assert model["sampled"]["p"][0][0] < model["p"][0][0]
    p = model["p"]
    paths, tau, _, _ = auto_tree(p, costs(10.0, draft=0.5, update=1.0), max_nodes=32)
    assert build_tree(paths).num_nodes == 33 and tau > 2


def test_cli_auto_tree_is_chosen_from_the_profile_and_stays_lossless(tmp_path, monkeypatch, capsys):
    """tuning.auto_tree_for reads the head's acceptance.json and this machine's cost profile (under
    $HOME/.cache/eagle-fast, keyed by instruction set, threads and torch): a flat fp32 profile gives a
    deep, wide tree, exactly auto_tree's; without a profile it says how to make one and takes chain-1.
    Greedy EAGLE with the chosen tree equals vanilla (fp32)."""
    import torch

    import generate
    from test_eagle import copycat_head, tiny_prompts, tiny_target, vanilla_greedy

    monkeypatch.setenv("HOME", str(tmp_path))
    model = tiny_target()
    head = copycat_head(model)
    p = [[0.6, 0.15, 0.08, 0.05]] * 6
    (tmp_path / "acceptance.json").write_text(json.dumps({"p": p}))
    assert tuning.auto_tree_for(tmp_path, model, "cpu") == "chain-1"
    assert "tree auto: chain-1 (no cost profile of this machine for fp32" in capsys.readouterr().err
    flat = {str(n): 10.0 for n in (1, 64)}
    profile = {"model": "dim4096-layers32-heads32/8-ffn14336-vocab128256",  # another model's profile: not used
               "precisions": {"fp32": {"verify_ms": flat, "draft_ms": {"1": 0.1, "64": 0.1},
                                       "update_ms": {"1": 0.5, "9": 0.5}, "move_ms": {"1": 0.1, "9": 0.1}}}}
    path = tuning.cost_profile_path(torch.get_num_threads())
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(profile))
    assert tuning.auto_tree_for(tmp_path, model, "cpu") == "chain-1"
    assert "the one there is of another model (dim4096-layers32" in capsys.readouterr().err
    path.write_text(json.dumps({k: v for k, v in profile.items() if k != "model"}))  # a profile that names none
    assert tuning.auto_tree_for(tmp_path, model, "cpu") == "chain-1"
    assert "of another model (not recorded" in capsys.readouterr().err
    profile["model"] = tuning.profile_model(model.config)
    path.write_text(json.dumps(profile))
    chosen = tree.parse_tree(tuning.auto_tree_for(tmp_path, model, "cpu"))
    paths, tau, _, _ = auto_tree(p, CycleCosts.from_profile(profile, "fp32"), margin=tuning.AUTO_TREE_MARGIN)
    assert chosen.num_nodes == len(paths) + 1 >= 20 and chosen.max_depth >= 4
    (tmp_path / "acceptance.json").write_text(json.dumps({"p": p, "lookup": {"joints": [[[0, 0, 10]] * 7] * 2}}))
    assert "+lookup-" in tuning.auto_tree_for(tmp_path, model, "cpu")  # every position matches: a branch
    assert "+lookup-" not in tuning.auto_tree_for(tmp_path, model, "cpu", greedy=False)  # sampling: none
    assert f"tree auto: {paths} (predicted tau {tau:.2f}" in capsys.readouterr().err
    for prompt in tiny_prompts(2, model.config.vocab_size):
        out, _ = generate.Session(model, len(prompt) + 24, head, chosen).generate(prompt, 24, generate.Sampling())
        assert out == vanilla_greedy(model, prompt, 24)


def test_a_margin_prefers_the_smaller_of_nearly_equal_trees():
    """chain-2 predicted 1% faster than chain-1 (every other tree far slower) wins without a margin and
    loses with one of 2%."""
    p = [[0.675, 0.0], [0.566, 0.0]]
    tau1, tau2 = 1.675, 1 + 0.675 + 0.675 * 0.566
    v3 = tau2 * (12.0 + 1.0) / (1.01 * tau1) - 2.0  # chain-2's cycle: verify(3) + a draft step + update
    c = costs(lambda n: {1: 10.0, 2: 12.0, 3: v3}.get(n, 100.0 * n), draft=1.0, update=1.0)
    best, _, s_best, _ = auto_tree(p, c)
    small, _, s_small, _ = auto_tree(p, c, margin=0.02)
    assert best == [[0], [0, 0]] and small == [[0]] and s_best == pytest.approx(1.01 * s_small)


# ---------------------------------------------------------------- the context branch
def chain_model(pairs, depth):
    """The positional model (p) and the joint counts (tuning.context_gain) of positions given as (a, b):
    the head's chain accepted a tokens, a context proposal matched b."""
    joint = [[0] * 9 for _ in range(depth + 1)]
    for a, b in pairs:
        joint[a][b] += 1
    reached = [sum(1 for a, _ in pairs if a >= d) for d in range(depth + 1)]
    return [[reached[d + 1] / reached[d] if reached[d] else 0.0] for d in range(depth)], joint


def test_branch_taus_of_a_chain_are_the_mean_longer_match():
    """For a chain, A = min(head chain, k) exactly, so the predicted tau with a context branch of L nodes
    is the mean over positions of 1 + max(min(a, k), min(b, L)); with L = 0 it is tree_tau."""
    rng = random.Random(1)
    pairs = [(min(int(rng.expovariate(0.7)), 6), min(int(rng.expovariate(0.5)) * (rng.random() < 0.4), 8))
             for _ in range(2000)]
    pairs += [(a, min(8, a + 2)) for a, _ in pairs[:300]]  # correlated: context long where the head is
    p, joint = chain_model(pairs, 6)
    for k in (1, 2, 4):
        taus = tuning.branch_taus(tree.chain(k), p, [joint] * 8)
        assert taus[0] == pytest.approx(tree_tau(tree.chain(k), p))
        for lookup in range(9):
            mean = sum(1 + max(min(a, k), min(b, lookup)) for a, b in pairs) / len(pairs)
            assert taus[lookup] == pytest.approx(mean)


def test_each_branch_length_is_scored_on_its_own_joint():
    """branch_taus: length n reads joints[n - 1] (counted on the cycles a walk with that branch runs)."""
    pairs_short, pairs_long = [(0, 1)] * 10 + [(1, 0)] * 10, [(0, 2)] * 10 + [(1, 2)] * 10
    p, short = chain_model(pairs_short, 2)
    _, long = chain_model(pairs_long, 2)
    taus = tuning.branch_taus(tree.chain(1), p, [short, long])
    assert taus == pytest.approx([1.5, tuning.branch_taus(tree.chain(1), p, [short])[1],
                                  tuning.branch_taus(tree.chain(1), p, [long, long])[2]])
    assert taus[1] == pytest.approx(2.0) and taus[2] == pytest.approx(3.0)
    assert tuning.predict("chain-1+lookup-2", p, None, [short, long]) == (pytest.approx(3.0), None)


def test_auto_tree_adds_a_context_branch_only_where_it_pays():
    """Frequent long matches and cheap rows: a context branch is chosen (and its spec parses into a tree of
    that many nodes); no matches, or rows that cost as much as a decode step each: none."""
    rng = random.Random(2)
    heads = [min(int(rng.expovariate(1.0)), 4) for _ in range(1000)]
    often, never = chain_model([(a, 6 if rng.random() < 0.5 else 0) for a in heads], 4), chain_model([(a, 0) for a in heads], 4)
    flat = costs(lambda n: 10.0 + 0.2 * n, draft=1.0, update=0.5, move=0.2)
    best = auto_tree(often[0], flat, lookup_joints=[often[1]] * 8)
    assert best.lookup >= 4 and best.speedup > auto_tree(often[0], flat).speedup
    built = tree.parse_tree(best.spec)
    assert built.num_nodes == len(best.paths) + 1 + best.lookup and built.lookup == best.lookup
    assert auto_tree(never[0], flat, lookup_joints=[never[1]] * 8).lookup == 0
    steep = costs(lambda n: 10.0 * n, draft=1.0, update=0.5, move=0.2)
    assert auto_tree(often[0], steep, lookup_joints=[often[1]] * 8).lookup == 0


def test_context_lookup_copies_the_latest_match():
    c = tree.ContextLookup(ngram=3)
    assert c.propose([5, 6], 2) == [6, 6]  # no earlier occurrence: the last token repeated
    assert c.propose([1, 2, 3, 9, 1, 2, 3, 7, 1, 2], 2) == [3, 7]  # the latest "1 2", not the first
    assert c.propose([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 3) == [7, 1, 2]  # "1 2 3" beats "2 3", "3"
    assert c.propose([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3, 4, 4], 3) == [4, 4, 4]  # periodic: copies itself
    c.reset()
    assert c.propose([8, 1, 8], 2) == [1, 8]


def test_autotune_follows_this_machines_measurement(tmp_path, monkeypatch, capsys):
    """--autotune auto compiles the way profile_costs.py --autotune measured fastest at this precision (its
    "auto": default, frozen or autotuned; an older profile's {"faster": bool} means autotuned or default);
    on / freeze / off force a kind; no profile: the default compile."""
    import torch

    from test_eagle import tiny_target

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(tuning, "REFERENCE_PROFILES", tmp_path / "no-reference-profiles")
    model = tiny_target()  # fp32
    assert tuning.compile_kind("auto", model, "cpu") == "default"
    assert [tuning.compile_kind(c, model, "cpu") for c in ("on", "freeze", "off")] == ["autotuned", "frozen", "default"]
    path = tuning.cost_profile_path(torch.get_num_threads())
    path.parent.mkdir(parents=True)
    for entry, expected in (({"auto": "frozen"}, "frozen"), ({"auto": "autotuned"}, "autotuned"),
                            ({"auto": "default"}, "default"), ({"faster": True}, "autotuned"), ({"faster": False}, "default")):
        path.write_text(json.dumps({"model": tuning.profile_model(model.config), "precisions": {},
                                    "autotune": {"fp32": entry}}))
        assert tuning.compile_kind("auto", model, "cpu") == expected
        assert tuning.compile_kind("off", model, "cpu") == "default"
        assert tuning.COMPILE_KINDS[expected] == {"default": None, "frozen": tuning.FREEZE_OPTIONS,
                                                    "autotuned": tuning.AUTOTUNE_OPTIONS}[expected]
    err = capsys.readouterr().err
    assert "compile: weights frozen (measured faster here for fp32" in err
    assert "compile: weights frozen and inductor max-autotune (measured faster here for fp32" in err


def test_precision_auto_picks_the_fastest_predicted(tmp_path, monkeypatch, capsys):
    """--precision auto: vanilla takes the precision of the fastest decode step in this machine's profile;
    with a head it takes the fastest with that head's --tree auto tree, which may be another (here: a
    slower bf16 step whose extra verify rows are nearly free beats int4's steep rows)."""
    import torch

    import generate

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(tuning, "REFERENCE_PROFILES", tmp_path / "no-reference-profiles")  # a machine of no kind met
    config = generate.ModelArgs()  # the default model's shape
    with pytest.raises(generate.UsageError, match="profile_costs.py --threads"):
        tuning.fastest_precision(config, None)
    steep, flat = {str(n): 10.0 * n for n in (1, 64)}, {str(n): 13.0 + 0.01 * n for n in (1, 64)}
    piece = {"draft_ms": {"1": 0.1, "64": 0.1}, "update_ms": {"1": 0.1, "9": 0.1}, "move_ms": {"1": 0.1, "9": 0.1}}
    profile = {"model": tuning.profile_model(config),
               "precisions": {"int4": {"verify_ms": steep, **piece}, "bf16": {"verify_ms": flat, **piece},
                              "fp32": {"verify_ms": {"1": 40.0, "64": 41.0}, **piece}}}
    tuning.cost_profile_path(torch.get_num_threads()).parent.mkdir(parents=True)
    tuning.cost_profile_path(torch.get_num_threads()).write_text(json.dumps(profile))
    (tmp_path / "acceptance.json").write_text(json.dumps({"p": [[0.8, 0.1]] * 6}))
    assert tuning.fastest_precision(config, None) == "int4"
    assert tuning.fastest_precision(config, tmp_path) == "bf16"
    with pytest.raises(generate.UsageError, match="of another model"):
        tuning.fastest_precision(generate.ModelArgs(dim=64, n_head=4, n_local_heads=2, n_layer=2), None)
    assert "precision auto: bf16 (predicted tokens/s with EAGLE: bf16" in capsys.readouterr().err
    for argv in (["--precision", "auto", "--quantize", "int4"], ["--precision", "bf16", "--dtype", "float32"]):
        with pytest.raises(generate.UsageError, match="--precision replaces"):
            generate.parse_args(argv)


def test_cpu_family_is_read_and_matched():
    """tuning.cpu_family reads "family F model M" from cpuinfo text (None where it is not there); a profile recorded
    as "family F" (model not recorded) holds for every model of that family, "family F model M" for that one."""
    text = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\n"
    assert tuning.cpu_family(text) == "family 25 model 17"
    assert tuning.cpu_family("model name\t: Apple M2\n") is None
    assert tuning.same_cpu("family 25 model 17", "family 25 model 17") and tuning.same_cpu("family 25", "family 25 model 17")
    assert not tuning.same_cpu("family 25", "family 26 model 2") and not tuning.same_cpu("family 2", "family 25 model 1")
    assert not tuning.same_cpu("family 25 model 17", "family 25 model 160") and not tuning.same_cpu(None, "family 25 model 17")
    assert not tuning.same_cpu("family 25", None)


def test_reference_profile_serves_a_machine_without_its_own(tmp_path, monkeypatch, capsys):
    """A fresh machine (no profile under $HOME) of the instruction set, thread count and CPU family a shipped
    reference profile was measured at: --tree auto chooses from it and says so; its compile-kinds table only
    where that was measured on this CPU family too; of another CPU family or thread count, or where the machine
    has its own profile, that one (or none: a calibration) is used instead."""
    from model import ModelArgs

    monkeypatch.setenv("HOME", str(tmp_path))
    shipped = sorted(tuning.REFERENCE_PROFILES.glob("*.json"))
    assert {p.stem for p in shipped} >= {"amx-t2", "avx512_bf16-t1", "avx512_bf16-t2"}
    config = ModelArgs()  # the default model's shape, what the reference profiles were measured on
    for each in shipped:  # each serves a machine of its instruction set, thread count and CPU
        reference = json.loads(each.read_text())
        isa, threads, family = reference["isa"], reference["threads"], reference["cpu_family"]
        monkeypatch.setattr(tuning, "instruction_set", lambda: isa)
        monkeypatch.setattr(tuning.torch, "get_num_threads", lambda: threads)
        here = family if len(family.split()) == 4 else family + " model 1"  # a CPU of the family (and model) measured
        monkeypatch.setattr(tuning, "cpu_family", lambda: here)
        assert tuning.profile_model(config) == reference["model"]
        path, profile, other = tuning.cost_profile(config)
        assert path == each and profile["precisions"] == reference["precisions"] and other is None
        assert f"reference cost profile {path.stem} of the shipped head (CPU {family})" in tuning.profile_source(path)
    first = shipped[-1]  # the last served: instruction set, threads and CPU still set as for it
    monkeypatch.setattr(tuning, "cpu_family", lambda: "family 1 model 1")  # another CPU of this instruction set
    assert tuning.cost_profile(config)[1] is None
    # a compile-kinds table measured on another CPU than the curves: served on that of the curves without it
    mixed = tmp_path / "references"
    mixed.mkdir()
    (mixed / first.name).write_text(json.dumps({**reference, "cpu_family": "family 25",
                                                     "autotune_cpu_family": "family 26", "autotune": {"int4": {}}}))
    monkeypatch.setattr(tuning, "REFERENCE_PROFILES", mixed)
    for cpu, served, kinds in (("family 25 model 17", True, False), ("family 26 model 2", False, False)):
        monkeypatch.setattr(tuning, "cpu_family", lambda: cpu)
        profile = tuning.cost_profile(config)[1]
        assert (profile is not None) == served and (served and "autotune" in profile) == kinds
    same = {k: v for k, v in reference.items() if k != "autotune_cpu_family"}  # both measured on one CPU
    (mixed / first.name).write_text(json.dumps({**same, "cpu_family": "family 25 model 17", "autotune": {"int4": {}}}))
    assert tuning.cost_profile(config)[1] is None  # family 26
    monkeypatch.setattr(tuning, "cpu_family", lambda: "family 25 model 160")
    assert tuning.cost_profile(config)[1] is None  # another model of the family recorded with its model
    monkeypatch.setattr(tuning, "cpu_family", lambda: "family 25 model 17")
    assert "autotune" in tuning.cost_profile(config)[1]
    monkeypatch.setattr(tuning, "REFERENCE_PROFILES", first.parent)
    monkeypatch.setattr(tuning, "cpu_family", lambda: here)
    monkeypatch.setattr(tuning.torch, "get_num_threads", lambda: 7)
    assert tuning.cost_profile(config)[1] is None  # no reference at 7 threads
    monkeypatch.setattr(tuning.torch, "get_num_threads", lambda: threads)
    own = tuning.cost_profile_path(threads)
    own.parent.mkdir(parents=True)
    own.write_text(json.dumps({**reference, "precisions": {"int4": reference["precisions"]["int4"]}}))
    assert tuning.cost_profile(config)[0] == own  # this machine's own profile comes first


def test_a_machine_with_no_profile_calibrates_once(tmp_path, monkeypatch, capsys):
    """No profile of its own and no reference for this kind of machine: the run times the pieces of a cycle on
    the loaded target and head (tuning.calibrate, timed by costs.py), keeps the result, chooses a tree from it and
    says so; the next run reuses it without timing again. The chosen tree stays lossless."""
    import torch

    import generate
    from test_eagle import copycat_head, tiny_prompts, tiny_target, vanilla_greedy

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(tuning, "REFERENCE_PROFILES", tmp_path / "no-reference-profiles")
    model = tiny_target()
    head = copycat_head(model)
    (tmp_path / "acceptance.json").write_text(json.dumps({"p": [[0.6, 0.15, 0.08, 0.05]] * 6}))
    with torch.no_grad():
        spec = tuning.auto_tree_for(tmp_path, model, "cpu", calibrate_with=(head, "eager"))
    err = capsys.readouterr().err
    assert "calibrating (once" in err and "this machine's quick calibration calibration-" in err, err
    saved = json.loads(next((tmp_path / ".cache" / "eagle-fast").glob("calibration-*-eager.json")).read_text())
    assert saved["model"] == tuning.profile_model(model.config) and set(saved["precisions"]) == {"fp32"}
    assert saved["cpu_family"] == tuning.cpu_family()  # what a profile holds for
    assert all(v > 0 for v in saved["precisions"]["fp32"]["verify_ms"].values())
    assert saved["sampling"]["decode_ms"] >= 0 and saved["sampling"]["cycle_ms"]  # priced at T > 0
    with torch.no_grad():
        assert tuning.auto_tree_for(tmp_path, model, "cpu", calibrate_with=(head, "eager")) == spec
    assert "calibrating" not in capsys.readouterr().err
    prompt = tiny_prompts(1, model.config.vocab_size, seed=3)[0]
    out, _ = generate.Session(model, 64, head, tree.parse_tree(spec)).generate(prompt, 20, generate.Sampling())
    assert out == vanilla_greedy(model, prompt, 20)
    # batch 3: a calibration of the batched cycle, kept beside batch 1's
    with torch.no_grad():
        tuning.auto_tree_for(tmp_path, model, "cpu", calibrate_with=(head, "eager"), batch_size=3)
    assert "calibrating" in capsys.readouterr().err
    saved = json.loads(next((tmp_path / ".cache" / "eagle-fast").glob("calibration-*-eager.json")).read_text())
    assert set(saved["precisions"]) == {"fp32"} and set(saved["batches"]) == {"3"}
    assert all(v > 0 for v in saved["batches"]["3"]["fp32"]["verify_ms"].values())
    with torch.no_grad():
        tuning.auto_tree_for(tmp_path, model, "cpu", calibrate_with=(head, "eager"), batch_size=3)
        tuning.auto_tree_for(tmp_path, model, "cpu", calibrate_with=(head, "eager"))
    assert "calibrating" not in capsys.readouterr().err


def test_a_compiled_run_calibrates_in_the_compile_kind_it_runs(tmp_path, monkeypatch, capsys):
    """--autotune freeze / on: the calibration compiles the cycle's pieces (the head's steps too) the way the run's
    steps are compiled, and keeps it apart from the default kind's; eager runs share one whatever the kind."""
    import torch

    import costs
    from test_eagle import copycat_head, tiny_target

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(tuning, "REFERENCE_PROFILES", tmp_path / "no-reference-profiles")
    configs = []
    real = costs.Pieces.prepare

    def spy(self, model, head, mode, tag, max_rows, batch_size=1, inductor_config=None):
        configs.append((mode, inductor_config))
        return real(self, model, head, "eager", tag, max_rows, batch_size)  # timed eagerly: the test's time

    monkeypatch.setattr(costs.Pieces, "prepare", spy)
    model = tiny_target()
    head = copycat_head(model)
    (tmp_path / "acceptance.json").write_text(json.dumps({"p": [[0.6, 0.15, 0.08, 0.05]] * 6}))
    with torch.no_grad():
        for kind in ("frozen", "autotuned", "default", "frozen"):
            tuning.auto_tree_for(tmp_path, model, "cpu", calibrate_with=(head, "dynamic"), kind=kind)
        tuning.auto_tree_for(tmp_path, model, "cpu", calibrate_with=(head, "eager"), kind="autotuned")
    assert configs == [("dynamic", tuning.COMPILE_KINDS["frozen"]), ("dynamic", tuning.COMPILE_KINDS["autotuned"]),
                       ("dynamic", None), ("eager", None)]  # the second frozen run: kept from the first
    key = tuning.cost_profile_path(torch.get_num_threads()).stem.removeprefix("costs-")
    kept = {p.name.removeprefix(f"calibration-{key}") for p in (tmp_path / ".cache" / "eagle-fast").glob("calibration-*")}
    assert kept == {"-dynamic-frozen.json", "-dynamic-autotuned.json", "-dynamic.json", "-eager.json"}
    assert "calibrating" in capsys.readouterr().err


def test_sampled_acceptance_matches_the_sampling_verifier():
    """train_eagle.sampled_acceptance (acceptance.json's temperature-1 model) gives each child's chance of being
    the one engine.accept_sampling accepts, measured by running that verifier on k children drawn without
    replacement from q; exact for the first child, close with part of the vocabulary lumped into one token."""
    import torch

    from engine import Sampling, accept_sampling
    from scripts.train_eagle import sampled_acceptance

    torch.manual_seed(0)
    V, k, n = 12, 3, 3000
    p = torch.softmax(torch.randn(2, V) * 2, -1)
    q = torch.softmax(torch.randn(2, V) * 2 + torch.log(p), -1)
    model = sampled_acceptance(p, q, k, samples=n, support=6)  # half the vocabulary lumped together
    exact = sampled_acceptance(p, q, k, samples=n, support=V)
    for row in range(2):
        counts = torch.zeros(k + 1)
        probs = torch.zeros(k + 1, V)
        probs[0] = q[row]
        for _ in range(n):
            children = torch.multinomial(q[row], k).tolist()
            path, _ = accept_sampling([0] + children, p[row].log().repeat(k + 1, 1), [[1, 2, 3], [], [], []],
                                      Sampling(1.0), probs)
            counts[path[1] - 1 if len(path) > 1 else k] += 1
        measured = counts[:k] / n
        assert exact[row, 0] == pytest.approx(torch.minimum(p[row], q[row]).sum())
        assert exact[row].tolist() == pytest.approx(measured.tolist(), abs=0.04)
        assert model[row].tolist() == pytest.approx(measured.tolist(), abs=0.08)


def test_sampling_scores_trees_with_the_sampled_acceptance_model():
    """--tree auto when sampling scores trees with acceptance.json's temperature-1 model where it has one
    (a head evaluated before it: the greedy model)."""

    greedy, sampled = [[0.9, 0.05]] * 3, [[0.5, 0.2]] * 3
    assert tuning.acceptance_p({"p": greedy, "sampled": {"p": sampled}}, greedy=False) == sampled
    assert tuning.acceptance_p({"p": greedy, "sampled": {"p": sampled}}, greedy=True) == greedy
    assert tuning.acceptance_p({"p": greedy}, greedy=False) == greedy
    steep = costs(lambda n: 10.0 + 2 * (n - 1), draft=0.5, update=1.0)  # each verified row costs a fifth of a step
    assert (auto_tree(greedy, steep).spec, auto_tree(sampled, steep).spec) == ("chain-3", "chain-1")
