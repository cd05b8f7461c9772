"""Download a model or an EAGLE head from the Hugging Face Hub into checkpoints/<repo_id>/.

Only configs, weights and tokenizer files are fetched (pytorch .bin weights only when the repo has no
safetensors). A full model is then converted to `model.pth` (scripts/convert_hf_checkpoint.py); an
EAGLE head (one layer plus `fc`) is used as downloaded.

    python scripts/download.py --repo_id meta-llama/Llama-2-7b-chat-hf --hf_token hf_...
    python scripts/download.py --repo_id yuhuili/EAGLE-Vicuna-7B-v1.3
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from model import CheckpointError  # noqa: E402
from scripts.convert_hf_checkpoint import convert_hf_checkpoint, read_shard, weight_files  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
FILE_PATTERNS = ["*.json", "*.safetensors", "*.bin", "tokenizer.model", "*.jinja"]
# Meta's original-format weights that some repos carry beside the HF ones
IGNORE_PATTERNS = ["original/*", "consolidated*"]


def short_reason(error: Exception) -> str:
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, OfflineModeIsEnabled,
                                        RepositoryNotFoundError)

    if isinstance(error, GatedRepoError):
        return "the repository is gated: accept its license on huggingface.co and pass --hf_token"
    if isinstance(error, RepositoryNotFoundError):
        return "repository not found (a private or gated one needs --hf_token)"
    if isinstance(error, OfflineModeIsEnabled):
        return "HF_HUB_OFFLINE is set"
    if isinstance(error, LocalEntryNotFoundError):
        return "the Hub cannot be reached"
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:200] if lines else ''}".rstrip(": ")


def download(repo_id: str, out_dir: Path, token=None) -> Path:
    """snapshot_download the repo's configs, weights and tokenizer files into out_dir."""
    from huggingface_hub import constants, model_info, snapshot_download

    # one metadata request, no retries, bounded like the Hub client's own (HF_HUB_ETAG_TIMEOUT)
    info = model_info(repo_id, token=token, timeout=constants.HF_HUB_ETAG_TIMEOUT)
    files = [s.rfilename for s in info.siblings or []]
    has_safetensors = any(f.endswith(".safetensors") and not f.startswith(("original/", "consolidated"))
                          for f in files)
    patterns = [p for p in FILE_PATTERNS if not (has_safetensors and p == "*.bin")]
    snapshot_download(repo_id, local_dir=out_dir, allow_patterns=patterns, ignore_patterns=IGNORE_PATTERNS,
                      token=token)
    return out_dir


def is_eagle_head(checkpoint_dir: Path, config: dict) -> bool:
    """The public EAGLE heads: a one-layer LlamaConfig whose weights hold `fc.weight`."""
    if config.get("num_hidden_layers") != 1:
        return False
    return any(name == "fc.weight" for path in weight_files(checkpoint_dir) for name, _ in read_shard(path))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repo_id", required=True, help="e.g. meta-llama/Llama-2-7b-chat-hf")
    parser.add_argument("--hf_token", help="Hugging Face token for gated or private repos")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "checkpoints", help="checkpoints root")
    args = parser.parse_args()
    checkpoint_dir = args.out / args.repo_id
    try:
        download(args.repo_id, checkpoint_dir, args.hf_token)
    except Exception as e:
        sys.exit(f"error: could not download {args.repo_id}: {short_reason(e)}; check the network/HF token")
    try:
        config = json.loads((checkpoint_dir / "config.json").read_text())
        if "architectures" not in config or is_eagle_head(checkpoint_dir, config):
            print(checkpoint_dir)
        else:
            print(convert_hf_checkpoint(checkpoint_dir))
    except (CheckpointError, OSError, json.JSONDecodeError) as e:
        sys.exit(f"error: {args.repo_id} was downloaded to {checkpoint_dir} but not converted: {e}")


if __name__ == "__main__":
    main()
