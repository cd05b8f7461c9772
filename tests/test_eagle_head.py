"""The EAGLE head: official checkpoint layout, fit checks, shifted alignment, training and resume,
and the shipped head's held-out accuracy against its training record."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import generate
from eagle_head import EagleHead
from model import CheckpointError, ModelArgs, Transformer
from test_model import hf_config, write_checkpoint

REPO = Path(__file__).resolve().parent.parent
TINY = ModelArgs(dim=64, n_layer=2, n_head=4, n_local_heads=2, intermediate_size=128, vocab_size=96,
                 rope_base=10000.0, tie_embeddings=True)


def head_output(head, seed=0, T=7):
    g = torch.Generator().manual_seed(seed)
    embeds, feats = torch.randn(1, T, head.config.dim, generator=g), torch.randn(1, T, head.config.dim, generator=g)
    head.setup_caches(16)
    return head(embeds, feats, torch.arange(T))


@pytest.mark.parametrize("fc_bias", [True, False])
@pytest.mark.parametrize("safetensors", [False, True])
def test_official_layout_round_trip(tmp_path, fc_bias, safetensors):
    torch.manual_seed(0)
    head = EagleHead.for_target(TINY, fc_bias=fc_bias).eval()
    head.save(tmp_path, target_embedding=torch.randn(TINY.vocab_size, TINY.dim), safetensors=safetensors)
    keys = set((torch.load(tmp_path / "pytorch_model.bin") if not safetensors else
                __import__("safetensors.torch").torch.load_file(tmp_path / "model.safetensors")).keys())
    expected = {"fc.weight", "embed_tokens.weight", "layers.0.post_attention_layernorm.weight"} | {
        f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"} | {f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    assert keys == expected | ({"fc.bias"} if fc_bias else set())
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["bias"] is fc_bias and config["num_hidden_layers"] == 1
    loaded = EagleHead.load(tmp_path)
    assert loaded.fc_bias is fc_bias
    with torch.no_grad():
        torch.testing.assert_close(head_output(loaded), head_output(head), rtol=0, atol=0)


def test_a_deeper_head_round_trips_and_grows_from_a_shallow_one(tmp_path):
    """A two-layer head (num_hidden_layers 2: layers.1 with its input norm) saves and loads exactly; one grown
    from a one-layer head by `deepened` gives the same output until its new layer is trained."""
    torch.manual_seed(0)
    shallow = EagleHead.for_target(TINY).eval()
    deep = shallow.deepened(2)
    with torch.no_grad():
        torch.testing.assert_close(head_output(deep), head_output(shallow), rtol=0, atol=0)
        for p in deep.layers.parameters():
            p.add_(0.05 * torch.randn_like(p))
        assert not torch.equal(head_output(deep), head_output(shallow))
    deep.save(tmp_path)
    keys = set(torch.load(tmp_path / "pytorch_model.bin").keys())
    assert {"layers.1.input_layernorm.weight", "layers.1.self_attn.q_proj.weight", "layers.1.mlp.down_proj.weight",
            "layers.1.post_attention_layernorm.weight"} <= keys and "layers.0.input_layernorm.weight" not in keys
    assert json.loads((tmp_path / "config.json").read_text())["num_hidden_layers"] == 2
    loaded = EagleHead.load(tmp_path)
    assert len(loaded.layers) == 1 and len(loaded.kv_caches()) == 2
    with torch.no_grad():
        torch.testing.assert_close(head_output(loaded), head_output(deep), rtol=0, atol=0)


def test_official_layout_uses_hf_rotary_halves(tmp_path):
    """q/k rows are saved in HF's half-split layout: a HF-style attention over the saved weights
    (rotate_half rotary) gives the same scores as our interleaved one."""
    torch.manual_seed(1)
    head = EagleHead.for_target(TINY).eval()
    head.save(tmp_path)
    state = torch.load(tmp_path / "pytorch_model.bin")
    hd, T = TINY.head_dim, 5
    x = torch.randn(T, TINY.dim)
    pos = torch.arange(T, dtype=torch.float64)
    inv = 1.0 / (TINY.rope_base ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    ang = torch.outer(pos, inv)
    cos, sin = torch.cat([ang.cos()] * 2, -1).float(), torch.cat([ang.sin()] * 2, -1).float()

    def hf_rope(t):  # [T, heads, hd], HF rotate_half convention
        t1, t2 = t[..., : hd // 2], t[..., hd // 2:]
        return t * cos[:, None] + torch.cat([-t2, t1], -1) * sin[:, None]

    q = hf_rope((x @ state["layers.0.self_attn.q_proj.weight"].T).view(T, TINY.n_head, hd))
    k = hf_rope((x @ state["layers.0.self_attn.k_proj.weight"].T).view(T, TINY.n_local_heads, hd))
    hf_scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(TINY.n_head // TINY.n_local_heads, 1))
    from model import apply_rope, precompute_rope
    c, s = precompute_rope(T, hd, TINY.rope_base)
    wq, wk, _ = head.attention.wqkv.weight.split([TINY.n_head * hd, TINY.n_local_heads * hd, TINY.n_local_heads * hd])
    q2 = apply_rope((x @ wq.T).view(1, T, TINY.n_head, hd), c, s)[0]
    k2 = apply_rope((x @ wk.T).view(1, T, TINY.n_local_heads, hd), c, s)[0]
    ours = torch.einsum("qhd,khd->hqk", q2, k2.repeat_interleave(TINY.n_head // TINY.n_local_heads, 1))
    torch.testing.assert_close(ours, hf_scores, rtol=1e-4, atol=1e-4)


def test_head_that_does_not_fit_is_refused(tmp_path):
    EagleHead.for_target(ModelArgs(**{**TINY.__dict__, "dim": 32, "n_head": 2, "n_local_heads": 1,
                                      "head_dim": 0})).save(tmp_path / "narrow")
    head = EagleHead.load(tmp_path / "narrow")
    with pytest.raises(CheckpointError, match="hidden size 32 .* hidden size 64"):
        head.check_fits(TINY, TINY.vocab_size)
    EagleHead.for_target(ModelArgs(**{**TINY.__dict__, "vocab_size": 50})).save(tmp_path / "small_vocab")
    with pytest.raises(CheckpointError, match="vocabulary 50 .* vocabulary 96"):
        EagleHead.load(tmp_path / "small_vocab").check_fits(TINY, TINY.vocab_size)
    with pytest.raises(CheckpointError, match="config.json missing"):
        EagleHead.load(tmp_path / "nothing")
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "config.json").write_text((tmp_path / "narrow" / "config.json").read_text())
    (tmp_path / "corrupt" / "pytorch_model.bin").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="cannot be read"):
        EagleHead.load(tmp_path / "corrupt")


def test_shifted_alignment_in_training_inputs():
    """Position i of the head pairs f_i with the embedding of t_{i+1} and is trained towards f_{i+1}."""
    sys.path.insert(0, str(REPO / "scripts"))
    from scripts.train_eagle import head_inputs

    target = Transformer(TINY).eval()
    tokens = torch.tensor([5, 17, 42, 9, 3])
    features = torch.arange(5, dtype=torch.float32)[:, None].expand(5, TINY.dim).clone()
    record = {"tokens": tokens, "features": features, "loss_mask": torch.tensor([0, 0, 1, 1, 1]).bool()}
    embeds, inputs, targets, mask = head_inputs(target, EagleHead.for_target(TINY), record, "cpu")
    assert torch.equal(embeds, target.tok_embeddings(tokens[1:]))  # t_{i+1}, not t_i
    assert torch.equal(inputs[:, 0], torch.tensor([0.0, 1, 2, 3]))  # f_i
    assert torch.equal(targets[:, 0], torch.tensor([1.0, 2, 3, 4]))  # f_{i+1}
    assert mask.tolist() == [False, True, True, True]  # loss where t_{i+1} is an assistant token
    # the ablation's "unshifted" head pairs f_i with its own token t_i
    embeds, _, _, _ = head_inputs(target, EagleHead.for_target(TINY, input_mode="unshifted"), record, "cpu")
    assert torch.equal(embeds, target.tok_embeddings(tokens[:-1]))


def test_eagle_loss_weights_the_cross_entropy():
    """The loss is SmoothL1 + ce_weight * soft CE (paper 0.1); top-1 compares draft and target argmax."""
    from scripts.train_eagle import eagle_loss

    torch.manual_seed(0)
    target = Transformer(TINY).eval()
    head = EagleHead.for_target(TINY)
    head.bind(target.output.weight)
    pred, true_next = torch.randn(1, 5, TINY.dim), torch.randn(1, 5, TINY.dim)
    mask = torch.tensor([[False, True, True, True, True]])
    paper, reg, ce, top1 = eagle_loss(head, pred, true_next, mask)
    torch.testing.assert_close(paper, reg + 0.1 * ce)
    heavy, *_ = eagle_loss(head, pred, true_next, mask, ce_weight=1.0)
    torch.testing.assert_close(heavy, reg + ce)
    assert top1.shape == (4,)
    assert bool(eagle_loss(head, true_next, true_next, mask)[3].all())  # exact features: same argmax


@pytest.mark.parametrize("mode", ["unshifted", "feature", "token"])
def test_input_modes(tmp_path, mode):
    """Ablation heads keep their input mode through save/load; "feature" ignores the token half of
    the input and "token" the feature half."""
    torch.manual_seed(0)
    head = EagleHead.for_target(TINY, input_mode=mode)
    head.save(tmp_path / mode)
    loaded = EagleHead.load(tmp_path / mode)
    assert loaded.input_mode == mode
    EagleHead.for_target(TINY).save(tmp_path / "eagle")  # EAGLE's own heads keep the public layout
    assert "eagle_input_mode" not in json.loads((tmp_path / "eagle" / "config.json").read_text())
    loaded.setup_caches(8)
    pos = torch.arange(3)
    embeds, feats = torch.randn(1, 3, TINY.dim), torch.randn(1, 3, TINY.dim)
    out = loaded(embeds, feats, pos)
    if mode == "feature":
        assert torch.equal(out, loaded(torch.randn_like(embeds), feats, pos))
    elif mode == "token":
        assert torch.equal(out, loaded(embeds, torch.randn_like(feats), pos))
    else:
        assert not torch.allclose(out, loaded(torch.randn_like(embeds), feats, pos))
    config = json.loads((tmp_path / mode / "config.json").read_text())
    (tmp_path / mode / "config.json").write_text(json.dumps({**config, "eagle_input_mode": "sideways"}))
    with pytest.raises(CheckpointError, match="eagle_input_mode"):
        EagleHead.load(tmp_path / mode)


@pytest.mark.parametrize("mode", ["shifted", "unshifted"])
def test_generation_pairs_feature_with_next_token(mode):
    """At inference the head's first input after the prompt pairs f_{P-1} with the sampled t_P, and a
    draft node's input pairs its parent's predicted feature with the node's own token; an "unshifted"
    head gets t_{P-1} and the parent's token instead, as in its training inputs."""
    torch.manual_seed(0)
    target = Transformer(TINY).eval()
    head = EagleHead.for_target(TINY, input_mode=mode).eval()
    seen = {"draft": [], "verify": []}
    steps = generate.Steps()
    real_prefill, real_draft, real_verify = steps.head_prefill, steps.draft, steps.verify

    def spy_prefill(model, h, next_tokens, features, input_pos, *rest):
        seen["next"], seen["pos"] = next_tokens.clone(), input_pos.clone()
        return real_prefill(model, h, next_tokens, features, input_pos, *rest)

    def spy_draft(model, h, tokens, *rest):
        seen["draft"].append(tokens.clone())
        return real_draft(model, h, tokens, *rest)

    def spy_verify(model, node_tokens, *rest):
        seen["verify"].append(node_tokens.clone())
        return real_verify(model, node_tokens, *rest)

    steps.head_prefill, steps.draft, steps.verify = spy_prefill, spy_draft, spy_verify
    prompt = [3, 8, 13, 21]
    out, _ = generate.Session(target, 16, head, generate.parse_tree("chain-2"), steps).generate(prompt, 2,
                                                                                              generate.Sampling())
    assert seen["pos"].tolist() == [0, 1, 2, 3]
    if mode == "shifted":
        assert seen["next"][0].tolist() == prompt[1:] + [out[0]]
    else:
        assert seen["next"][0].tolist() == prompt
    root, depth1 = seen["verify"][0][0, :2].tolist()  # the chain's nodes: root, then its depth-1 draft
    assert seen["draft"][0].tolist() == [[depth1 if mode == "shifted" else root]]


def make_tiny_data(tmp_path):
    torch.manual_seed(0)
    target = Transformer(TINY).eval()
    ckpt = write_checkpoint(tmp_path / "tiny", target, hf_config(TINY, tie_word_embeddings=True)).parent
    data = tmp_path / "data"
    data.mkdir()
    records = []
    with torch.no_grad():
        for i in range(12):
            tokens = torch.randint(0, TINY.vocab_size, (24,))
            target.setup_caches(1, 24)
            _, feats = target(tokens[None], torch.arange(24))
            records.append({"tokens": tokens, "features": feats[0].to(torch.bfloat16),
                            "loss_mask": torch.arange(24) >= 6})
    torch.save(records[:10], data / "train-generated-00000.pt")
    torch.save(records[10:], data / "eval-generated-00000.pt")
    torch.save(torch.ones(TINY.vocab_size, dtype=torch.long), data / "sharegpt_token_counts.pt")
    return ckpt / "model.pth", data


def train(ckpt, data, out, steps, stop_after=None, batch_size=2, launcher=(), extra=()):
    cmd = [sys.executable, *launcher, str(REPO / "scripts" / "train_eagle.py"), "train", "--checkpoint", str(ckpt),
           "--data", str(data), "--out", str(out), "--max_steps", str(steps), "--batch_size", str(batch_size),
           "--lr", "3e-3", "--warmup", "2", "--eval_every", "100", "--save_every", "2", "--eval_records", "2",
           "--draft_vocab", "0", "--threads", "1", *extra] + (["--stop_after", str(stop_after)] if stop_after else [])
    subprocess.run(cmd, check=True, capture_output=True, cwd=REPO)
    return torch.load(Path(out) / "checkpoint.pt", weights_only=False)


def test_ddp_training_equals_one_process(tmp_path):
    """torchrun with 2 CPU processes (gloo), 1 sequence each, takes the same steps as one process with
    2 sequences: DDP averages the two ranks' gradients, and with equal-length sequences (and no
    input noise, whose random stream differs per process) that is the one-process gradient. Without
    the gradient all-reduce, rank 0 (which saves) would have trained on its own sequence only."""
    ckpt, data = make_tiny_data(tmp_path)
    one = train(ckpt, data, tmp_path / "one", 4, extra=["--noise", "0"])
    ddp = train(ckpt, data, tmp_path / "ddp", 4, batch_size=1, extra=["--noise", "0"],
                launcher=["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"])
    assert ddp["state"]["step"] == one["state"]["step"] == 4
    assert ddp["state"]["tokens_seen"] == one["state"]["tokens_seen"]
    for name, value in one["head"].items():
        assert torch.allclose(ddp["head"][name], value, atol=1e-5, rtol=1e-4), name


def test_training_lowers_loss_and_resumes(tmp_path):
    from scripts.train_eagle import evaluate, load_records

    ckpt, data = make_tiny_data(tmp_path)
    target = Transformer.from_checkpoint(ckpt)
    records = load_records(data, "train-generated")

    def loss_of(state):
        head = EagleHead.for_target(target.config)
        head.load_state_dict(state["head"])
        head.bind(target.output.weight)
        head.setup_rope(32)
        return evaluate(target, head, records, "cpu", steps=0)["loss"]

    torch.manual_seed(0)  # the training script seeds 0 before building its head
    fresh = EagleHead.for_target(target.config)
    first = train(ckpt, data, tmp_path / "run", 8, stop_after=4)
    assert first["state"]["step"] == 4
    assert loss_of({"head": first["head"]}) < loss_of({"head": fresh.state_dict()})
    # resume: the run stopped at 4 and continued to 8 equals one that went to 8 directly
    resumed = train(ckpt, data, tmp_path / "run", 8)
    straight = train(ckpt, data, tmp_path / "straight", 8)
    assert resumed["state"]["step"] == straight["state"]["step"] == 8
    for k in straight["head"]:
        torch.testing.assert_close(resumed["head"][k], straight["head"][k], rtol=1e-5, atol=1e-6)
    assert resumed["optimizer"]["state"][0]["step"] == straight["optimizer"]["state"][0]["step"]


def test_shipped_head_accuracy_matches_training_record(default_checkpoint):
    """Top-1 accuracy of the shipped head on its 20 held-out target-generated sequences, recomputed
    here from scratch, agrees with the number in its training record within 0.02."""
    from scripts.train_eagle import heldout_accuracy

    head_dir = generate.DEFAULT_HEAD
    record = json.loads((head_dir / "training_record.json").read_text())
    sequences = json.loads((head_dir / "heldout-generated.json").read_text())
    assert len(sequences) == 20
    target = Transformer.from_checkpoint(default_checkpoint)
    head = EagleHead.load(head_dir)
    head.bind(target.output.weight)
    measured = heldout_accuracy(target, head, sequences, steps=0)["top1"][0]
    assert abs(measured - record["heldout_eval"]["generated"]["top1"][0]) < 0.02


def test_batch_generate_matches_one_prompt_at_a_time():
    """The data step's batched greedy answers (left padding, finished rows leaving the batch) equal
    vanilla greedy decoding of each prompt alone, and their features equal a plain forward's."""
    from scripts.train_eagle import batch_generate

    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=64, n_layer=2, n_head=4, n_local_heads=2, intermediate_size=96,
                                  vocab_size=128)).eval()
    prompts = [[1, 5, 9], [1, 7, 3, 8, 2, 6], [1, 4]]
    greedy = []
    for p in prompts:
        out, _ = generate.Session(model, 32).generate(p, 12, generate.Sampling())
        greedy.append(out)
    stop = {greedy[0][3], greedy[2][6]}  # rows stop at different steps, one possibly never
    rows = batch_generate(model, prompts, 12, stop)
    for p, want, (ids, features, n_prompt) in zip(prompts, greedy, rows):
        end = next((i + 1 for i, t in enumerate(want) if t in stop), len(want))
        assert n_prompt == len(p) and ids == p + want[: end - 1]  # the last token has no feature
        model.setup_caches(1, len(ids))
        _, expected = model(torch.tensor([ids]), torch.arange(len(ids)))
        torch.testing.assert_close(features, expected[0], atol=1e-4, rtol=1e-4)


def test_length_band_shards_join_the_generated_set(tmp_path):
    """`data --min_prompt_len N` writes train-generated-pN-* shards and `data --skip S` (later
    conversations) train-generated-sS-* ones: the default training set (`generated`) reads them beside
    the other shards, and `generated-pN` reads its band alone."""
    from scripts.train_eagle import generated_shard_name, load_records

    assert generated_shard_name(0, 1) == "train-generated"
    assert generated_shard_name(0, 129) == "train-generated-p129"
    assert generated_shard_name(6300, 1) == "train-generated-s6300"
    assert generated_shard_name(6300, 129) == "train-generated-s6300-p129"
    record = {"tokens": torch.arange(3)}
    torch.save([record], tmp_path / "train-generated-00000.pt")
    torch.save([record, record], tmp_path / "train-generated-p129-00000.pt")
    torch.save([record] * 4, tmp_path / "train-generated-s6300-00000.pt")
    torch.save([record], tmp_path / "eval-generated-00000.pt")
    assert len(load_records(tmp_path, "train-generated")) == 7
    assert len(load_records(tmp_path, "train-generated-p129")) == 2
