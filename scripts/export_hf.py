"""Export a checkpoint directory (`model.pth` + config.json + tokenizer files) as a Hugging Face directory.

The inverse of scripts/convert_hf_checkpoint.py, so that a model converted here (from a GGUF or from HF)
loads in transformers, vLLM or SGLang: `wqkv` is split into q/k/v_proj, q/k rows (and biases) go back
from model.py's interleaved rotary pairs to HF's half-split layout, and names become HF's. Written:
`model.safetensors`, `config.json` (with `torch_dtype`), `generation_config.json`, and the tokenizer
files with the chat template.

An EAGLE-1 head (`--head`) is written for vLLM: heads/ holds it in EAGLE's own layout, whose config key
"bias" means a bias on `fc`, but vLLM builds `fc` without one, reads "bias" as LLaMA's attention bias, and
leaves those biases unloaded (NaN: every draft is rejected). The export folds the fc bias b into the first
layer, exactly: its input fc(x) + b reaches the attention (q/k/v biases W_q b, W_k b, W_v b; rotary acts
after the projection, so this is exact) and the residual (o_proj bias b); later layers get zero biases.

    python scripts/export_hf.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct --out exports/smollm2
    python scripts/export_hf.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct --dtype w8a8 --out exports/smollm2-w8a8
    python scripts/export_hf.py --head heads/SmolLM2-135M-Instruct-eagle --out exports/smollm2-eagle

`--dtype w8a8` writes quantize.py's w8a8 model (its int8 weights and scales) in compressed-tensors' format, which
vLLM's CPU engine runs through its own int8 kernels.
"""
import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from eagle_head import EAGLE3_ARCHITECTURES, read_head_config, read_weights  # noqa: E402
import quantize  # noqa: E402
from model import DTYPES, CheckpointError, ModelArgs, Transformer, interleaved_to_halves  # noqa: E402
from scripts.convert_hf_checkpoint import GLOBAL_NAMES, LAYER_NAMES  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")


def hf_state_dict(state: dict, config: ModelArgs) -> dict:
    """model.py's state dict -> HF LlamaForCausalLM names and rotary layout."""
    to_hf = {ours: hf for hf, ours in GLOBAL_NAMES.items()}
    layer_to_hf = {ours: hf for hf, ours in LAYER_NAMES.items()}
    q_rows, kv_rows = config.n_head * config.head_dim, config.n_local_heads * config.head_dim
    out = {}
    for name, tensor in state.items():
        if name in to_hf:
            out[to_hf[name]] = tensor
            continue
        _, layer, rest = name.split(".", 2)
        prefix = f"model.layers.{layer}."
        if rest.startswith("attention.wqkv."):
            kind = rest.rsplit(".", 1)[1]  # weight or bias
            q, k, v = tensor.split([q_rows, kv_rows, kv_rows])
            for proj, rows, heads in (("q", q, config.n_head), ("k", k, config.n_local_heads)):
                flat = rows if kind == "weight" else rows.unsqueeze(-1)
                out[f"{prefix}self_attn.{proj}_proj.{kind}"] = \
                    interleaved_to_halves(flat, heads, config.head_dim).reshape(rows.shape)
            out[f"{prefix}self_attn.v_proj.{kind}"] = v
        elif rest in layer_to_hf:
            out[prefix + layer_to_hf[rest]] = tensor
        else:
            raise CheckpointError(f"unexpected tensor {name!r}: export a float model.pth, not a quantized file")
    return {name: t.contiguous() for name, t in out.items()}


def read_hf(checkpoint_dir: Path) -> tuple:
    """(config.json as a dict, its ModelArgs, model.pth's tensors in HF's names and layout) of checkpoint_dir."""
    weights = Path(checkpoint_dir) / "model.pth"
    if not weights.is_file():
        raise CheckpointError(f"{weights} not found; convert the model first (scripts/convert_gguf.py or "
                              "scripts/convert_hf_checkpoint.py)")
    config_dict = json.loads((Path(checkpoint_dir) / "config.json").read_text())
    config = ModelArgs.from_config(config_dict)
    state = torch.load(weights, map_location="cpu", weights_only=True, mmap=True)
    return config_dict, config, hf_state_dict(state, config)


def write_hf(checkpoint_dir: Path, out_dir: Path, tensors: dict, config_dict: dict, config: ModelArgs,
             torch_dtype: torch.dtype) -> Path:
    """out_dir as an HF directory: the tensors, config.json (torch_dtype: the model's float dtype), the
    generation config and checkpoint_dir's tokenizer files; returns out_dir."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    config_dict = dict(config_dict)
    config_dict.setdefault("model_type", config_dict["architectures"][0].removesuffix("ForCausalLM").lower())
    config_dict["torch_dtype"] = {v: k for k, v in DTYPES.items()}[torch_dtype]
    config_dict.setdefault("head_dim", config.head_dim)
    (out_dir / "config.json").write_text(json.dumps(config_dict, indent=2) + "\n")
    generation = {k: config_dict[k] for k in ("bos_token_id", "eos_token_id") if config_dict.get(k) is not None}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (Path(checkpoint_dir) / name).is_file():
            shutil.copyfile(Path(checkpoint_dir) / name, out_dir / name)
    return out_dir


def export_hf(checkpoint_dir: Path, out_dir: Path, dtype: str | None = None) -> Path:
    """Write the HF directory out_dir from checkpoint_dir; returns out_dir. dtype: None keeps the weights'."""
    config_dict, config, tensors = read_hf(checkpoint_dir)
    if dtype is not None:
        tensors = {name: t.to(DTYPES[dtype]) for name, t in tensors.items()}
    return write_hf(checkpoint_dir, out_dir, tensors, config_dict, config, next(iter(tensors.values())).dtype)


W8A8_QUANTIZATION_CONFIG = {  # compressed-tensors' reading of quantize.py's w8a8, as vLLM loads it
    "quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True},
    }},
    "ignore": ["lm_head"]}


def export_w8a8(checkpoint_dir: Path, out_dir: Path) -> Path:
    """export_hf at bfloat16 with every decoder linear as quantize.py's w8a8 makes it (int8 weights, one scale
    per output row; int8 activations, one scale per token, at run time), in compressed-tensors' int-quantized
    format: `*.weight` int8 and `*.weight_scale` float32 [rows, 1]. The same integers and scales as ours; the
    LM head stays bfloat16 (tied to the embeddings, which vLLM does not quantize), where ours quantizes it."""
    config_dict, config, tensors = read_hf(checkpoint_dir)
    model = Transformer.from_checkpoint(Path(checkpoint_dir) / "model.pth", dtype=torch.bfloat16)
    quantize.quantize_model(model, quantize.handler_for("w8a8"), quantize_lm_head=False)
    linears = {f"{name}.weight": m for name, m in model.named_modules() if isinstance(m, quantize.W8A8CPULinear)}
    if not linears:
        raise CheckpointError("w8a8 export: no linear was quantized (does this PyTorch have oneDNN?)")
    scales = hf_state_dict({n: m.int8_scales[:, None] for n, m in linears.items()}, config)
    tensors = {name: t.to(torch.bfloat16) for name, t in tensors.items()}
    tensors.update(hf_state_dict({n: m.int8_weight for n, m in linears.items()}, config))
    tensors.update({name + "_scale": s.float() for name, s in scales.items()})
    config_dict = {**config_dict, "quantization_config": W8A8_QUANTIZATION_CONFIG}
    return write_hf(checkpoint_dir, out_dir, tensors, config_dict, config, torch.bfloat16)


def vllm_head_state(config: dict, state: dict) -> tuple:
    """An EAGLE-1 head's (config, weights) in EAGLE's layout -> the same function in vLLM's reading of it:
    no fc bias, attention biases that carry it (see the module doc)."""
    state = dict(state)
    state.pop("embed_tokens.weight", None)  # vLLM shares the target's
    bias = state.pop("fc.bias", None)
    if bias is not None:
        for i in range(int(config.get("num_hidden_layers", 1))):
            prefix = f"layers.{i}.self_attn."
            for proj in "qkvo":
                weight = state[f"{prefix}{proj}_proj.weight"]
                folded = bias if proj == "o" else weight @ bias
                state[f"{prefix}{proj}_proj.bias"] = folded.contiguous() if i == 0 else torch.zeros_like(folded)
    return {**config, "bias": False, "attention_bias": bias is not None}, state


def export_head(head_dir: Path, out_dir: Path) -> Path:
    """Write out_dir, an EAGLE-1 head for vLLM, from head_dir (heads/...); returns out_dir."""
    from safetensors.torch import save_file

    config = read_head_config(Path(head_dir))
    if set(config.get("architectures", [])) & set(EAGLE3_ARCHITECTURES):
        raise CheckpointError(f"{head_dir} is an EAGLE-3 head; --head exports EAGLE-1 heads (fc bias folded for vLLM)")
    try:
        config, state = vllm_head_state(config, read_weights(Path(head_dir)))
    except KeyError as e:
        raise CheckpointError(f"EAGLE head in {head_dir} lacks weight {e.args[0]}") from None
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.float().contiguous() for k, v in state.items()}, out_dir / "model.safetensors",
              metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint_dir", type=Path, help="directory with model.pth and config.json")
    source.add_argument("--head", type=Path, help="an EAGLE-1 head directory (heads/...), written for vLLM")
    parser.add_argument("--out", type=Path, required=True, help="the Hugging Face directory to write")
    parser.add_argument("--dtype", choices=list(DTYPES) + ["w8a8"],
                        help="cast the weights (default: keep model.pth's); w8a8: quantize.py's w8a8 as compressed-tensors")
    args = parser.parse_args()
    try:
        if args.head:
            print(export_head(args.head, args.out))
        else:
            export = export_w8a8 if args.dtype == "w8a8" else lambda c, o: export_hf(c, o, args.dtype)
            print(export(args.checkpoint_dir, args.out))
    except (CheckpointError, quantize.QuantizeError, FileNotFoundError, json.JSONDecodeError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
