"""batched.py: B sequences per cycle give each row what a single-sequence Session gives it (greedy, fp32), and
the sampled rows follow the target's law (G-tests, failing with a broken verifier)."""
import collections

import pytest
import torch

import batched
from batched import BatchedSession
from generate import Sampling, Session, UsageError
from test_eagle import (CUSTOM_TREE, E2E_PROMPT, E2E_VOCAB, MAIN_E2E, P_BROKEN, P_PASS, SAMPLING_CONFIGS, VerifierLog,
                        accept_sampling_without_residual, copycat_head, first_tokens_law, g_test, tiny_prompts,
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
    session = BatchedSession(model, max(map(len, prompts)) + n, 4, head, None if spec is None else parse_tree(spec))
    out, stats = session.generate(prompts, n, Sampling(), stop)
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
    session = BatchedSession(model, max(map(len, prompts)) + n, 3, head, None if spec is None else parse_tree(spec))
    out, stats = session.generate(prompts, n, Sampling(), stop)
    assert out == ref
    if spec is not None:
        assert stats.accept_lengths == ref_accepts
    # refilled, not run in batches of three: fewer forwards than the three batches' longest rows take
    in_batches = sum(max(map(len, (ref_accepts if spec else ref)[i:i + 3])) for i in range(0, 7, 3))
    assert stats.target_forwards < in_batches


def test_sessions_of_other_batch_sizes_share_a_model():
    """Sessions of batch 2 and 3 (vanilla and EAGLE) on one model, called in turn: each call sets the shared
    caches up for its own batch (a session sharing the model with another reallocates nothing it fits)."""
    model = tiny_target()
    head = copycat_head(model, noise=HEAD_NOISE)
    prompts, n = tiny_prompts(4, model.config.vocab_size, seed=8), 10
    ref = session_outputs(model, head, "paper", prompts, n, frozenset())[0]
    sessions = [BatchedSession(model, 12 + n, b, h, t) for b in (2, 3) for h, t in ((None, None), (head, parse_tree("paper")))]
    for _ in range(2):
        for s in sessions:
            assert s.generate(prompts, n, Sampling())[0] == ref
            assert model.max_batch_size == s.batch_size


@pytest.mark.parametrize("spec", [None, "paper", "dynamic-4-4-12"])
def test_compiled_batched_session_does_not_recompile(spec):
    """Compiled steps give the eager tokens; after a warm-up batch, batches of other prompts (rows advancing and
    finishing at their own steps) compile nothing new."""
    model = tiny_target()
    head = None if spec is None else copycat_head(model, noise=HEAD_NOISE)
    tree = None if spec is None else parse_tree(spec)
    n = 16
    warm, prompts = tiny_prompts(3, model.config.vocab_size, seed=5), tiny_prompts(3, model.config.vocab_size, seed=6)
    eager = BatchedSession(model, 12 + n, 4, head, tree).generate(prompts, n, Sampling(), {7})[0]
    warm_ref = session_outputs(model, head, spec, warm, n, {7})[0]
    torch._dynamo.reset()
    session = BatchedSession(model, 12 + n, 4, head, tree, compile=True)
    session.generate(warm, n, Sampling(), {7})
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert session.generate(prompts, n, Sampling(), {7})[0] == eager
        assert session.generate(prompts[:2], n, Sampling(), {7})[0] == eager[:2]
        # more prompts than rows: finished rows are refilled
        assert session.generate(prompts + warm, n, Sampling(), {7})[0] == eager + warm_ref


def test_batched_session_refuses_bad_input():
    model = tiny_target()
    with pytest.raises(UsageError, match="needs a tree"):
        BatchedSession(model, 32, 2, copycat_head(model), None)
    session = BatchedSession(model, 32, 2)
    with pytest.raises(UsageError, match="no prompts"):
        session.generate([], 4, Sampling())
    with pytest.raises(UsageError, match="empty"):
        session.generate([[1], []], 4, Sampling())
    with pytest.raises(UsageError, match="max_seq_len"):
        session.generate([[1] * 30], 4, Sampling())


# ---------------------------------------------------------------- sampling: the target's law in every row
BATCH_SAMPLES = 12_000  # sampled rows in all, half per prompt
OTHER_PROMPT = [3, 6, 1, 1, 4]


def batched_sampling(config, verifier, monkeypatch, seed=0):
    """G-test p-values of the first three new tokens of rows of two prompts (alternating in a batch of 4),
    one generate call per batch, and the verifier's counts."""
    spec, sampling = SAMPLING_CONFIGS[config]
    model = tiny_target(vocab_size=E2E_VOCAB, n_layer=1, out_scale=2.0)
    head = copycat_head(model)
    prompts = [E2E_PROMPT, OTHER_PROMPT] * 2
    laws = [first_tokens_law(model, p, sampling) for p in prompts[:2]]
    log = VerifierLog(verifier)
    monkeypatch.setattr(batched, "accept_sampling", log)
    session = BatchedSession(model, len(OTHER_PROMPT) + 3, len(prompts), head, parse_tree(spec))
    torch.manual_seed(seed)
    observed = [collections.Counter(), collections.Counter()]
    for _ in range(BATCH_SAMPLES // len(prompts)):
        outs, _ = session.generate(prompts, 3, sampling)
        for i, out in enumerate(outs):
            observed[i % 2][tuple(out)] += 1
    return [g_test(o, law) for o, law in zip(observed, laws)], log.counts


def test_batched_sampling_is_lossless(monkeypatch):
    ps, counts = batched_sampling(MAIN_E2E, batched.accept_sampling, monkeypatch)
    assert min(ps) > P_PASS, f"G-test p = {ps}; verifier {dict(counts)}"
    assert counts["sampled_drafts"] == counts["cycles"] and counts["accepted"] > 0.5 * counts["cycles"]
    assert counts["sibling_rejected"] > 0.05 * counts["cycles"] and counts["children_rejected"] > 0.05 * counts["cycles"]


def test_batched_dynamic_tree_sampling_is_lossless(monkeypatch):
    """Each row's own dynamic tree (one-hot proposals of the draft's best tokens) under top-p: the target's law."""
    ps, counts = batched_sampling("topp0.8-dynamic", batched.accept_sampling, monkeypatch)
    assert min(ps) > P_PASS, f"G-test p = {ps}; verifier {dict(counts)}"
    assert counts["accepted"] > 0.3 * counts["cycles"]


def test_batched_sampling_with_a_broken_verifier_fails(monkeypatch):
    ps, _ = batched_sampling(MAIN_E2E, accept_sampling_without_residual, monkeypatch)
    assert min(ps) < P_BROKEN, f"the broken verifier passed the batched test: p = {ps}"
