"""HF checkpoint -> model.pth conversion (logits equal transformers' on the same weights) and download.py."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import scripts.download as download_script
from model import CheckpointError, Transformer
from scripts.convert_hf_checkpoint import convert_hf_checkpoint
from scripts.convert_hf_checkpoint import main as convert_main

REPO_ROOT = Path(__file__).resolve().parent.parent
TINY = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
            vocab_size=128, max_position_embeddings=128, rms_norm_eps=1e-5, initializer_range=0.1)
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}


def save_random_hf_model(out_dir: Path, arch: str = "llama", save_kwargs=None, dtype=torch.float32, **overrides):
    """A randomly initialised tiny HF model saved with save_pretrained; returns the HF model."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]
    torch.manual_seed(0)
    hf = model_cls(config_cls(**{**TINY, **overrides})).eval()
    with torch.no_grad():  # norms and biases away from their 1 / 0 init, so a misplaced one shows
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.normal_(0, 0.2)
    hf.to(dtype).save_pretrained(out_dir, **(save_kwargs or {}))
    return hf


def ours_vs_hf(tmp_path, seq_len=24, arch="llama", save_kwargs=None, **overrides):
    hf = save_random_hf_model(tmp_path, arch, save_kwargs, **overrides)
    model = Transformer.from_checkpoint(convert_hf_checkpoint(tmp_path))
    model.setup_caches(1, seq_len)
    idx = torch.randint(0, TINY["vocab_size"], (1, seq_len), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, _ = model(idx, torch.arange(seq_len))
        theirs = hf(idx).logits
    return (ours - theirs).abs().max().item()


def test_llama_gqa_untied(tmp_path):
    assert ours_vs_hf(tmp_path, tie_word_embeddings=False) < 1e-4
    assert "output.weight" in torch.load(tmp_path / "model.pth", weights_only=True)


def test_llama3_rope_scaling_beyond_original_context(tmp_path):
    # 100 positions > original_max_position_embeddings=64: the scaled low frequencies matter
    assert ours_vs_hf(tmp_path, seq_len=100, rope_scaling=dict(LLAMA3_SCALING), rope_theta=500000.0) < 1e-4


def test_qwen2_qkv_bias(tmp_path):
    assert ours_vs_hf(tmp_path, arch="qwen2") < 1e-4
    assert "layers.0.attention.wqkv.bias" in torch.load(tmp_path / "model.pth", weights_only=True)


def test_tied_embeddings(tmp_path):
    assert ours_vs_hf(tmp_path, tie_word_embeddings=True) < 1e-4
    assert "output.weight" not in torch.load(tmp_path / "model.pth", weights_only=True)


def test_sharded_safetensors_split_qkv(tmp_path):
    # tiny shards: a layer's q, k and v land in different files, tied together by the index
    assert ours_vs_hf(tmp_path, save_kwargs={"max_shard_size": "20KB"}) < 1e-4
    assert (tmp_path / "model.safetensors.index.json").is_file()


def test_bf16_weights_keep_their_dtype(tmp_path):
    save_random_hf_model(tmp_path, dtype=torch.bfloat16)
    state = torch.load(convert_hf_checkpoint(tmp_path), weights_only=True)
    assert {t.dtype for t in state.values()} == {torch.bfloat16}


def test_pytorch_bin(tmp_path):
    hf = save_random_hf_model(tmp_path)
    shutil.move(tmp_path / "model.safetensors", tmp_path / "hf.safetensors")
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    from_bin = torch.load(convert_hf_checkpoint(tmp_path), weights_only=True)
    (tmp_path / "pytorch_model.bin").unlink()
    shutil.move(tmp_path / "hf.safetensors", tmp_path / "model.safetensors")
    from_safetensors = torch.load(convert_hf_checkpoint(tmp_path), weights_only=True)
    assert from_bin.keys() == from_safetensors.keys()
    assert all(torch.equal(from_bin[k], from_safetensors[k]) for k in from_bin)


def test_conversion_errors(tmp_path, monkeypatch):
    with pytest.raises(CheckpointError, match="not a directory"):
        convert_hf_checkpoint(tmp_path / "missing")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], **TINY}))
    with pytest.raises(CheckpointError, match="no model"):
        convert_hf_checkpoint(tmp_path)
    monkeypatch.setattr(sys, "argv", ["convert_hf_checkpoint.py", "--checkpoint_dir", str(tmp_path)])
    with pytest.raises(SystemExit) as exit_info:
        convert_main()
    assert str(exit_info.value.code).startswith("error: no model") and "\n" not in exit_info.value.code


def test_download_converts_full_models_only(tmp_path, monkeypatch):
    """download.py's work after the download: convert a full model, leave an EAGLE head as it is."""
    model_dir, head_dir = tmp_path / "hub" / "model", tmp_path / "hub" / "head"
    save_random_hf_model(model_dir)
    head_dir.mkdir()
    (head_dir / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], **TINY,
                                                      "num_hidden_layers": 1}))
    save_file({"fc.weight": torch.zeros(64, 128)}, head_dir / "model.safetensors")
    monkeypatch.setattr(download_script, "download",
                        lambda repo_id, out_dir, token=None: shutil.copytree(tmp_path / "hub" / repo_id, out_dir))
    for repo_id in ("model", "head"):
        monkeypatch.setattr(sys, "argv", ["download.py", "--repo_id", repo_id, "--out", str(tmp_path / "out")])
        download_script.main()
    assert (tmp_path / "out" / "model" / "model.pth").is_file()
    assert not (tmp_path / "out" / "head" / "model.pth").exists()


def test_download_without_network_fails_in_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_ETAG_TIMEOUT="5", HF_HUB_DOWNLOAD_TIMEOUT="5")
    result = subprocess.run([sys.executable, "scripts/download.py", "--repo_id", "yuhuili/EAGLE-Vicuna-7B-v1.3",
                             "--out", str(tmp_path)], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith("error: could not download yuhuili/EAGLE-Vicuna-7B-v1.3: ")
    assert result.stderr.rstrip().endswith("check the network/HF token")


def test_export_hf_round_trip(tmp_path):
    """export_hf.py: the export loads in transformers with our logits, and converts back to identical weights."""
    from transformers import AutoModelForCausalLM

    from scripts.export_hf import export_hf
    for arch, overrides in (("llama", {"tie_word_embeddings": False}), ("llama", {"tie_word_embeddings": True}),
                            ("qwen2", {})):
        source, exported = tmp_path / f"{arch}-{len(overrides)}", tmp_path / f"{arch}-{len(overrides)}-hf"
        save_random_hf_model(source, arch, **overrides)
        ours = torch.load(convert_hf_checkpoint(source), weights_only=True)
        (source / "model.safetensors").unlink()  # the export must not lean on the original HF weights
        export_hf(source, exported)
        hf = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
        model = Transformer.from_checkpoint(source / "model.pth")
        model.setup_caches(1, 24)
        idx = torch.randint(0, TINY["vocab_size"], (1, 24), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            assert (model(idx, torch.arange(24))[0] - hf(idx).logits).abs().max().item() < 1e-4
        back = torch.load(convert_hf_checkpoint(exported), weights_only=True)
        assert back.keys() == ours.keys() and all(torch.equal(back[k], ours[k]) for k in ours)


def test_export_w8a8_holds_our_integers_and_scales_in_hf_layout(tmp_path):
    """export_hf.py --dtype w8a8 (vLLM's peer at w8a8): every decoder linear as compressed-tensors' int8 weight and
    float32 scale per output row, in HF's names and rotary row order; dequantized and converted back, each equals
    what quantize.py's w8a8 linear multiplies by (so rows and scales moved together)."""
    from safetensors.torch import load_file

    import quantize
    from scripts.export_hf import export_w8a8
    save_random_hf_model(tmp_path / "hf", tie_word_embeddings=True)
    checkpoint = convert_hf_checkpoint(tmp_path / "hf")
    exported = export_w8a8(checkpoint.parent, tmp_path / "w8a8")
    config = json.loads((exported / "config.json").read_text())
    group = config.pop("quantization_config")["config_groups"]["group_0"]
    assert group["weights"]["strategy"] == "channel" and group["input_activations"]["strategy"] == "token"
    tensors = load_file(exported / "model.safetensors")
    quantized = [name for name, t in tensors.items() if t.dtype == torch.int8]
    assert len(quantized) == 7 * TINY["num_hidden_layers"] and "lm_head.weight" not in tensors
    dequantized = {name: t.float() for name, t in tensors.items() if not name.endswith("_scale")}
    for name in quantized:
        scale = tensors[name + "_scale"]
        assert scale.dtype == torch.float32 and scale.shape == (tensors[name].shape[0], 1)
        dequantized[name] = tensors[name].float() * scale
    back_dir = tmp_path / "dequantized"
    back_dir.mkdir()
    save_file(dequantized, back_dir / "model.safetensors", metadata={"format": "pt"})
    (back_dir / "config.json").write_text(json.dumps({**config, "torch_dtype": "float32"}))
    back = torch.load(convert_hf_checkpoint(back_dir), weights_only=True)
    model = Transformer.from_checkpoint(checkpoint, dtype=torch.bfloat16)
    quantize.quantize_model(model, quantize.handler_for("w8a8"), quantize_lm_head=False)
    linears = {name: m for name, m in model.named_modules() if isinstance(m, quantize.W8A8CPULinear)}
    assert len(linears) == 5 * TINY["num_hidden_layers"]  # wqkv, wo, w1, w2, w3
    for name, linear in linears.items():
        assert torch.equal(back[name + ".weight"], linear.int8_weight.float() * linear.int8_scales[:, None]), name


def test_export_hf_default_model_tokenizer_and_chat_template(default_checkpoint, tmp_path):
    """The default model's export carries a tokenizer that transformers renders our chat prompt with."""
    from transformers import AutoTokenizer

    from scripts.export_hf import export_hf
    from tokenizer import Tokenizer
    checkpoint_dir = default_checkpoint.parent
    tiny = tmp_path / "tiny"  # the default model's tokenizer beside a tiny model.pth: the weights are tested above
    save_random_hf_model(tmp_path / "hf")
    convert_hf_checkpoint(tmp_path / "hf")
    tiny.mkdir()
    shutil.copyfile(tmp_path / "hf" / "model.pth", tiny / "model.pth")
    shutil.copyfile(tmp_path / "hf" / "config.json", tiny / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(checkpoint_dir / name, tiny / name)
    exported = export_hf(tiny, tmp_path / "out", dtype="bfloat16")
    assert json.loads((exported / "config.json").read_text())["torch_dtype"] == "bfloat16"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fruit."}]
    theirs = AutoTokenizer.from_pretrained(exported).apply_chat_template(messages, add_generation_prompt=True,
                                                                         tokenize=True, return_dict=False)
    assert list(theirs) == Tokenizer.load(checkpoint_dir).encode_chat(messages)


def test_export_hf_errors_in_one_line(tmp_path):
    result = subprocess.run([sys.executable, "scripts/export_hf.py", "--checkpoint_dir", str(tmp_path / "none"),
                             "--out", str(tmp_path / "out")], cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 1 and result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert "convert the model first" in result.stderr


def test_export_head_for_vllm_is_the_same_function(tmp_path):
    """export_hf.py --head: with the fc bias folded into layer 0's attention biases, a transformers LLaMA decoder
    layer read the way vLLM's EAGLE-1 drafter reads it (attention_bias from the config, fc without a bias, no
    input norm on layer 0) gives our head's output; an EAGLE-3 head is refused in one line."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from eagle_head import Eagle3Head, EagleHead
    from model import ModelArgs
    from safetensors.torch import load_file
    from scripts.export_hf import export_head
    tiny = ModelArgs(dim=64, n_layer=2, n_head=4, n_local_heads=2, intermediate_size=128, vocab_size=96,
                     rope_base=10000.0, tie_embeddings=True)
    torch.manual_seed(0)
    head = EagleHead.for_target(tiny, fc_bias=True).eval()
    with torch.no_grad():
        head.fc.bias.normal_(0, 1.0)  # a bias that matters
    head.save(tmp_path / "head", target_embedding=torch.randn(tiny.vocab_size, tiny.dim))
    out = export_head(tmp_path / "head", tmp_path / "vllm")
    config, state = json.loads((out / "config.json").read_text()), load_file(out / "model.safetensors")
    assert config["bias"] is False and config["attention_bias"] is True
    assert "fc.bias" not in state and "embed_tokens.weight" not in state

    hf_config = LlamaConfig(**{k: v for k, v in config.items() if k != "architectures"})
    hf_config._attn_implementation = "sdpa"  # causal without a mask
    layer = LlamaDecoderLayer(hf_config, layer_idx=0).eval()
    layer.input_layernorm = torch.nn.Identity()  # EAGLE-1's first layer has no input norm
    layer.load_state_dict({k.removeprefix("layers.0."): v for k, v in state.items() if k.startswith("layers.0.")},
                          strict=False)
    assert all(not torch.isnan(p).any() for p in layer.parameters())
    T = 7
    g = torch.Generator().manual_seed(0)
    embeds, feats = torch.randn(1, T, tiny.dim, generator=g), torch.randn(1, T, tiny.dim, generator=g)
    head.setup_caches(16)
    with torch.no_grad():
        ours = head(embeds, feats, torch.arange(T))
        x = torch.cat([embeds, feats], -1) @ state["fc.weight"].T
        position_embeddings = LlamaRotaryEmbedding(hf_config)(x, torch.arange(T)[None])
        theirs = layer(x, position_embeddings=position_embeddings, position_ids=torch.arange(T)[None])
        theirs = theirs[0] if isinstance(theirs, tuple) else theirs
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)

    Eagle3Head.for_target(tiny, feature_layers=(0, 1, 2)).save(tmp_path / "eagle3")
    result = subprocess.run([sys.executable, "scripts/export_hf.py", "--head", str(tmp_path / "eagle3"),
                             "--out", str(tmp_path / "x")], cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 1 and result.stderr.count("\n") == 1 and "EAGLE-3" in result.stderr
