"""engine.py: B rows per cycle give each request what a single-sequence Session gives it (greedy, fp32), whatever
its neighbours sample and whenever requests join, finish or are cancelled, and the sampled rows follow the target's
law (G-tests, failing with a broken verifier)."""
import collections
import random

import pytest
import torch

import engine
from engine import Engine
from generate import Sampling, Session, UsageError
from tuning import COMPILE_KINDS
from test_eagle import (CUSTOM_TREE, E2E_PROMPT, E2E_VOCAB, MAIN_E2E, P_BROKEN, P_PASS, SAMPLING_CONFIGS, VerifierLog,
                        accept_sampling_without_residual, copycat_head, first_tokens_law, g_test, sampling_e2e, tiny_prompts,
                        tiny_target)
from tree import parse_tree

pytestmark = pytest.mark.usefixtures("lean_torch")

HEAD_NOISE = 1.5  # the copycat head with its attention undamped: a wrong draft mask changes its drafts
BATCHED_TREES = ["chain-4", "paper", CUSTOM_TREE, "paper+lookup-3", "chain-1+lookup-4", "dynamic-4-4-12", "dynamic-2-5-9"]


def session_outputs(model, head, spec, prompts, n, stop_ids):
    """Each prompt's new tokens and its cycles' accepted drafts, one Session at a time."""
    outs, accepts = [], []
    for p in prompts:
        session = Session(model, len(p) + n, head, None if head is None else parse_tree(spec))
        out, stats = session.generate(p, n, Sampling(), stop_ids)
        outs.append(out)
        accepts.append(stats.accept_lengths)
    return outs, accepts


def stop_token_of(outs: list) -> int:
    """A token that ends one row early and not the others: rows finish at different steps."""
    for t in outs[0][3:]:
        if all(t not in o[: len(outs[0])] for o in outs[1:]):
            return t
    return outs[0][3]


@pytest.mark.parametrize("spec", [None] + BATCHED_TREES)
def test_batched_greedy_equals_single_sequences(spec):
    """Rows of different prompt lengths, one ended early by a stop token, one batch row without a prompt: each
    row's tokens equal a single-sequence Session's (vanilla when spec is None), and so do the drafts each cycle
    accepted (output is right whatever the drafts; equal acceptances show the batched draft is the same)."""
    model = tiny_target()
    head = None if spec is None else copycat_head(model, noise=HEAD_NOISE)
    prompts, n = tiny_prompts(3, model.config.vocab_size, seed=3), 24
    plain, _ = session_outputs(model, head, spec, prompts, n, frozenset())
    stop = {stop_token_of(plain)}
    ref, ref_accepts = session_outputs(model, head, spec, prompts, n, stop)
    assert len(ref[0]) < n and any(len(r) == n for r in ref[1:])  # the rows finish at different steps
    eng = Engine(model, max(map(len, prompts)) + n, 4, head, None if spec is None else parse_tree(spec))
    out, stats = eng.generate(prompts, n, Sampling(), stop)
    assert out == ref
    assert stats.new_tokens == [len(r) for r in ref]
    if spec is not None:  # the same drafts as each row's own session: the same acceptances, cycle by cycle
        assert stats.accept_lengths == ref_accepts
        assert max(map(max, ref_accepts)) >= 2 and stats.target_forwards == max(map(len, ref_accepts))


@pytest.mark.parametrize("spec", [None, "paper", "chain-1+lookup-4", "dynamic-4-4-12"])
def test_finished_rows_are_refilled(spec):
    """Seven prompts through a batch of three: each finished row takes the next prompt at once (the batch holds
    three until the queue runs dry), and every prompt gets a single-sequence Session's tokens and acceptances,
    among them a prompt that its first new token already ends (its row takes the next prompt in the same step)."""
    model = tiny_target()
    head = None if spec is None else copycat_head(model, noise=HEAD_NOISE)
    prompts, n = tiny_prompts(7, model.config.vocab_size, seed=11), 12
    plain, _ = session_outputs(model, head, spec, prompts, n, frozenset())
    stop = {stop_token_of(plain), plain[4][0]}  # prompt 5 ends at its first token
    ref, ref_accepts = session_outputs(model, head, spec, prompts, n, stop)
    assert len(ref[4]) == 1 and len({len(r) for r in ref}) > 2
    eng = Engine(model, max(map(len, prompts)) + n, 3, head, None if spec is None else parse_tree(spec))
    out, stats = eng.generate(prompts, n, Sampling(), stop)
    assert out == ref
    if spec is not None:
        assert stats.accept_lengths == ref_accepts
    # refilled, not run in batches of three: fewer forwards than the three batches' longest rows take
    in_batches = sum(max(map(len, (ref_accepts if spec else ref)[i:i + 3])) for i in range(0, 7, 3))
    assert stats.target_forwards < in_batches


def test_engines_of_other_batch_sizes_share_a_model():
    """Engines of batch 2 and 3 (vanilla and EAGLE) on one model, called in turn: each call sets the shared
    caches up for its own batch (an engine sharing the model with another reallocates nothing it fits)."""
    model = tiny_target()
    head = copycat_head(model, noise=HEAD_NOISE)
    prompts, n = tiny_prompts(4, model.config.vocab_size, seed=8), 10
    ref = session_outputs(model, head, "paper", prompts, n, frozenset())[0]
    engines = [Engine(model, 12 + n, b, h, t) for b in (2, 3) for h, t in ((None, None), (head, parse_tree("paper")))]
    for _ in range(2):
        for s in engines:
            assert s.generate(prompts, n, Sampling())[0] == ref
            assert model.max_batch_size == s.batch_size


@pytest.mark.parametrize("spec, kind, adapt", [(None, "default", False), ("paper", "default", False),
                                               ("dynamic-4-4-12", "default", False), ("paper", "frozen", False),
                                               ("chain-2", "default", True)])
def test_compiled_engine_does_not_recompile(spec, kind, adapt):
    """Compiled steps (by default, or with the weights frozen into the graphs) give the eager tokens; after a
    warm-up batch, batches of other prompts (rows advancing and finishing at their own steps) compile nothing new.
    With the adaptation, the warm-up compiles the plain steps (the decode graph that returns features) too."""
    model = tiny_target()
    head = None if spec is None else copycat_head(model, noise=HEAD_NOISE)
    tree = None if spec is None else parse_tree(spec)
    n = 16
    warm, prompts = tiny_prompts(3, model.config.vocab_size, seed=5), tiny_prompts(3, model.config.vocab_size, seed=6)
    eager = Engine(model, 12 + n, 4, head, tree).generate(prompts, n, Sampling(), {7})[0]
    warm_ref = session_outputs(model, head, spec, warm, n, {7})[0]
    torch._dynamo.reset()
    eng = Engine(model, 12 + n, 4, head, tree, compile=True, inductor_config=COMPILE_KINDS[kind],
                 adapt=engine.Adaptation() if adapt else None)
    eng.warm_up(warm[0])  # every bucket of rows (1, 2, 4)
    warm_plain = eng.plain_steps
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert eng.generate(prompts, n, Sampling(), {7})[0] == eager
        assert eng.generate(prompts[:2], n, Sampling(), {7})[0] == eager[:2]
        # more prompts than rows: finished rows are refilled
        assert eng.generate(prompts + warm, n, Sampling(), {7})[0] == eager + warm_ref
    assert not adapt or eng.plain_steps > warm_plain  # the checked generations decoded plainly too


def test_compiled_steps_check_only_what_engines_change(monkeypatch):
    """A compiled step checks the guards on its arguments and on what an engine changes between calls (the KV
    caches, the RoPE tables, the target's feature_layers: engine.CHANGING), not the thousands on the modules'
    structure and weights (0.5-1.3 ms a call): it still follows the changes an engine makes (EAGLE-3's fused
    features, caches reallocated longer) with the eager numbers, and a thread count change recompiles nothing."""
    kept, step_guards = [], engine.step_guards

    def counting(guards):
        keep = step_guards(guards)
        kept.append((sum(keep), len(keep)))
        return keep

    monkeypatch.setattr(engine, "step_guards", counting)
    model = tiny_target()
    model.setup_caches(1, 16)
    verify = engine.compile_step(engine.verify_rows, tag="guards", fullgraph=True, dynamic=False)
    tokens, pos = torch.tensor([[3, 5]]), torch.tensor([[4, 5]])
    mask = torch.ones(1, 1, 2, 16, dtype=torch.bool)

    def both():
        return verify(model, tokens, pos, pos, mask, True), engine.verify_rows(model, tokens, pos, pos, mask, True)
    (out, features), (ref, ref_features) = both()
    assert torch.equal(out, ref) and torch.allclose(features, ref_features, atol=1e-5)
    assert kept and all(k < n // 4 for k, n in kept)  # most guards dropped
    model.feature_layers = (0, 1)  # an EAGLE-3 head's taps: the step recompiles and returns the fused states
    (_, features), (_, ref_features) = both()
    assert features.shape[-1] == 2 * model.config.dim and torch.allclose(features, ref_features, atol=1e-5)
    model.feature_layers = None
    model.setup_caches(1, 32)  # new, longer caches: the step follows them
    mask = torch.ones(1, 1, 2, 32, dtype=torch.bool)
    (out, features), (ref, ref_features) = both()
    assert torch.equal(out, ref) and torch.allclose(features, ref_features, atol=1e-5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(max(1, threads - 1) if threads > 1 else 2)
        with torch._dynamo.config.patch(error_on_recompile=True):
            both()
    finally:
        torch.set_num_threads(threads)


def test_engine_refuses_bad_input():
    model = tiny_target()
    with pytest.raises(UsageError, match="needs a tree"):
        Engine(model, 32, 2, copycat_head(model), None)
    eng = Engine(model, 32, 2)
    with pytest.raises(UsageError, match="no prompts"):
        eng.generate([], 4, Sampling())
    with pytest.raises(UsageError, match="empty"):
        eng.generate([[1], []], 4, Sampling())
    with pytest.raises(UsageError, match="max_seq_len"):
        eng.generate([[1] * 30], 4, Sampling())


# ---------------------------------------------------------------- sampling: the target's law in every row
BATCH_SAMPLES = 12_000  # sampled rows in all, half per prompt
OTHER_PROMPT = [3, 6, 1, 1, 4]


def batched_sampling(config, verifier, monkeypatch, seed=0, greedy_neighbours=False):
    """G-test p-values of the first three new tokens of rows of two prompts (alternating in a batch of 4; with
    greedy_neighbours, two of the four rows decode greedily beside them, and must give their greedy text), and
    the verifier's counts."""
    spec, sampling = SAMPLING_CONFIGS[config]
    model = tiny_target(vocab_size=E2E_VOCAB, n_layer=1, out_scale=2.0)
    head = copycat_head(model)
    prompts = [E2E_PROMPT, OTHER_PROMPT] * 2
    laws = [first_tokens_law(model, p, sampling) for p in prompts[:2]]
    settings = [sampling, sampling, Sampling(), Sampling()] if greedy_neighbours else [sampling] * 4
    greedy_text = session_outputs(model, head, spec, prompts[2:], 3, frozenset())[0]
    log = VerifierLog(verifier)
    monkeypatch.setattr(engine, "accept_sampling", log)
    eng = Engine(model, len(OTHER_PROMPT) + 3, len(prompts), head, parse_tree(spec))
    torch.manual_seed(seed)
    observed = [collections.Counter(), collections.Counter()]
    for _ in range(BATCH_SAMPLES // len(prompts) * (2 if greedy_neighbours else 1)):
        requests = [eng.add(p, 3, s) for p, s in zip(prompts, settings)]
        while eng.pending():
            eng.step()
        for i, r in enumerate(requests):
            if settings[i].greedy:
                assert r.out == greedy_text[i - 2]
            else:
                observed[i % 2][tuple(r.out)] += 1
    return [g_test(o, law) for o, law in zip(observed, laws)], log.counts


def test_batched_sampling_is_lossless(monkeypatch):
    ps, counts = batched_sampling(MAIN_E2E, engine.accept_sampling, monkeypatch)
    assert min(ps) > P_PASS, f"G-test p = {ps}; verifier {dict(counts)}"
    assert counts["sampled_drafts"] == counts["cycles"] and counts["accepted"] > 0.5 * counts["cycles"]
    assert counts["sibling_rejected"] > 0.05 * counts["cycles"] and counts["children_rejected"] > 0.05 * counts["cycles"]


def test_batched_dynamic_tree_sampling_is_lossless(monkeypatch):
    """Each row's own dynamic tree (one-hot proposals of the draft's best tokens) under top-p: the target's law."""
    ps, counts = batched_sampling("topp0.8-dynamic", engine.accept_sampling, monkeypatch)
    assert min(ps) > P_PASS, f"G-test p = {ps}; verifier {dict(counts)}"
    assert counts["accepted"] > 0.3 * counts["cycles"]


def test_batched_sampling_with_a_broken_verifier_fails(monkeypatch):
    ps, _ = batched_sampling(MAIN_E2E, accept_sampling_without_residual, monkeypatch)
    assert min(ps) < P_BROKEN, f"the broken verifier passed the batched test: p = {ps}"


def test_greedy_rows_beside_sampled_rows(monkeypatch):
    """Rows that sample and rows that decode greedily share each cycle: the greedy rows give their greedy text
    every time (checked inside), the sampled rows keep the target's law."""
    ps, counts = batched_sampling(MAIN_E2E, engine.accept_sampling, monkeypatch, greedy_neighbours=True)
    assert min(ps) > P_PASS, f"G-test p = {ps}; verifier {dict(counts)}"
    assert counts["sampled_drafts"] == counts["cycles"]


# ---------------------------------------------------------------- requests that join, stream and leave
@pytest.mark.parametrize("spec", [None, "paper", "dynamic-4-4-12"])
def test_requests_join_stream_and_are_cancelled(spec):
    """The server's use: requests added while others run, their tokens read step by step, one cancelled midway.
    Every request that ran to its end got a single Session's text, streamed in order (the first token from its
    prefill); the cancelled one stopped there and freed its row for the one waiting; an idle engine steps
    without a forward."""
    model = tiny_target()
    head = None if spec is None else copycat_head(model, noise=HEAD_NOISE)
    prompts, n = tiny_prompts(5, model.config.vocab_size, seed=21), 12
    ref = session_outputs(model, head, spec, prompts, n, frozenset())[0]
    eng = Engine(model, max(map(len, prompts)) + n, 2, head, None if spec is None else parse_tree(spec))
    assert eng.step() == [] and eng.target_forwards == 0
    first = [eng.add(p, n) for p in prompts[:3]]  # two rows: the third waits
    streamed = {r.id: [] for r in first}
    for new in eng.step():
        streamed[new[0].id] += new[1]
    assert [len(streamed[r.id]) >= 1 for r in first] == [True, True, False] and eng.running == 2
    eng.cancel(first[1])
    late = [eng.add(p, n) for p in prompts[3:]]
    streamed.update({r.id: [] for r in late})
    while eng.pending():
        for request, tokens in eng.step():
            streamed[request.id] += tokens
            assert request is not first[1]  # a cancelled request gets nothing more
        assert eng.running <= 2
    assert first[1].finish_reason == "cancelled" and first[1].out == ref[1][: len(first[1].out)]
    for r, p in zip([first[0], first[2], *late], [0, 2, 3, 4]):
        assert r.out == ref[p] and streamed[r.id] == r.out and r.finish_reason == "length"
    forwards = eng.target_forwards
    assert eng.step() == [] and eng.target_forwards == forwards
    queued = eng.add(prompts[0], n)
    eng.cancel(queued)  # cancelled before it ran: it never takes a row
    assert eng.step() == [] and queued.out == [] and queued.finish_reason == "cancelled"


@pytest.mark.parametrize("spec", [None, "chain-3", "dynamic-2-3-6"])
def test_a_seeded_request_repeats_whatever_runs_beside_it(spec):
    """A request with its own seed (Sampling.seeded) draws from its own generator: at temperature 1 it gets the same
    tokens alone and beside other sampling requests (seeded otherwise, or on the global generator); another seed
    gives other tokens."""
    model = tiny_target()
    head = None if spec is None else copycat_head(model, noise=HEAD_NOISE)
    prompts, n = tiny_prompts(3, model.config.vocab_size, seed=5), 20
    eng = Engine(model, max(map(len, prompts)) + n, 3, head, None if spec is None else parse_tree(spec))

    def run(seed, neighbours):
        request = eng.add(prompts[0], n, Sampling.seeded(1.0, seed=seed))
        others = [eng.add(p, n, s) for p, s in zip(prompts[1:], neighbours)]
        while not all(r.done for r in [request, *others]):
            eng.step()
        return request.out

    alone = run(7, [])
    assert run(7, [Sampling(1.0), Sampling.seeded(0.8, top_p=0.9, seed=7)]) == alone
    assert run(7, [Sampling()]) == alone and run(8, []) != alone


def test_each_compiled_engine_has_graphs_of_its_own():
    """Dynamo keeps graphs, and counts recompiles against its limit of 8, per code object: each compiled engine's
    steps get code objects of their own, so a process of many engines (the peer benchmark: three precisions at
    four batch sizes) never reaches that limit (it did: FailOnRecompileLimitHit at the ninth)."""
    model = tiny_target()
    engines = [Engine(model, 64, n, compile=True) for n in (1, 2, 2)]
    engines.append(Engine(model, 64, 2, steps=engines[2].steps))  # given a Steps: its graphs are shared
    codes = [[step._torchdynamo_orig_callable.__code__ for step in (e.steps.decode, e.steps.verify, e.steps.draft,
                                                                     e.steps.head_update)] for e in engines]
    assert len({id(c) for steps in codes for c in steps}) == 12 and codes[3] == codes[2]
    assert codes[0][0].co_name.startswith("decode_rows_steps")


@pytest.mark.parametrize("spec", [None, "paper", "dynamic-4-4-12"])
def test_steps_run_only_the_rows_up_to_the_last_busy_one(spec):
    """A request alone in an engine of 4 rows runs 1-row steps (a lone client is not slowed by empty rows); with
    three at once each step runs the bucket (engine.row_buckets) that holds the last busy row: 4 rows, fewer once
    row 2 ends; every output is still a single sequence's."""
    assert engine.row_buckets(1) == [1] and engine.row_buckets(4) == [1, 2, 4] and engine.row_buckets(6) == [1, 2, 4, 6]
    model = tiny_target()
    head = None if spec is None else copycat_head(model, noise=HEAD_NOISE)
    prompts, n = tiny_prompts(3, model.config.vocab_size, seed=21), 24
    ref = session_outputs(model, head, spec, prompts, n, frozenset())[0]
    budgets = [24, 12, 3]
    eng = Engine(model, max(map(len, prompts)) + n, 4, head, None if spec is None else parse_tree(spec))
    sizes, expected = [], []
    eng.steps = engine.Steps()  # its own (not the shared engine.EAGER), to spy on
    step = eng.steps.decode if spec is None else eng.steps.verify

    def spy(model_, tokens, *rest):  # the rows a step ran, and the bucket holding the last busy row then
        last = max(b for b, r in enumerate(eng.rows) if r is not None and not r.done)
        sizes.append(tokens.shape[0])
        expected.append(next(n for n in (1, 2, 4) if n > last))
        return step(model_, tokens, *rest)
    if spec is None:
        eng.steps.decode = spy
    else:
        eng.steps.verify = spy
    assert eng.generate(prompts[:1], n, Sampling())[0] == ref[:1]
    assert set(sizes) == {1}
    sizes.clear()
    expected.clear()
    requests = [eng.add(p, b, Sampling()) for p, b in zip(prompts, budgets)]
    while not all(r.done for r in requests):
        eng.step()
    assert [r.out for r in requests] == [o[:b] for o, b in zip(ref, budgets)]
    assert sizes == expected and sizes[0] == 4 and min(sizes) < 4  # row 2 ends first


@pytest.mark.parametrize("spec", [None, "paper", "dynamic-4-4-12", "chain-1+lookup-4"])
def test_a_follow_up_prefills_only_what_is_new(spec):
    """A finished request's row keeps its tokens: the next turn of its conversation (its prompt and answer, then
    more) takes that row, beside other rows, and prefills only the new tokens and the answer's last; its answer is
    a fresh single Session's. After forget() (Session.reset) it prefills the whole prompt again."""
    model = tiny_target()
    head = None if spec is None else copycat_head(model, noise=HEAD_NOISE)
    tree = None if spec is None else parse_tree(spec)
    first, other, later = tiny_prompts(3, model.config.vocab_size, seed=21)
    n = 10
    eng = Engine(model, 64, 3, head, tree)
    prefilled = []
    real = eng.steps.prefill

    def spy(model_, tokens, *rest):
        prefilled.append(tokens.shape[1])
        return real(model_, tokens, *rest)

    eng.steps = engine.Steps()
    eng.steps.prefill = spy
    a = eng.add(first, n)
    eng.add(other, n)
    while eng.pending():
        eng.step()
    follow_up = first + a.out + [5, 9, 2]
    c = eng.add(follow_up, n)
    b = eng.add(later, n)  # a newcomer: the lowest free row
    eng.step()
    assert eng.rows.index(c) == 0 and eng.rows.index(b) == 1
    while eng.pending():
        eng.step()
    held = len(first) + len(a.out) - 1  # the last answer token: not in the target's cache (vanilla), or its head
    assert prefilled[-2] == len(follow_up) - held  # pair needs the token after it (EAGLE)
    assert c.out == session_outputs(model, head, spec, [follow_up], n, frozenset())[0][0]
    session = Session(model, 64, head, tree)
    session.generate(first, n, Sampling())
    out, _ = session.generate(follow_up, n, Sampling())
    assert out == c.out
    session.engine.steps = eng.steps
    session.reset()
    assert session.generate(follow_up, n, Sampling())[0] == c.out and prefilled[-1] == len(follow_up)


def test_warm_up_prefills_from_slot_0_and_after_a_held_prefix():
    """Engine.warm_up runs the prefill shapes a compiled prefill needs a graph for before anything is timed: from
    slot 0 and after a held prefix of several new tokens (a chat's next turn); the rows are forgotten after."""
    model = tiny_target()
    eng = Engine(model, 40, 2)
    eng.steps = engine.Steps()  # its own, to spy on
    prefill, seen = eng.steps.prefill, []

    def spy(model_, tokens, input_pos, mask):
        seen.append((int(input_pos[0]), tokens.shape[1]))
        return prefill(model_, tokens, input_pos, mask)
    eng.steps.prefill = spy
    eng.warm_up(list(range(1, 13)))
    assert (0, 12) in seen and (6, 6) in seen
    assert all(r is None or r.length <= 1 for r in eng.rows)


@pytest.mark.parametrize("spec", [None, "paper"])
def test_compiled_prefill_at_every_row(spec):
    """Prefills compiled with dynamic shapes (generate.py --compile_prefill) fill any row of a batch: the outputs
    are the eager ones. The aot_eager backend: dynamo's tracing without inductor's C++ build."""
    model = tiny_target()
    head = None if spec is None else copycat_head(model, noise=HEAD_NOISE)
    tree = None if spec is None else parse_tree(spec)
    prompts, n = tiny_prompts(5, model.config.vocab_size, seed=9), 8
    ref = Engine(model, 40, 2, head, tree).generate(prompts, n, Sampling())[0]
    torch._dynamo.reset()
    try:
        steps = engine.Steps.compiled("cpu", prefill_too=True, backend="aot_eager")
        assert Engine(model, 40, 2, head, tree, steps=steps).generate(prompts, n, Sampling())[0] == ref
    finally:
        torch._dynamo.reset()


# ---------------------------------------------------------------- adaptation (issue 48)
class Pattern(engine.Schedule):
    """A forced switch pattern: speculates as a seeded coin says (or as `choices` list, then the coin)."""

    def __init__(self, seed: int, choices=()):
        super().__init__(choices)
        self.rng, self.seen = random.Random(seed), []

    def speculate(self, bucket):
        choice = super().speculate(bucket) if self.choices else self.rng.random() < 0.5
        self.seen.append(choice)
        return choice


@pytest.mark.parametrize("spec", ["chain-4", "paper", "dynamic-4-4-12", "paper+lookup-3"])
def test_any_switch_pattern_is_lossless(spec):
    """Greedy EAGLE whose steps switch at random between cycles and plain decode steps (the head re-primed with the
    plain steps' features before the next cycle) gives vanilla's tokens, in rows of a batch and one sequence at a
    time, and its cycles still accept drafts."""
    model = tiny_target()
    head = copycat_head(model, noise=HEAD_NOISE)
    prompts, n = tiny_prompts(3, model.config.vocab_size, seed=13), 24
    ref = session_outputs(model, None, None, prompts, n, frozenset())[0]
    for seed in range(3):
        pattern = Pattern(seed)
        eng = Engine(model, 12 + n + 8, 3, head, parse_tree(spec), adapt=pattern)
        out, stats = eng.generate(prompts, n, Sampling())
        assert out == ref
        assert eng.plain_steps > 0 and sum(pattern.seen) > 0 and max(map(max, stats.accept_lengths)) >= 2
        session = Session(model, 64, head, parse_tree(spec), adapt=Pattern(seed))
        for p, r in zip(prompts, ref):
            out, st = session.generate(p, n, Sampling())
            assert out == r and st.plain_steps + len(st.accept_lengths) == st.target_forwards


@pytest.mark.parametrize("spec", ["paper", "dynamic-4-4-12"])
def test_reprimed_head_predicts_as_after_a_prefill(spec):
    """After plain steps the head reads their pairs (f_i, t_{i+1}) in one forward: its prediction then (the next
    root) is the one a head that prefilled the same tokens makes."""
    model = tiny_target()
    head = copycat_head(model, noise=HEAD_NOISE)
    prompt = tiny_prompts(1, model.config.vocab_size, seed=14)[0]
    session = Session(model, 64, head, parse_tree(spec), adapt=Pattern(0, [False, True, True] + [False] * 30))
    session.generate(prompt, 20, Sampling())  # plain, two cycles, then plain steps to the end
    eng = session.engine
    row = eng.rows[0]
    assert len(row.unread) >= 2
    eng._reprime([row])
    root = [t[0].clone() for t in eng.root]
    fresh = Session(model, 64, head, parse_tree(spec))
    fresh.generate(row.tokens[: row.length], 1, Sampling())  # its first token is row.tokens[length] (greedy)
    assert fresh.engine.rows[0].tokens[-1] == row.tokens[row.length]
    assert torch.equal(root[3], fresh.engine.root.top_tokens[0])
    assert torch.allclose(root[0], fresh.engine.root.hidden[0], atol=1e-5)


def test_adaptation_follows_what_steps_cost_and_commit():
    """Plain steps are priced first (the first step of each kind untimed); cycles go on while tau per cycle time
    beats a plain step's pace; after MIN_RUN cycles below it by the margin the engine decodes plainly, probing with
    PROBE cycles after 8, 16, 32 ... plain steps, until a probe's text pays again; speculating, it re-prices a
    plain step every REFRESH cycles."""
    a = engine.Adaptation(prior_tau=2.0)
    assert not a.speculate(1)
    a.record(1, False, 0.100)  # a first step is not timed (a cold start)
    assert not a.speculate(1)
    a.record(1, False, 0.010)
    assert a.speculate(1)
    a.record(1, True, 0.300, 2.0)
    a.record(1, True, 0.018, 2.0)  # 2 tokens per 18 ms beat 1 per 10 ms
    assert a.speculating and a.t_cycle[1] == 0.018 and a.t_step[1] == 0.010
    cycles = 0
    while a.speculating:
        a.record(1, True, 0.025, 1.5)  # 1.5 per 25 ms: slower
        cycles += 1
    assert a.switches == 1 and cycles == a.MIN_RUN - 2

    def probe(tau):
        choices = [a.speculate(1) for _ in range(a.wait + 1)]
        assert choices == [False] * (len(choices) - 1) + [True]
        for i in range(a.PROBE):
            assert i == 0 or a.speculate(1)
            a.record(1, True, 0.025, tau)

    probe(1.5)
    assert not a.speculating and a.wait == 2 * a.FIRST_WAIT
    probes = 0
    while not a.speculating:  # text the drafts match: probes commit 4 tokens a cycle
        probe(4.0)
        probes += 1
    assert a.switches == 2 and probes <= 3 and a.wait == a.FIRST_WAIT
    # while it speculates, a plain step every REFRESH cycles re-prices the alternative (a load change shows)
    a.record(1, False, 0.010)
    for _ in range(a.REFRESH):
        assert a.speculate(1)
        a.record(1, True, 0.025, 4.0)
    assert not a.speculate(1)
    a.record(1, False, 0.012)
    assert a.speculate(1) and a.t_step[1] == pytest.approx(0.010 + a.ALPHA_TIME * 0.002) and a.speculating
    a.reset()
    assert a.tau == 2.0 and not a.t_step and not a.speculate(1)


def test_adaptation_leaves_a_text_the_head_cannot_follow_early():
    """EARLY cycles in a row that accept no draft token switch to plain steps before MIN_RUN, where speculation
    loses on the average so far; the prior weighs as PRIOR_WEIGHT cycles, so it does not hold that average up.
    Misses after a text's good start do not switch early: its average still pays."""
    for prior in (None, 1.8):
        a = engine.Adaptation(prior_tau=prior)
        for seconds in (0.100, 0.010):
            a.record(1, False, seconds)
        for _ in range(a.EARLY):
            assert a.speculating and a.speculate(1)
            a.record(1, True, 0.015, 1.0)  # a cycle priced 1.5 plain steps, committing its bonus token only
        assert not a.speculating and a.switches == 1 and a.run == a.EARLY < a.MIN_RUN
        assert a.tau == pytest.approx(1.0 if prior is None else (1.8 * a.PRIOR_WEIGHT + a.EARLY) / (a.PRIOR_WEIGHT + a.EARLY))
    a = engine.Adaptation()
    for seconds in (0.100, 0.010):
        a.record(1, False, seconds)
    for tau in [3.0] * 6 + [1.0] * a.EARLY:
        a.record(1, True, 0.015, tau)
    assert a.speculating and a.misses == a.EARLY and a.gain(1) > 1  # (6 * 3 + 4) / 10 tokens a cycle still pay


def test_adaptive_sampling_is_lossless(monkeypatch):
    """The sampling G-test of the first three tokens with steps switched at random between cycles and plain steps
    (one adaptation across the calls, so the re-primed head and the plain steps' sampling both run)."""
    p, counts, accepts = sampling_e2e("t1", engine.accept_sampling, monkeypatch, adapt=Pattern(7))
    assert p > P_PASS, f"G-test p = {p:.2e}, {dict(counts)}"
    assert sum(accepts.values()) > 0 and counts["accepted"] > 0
