"""Issue 22's line budget: the core files' lines, and how many of them are features the core files did
not have at 1e339b0 (the budget's "today", 2,044 lines), so that the rest can be compared with 2,044.

    python results/2026-12-01-line-budget/count.py      # from the repository root

A new feature's lines are counted only where they are whole definitions (found by name with ast, with
their decorators, the comment lines right above them and the blank lines that separate them from the code
before; the last column charges those blank lines to the old features instead) or listed fragments inside
older functions (found by their first line, which must occur once outside those definitions); everything
else counts as an old feature's, so the count of old-feature lines is an upper bound. Each entry names the
commit (or issue item) that added it.
"""
import ast
import subprocess
from pathlib import Path

CORE = ["model.py", "generate.py", "eagle_head.py", "tree.py", "quantize.py", "tokenizer.py"]
BEFORE = "1e339b0"

# feature -> {file: [qualified names of whole definitions]}
UNITS = {
    "EAGLE-3 head and fused features (5065f0b, 9b26679, eba5378)": {
        "eagle_head.py": ["EAGLE3_ARCHITECTURES", "default_feature_layers", "Eagle3Head", "checked_layers",
                          "layer_ids_config", "layer_ids_from_config", "draft_vocab_from_offsets", "load_head",
                          "EagleHead.feature_layers", "EagleHead.feature_dim"],
    },
    "GGUF conversion and the default model, moved in from scripts/ (item 3; 3b58922)": {
        "model.py": ["GGUF_LAYER_NAMES", "GGUF_NAMES", "gguf_config", "gguf_state_dict", "save_gguf_checkpoint"],
        "tokenizer.py": ["DEFAULT_GGUF", "convert_gguf", "ensure_default_model"],
    },
    "batch rows for training, moved in from scripts/train_eagle.py (item 'training code rewriting the caches'; 731a2b4)": {
        "model.py": ["Transformer.keep_batch_rows"],
    },
    "tree auto and the cost model (a83bc2e, b394711, 0d52572)": {
        "tree.py": ["path_value", "tree_tau", "accepted_depth", "greedy_order", "along", "CycleCosts", "reach",
                    "AutoTree", "predict", "auto_tree", "instruction_set", "cost_profile_path"],
        "generate.py": ["PRECISIONS", "AUTO_TREE_MARGIN", "precision_of", "profile_model", "cost_profile",
                        "profile_hint", "cycle_models", "auto_tree_for"],
    },
    "context branch (a3975b9, a3fd7a9)": {
        "tree.py": ["split_lookup", "ContextLookup", "context_gain", "branch_taus", "Tree.lookup"],
    },
    "--precision and --autotune chosen by measurement (d2c863b)": {
        "generate.py": ["AUTOTUNE_OPTIONS", "fastest_precision", "autotune_options"],
    },
    "--quantize from the float model on first use, warm-up report, streaming (0cdaf1f)": {
        "quantize.py": ["quantized_checkpoint"],
        "generate.py": ["warm_up"],  # streamer counts as old: chat streamed before
    },
    "torchao's import noise filtered (issue 19)": {
        "quantize.py": ["KnownImportNoise"],
    },
}

# feature -> [(file, first line of the fragment (stripped, must occur once), its line count)]
FRAGMENTS = {
    "GGUF conversion and the default model, moved in from scripts/ (item 3; 3b58922)": [
        ("tokenizer.py", "the whole conversion of a GGUF checkpoint (its weights through model.py) and of the default model.\"\"\"", 1),
        ("tokenizer.py", "from model import DEFAULT_CHECKPOINT, REPO_ROOT, CheckpointError, save_gguf_checkpoint", 1),
        ("model.py", "import os", 1),
        ("model.py", "DEFAULT_CHECKPOINT = REPO_ROOT / \"checkpoints\" / \"HuggingFaceTB\" / \"SmolLM2-135M-Instruct\" / \"model.pth\"", 1),
        ("tokenizer.py", "import importlib.util", 1), ("tokenizer.py", "import sys", 1), ("tokenizer.py", "import time", 1),
    ],
    "EAGLE-3 head and fused features (5065f0b, 9b26679, eba5378)": [
        ("model.py", "states entering those layers, concatenated.", 1),
        ("model.py", "# EAGLE-3's fused features: layer boundaries k (the residual stream entering layer k; k = n_layer:", 4),
        ("model.py", "taps = self.feature_layers", 2),
        ("model.py", "if taps is not None and i in taps:", 2),
        ("model.py", "if taps is not None:", 3),
        ("model.py", "hidden states, the input of the LM head. With `feature_layers` set, features are instead the", 2),
        ("generate.py", "# the target's features are what this session's head reads (EAGLE-3: fused layers' states); set per", 3),
    ],
    "tree auto and the cost model (a83bc2e, b394711, 0d52572)": [
        ("generate.py", "import json", 1),
        ("tree.py", "import platform", 1),
        ("tree.py", "from pathlib import Path", 1),
        ("tree.py", "# ---------------------------------------------------------------- tree auto", 28),  # the comment block
        ("generate.py", "auto = args.tree == \"auto\"", 1),
        ("generate.py", "tree = (parse_tree(auto_tree_for(Path(head_dir), model, args.device, args.temperature == 0)) if auto", 2),
        ("generate.py", "p.add_argument(\"--tree\", default=\"auto\", help=\"auto | chain-N | paper | dynamic-TOPK-DEPTH-NODES | list of paths \"", 1),
    ],
    "context branch (a3975b9, a3fd7a9)": [
        ("generate.py", "draft.lookup_from)", 1),
        ("tree.py", "one optionally followed by '+lookup-N' (a context branch of N nodes). Returns a Tree or a DynamicTree.\"\"\"", 1),
        ("generate.py", "head node's token: then two paths match, and the deeper one, either is correct, is taken.)", 1),
        ("tree.py", "A static tree may also hold a context branch (\"paper+lookup-3\"): a chain of `lookup` nodes from the root,", 3),
        ("tree.py", "spec, lookup = split_lookup(spec)", 1),  # parse_tree: the spec's branch
        ("tree.py", "if lookup:", 2),  # and its refusal with a dynamic tree
        ("tree.py", "if self.lookup:", 2),  # Tree.draft: the branch's tokens
        ("tree.py", "parents += [len(nodes) + d - 1 if d else 0 for d in range(lookup)]  # the context chain", 1),
        ("tree.py", "lookup_from: Optional[int] = None  # nodes from this index on are context proposals (one-hot)", 1),
        ("generate.py", "self.context = ContextLookup()  # the tree's context branch, if it has one", 1),
        ("generate.py", "self.context.reset()", 1),
        ("generate.py", "if q is None or (lookup_from is not None and child >= lookup_from):", 1),
    ],
    "--precision and --autotune chosen by measurement (d2c863b)": [
        ("generate.py", "if compiled else EAGER", 1),
        ("generate.py", "if args.precision:", 7),
        ("generate.py", "p.add_argument(\"--precision\", choices=[\"auto\", \"fp32\", \"bf16\", \"int8\", \"int4\"], help=\"instead of --dtype and \"", 2),
        ("generate.py", "p.add_argument(\"--autotune\", choices=[\"auto\", \"on\", \"off\"], default=\"auto\", help=\"with --compile: inductor's \"", 2),
        ("generate.py", "if args.precision and (args.dtype or args.quantize):", 2),
    ],
    "--quantize from the float model on first use, warm-up report, streaming (0cdaf1f)": [
        ("tokenizer.py", "self.has_own_chat_template = chat_template is not None  # else sentencepiece models get Vicuna's", 1),
        ("generate.py", "templated = args.chat_template or (not args.raw and tokenizer.has_own_chat_template)", 1),
        ("generate.py", "if not templated:", 2),
        ("quantize.py", "import time", 1),
        ("generate.py", "p.add_argument(\"--quantize\", choices=[\"int8\", \"int4\"], help=\"run int8 / int4 weights, quantized from the \"", 2),
        ("generate.py", "if args.quantize:", 4),
        ("generate.py", "p.add_argument(\"--raw\", action=\"store_true\", help=\"plain continuation of --prompt, without the chat template\")", 1),
        ("generate.py", "if args.raw and (args.chat_template or args.chat):", 2),
        ("generate.py", "warm_up(session, prompt, sampling)", 1),
        ("generate.py", "warm_up(session, tokenizer.encode_chat([{\"role\": \"user\", \"content\": \"Hi\"}]), sampling)", 1),
    ],
    "torchao's import noise filtered (issue 19)": [
        ("quantize.py", "import logging", 1),
        ("quantize.py", "for _logger in (\"torchao\", \"torch.utils._pytree\"):", 2),
    ],
}


def spans(path: Path, separators: bool) -> dict:
    """Qualified name -> (first line, last line) of each top-level and class-level definition, with the
    comment lines right above it, and with `separators` the blank lines above those too."""
    text = path.read_text()
    lines = text.splitlines()
    tree = ast.parse(text)
    out = {}

    def add(name, node):
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        while first > 1 and (lines[first - 2].strip().startswith("#") or separators and not lines[first - 2].strip()):
            first -= 1
        out[name] = (first, node.end_lineno)

    for node in tree.body:
        names = [t.id for t in node.targets if isinstance(t, ast.Name)] if isinstance(node, ast.Assign) else \
            [node.target.id] if isinstance(node, ast.AnnAssign) else [getattr(node, "name", None)]
        for name in filter(None, names):
            add(name, node)
        if isinstance(node, ast.ClassDef):
            for member in node.body:
                if isinstance(member, (ast.FunctionDef, ast.ClassDef)):
                    add(f"{node.name}.{member.name}", member)
                elif isinstance(member, (ast.Assign, ast.AnnAssign)):
                    targets = member.targets if isinstance(member, ast.Assign) else [member.target]
                    for t in targets:
                        if isinstance(t, ast.Name):
                            add(f"{node.name}.{t.id}", member)
    return out


def new_lines(root: Path, separators: bool):
    """({file: line numbers of new features}, {feature: its line count})."""
    counted = {f: set() for f in CORE}
    per_feature = dict.fromkeys(UNITS.keys() | FRAGMENTS.keys(), 0)
    for feature, files in UNITS.items():  # whole definitions first
        for f, names in files.items():
            s = spans(root / f, separators)
            for name in names:
                first, last = s[name]
                new = set(range(first, last + 1)) - counted[f]
                counted[f] |= new
                per_feature[feature] += len(new)
    for feature, fragments in FRAGMENTS.items():  # then fragments, in lines no definition above holds
        for f, first_line, count in fragments:
            lines = [line.strip() for line in (root / f).read_text().splitlines()]
            hits = [i for i, line in enumerate(lines, 1) if line == first_line and i not in counted[f]]
            assert len(hits) == 1, f"{f}: {first_line!r} occurs {len(hits)} times outside the definitions"
            new = set(range(hits[0], hits[0] + count)) - counted[f]
            counted[f] |= new
            per_feature[feature] += len(new)
    return counted, per_feature


def main():
    root = Path(__file__).resolve().parents[2]
    total = {f: len((root / f).read_text().splitlines()) for f in CORE}
    before = {f: len(subprocess.run(["git", "show", f"{BEFORE}:{f}"], cwd=root, capture_output=True, text=True,
                                    check=True).stdout.splitlines()) for f in CORE}
    strict, _ = new_lines(root, separators=False)  # blank lines between definitions charged to the old features
    counted, per_feature = new_lines(root, separators=True)  # each definition with the blank lines above it
    print(f"| file | at {BEFORE} | now | new features | old features | old, blank separators charged to them |")
    print("|---|---:|---:|---:|---:|---:|")
    for f in CORE:
        print(f"| {f} | {before[f]} | {total[f]} | {len(counted[f])} | {total[f] - len(counted[f])} | "
              f"{total[f] - len(strict[f])} |")
    n_new, n_strict = (sum(len(c) for c in d.values()) for d in (counted, strict))
    print(f"| **total** | **{sum(before.values())}** | **{sum(total.values())}** | **{n_new}** | "
          f"**{sum(total.values()) - n_new}** | **{sum(total.values()) - n_strict}** |")
    print()
    print("| new feature | lines |")
    print("|---|---:|")
    for feature, n in sorted(per_feature.items(), key=lambda kv: -kv[1]):
        print(f"| {feature} | {n} |")


if __name__ == "__main__":
    main()
