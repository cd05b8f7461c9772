"""scripts/make_data.py: its answers (engine.Engine through answer_all) equal Session.generate's, its files
round-trip, runs resume."""
import argparse
import json
import shutil
import sys

import pytest
import torch

from engine import Engine, Sampling, Session, Steps
from model import ModelArgs, Transformer, causal_mask
from scripts import make_data
from scripts.make_data import Conversation, DataError, Turn, load_answers, read_chunk, write_chunk
from test_model import hf_config, write_checkpoint

pytestmark = pytest.mark.usefixtures("lean_torch")


def tiny_target(vocab_size=64, seed=0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(ModelArgs(dim=32, n_layer=2, n_head=4, n_local_heads=2, intermediate_size=64,
                                  vocab_size=vocab_size)).eval()
    with torch.no_grad():
        model.output.weight.mul_(3.0)  # sharp next-token distributions: no near-ties
    return model


def session_answers(model, turns, stop_ids):
    out = []
    for t in turns:
        answer, _ = Session(model, len(t.prompt) + t.max_new_tokens).generate(t.prompt, t.max_new_tokens, Sampling(),
                                                                              stop_ids)
        out.append(answer)
    return out


def engine_answers(model, turns, batch_size, max_len, stop_ids, compile=False, cut_loops=False, engine=None):
    """answer_all's answers and reasons to turns (keyed by their conversation field), in the turns' order."""
    queue, got = list(turns), {}
    engine = engine or Engine(model, max_len, batch_size, compile=compile)
    made = make_data.answer_all(engine, lambda: queue.pop(0) if queue else None,
                                lambda turn, answer, reason: got.__setitem__(turn.conversation, (list(answer), reason)),
                                stop_ids, cut_loops)
    assert made == sum(len(a) for a, _ in got.values())
    return [got[t.conversation] for t in turns], engine


def tiny_turns(n, vocab_size, seed=0, max_new=(3, 20)):
    g = torch.Generator().manual_seed(seed)
    return [Turn(torch.randint(0, vocab_size, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist(),
                 int(torch.randint(*max_new, (1,), generator=g)), Sampling(), i) for i in range(n)]


@pytest.mark.parametrize("compile", [False, True])
def test_answers_greedy_equal_session_tiny(compile):
    """Rows of different prompt lengths finish at different steps (budgets, a stop token, a full cache) and are
    refilled; every answer equals a single-sequence greedy generation. Compiled: after the engine's warm-up,
    no recompiles."""
    model = tiny_target()
    turns = tiny_turns(9, 64)
    stop = {7}
    ref = session_answers(model, turns, stop)
    assert any(a[-1] in stop for a in ref) and any(a[-1] not in stop for a in ref)  # both kinds of ending
    if compile:
        torch._dynamo.reset()
    full = Turn(list(range(1, 13)), 30, Sampling(), "fills the cache")  # 12 + 30 > max_len 40
    ref.append(session_answers(model, [full], stop)[0][:40 - 12])
    engine = Engine(model, 40, 4, compile=compile)
    engine.warm_up([1, 2, 3])
    # config.patch, not monkeypatch.setattr: monkeypatch's undo deletes the flag from dynamo's config module,
    # and the next recompile anywhere in the process fails reading it
    with torch._dynamo.config.patch(error_on_recompile=compile):
        got, _ = engine_answers(model, turns + [full], 4, 40, stop, engine=engine)
    assert [a for a, _ in got] == ref
    assert [reason for _, reason in got] == ["stop" if a[-1] in stop else "length" for a in ref]


def test_answers_in_bf16_keep_a_bf16_cache_and_equal_session():
    """bf16 weights and kv_dtype bf16 (as make_data runs them): the engine's keys and values are bf16 and its
    compiled step attends with model.decode_attention; the answers equal single-sequence generation of the same
    bf16 model (fp32 cache, PyTorch's attention) on a model without near-ties. The prefills stay eager, as the
    session's: a compiled bf16 prefill (Engine(compile=True)'s) keeps fp32 intermediates where eager rounds each op
    to bf16, which here parts one answer at its first token."""
    model = tiny_target().to(torch.bfloat16)
    turns = tiny_turns(6, 64, seed=2)
    ref = session_answers(model, turns, {7})
    torch._dynamo.reset()
    engine = Engine(model, 40, 4, steps=Steps.compiled("cpu"), kv_dtype=torch.bfloat16)
    got, _ = engine_answers(model, turns, 4, 40, {7}, engine=engine)
    assert model.kv_caches()[0].k_cache.dtype == torch.bfloat16
    assert [a for a, _ in got] == ref


def test_a_looping_answer_ends_where_the_loop_is_seen(monkeypatch):
    """With cut_loops, an answer whose tail repeats (checked every LOOP_EVERY tokens) ends there, finish "loop",
    and is the single-sequence answer cut at make_data.loop_start; the row is refilled."""
    monkeypatch.setattr(make_data, "LOOP_WINDOW", 4)
    monkeypatch.setattr(make_data, "LOOP_PERIOD", 6)
    monkeypatch.setattr(make_data, "LOOP_EVERY", 2)
    model = tiny_target()
    turns = tiny_turns(8, 64, seed=3, max_new=(30, 40))
    ref = session_answers(model, turns, set())
    got, _ = engine_answers(model, turns, 3, 60, set(), cut_loops=True)
    cuts = [make_data.loop_start(a, 2) for a in ref]
    assert any(c is not None and c < len(a) for c, a in zip(cuts, ref))  # some answers loop (tiny greedy models do)
    for (answer, reason), want, cut in zip(got, ref, cuts):
        if cut is not None and cut < len(want):
            assert (answer, reason) == (want[:cut], "loop")
        else:
            assert (answer, reason) == (want, "length")


def test_a_follow_up_reuses_the_row():
    """A follow-up turn (a conversation's next) runs in the row that holds its prefix and prefills only what is
    new; its answer equals a fresh single-sequence generation of the whole prompt."""
    model = tiny_target()
    first = Turn([3, 5, 9, 11], 6, Sampling(), "turn 1")
    answers, prefilled = {}, []

    def on_done(turn, answer, reason):
        answers[turn.conversation] = list(answer)
        if turn.conversation == "turn 1":
            return Turn(turn.prompt + list(answer) + [4, 4], 5, Sampling(), "turn 2")
        return None

    steps = Steps()  # eager, with a prefill that counts the tokens it runs
    prefill = steps.prefill
    steps.prefill = lambda model, tokens, *a: (prefilled.append(tokens.shape[1]), prefill(model, tokens, *a))[1]
    queue = [first, Turn([2, 2, 2], 4, Sampling(), "another")]
    make_data.answer_all(Engine(model, 40, 2, steps=steps), lambda: queue.pop(0) if queue else None, on_done)
    second_prompt = first.prompt + answers["turn 1"] + [4, 4]
    assert answers["turn 2"] == session_answers(model, [Turn(second_prompt, 5, Sampling())], set())[0]
    # turn 2 prefilled its two new tokens and turn 1's last answer token (sampled, never fed) only: the rest of
    # turn 1's answer ran through the target as it was decoded
    assert prefilled == [len(first.prompt), 3, 3]  # turn 1, another, turn 2


def test_answers_of_the_default_model(default_checkpoint):
    """The default model, fp32: the engine's greedy answers equal Session.generate's."""
    from tokenizer import Tokenizer

    model = Transformer.from_checkpoint(default_checkpoint)
    tokenizer = Tokenizer.load(default_checkpoint.parent)
    questions = ["What is 2+2?", "Write a haiku about the sea.", "Name three rivers.", "Who wrote Hamlet?"]
    turns = [Turn(tokenizer.encode_chat([{"role": "user", "content": q}]), n, Sampling(), i)
             for i, (q, n) in enumerate(zip(questions, [30, 12, 24, 16]))]
    ref = session_answers(model, turns, tokenizer.stop_ids)
    got, _ = engine_answers(model, turns, 2, 120, tokenizer.stop_ids)
    assert [a for a, _ in got] == ref


def test_batched_rows_match_single_rows():
    """model.forward with per-row cache slots [B, T] writes and reads each row as a batch-1 forward would."""
    model = tiny_target()
    model.setup_caches(2, 16)
    seqs = [torch.tensor([1, 2, 3, 4, 5]), torch.tensor([9, 8])]
    with torch.no_grad():
        for b, s in enumerate(seqs):  # prefill each row alone
            with model.cache_row(b):
                pos = torch.arange(len(s))
                model(s[None], pos, mask=causal_mask(pos, len(s)))
        pos = torch.tensor([[5], [2]])
        logits, _ = model(torch.tensor([[6], [7]]), pos, mask=causal_mask(pos, 6)[:, None])
        for b, s in enumerate(seqs):
            ref = tiny_target()
            ref.setup_caches(1, 16)
            full = torch.cat([s, torch.tensor([6 if b == 0 else 7])])
            expected, _ = ref(full[None], torch.arange(len(full)))
            torch.testing.assert_close(logits[b, -1], expected[0, -1], atol=1e-5, rtol=0)


def tiny_checkpoint_with_tokenizer(tmp_path, default_checkpoint):
    """A tiny target's checkpoint directory with the default model's tokenizer (its vocabulary: 49152)."""
    ckpt_dir = tmp_path / "tiny"
    target = tiny_target(vocab_size=49152)
    write_checkpoint(ckpt_dir, target, hf_config(target.config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_checkpoint.parent / name, ckpt_dir / name)
    return ckpt_dir


def conversations_with_records():
    a = Conversation(5, ["hi", "more"])
    a.records = [([1, 2, 3], [4, 5, 2], "stop"), ([1, 2, 3, 4, 5, 2, 9, 9], [6, 7], "length")]
    b = Conversation(6, ["x"])
    b.records = [([1, 8], [2], "stop")]
    return [a, b]


def test_chunk_round_trip_and_refusals(tmp_path):
    convs = conversations_with_records()
    manifest = write_chunk(tmp_path, "sharegpt-c000005-t0", convs,
                           {"target": {"weights_sha256": "abc"}, "sampling": {"temperature": 0.0}})
    assert manifest["answer_tokens"] == 6 and manifest["later_turn_answer_tokens"] == 2
    assert manifest["stored_tokens"] == 3 + 3 + 2 + 2 + 2 + 1  # turn 2 stores only its new prompt tokens
    records = read_chunk(tmp_path / "sharegpt-c000005-t0.json", "abc")
    assert [(r["prompt"], r["answer"], r["turn"], r["finish"]) for r in records] == \
        [(p, a, t, f) for c in convs for t, (p, a, f) in enumerate(c.records)]
    assert load_answers(tmp_path) == records
    with pytest.raises(DataError, match="other weights"):
        read_chunk(tmp_path / "sharegpt-c000005-t0.json", "another")
    (tmp_path / "sharegpt-c000005-t0.ids.xz").write_bytes(b"garbage")
    with pytest.raises(DataError, match="cannot be read"):
        read_chunk(tmp_path / "sharegpt-c000005-t0.json")


def test_make_data_resumes(tmp_path, default_checkpoint, capsys):
    """Two chunks of real ShareGPT conversations answered by a tiny target with the default tokenizer; a second
    run has nothing to do; a deleted chunk is made again, the other is left alone."""
    ckpt_dir = tiny_checkpoint_with_tokenizer(tmp_path, default_checkpoint)
    out = tmp_path / "data"
    args = ["--checkpoint", str(ckpt_dir / "model.pth"), "--out", str(out), "--conversations", "4", "--chunk", "2",
            "--batch_size", "3", "--max_new_tokens", "6", "--max_len", "400", "--no-compile", "--dtype", "float32"]
    make_data.main(args)
    manifests = sorted(out.glob("*.json"))
    assert [p.name for p in manifests] == ["sharegpt-c000200-t0.json", "sharegpt-c000202-t0.json"]
    first = json.loads(manifests[0].read_text())
    assert first["conversations"] == [200, 202] and first["answer_tokens"] > 0
    records = load_answers(out, first["target"]["weights_sha256"])
    assert all(len(r["answer"]) <= 6 for r in records) and {r["conversation"] for r in records} <= {200, 201, 202, 203}
    assert any(r["turn"] > 0 for r in records)  # later turns continue the conversation
    make_data.main(args)
    assert "nothing to do" in capsys.readouterr().err
    stamp = manifests[1].stat().st_mtime_ns
    manifests[0].unlink()
    make_data.main(args)
    assert manifests[0].exists() and manifests[1].stat().st_mtime_ns == stamp
    # a second pass over the same conversations: every chunk sampled at T=1 into files of its own, read beside the
    # first pass's, each pass's turns one training sequence per conversation (never joined across passes)
    make_data.main(args + ["--resample", "1"])
    assert sorted(p.name for p in out.glob("*-s1.json")) == ["sharegpt-c000200-t1-s1.json", "sharegpt-c000202-t1-s1.json"]
    both = load_answers(out)
    again = [r for r in both if r["resample"] == 1]
    assert len(both) == len(records) + len(again) and {r["temperature"] for r in again} == {1.0}
    assert {r["conversation"] for r in again} == {r["conversation"] for r in records}
    from scripts.train_eagle import conversation_sequences
    passes = [len(list(conversation_sequences([r for r in both if r["resample"] == n]))) for n in (0, 1)]
    assert len(list(conversation_sequences(both))) == sum(passes)


def test_a_stopped_run_keeps_the_conversations_it_finished(tmp_path, default_checkpoint, monkeypatch):
    """Stopped before its chunk is complete, a run writes the conversations it answered in full to OUT/partial/
    (not read as training data); the next run answers only the others, then writes the chunk and drops the
    partial file. Greedy fp32: the chunk holds what an uninterrupted run writes."""
    ckpt_dir = tiny_checkpoint_with_tokenizer(tmp_path, default_checkpoint)
    args = ["--checkpoint", str(ckpt_dir / "model.pth"), "--conversations", "4", "--chunk", "4", "--batch_size", "2",
            "--max_new_tokens", "6", "--max_len", "400", "--no-compile", "--dtype", "float32"]
    make_data.main(args + ["--out", str(tmp_path / "whole")])
    out, answer_all, asked = tmp_path / "data", make_data.answer_all, []

    def stopped_early(engine, next_turn, on_done, stop_ids=frozenset(), cut_loops=False, should_stop=None,
                      on_step=None):
        def done(turn, answer, reason):
            follow = on_done(turn, answer, reason)
            if follow is None:
                asked.append(turn.conversation.index)  # a conversation answered in full
            return follow
        return answer_all(engine, next_turn, done, stop_ids, cut_loops, should_stop=lambda: len(asked) >= 1,
                          on_step=on_step)

    monkeypatch.setattr(make_data, "answer_all", stopped_early)
    make_data.main(args + ["--out", str(out)])
    assert not list(out.glob("*.json")) and load_answers(out) == []
    kept = read_chunk(out / "partial" / "sharegpt-c000200-t0.json")
    assert {r["conversation"] for r in kept} == set(asked)
    monkeypatch.setattr(make_data, "answer_all", answer_all)
    answered = []
    monkeypatch.setattr(make_data, "conversation_turn", lambda conv, *a, _f=make_data.conversation_turn:
                        (answered.append(conv.index), _f(conv, *a))[1])
    make_data.main(args + ["--out", str(out)])
    assert not set(asked) & set(answered) and not list((out / "partial").glob("*"))
    assert load_answers(out) == load_answers(tmp_path / "whole")


def test_training_reads_stored_ids_with_the_targets_features(tmp_path):
    """train_eagle online --answers: the stored prompt + answer ids become training sequences (loss on the
    answer), and their packed target pass gives each sequence the features of a plain forward over it alone."""
    import argparse

    from eagle_head import EagleHead
    from scripts import train_eagle

    target = tiny_target()
    convs = conversations_with_records()
    write_chunk(tmp_path, "sharegpt-c000005-t0", convs, {"target": {"weights_sha256": make_data.weights_hash(target)},
                                                         "sampling": {"temperature": 0.0}})
    args = argparse.Namespace(answers=str(tmp_path), shards=None, pack_len=64, eval_records=4, eval_json=[])
    train, evals = train_eagle.online_sequences(args, make_data.weights_hash(target))
    assert evals == {}  # no heldout/ folder
    F, T = False, True  # a's second turn extends its first (its prompt starts with all of it): one sequence
    expected = [([1, 2, 3, 4, 5, 2, 9, 9, 6, 7], [F, F, F, T, T, T, F, F, T, T]), ([1, 8, 2], [F, F, T])]
    assert [(s["tokens"], s["loss_mask"]) for s in train] == expected
    records = [{"conversation": 1, "temperature": 0.0, "turn": 0, "prompt": [1, 2], "answer": [3]},
               {"conversation": 1, "temperature": 0.0, "turn": 1, "prompt": [1, 2, 4, 5], "answer": [6]}]
    assert list(train_eagle.conversation_sequences(records)) == [([1, 2, 3], [F, F, T]), ([1, 2, 4, 5, 6], [F, F, F, F, T])]
    # a looping answer: loss up to where the loop cut would have ended it, then nothing; a later turn that
    # continues it keeps the looped tokens as context
    loop = list(range(100, 140)) + [7, 8, 9] * 60  # period 3 from token 40 on
    start = make_data.loop_start(loop)
    assert start is not None and start % make_data.LOOP_EVERY == 0 and 40 + make_data.LOOP_WINDOW <= start < 40 + 64 + 16
    assert make_data.loop_start(list(range(300))) is None
    looped = [{"conversation": 2, "temperature": 0.0, "turn": 0, "prompt": [1, 2], "answer": loop}]
    (tokens, mask), = train_eagle.conversation_sequences(looped)
    assert tokens == [1, 2] + loop[:start] and mask == [F, F] + [T] * start
    (tokens, mask), = train_eagle.conversation_sequences(looped, loops=True)
    assert tokens == [1, 2] + loop and sum(mask) == len(loop)
    looped.append({"conversation": 2, "temperature": 0.0, "turn": 1, "prompt": [1, 2] + loop + [5], "answer": [6]})
    (tokens, mask), = train_eagle.conversation_sequences(looped)
    assert tokens == [1, 2] + loop + [5, 6] and mask == [F, F] + [T] * start + [F] * (len(loop) - start + 1) + [T]
    with pytest.raises(DataError, match="other weights"):
        train_eagle.online_sequences(args, "another")
    batch = train_eagle.target_pass(target, EagleHead(target.config), train_eagle.packed_batch(train, [[0, 1]]))
    at = 0
    for s in train:
        n = len(s["tokens"])
        fresh = tiny_target()
        fresh.setup_caches(1, n)
        logits, features = fresh(torch.tensor([s["tokens"]]), torch.arange(n))
        torch.testing.assert_close(batch["features"][0, at: at + n], features[0], atol=1e-5, rtol=0)
        scored = torch.tensor(s["loss_mask"])  # the target's token and distribution where a draft is scored
        assert torch.equal(batch["target_top"][0, at: at + n][scored], logits[0, scored].argmax(-1))
        torch.testing.assert_close(batch["target_p"][0, at: at + n][scored], logits[0, scored].softmax(-1))
        assert not batch["target_p"][0, at: at + n][~scored].any()
        at += n
    # training's bf16 copy: its Linear weights in bf16, a weight tied to the embeddings stays fp32 there, and
    # under autocast it computes exactly what the target computes
    target.output.weight = target.tok_embeddings.weight
    copy = train_eagle.linears_in_bf16(target)
    assert copy.output.weight.dtype == torch.bfloat16 and copy.layers[0].attention.wqkv.weight.dtype == torch.bfloat16
    assert copy.tok_embeddings.weight.dtype == target.output.weight.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rows = train_eagle.packed_batch(train, [[0, 1]])
        ours, theirs = (train_eagle.target_pass(m, EagleHead(target.config), rows) for m in (copy, target))
    for key in ("features", "target_top", "target_p"):
        assert torch.equal(ours[key], theirs[key]), key


def test_heldout_answers_go_to_their_own_folder(tmp_path, default_checkpoint, monkeypatch):
    """--heldout answers the first (never trained on) conversations into OUT/heldout/, which training reads as
    its evaluation set and load_answers(OUT) leaves out."""
    ckpt_dir = tiny_checkpoint_with_tokenizer(tmp_path, default_checkpoint)
    out = tmp_path / "data"
    make_data.main(["--checkpoint", str(ckpt_dir / "model.pth"), "--out", str(out), "--conversations", "2",
                    "--batch_size", "2", "--max_new_tokens", "4", "--max_len", "400", "--no-compile",
                    "--dtype", "float32", "--heldout"])
    manifest = json.loads((out / "heldout" / "sharegpt-c000000-t0.json").read_text())
    assert manifest["conversations"] == [0, 2] and load_answers(out) == []
    assert {r["conversation"] for r in load_answers(out / "heldout")} <= {0, 1}
    # train_eagle eval --answers: a head's held-out accuracy and acceptance model measured on these answers
    from eagle_head import EagleHead
    from scripts import train_eagle

    target = Transformer.from_checkpoint(ckpt_dir / "model.pth")
    head_dir = tmp_path / "head"
    EagleHead.for_target(target.config).save(head_dir)
    monkeypatch.setattr(sys, "argv", ["train_eagle.py", "eval", "--checkpoint", str(ckpt_dir / "model.pth"),
                                      "--head", str(head_dir), "--sets", "answers", "--answers", str(out),
                                      "--acceptance_set", "answers", "--records", "4"])
    train_eagle.main()
    expected = train_eagle.answer_sequences(out / "heldout", make_data.weights_hash(target), 1024, temperature=0.0)
    assert json.loads((head_dir / "heldout-answers.json").read_text()) == expected[:4] != []
    acceptance = json.loads((head_dir / "acceptance.json").read_text())
    assert acceptance["set"] == "heldout-answers.json" and acceptance["nodes"][0] > 0
    # the features it measures with hold no autograd graph (one held the whole forward's activations per sequence:
    # ~1 GB per 1,024 tokens of the default model, which ran out of memory on 20 sequences)
    with torch.enable_grad():  # as in the script (the tests' conftest turns gradients off)
        assert not train_eagle.heldout_records(target, expected[:1])[0]["features"].requires_grad
    # the same conversations sampled at T=1 (--resample 1): set 'answers-t1', on which --sampled_set measures the
    # temperature-1 acceptance model; training's held-out set stays the greedy answers
    make_data.main(["--checkpoint", str(ckpt_dir / "model.pth"), "--out", str(out), "--conversations", "2",
                    "--batch_size", "2", "--max_new_tokens", "4", "--max_len", "400", "--no-compile",
                    "--dtype", "float32", "--heldout", "--resample", "1"])
    sampled = train_eagle.answer_sequences(out / "heldout", make_data.weights_hash(target), 1024, temperature=1.0)
    assert sampled and sampled != expected
    monkeypatch.setattr(sys, "argv", ["train_eagle.py", "eval", "--checkpoint", str(ckpt_dir / "model.pth"),
                                      "--head", str(head_dir), "--sets", "answers", "answers-t1", "--answers", str(out),
                                      "--acceptance_set", "answers", "--sampled_set", "answers-t1", "--records", "4"])
    train_eagle.main()
    assert json.loads((head_dir / "heldout-answers-t1.json").read_text()) == sampled[:4]
    acceptance = json.loads((head_dir / "acceptance.json").read_text())
    assert acceptance["set"] == "heldout-answers.json" and acceptance["sampled"]["set"] == "heldout-answers-t1.json"
    args = argparse.Namespace(answers=str(out), shards=None, pack_len=1024, eval_records=4, eval_json=[])
    assert train_eagle.online_sequences(args, make_data.weights_hash(target))[1]["answers"] == expected[:4]


def test_a_looping_answer_ends_as_a_loop():
    """An answer that repeats one phrase ends with finish 'loop' once 64 tokens repeat; varied text does not."""
    from scripts.make_data import LOOP_PERIOD, LOOP_WINDOW, looping

    phrase = [5, 9, 13, 2, 7]
    assert looping([1, 2, 3] + phrase * 30) and not looping(list(range(300)))
    assert looping(phrase * ((LOOP_WINDOW + 5) // 5 + 1)) and not looping(phrase * ((LOOP_WINDOW + 5) // 5))
    passage = list(range(100, 100 + LOOP_PERIOD))  # a paragraph repeated, the longest period cut
    assert looping([1] + passage * 2 + passage[:LOOP_WINDOW]) and not looping([1] + passage + passage[:LOOP_WINDOW - 1])

    model = tiny_target()
    with torch.no_grad():
        model.output.weight.zero_()
        model.tok_embeddings.weight.zero_()  # every position sees the same input: one token forever
    turn = Turn([1, 2, 3], 300, Sampling(), 0)
    got, _ = engine_answers(model, [turn], 2, 400, set())
    assert got[0][1] == "length"  # without the cut
    got, _ = engine_answers(model, [turn], 2, 400, set(), cut_loops=True)
    assert got[0][1] == "loop" and len(got[0][0]) < 300


def test_a_resumed_training_run_keeps_its_chunks_and_exports_its_head(tmp_path, monkeypatch):
    """train_eagle online --answers reads the chunks there at its first start and keeps to them when resumed,
    while the data job adds more; where it stops (here --stop_after) --save_head exports the head so far,
    its record saying how far it got."""
    from scripts import train_eagle

    target = tiny_target()
    ckpt = write_checkpoint(tmp_path / "tiny", target, hf_config(target.config))
    manifest = {"target": {"weights_sha256": make_data.weights_hash(target)}, "sampling": {"temperature": 0.0}}
    data, run, head = tmp_path / "data", tmp_path / "run", tmp_path / "head"
    write_chunk(data, "sharegpt-c000005-t0", conversations_with_records(), manifest)

    def online(*extra):
        monkeypatch.setattr(sys, "argv", ["train_eagle.py", "online", "--checkpoint", str(ckpt), "--answers", str(data),
                                          "--out", str(run), "--save_head", str(head), "--head", "eagle", "--draft_vocab", "0",
                                          "--pack_len", "16", "--batch_size", "1", "--ttt_steps", "1", "--max_steps", "4",
                                          "--eval_every", "10", "--save_every", "1", "--no-bf16", "--threads", "1", *extra])
        with torch.enable_grad():
            train_eagle.main()
        return json.loads((head / "training_record.json").read_text())

    first = online("--stop_after", "1")
    assert (first["steps"], first["of_steps"], first["finished"], first["chunks"]) == (1, 4, False, 1)
    write_chunk(data, "sharegpt-c000007-t0", conversations_with_records(), manifest)  # the data job wrote more
    assert len(load_answers(data)) == 2 * len(load_answers(data, names=["sharegpt-c000005-t0"]))
    second = online()
    assert (second["steps"], second["finished"], second["chunks"]) == (4, True, 1)
    assert second["train_sequences"] == first["train_sequences"]
    assert torch.load(run / "checkpoint.pt", weights_only=False)["state"]["chunks"] == ["sharegpt-c000005-t0"]
