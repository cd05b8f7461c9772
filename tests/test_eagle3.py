"""The EAGLE-3 head: official layout round trips, fit checks, draft ids through d2t, the target's fused
features, greedy generation through generate.Session, and training-time test (scripts/train_eagle.py)."""
import json

import pytest
import torch

import generate
from eagle_head import EagleHead, Eagle3Head, default_feature_layers, load_head
from model import CheckpointError, ModelArgs, Transformer
from test_model import hf_config, write_checkpoint
from tree import parse_tree

# 8 layers: the default boundaries (2, 4, 5) are distinct; no GQA, so the copycat head below can copy
TINY = ModelArgs(dim=32, n_layer=8, n_head=4, n_local_heads=4, intermediate_size=64, vocab_size=64)
EVEN = torch.arange(0, TINY.vocab_size, 2)  # a reduced draft vocabulary: even token ids


pytestmark = pytest.mark.usefixtures("lean_torch")


def tiny_target(seed=0, out_scale=3.0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(TINY).eval()
    with torch.no_grad():
        model.output.weight.mul_(out_scale)  # sharper next-token distributions
    return model


def random_head(draft_vocab=None, seed=1) -> Eagle3Head:
    torch.manual_seed(seed)
    head = Eagle3Head.for_target(TINY, draft_vocab).eval()
    with torch.no_grad():  # norms away from 1, so a swapped norm weight shows
        for norm in (head.input_norm, head.hidden_norm, head.post_attention_norm, head.norm):
            norm.weight.uniform_(0.5, 1.5)
    return head


def head_output(head, seed=0, T=6):
    """The head's output and draft logits for a first step (fused features) and a draft step (its own)."""
    g = torch.Generator().manual_seed(seed)
    embeds = torch.randn(1, T, TINY.dim, generator=g)
    fused = torch.randn(1, T, head.feature_dim, generator=g)
    head.setup_caches(2 * T)
    first = head(embeds, fused, torch.arange(T))
    second = head(embeds.flip(1), first, torch.arange(T, 2 * T))
    return first, second, head.draft_logits(second)


def read_state(path):
    if (path / "model.safetensors").is_file():
        from safetensors.torch import load_file
        return load_file(path / "model.safetensors")
    return torch.load(path / "pytorch_model.bin", weights_only=True)


# ---------------------------------------------------------------- layout
@pytest.mark.parametrize("safetensors", [False, True])
@pytest.mark.parametrize("draft_vocab", [None, EVEN])
def test_official_layout_round_trip(tmp_path, safetensors, draft_vocab):
    head = random_head(draft_vocab)
    head.save(tmp_path, safetensors=safetensors)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["draft_vocab_size"] == (TINY.vocab_size if draft_vocab is None else len(draft_vocab))
    assert config["vocab_size"] == TINY.vocab_size
    # the layer ids as each loader reads them: vLLM's top-level boundaries, SGLang's "output of layer k"
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    state = read_state(tmp_path)
    expected = {"fc.weight", "norm.weight", "lm_head.weight"} | {
        f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"} | {
        f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")} | {
        f"midlayer.{n}.weight" for n in ("hidden_norm", "input_layernorm", "post_attention_layernorm")}
    assert set(state) == expected | (set() if draft_vocab is None else {"d2t", "t2d"})
    dim = TINY.dim
    assert state["fc.weight"].shape == (dim, 3 * dim)
    assert state["midlayer.self_attn.q_proj.weight"].shape == (dim, 2 * dim)
    assert state["midlayer.self_attn.k_proj.weight"].shape == (TINY.n_local_heads * TINY.head_dim, 2 * dim)
    if draft_vocab is not None:
        assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool
        assert torch.equal(torch.arange(len(draft_vocab)) + state["d2t"], draft_vocab)
        assert torch.equal(state["t2d"].nonzero()[:, 0], draft_vocab)
    loaded = load_head(tmp_path)
    assert isinstance(loaded, Eagle3Head) and loaded.feature_layers == (2, 4, 5)
    assert loaded.draft_vocab is None if draft_vocab is None else torch.equal(loaded.draft_vocab, draft_vocab)
    with torch.no_grad():
        for ours, theirs in zip(head_output(loaded), head_output(head)):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_load_head_picks_the_class(tmp_path):
    EagleHead.for_target(TINY).save(tmp_path / "eagle1")
    random_head().save(tmp_path / "eagle3")
    assert type(load_head(tmp_path / "eagle1")) is EagleHead
    assert type(load_head(tmp_path / "eagle3")) is Eagle3Head
    with pytest.raises(CheckpointError, match="config.json missing"):
        load_head(tmp_path / "nothing")


def test_official_heads_without_layer_ids_take_the_targets_defaults(tmp_path):
    """yuhuili's EAGLE3 heads name no layers: they read the target's default boundaries, settled by
    check_fits; SGLang's eagle_config ids are "output of layer k" when the first is 1."""
    random_head().save(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    plain = {k: v for k, v in config.items() if k not in ("eagle_aux_hidden_state_layer_ids", "eagle_config")}
    (tmp_path / "config.json").write_text(json.dumps(plain))
    head = load_head(tmp_path)
    assert head.feature_layers is None
    head.check_fits(TINY, TINY.vocab_size)
    assert head.feature_layers == default_feature_layers(TINY.n_layer) == (2, 4, 5)
    (tmp_path / "config.json").write_text(json.dumps({**plain, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 4, 7]}}))
    assert load_head(tmp_path).feature_layers == (2, 5, 8)
    (tmp_path / "config.json").write_text(json.dumps({**plain, "eagle_aux_hidden_state_layer_ids": [1, 4, 7]}))
    assert load_head(tmp_path).feature_layers == (1, 4, 7)


def test_draft_ids_map_to_token_ids_through_d2t(tmp_path):
    """Draft index i drafts token i + d2t[i], whatever the order of the draft vocabulary."""
    vocab = torch.tensor([5, 9, 10, 33, 60, 63])
    head = random_head(vocab)
    assert torch.equal(head.token_ids(torch.arange(6)), vocab)
    head.save(tmp_path)
    state = read_state(tmp_path)
    assert state["d2t"].tolist() == [5, 8, 8, 30, 56, 58]
    loaded = load_head(tmp_path)
    index = torch.tensor([[3, 0], [5, 1]])
    assert loaded.token_ids(index).tolist() == [[33, 5], [63, 9]]
    # a draft step's top token, in token ids: the draft logits' argmax through the map
    hidden = torch.randn(2, loaded.config.dim)
    logits = loaded.draft_logits(hidden)
    assert loaded.token_ids(logits.argmax(-1)).tolist() == vocab[logits.argmax(-1)].tolist()


def test_head_that_does_not_fit_is_refused(tmp_path):
    narrow = ModelArgs(**{**TINY.__dict__, "dim": 16, "n_head": 2, "n_local_heads": 2, "head_dim": 0})
    Eagle3Head.for_target(narrow).save(tmp_path / "narrow")
    with pytest.raises(CheckpointError, match="hidden size 16 .* hidden size 32"):
        load_head(tmp_path / "narrow").check_fits(TINY, TINY.vocab_size)
    Eagle3Head.for_target(ModelArgs(**{**TINY.__dict__, "vocab_size": 50})).save(tmp_path / "vocab")
    with pytest.raises(CheckpointError, match="vocabulary 50 .* vocabulary 64"):
        load_head(tmp_path / "vocab").check_fits(TINY, TINY.vocab_size)
    Eagle3Head.for_target(TINY, feature_layers=(2, 6, 9)).save(tmp_path / "deep")
    with pytest.raises(CheckpointError, match=r"layers \[2, 6, 9\], which a 8-layer target does not have"):
        load_head(tmp_path / "deep").check_fits(TINY, TINY.vocab_size)
    shallow = ModelArgs(**{**TINY.__dict__, "n_layer": 5})  # default boundaries (2, 2, 2)
    random_head().save(tmp_path / "defaults")
    config = json.loads((tmp_path / "defaults" / "config.json").read_text())
    (tmp_path / "defaults" / "config.json").write_text(json.dumps(
        {k: v for k, v in config.items() if k not in ("eagle_aux_hidden_state_layer_ids", "eagle_config")}))
    with pytest.raises(CheckpointError, match="a 5-layer target does not have"):
        load_head(tmp_path / "defaults").check_fits(shallow, TINY.vocab_size)


def test_broken_checkpoints_are_refused(tmp_path):
    random_head(EVEN).save(tmp_path / "head")
    good = read_state(tmp_path / "head")
    config = json.loads((tmp_path / "head" / "config.json").read_text())

    def variant(name, state=None, **config_changes):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**config, **config_changes}))
        torch.save(good if state is None else state, d / "pytorch_model.bin")
        return d

    no_map = {k: v for k, v in good.items() if k not in ("d2t", "t2d")}
    with pytest.raises(CheckpointError, match="drafts 32 of 64 tokens but has no d2t"):
        load_head(variant("no-d2t", no_map))
    with pytest.raises(CheckpointError, match="t2d does not mark"):
        load_head(variant("bad-t2d", {**good, "t2d": ~good["t2d"]}))
    with pytest.raises(CheckpointError, match="d2t does not map"):
        load_head(variant("bad-d2t", {**good, "d2t": good["d2t"] + 100}))
    with pytest.raises(CheckpointError, match="lacks weight midlayer.hidden_norm.weight"):
        load_head(variant("eagle1-ish", {k: v for k, v in good.items() if k != "midlayer.hidden_norm.weight"}))
    with pytest.raises(CheckpointError, match="does not match its config.json"):
        load_head(variant("wrong-size", draft_vocab_size=32, intermediate_size=48))
    with pytest.raises(CheckpointError, match="target_hidden_size"):
        load_head(variant("wide-target", target_hidden_size=64))


# ---------------------------------------------------------------- fused features
def test_target_returns_the_fused_features():
    """With feature_layers set, the target's features are the hidden states entering those layers
    (n_layer: the last layer's output), concatenated; logits are unchanged."""
    model = tiny_target()
    model.setup_caches(1, 8)
    tokens, pos = torch.randint(0, TINY.vocab_size, (1, 6)), torch.arange(6)
    seen = []
    hooks = [model.layers[i].register_forward_pre_hook(lambda m, args: seen.append(args[0])) for i in (2, 5)]
    logits, post_norm = model(tokens, pos)
    for h in hooks:
        h.remove()
    model.feature_layers = (0, 2, 5, 8)
    fused_logits, fused = model(tokens, pos)
    assert torch.equal(fused_logits, logits) and fused.shape == (1, 6, 4 * TINY.dim)
    parts = fused.split(TINY.dim, -1)
    torch.testing.assert_close(parts[0], model.tok_embeddings(tokens))
    torch.testing.assert_close(parts[1], seen[0])
    torch.testing.assert_close(parts[2], seen[1])
    torch.testing.assert_close(model.norm(parts[3]), post_norm)


# ---------------------------------------------------------------- generation
def copycat_head(target: Transformer, draft_vocab=None) -> Eagle3Head:
    """An EAGLE-3 head whose attention copies the current token's normalized embedding (large self
    scores, values = the embedding half of its input) and whose LM head is the target's: a tiny target's
    next token mostly follows from its current token, so the first draft step is often right, and later
    steps (their residual adds the previous step's copy) sometimes."""
    head = Eagle3Head.for_target(target.config, draft_vocab).eval()
    dim, hd = TINY.dim, TINY.head_dim
    eye = torch.eye(dim)
    with torch.no_grad():
        head.fc.weight.zero_()
        head.feed_forward.w2.weight.zero_()
        wq, wk, wv = torch.zeros(dim, 2 * dim), torch.zeros(dim, 2 * dim), torch.zeros(dim, 2 * dim)
        wq[:, :dim], wk[:, :dim], wv[:, :dim] = 10 * eye, eye, eye  # per head: its slice of the embedding
        head.attention.wqkv.weight.copy_(torch.cat([wq, wk, wv]))
        head.attention.wo.weight.copy_(4 * eye)
        head.norm.weight.copy_(target.norm.weight)
        rows = target.output.weight if draft_vocab is None else target.output.weight[draft_vocab]
        head.lm_head.weight.copy_(rows)
    assert hd * TINY.n_head == dim
    return head


def eagle3_session(model, head, max_seq_len, tree, steps=None):
    """generate.Session with an EAGLE-3 head, checked as generate.load does (each step sets the target to return
    the head's fused features)."""
    head.check_fits(model.config, model.config.vocab_size)
    return generate.Session(model, max_seq_len, head, tree, steps)


def vanilla(model, prompt, n):
    return generate.Session(model, len(prompt) + n).generate(prompt, n, generate.Sampling())[0]


@pytest.mark.parametrize("spec", ["chain-3", "paper", "dynamic-4-4-12"])
@pytest.mark.parametrize("kind", ["copycat", "copycat-even", "random"])
def test_greedy_eagle3_equals_vanilla(spec, kind):
    """Greedy EAGLE with an EAGLE-3 head == vanilla greedy (fp32), for chain, static and dynamic trees.
    The copycat heads' drafts are accepted (whole-depth and partial acceptances go through commit), also
    when they draft from even token ids only, mapped through d2t (a broken map would propose the wrong
    tokens and be rejected as the random head is: mean acceptance < 0.2 here, the copycats' >= 0.5)."""
    model = tiny_target()
    draft_vocab = EVEN if kind == "copycat-even" else None
    head = random_head(EVEN) if kind == "random" else copycat_head(model, draft_vocab)
    tree = parse_tree(spec)
    accepted, n = [], 24
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        prompt = torch.randint(0, TINY.vocab_size, (5,), generator=g).tolist()
        ref = vanilla(model, prompt, n)
        out, stats = eagle3_session(model, head, len(prompt) + n, tree).generate(prompt, n, generate.Sampling())
        assert out == ref
        accepted += stats.accept_lengths
    mean = sum(accepted) / len(accepted)
    if kind == "random":
        assert mean < 0.2
    else:
        assert mean >= 0.5 and max(accepted) >= 3
    model.feature_layers = None


def test_sessions_with_both_head_kinds_share_one_target():
    """An EAGLE-3 session, an EAGLE-1 session and a vanilla one made first on one target, then used in
    turn: each generation sets the target's feature layers to its own head's, so all stay lossless."""
    model = tiny_target()
    prompt, n = [3, 8, 13, 21, 34], 16
    ref = vanilla(model, prompt, n)
    head3 = copycat_head(model)
    # the vanilla session first: sessions size the shared KV cache, the EAGLE ones (same tree) the largest
    sessions = {"vanilla": generate.Session(model, len(prompt) + n),
                "eagle3": eagle3_session(model, head3, len(prompt) + n, parse_tree("chain-3")),
                "eagle1": generate.Session(model, len(prompt) + n, EagleHead.for_target(model.config).eval(),
                                           parse_tree("chain-3"))}
    for name in ["eagle3", "eagle1", "eagle3", "vanilla", "eagle3"]:
        sessions[name].reset()
        out, stats = sessions[name].generate(prompt, n, generate.Sampling())
        assert out == ref, name
        assert model.feature_layers == (head3.feature_layers if name == "eagle3" else None)
        if name == "eagle3":
            assert max(stats.accept_lengths) >= 2  # its drafts are still accepted: it read fused features
    model.feature_layers = None


def test_generation_feeds_fused_features_then_own_hiddens():
    """After a target forward (the prompt, each commit) the head reads the target's fused features
    (3 * dim wide, the hidden states at its layers); at a draft step, the hidden it output for the
    node's parent (dim wide)."""
    model, seen = tiny_target(), []
    head = random_head(EVEN)
    steps = generate.Steps()

    def spy(name):
        real = getattr(steps, name)

        def call(target, h, tokens, features, *rest):
            out = real(target, h, tokens, features, *rest)
            seen.append((name, features.clone(), out.hidden.clone()))
            return out
        setattr(steps, name, call)

    for name in ("head_prefill", "draft", "head_update"):
        spy(name)
    prompt = [3, 8, 13, 21, 34]
    eagle3_session(model, head, 16, parse_tree("chain-3"), steps).generate(prompt, 6, generate.Sampling())
    names = [name for name, _, _ in seen]
    assert names[:4] == ["head_prefill", "draft", "draft", "head_update"]
    model.feature_layers = None
    model.setup_caches(1, 16)
    _, post_norm = model(torch.tensor([prompt]), torch.arange(5))
    model.feature_layers = head.feature_layers
    _, fused = model(torch.tensor([prompt]), torch.arange(5))
    torch.testing.assert_close(seen[0][1], fused)  # the prompt's fused features
    assert not torch.allclose(seen[0][1][..., -TINY.dim:], post_norm)
    for (name, features, _), (_, _, parent_out) in zip(seen[1:], seen):
        if name == "draft":  # a chain: the parent is the previous call's only output row
            assert features.shape[-1] == TINY.dim
            torch.testing.assert_close(features, parent_out[:, -1:])
        else:
            assert features.shape[-1] == head.feature_dim == 3 * TINY.dim
    model.feature_layers = None


# ---------------------------------------------------------------- training-time test
def tiny_sequences(n=2, length=12, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [{"tokens": torch.randint(0, TINY.vocab_size, (length + i,), generator=g).tolist(),
             "loss_mask": [i >= 3 for i in range(length + i)]} for i in range(n)]


def chains_one_at_a_time(target, head, sequence, steps, feed):
    """Brute force through the head's inference path (KV cache, as generation drafts a chain): for every
    start j, the head reads the true pairs 0..j, then drafts steps - 1 more, each fed `feed`: "own", the
    hidden it output at the step before (training-time test), or "true", the target's features at that
    position (teacher forcing). Returns per step the CE, the top-1 hits and the positions scored."""
    from scripts.train_eagle import packed_batch, target_pass

    batch = target_pass(target, head, packed_batch([sequence], [[0]]))
    tokens, features, L = batch["tokens"][0], batch["features"], len(sequence["tokens"])
    embeds = target.tok_embeddings(tokens)[None]
    ce, hits, count = [0.0] * steps, [0] * steps, [0] * steps
    for j in range(L - 1):
        head.setup_caches(L + steps)
        slots = torch.arange(j + 1)
        hidden = head(embeds[:, 1: j + 2], features[:, : j + 1], slots)[:, -1:]
        for s in range(steps):
            if j + 1 + s >= L:
                break
            if s:
                slot = torch.tensor([j + s])
                fed = hidden if feed == "own" else features[:, j + s: j + s + 1]
                hidden = head(embeds[:, j + 1 + s: j + 2 + s], fed, slot)
            at = j + 1 + s
            if sequence["loss_mask"][at]:
                logp = head.draft_logits(hidden[0, 0]).float().log_softmax(-1)
                ce[s] += -(batch["target_p"][0, at] * logp).sum().item()
                hits[s] += int(head.token_ids(logp.argmax()) == batch["target_top"][0, at])
                count[s] += 1
    head.clear_kv_caches()
    return ce, hits, count


@pytest.mark.parametrize("kind", ["eagle3", "eagle", "eagle-2-layers"])
def test_unrolled_steps_feed_the_heads_own_hiddens(kind):
    """Training-time test on two sequences packed in one row equals drafting every chain one at a time
    with the head's own hiddens fed back; feeding the target's true features instead (what EAGLE-1
    training does) gives other losses at the later steps, so an unrolling that did so fails here."""
    from scripts.train_eagle import pack_rows, packed_batch, target_pass, unrolled_steps

    target = tiny_target()
    head = random_head(EVEN) if kind == "eagle3" else EagleHead.for_target(TINY, n_layer=2 if "2" in kind else 1).eval()
    with torch.no_grad():  # confident drafts, so what a step is fed shows in its loss
        (head.lm_head if kind == "eagle3" else head.fc).weight.mul_(10)
    if kind != "eagle3":
        head.draft_vocab = EVEN
        head.bind(target.output.weight)
    head.setup_rope(64)
    sequences, steps = tiny_sequences(), 3
    rows = pack_rows([len(s["tokens"]) for s in sequences], 64)
    assert rows == [[1, 0]]  # one row: the second sequence first, the first after it
    unrolled = unrolled_steps(target, head, target_pass(target, head, packed_batch(sequences, rows)), steps)
    own = [chains_one_at_a_time(target, head, seq, steps, "own") for seq in sequences]
    true = [chains_one_at_a_time(target, head, seq, steps, "true") for seq in sequences]
    for s in range(steps):
        count = sum(o[2][s] for o in own)
        assert unrolled[s]["count"] == count > 0
        assert unrolled[s]["hits"] == sum(o[1][s] for o in own)
        torch.testing.assert_close(unrolled[s]["ce"].item(), sum(o[0][s] for o in own) / count, rtol=1e-4, atol=1e-5)
        if s:
            assert abs(sum(t[0][s] for t in true) / count - unrolled[s]["ce"].item()) > 0.1
    torch.testing.assert_close(sum(t[0][0] for t in true), sum(o[0][0] for o in own))  # step 0 is the same


def test_unrolled_loss_weights_and_eagle1_step_zero():
    """EAGLE-3's loss is sum_s 0.8^s CE_s; EAGLE-1's one-step loss is the shard path's (forward_batch)."""
    from scripts.train_eagle import (forward_batch, packed_batch, target_pass, unrolled_loss,
                                     unrolled_steps)

    target = tiny_target()
    head = random_head(EVEN)
    head.setup_rope(64)
    seq = tiny_sequences(1)[0]
    batch = target_pass(target, head, packed_batch([seq], [[0]]))
    steps = unrolled_steps(target, head, batch, 3)
    torch.testing.assert_close(unrolled_loss(head, steps), steps[0]["ce"] + 0.8 * steps[1]["ce"] + 0.64 * steps[2]["ce"])
    assert "smooth_l1" not in steps[0]
    eagle = EagleHead.for_target(TINY).eval()
    eagle.draft_vocab = EVEN
    eagle.bind(target.output.weight)
    eagle.setup_rope(64)
    batch = target_pass(target, eagle, packed_batch([seq], [[0]]))
    record = {"tokens": torch.tensor(seq["tokens"]), "loss_mask": torch.tensor(seq["loss_mask"]),
              "features": batch["features"][0]}
    shard_loss = forward_batch(target, eagle, [record], "cpu", ce_weight=1.0)[0]
    one = unrolled_steps(target, eagle, batch, 1)
    torch.testing.assert_close(unrolled_loss(eagle, one, ce_weight=1.0), shard_loss, rtol=1e-5, atol=1e-6)
    three = unrolled_steps(target, eagle, batch, 3)
    torch.testing.assert_close(unrolled_loss(eagle, three, ce_weight=0.5),
                               three[0]["smooth_l1"] + 0.5 * (three[0]["ce"] + 0.8 * three[1]["ce"] + 0.64 * three[2]["ce"]))


@pytest.mark.parametrize("n_layer", [1, 2])
def test_unrolled_evaluation_equals_chained_accuracy(n_layer):
    """The online held-out evaluation of an EAGLE-1 head gives evaluate()'s chained top-1 accuracies."""
    from scripts.train_eagle import evaluate, evaluate_unrolled

    target = tiny_target()
    head = EagleHead.for_target(TINY, n_layer=n_layer).eval()
    head.draft_vocab = EVEN
    head.bind(target.output.weight)
    head.setup_rope(64)
    sequences = tiny_sequences(3)
    records = []
    for seq in sequences:
        target.setup_caches(1, len(seq["tokens"]))
        _, features = target(torch.tensor([seq["tokens"]]), torch.arange(len(seq["tokens"])))
        records.append({"tokens": torch.tensor(seq["tokens"]), "loss_mask": torch.tensor(seq["loss_mask"]),
                        "features": features[0]})
    chained = evaluate(target, head, records, "cpu", steps=3)["top1"]
    head.setup_rope(64)
    assert evaluate_unrolled(target, head, sequences, steps=3)["top1"] == pytest.approx(chained, abs=1e-4)


def tiny_run_files(tmp_path):
    """A tiny target checkpoint and `data` shards whose token ids the online command trains on."""
    target = tiny_target()
    ckpt = write_checkpoint(tmp_path / "tiny", target, hf_config(TINY)).parent
    data = tmp_path / "data"
    data.mkdir()
    records = [{"tokens": torch.tensor(s["tokens"]), "loss_mask": torch.tensor(s["loss_mask"])}
               for s in tiny_sequences(10, length=14)]
    torch.save(records[:8], data / "train-generated-00000.pt")
    torch.save(records[8:], data / "eval-generated-00000.pt")
    return ckpt / "model.pth", data, target


def online(monkeypatch, ckpt, data, out, *extra):
    from scripts import train_eagle

    monkeypatch.setattr("sys.argv", ["train_eagle.py", "online", "--checkpoint", str(ckpt), "--shards", str(data),
                                     "--out", str(out), "--draft_vocab", "0", "--pack_len", "23", "--batch_size", "2",
                                     "--ttt_steps", "2", "--lr", "3e-3", "--warmup", "1", "--eval_every", "3",
                                     "--save_every", "1", "--no-bf16", "--threads", "1", *extra])
    torch.set_grad_enabled(True)
    try:
        train_eagle.main()
    finally:
        torch.set_grad_enabled(False)
    return torch.load(out / "checkpoint.pt", weights_only=False)


def test_online_training_saves_resumes_and_lowers_the_loss(tmp_path, monkeypatch):
    """`train_eagle.py online` on shards' token ids (features computed by the tiny target): stopped at
    step 2 and resumed, it takes the same steps as a run straight to 4; the saved EAGLE-3 head loads,
    fits and has a lower unrolled loss on its training rows than at the start."""
    from scripts.train_eagle import load_records, packed_batch, pack_rows, target_pass, unrolled_loss, unrolled_steps

    ckpt, data, target = tiny_run_files(tmp_path)
    first = online(monkeypatch, ckpt, data, tmp_path / "run", "--max_steps", "4", "--stop_after", "2")
    assert first["state"]["step"] == 2 and not (tmp_path / "head").exists()
    resumed = online(monkeypatch, ckpt, data, tmp_path / "run", "--max_steps", "4", "--save_head", str(tmp_path / "head"))
    straight = online(monkeypatch, ckpt, data, tmp_path / "straight", "--max_steps", "4")
    assert resumed["state"]["step"] == straight["state"]["step"] == 4
    for name, value in straight["head"].items():
        torch.testing.assert_close(resumed["head"][name], value, rtol=1e-5, atol=1e-6)
    record = json.loads((tmp_path / "head" / "training_record.json").read_text())
    assert record["ttt_steps"] == 2 and record["tokens_per_s"] > 0 and record["curve"][-1]["step"] == 4
    assert set(record["curve"][-1]) >= {"generated"} and len(record["curve"][-1]["generated"]["top1"]) == 4
    assert record["curve"][0]["step"] == 0  # the starting head measured on the same sets before the first step
    trained = load_head(tmp_path / "head")
    trained.check_fits(target.config, TINY.vocab_size)
    torch.manual_seed(0)  # the command seeds 0 before it builds its head
    fresh = Eagle3Head.for_target(TINY)
    sequences = [{"tokens": r["tokens"].tolist(), "loss_mask": r["loss_mask"].tolist()}
                 for r in load_records(data, "train-generated")]

    def loss(head):
        head.setup_rope(40)
        rows = pack_rows([len(s["tokens"]) for s in sequences], 23)
        return unrolled_loss(head, unrolled_steps(target, head, target_pass(target, head, packed_batch(sequences, rows)), 2)).item()

    assert loss(trained) < loss(fresh)


def test_online_training_grows_an_eagle1_head(tmp_path, monkeypatch):
    """--init with --head_layers 2 adds a layer that starts as the identity (the grown head drafts as its
    parent did) and trains it: the saved head has two layers in the official layout and the new layer moved;
    with --freeze_init only the new layer moves."""
    from scripts.train_eagle import evaluate_unrolled, load_records

    ckpt, data, target = tiny_run_files(tmp_path)
    torch.manual_seed(0)
    parent = EagleHead.for_target(TINY).eval()
    parent.save(tmp_path / "parent")
    grown = parent.deepened(2)
    sequences = [{"tokens": r["tokens"].tolist(), "loss_mask": r["loss_mask"].tolist()}
                 for r in load_records(data, "train-generated")]
    for head in (parent, grown):
        head.bind(target.output.weight)
        head.setup_rope(64)
    assert evaluate_unrolled(target, grown, sequences, steps=2) == evaluate_unrolled(target, parent, sequences, steps=2)
    online(monkeypatch, ckpt, data, tmp_path / "run", "--init", str(tmp_path / "parent"), "--head_layers", "2",
           "--max_steps", "2", "--save_head", str(tmp_path / "head"))
    trained = load_head(tmp_path / "head")
    assert isinstance(trained, EagleHead) and trained.config.n_layer == 2 and len(trained.layers) == 1
    assert json.loads((tmp_path / "head" / "config.json").read_text())["num_hidden_layers"] == 2
    assert trained.layers[0].feed_forward.w2.weight.abs().sum() > 0
    online(monkeypatch, ckpt, data, tmp_path / "frozen", "--init", str(tmp_path / "parent"), "--head_layers", "2",
           "--freeze_init", "--max_steps", "2", "--save_head", str(tmp_path / "frozen-head"))
    frozen = load_head(tmp_path / "frozen-head")
    for name, value in parent.state_dict().items():  # --freeze_init: the parent's weights as they were
        torch.testing.assert_close(frozen.state_dict()[name], value, rtol=0, atol=0)
    assert frozen.layers[0].feed_forward.w2.weight.abs().sum() > 0
    with pytest.raises(SystemExit, match="--freeze_init trains only"):
        online(monkeypatch, ckpt, data, tmp_path / "alone", "--freeze_init", "--max_steps", "1")
    with pytest.raises(SystemExit, match="an EAGLE-3 head has one layer"):
        online(monkeypatch, ckpt, data, tmp_path / "e3", "--head_layers", "2", "--max_steps", "1")
    with pytest.raises(SystemExit, match="only an EAGLE-1 head can grow"):
        online(monkeypatch, ckpt, data, tmp_path / "shrink", "--init", str(tmp_path / "head"), "--head_layers", "1",
               "--max_steps", "1")
