"""Convert a Hugging Face LLaMA-family checkpoint (Llama, Mistral, Qwen2) into model.py's `model.pth`.

Reads `model.safetensors`, `model-0000x-of-0000y.safetensors` or `pytorch_model*.bin` shard by shard
and writes `model.pth` into the same directory; config.json and the tokenizer files stay as they are.
q, k and v are fused into `wqkv`, and q/k rows (and biases) are permuted from HF's half-split rotary
layout to model.py's interleaved pairs. Weights keep their dtype; model.py casts on load.

    python scripts/convert_hf_checkpoint.py --checkpoint_dir checkpoints/meta-llama/Llama-2-7b-chat-hf
"""
import argparse
import json
import os
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from model import CheckpointError, ModelArgs, halves_to_interleaved  # noqa: E402

# HF name (after "model.layers.N.") -> model.py name (after "layers.N.")
LAYER_NAMES = {
    "self_attn.o_proj.weight": "attention.wo.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
GLOBAL_NAMES = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
                "lm_head.weight": "output.weight"}
QKV_NAME = re.compile(r"model\.layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)")
LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")


def weight_files(checkpoint_dir: Path) -> list[Path]:
    """The checkpoint's shards: safetensors if there are any, else pytorch .bin files."""
    for pattern, index_name in (("model*.safetensors", "model.safetensors.index.json"),
                                ("pytorch_model*.bin", "pytorch_model.bin.index.json")):
        index = checkpoint_dir / index_name
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            missing = [s for s in shards if not (checkpoint_dir / s).is_file()]
            if missing:
                raise CheckpointError(f"{checkpoint_dir} lacks {len(missing)} shard(s) listed in {index_name} "
                                      f"(first: {missing[0]}); download the model again")
            return [checkpoint_dir / s for s in shards]
        files = sorted(checkpoint_dir.glob(pattern))
        if files:
            return files
    raise CheckpointError(f"no model*.safetensors or pytorch_model*.bin in {checkpoint_dir}")


def read_shard(path: Path):
    """Yield (name, tensor) one at a time, so only one shard is ever mapped."""
    try:
        if path.suffix == ".safetensors":
            from safetensors import safe_open
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
            return
        try:
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except RuntimeError:  # legacy (non-zip) .bin files cannot be memory-mapped
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{path} cannot be read ({type(e).__name__}); download it again") from None
    yield from state.items()


def convert_hf_checkpoint(checkpoint_dir: Path) -> Path:
    """Write `model.pth` beside the HF weights in checkpoint_dir; returns its path."""
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise CheckpointError(f"{checkpoint_dir} is not a directory; download the model first")
    config = ModelArgs.from_checkpoint_dir(checkpoint_dir)
    heads = {"q": config.n_head, "k": config.n_local_heads, "v": config.n_local_heads}
    state, pending_qkv = {}, {}  # pending_qkv: (layer, "weight"/"bias") -> {"q": tensor, ...}
    for path in weight_files(checkpoint_dir):
        for name, tensor in read_shard(path):
            if name in GLOBAL_NAMES:
                state[GLOBAL_NAMES[name]] = tensor
            elif m := QKV_NAME.fullmatch(name):
                layer, proj, kind = m.groups()
                if proj in "qk":  # half-split rotary rows -> interleaved pairs
                    rows = tensor if kind == "weight" else tensor.unsqueeze(-1)
                    tensor = halves_to_interleaved(rows, heads[proj], config.head_dim).reshape(tensor.shape)
                parts = pending_qkv.setdefault((layer, kind), {})
                parts[proj] = tensor
                if len(parts) == 3:  # q, k and v may sit in different shards
                    state[f"layers.{layer}.attention.wqkv.{kind}"] = torch.cat([parts["q"], parts["k"], parts["v"]])
                    del pending_qkv[layer, kind]
            elif (m := LAYER_NAME.fullmatch(name)) and m.group(2) in LAYER_NAMES:
                state[f"layers.{m.group(1)}.{LAYER_NAMES[m.group(2)]}"] = tensor
            elif not name.endswith("rotary_emb.inv_freq"):  # old .bin files store the rope table
                raise CheckpointError(f"{path} holds an unexpected tensor {name!r}; "
                                      "is this a LLaMA-family model (not an EAGLE head)?")
    if pending_qkv:
        (layer, kind), parts = next(iter(pending_qkv.items()))
        raise CheckpointError(f"layer {layer} of {checkpoint_dir} lacks {kind}s for "
                              f"{', '.join(p for p in 'qkv' if p not in parts)}_proj")
    if config.tie_embeddings:
        state.pop("output.weight", None)
    elif "output.weight" not in state:
        raise CheckpointError(f"{checkpoint_dir} has no lm_head.weight and its config.json does not tie embeddings")
    out = checkpoint_dir / "model.pth"
    tmp = checkpoint_dir / f"model.pth.tmp{os.getpid()}"
    torch.save(state, tmp)
    tmp.rename(out)  # atomic: a half-written model.pth never exists
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint_dir", type=Path, required=True,
                        help="directory with config.json and the HF weights, e.g. checkpoints/<repo_id>")
    args = parser.parse_args()
    try:
        print(convert_hf_checkpoint(args.checkpoint_dir))
    except CheckpointError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
