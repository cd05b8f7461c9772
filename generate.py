"""Vanilla and EAGLE speculative generation, and an interactive chat, for LLaMA-family models.

    python generate.py --prompt "Tell me about owls"                 # default model, vanilla
    python generate.py --prompt "Tell me about owls" --eagle         # with the shipped EAGLE head
    python generate.py --chat --eagle --compile

EAGLE cycle (one target forward per cycle; Session._eagle_cycles runs these four steps):
  draft   the head grows a tree from the last committed token, one head forward per tree level
          (tree.py: Tree.draft, EAGLE-1's static tree; DynamicTree.draft, EAGLE-2's) -> a Draft;
  verify  the target runs once over the whole tree under a tree attention mask (verify);
  accept  the longest path the target agrees with (greedy) or that survives the lossless sampling
          rule, and a bonus token from the target (accept: engine.py's accept_greedy, accept_sampling);
  commit  the accepted path's KV entries move to contiguous cache slots; the head reads the target's
          true features of the accepted tokens (Session.commit).
The model steps run eagerly or compiled (Steps); CacheWindow decides how many cache slots they read.
Several sequences at once (--batch_size) run on engine.Engine, the same cycle over rows. What is chosen from
measurements of the machine (threads, compile kind, --tree auto, --precision auto) comes from tuning.py.
"""
import argparse
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import Tensor

from eagle_head import EagleHead, load_head
from engine import (Engine, HeadPrediction, Sampling, UsageError, accept_greedy, accept_sampling, argmax_tokens,
                    check_fits, compile_step, draft_step, head_prediction, sample)
from model import DEFAULT_CHECKPOINT, DTYPES, REPO_ROOT, CheckpointError, ModelArgs, Transformer, causal_mask
from tree import ContextLookup, Draft, DynamicTree, Tree, parse_tree, tree_attention_mask
from tuning import (AUTOTUNE_CHOICES, COMPILE_KINDS, PRECISIONS, START_WINDOW_S, ThreadGovernor, auto_tree_choice,
                    compile_kind, fastest_precision, warm_up)

DEFAULT_HEAD = REPO_ROOT / "heads" / "SmolLM2-135M-Instruct-eagle"


# ---------------------------------------------------------------- model steps (eager, or compiled by Steps)
def prefill(model: Transformer, tokens: Tensor, input_pos: Tensor, mask: Tensor):
    """Logits at the last position [1, 1, V] and features at all positions [1, T, dim]."""
    return model(tokens, input_pos, mask=mask, logits_at=slice(-1, None))


def decode_one_token(model: Transformer, token: Tensor, input_pos: Tensor, mask: Tensor, greedy: bool):
    """The next token's logits [1, 1, V], or with `greedy` the greedy token [1, 1] (argmax in the graph)."""
    logits, _ = model(token, input_pos, mask=mask)
    return argmax_tokens(logits) if greedy else logits


def verify(target: Transformer, node_tokens: Tensor, base: Tensor, depths: Tensor, mask: Tensor, greedy: bool):
    """Step 2: the target over all tree nodes at slots base.., rotary positions base + depths, under `mask`
    (tree.tree_attention_mask): the logits after each node [n, V] (greedy: tokens [n]), features [1, n, dim]."""
    input_pos = base + torch.arange(node_tokens.shape[-1], device=node_tokens.device)
    logits, features = target(node_tokens.view(1, -1), input_pos, mask=mask, rope_pos=base + depths)
    return (argmax_tokens(logits[0]) if greedy else logits[0]), features


def head_extend(target: Transformer, head: EagleHead, next_tokens: Tensor, features: Tensor,
                input_pos: Tensor, mask: Tensor, last: Tensor, k: int) -> HeadPrediction:
    """Feed the head committed pairs (f_i, t_{i+1}) at positions input_pos (under the causal `mask`); its
    prediction at index `last` [1, 1, ...] drafts the next root's children."""
    hidden = head(target.tok_embeddings(next_tokens), features, input_pos, mask)
    return head_prediction(head, hidden.index_select(1, last), k)


class Steps:
    """The model steps a Session runs: the target's prefill, decode and verify; the head's draft, update
    (after a commit) and prefill (head_extend both). Steps() runs them eagerly, Steps.compiled() compiled."""

    def __init__(self, fixed: Optional[Callable] = None, variable: Optional[Callable] = None):
        """fixed, variable: what wraps the fixed-shape steps and the two prefills (None: nothing)."""
        fixed, variable = fixed or (lambda f: f), variable or (lambda f: f)
        self.decode, self.verify, self.draft, self.head_update = map(fixed, (decode_one_token, verify, draft_step,
                                                                            head_extend))
        self.prefill, self.head_prefill = map(variable, (prefill, head_extend))

    @classmethod
    def compiled(cls, device: str, prefill_too: bool = False, inductor_config: Optional[dict] = None,
                 **options) -> "Steps":
        """Full graphs of static shape (a live mask's slot count is dynamic, see CacheWindow; on CUDA, CUDA
        graphs), so nothing recompiles: the target's steps compile once greedy, once sampling. prefill_too:
        the prefills too, with dynamic shapes. `options` go to every torch.compile call (e.g. backend=...);
        inductor_config (AUTOTUNE_OPTIONS) is set where inductor reads it, see compile_step."""
        fixed = {"fullgraph": True, "dynamic": False, **({"mode": "reduce-overhead"} if device.startswith("cuda") else {})}
        return cls(lambda f: compile_step(f, inductor_config, **fixed, **options),
                   (lambda f: compile_step(f, inductor_config, fullgraph=True, dynamic=True, **options))
                   if prefill_too else None)


EAGER = Steps()


@dataclass
class CacheWindow:
    """How many KV cache slots a step's attention reads (masks are [queries, slots]). live (CPU): the slots in
    use, as a step's cost there grows with them, that count marked dynamic so that one compiled graph serves
    every length. Otherwise (CUDA): the whole cache, one static shape for CUDA graphs."""
    live: bool

    def slots(self, end: int, cache_len: int) -> int:
        """Slots read when slot end - 1 is the last one in use."""
        return end if self.live else cache_len

    def mark(self, mask: Tensor) -> Tensor:
        if self.live:
            torch._dynamo.mark_dynamic(mask, mask.dim() - 1)
        return mask

    def causal(self, input_pos: Tensor, end: int, cache_len: int, mark: bool = True) -> Tensor:
        """causal_mask for tokens at slots input_pos, slot end - 1 the last in use; mark: its slot count dynamic
        (the fixed-shape steps; the prefills compile with dynamic shapes, or not at all)."""
        mask = causal_mask(input_pos, self.slots(end, cache_len))
        return self.mark(mask) if mark else mask

    def tree(self, base: int, tree_mask: Tensor, cache_len: int) -> Tensor:
        """tree_attention_mask for nodes at slots base + j, j < tree_mask.shape[1]."""
        return self.mark(tree_attention_mask(base, tree_mask, self.slots(base + tree_mask.shape[1], cache_len)))



# ---------------------------------------------------------------- session state
@dataclass
class Stats:
    new_tokens: int = 0
    prefill_s: float = 0.0
    total_s: float = 0.0
    target_forwards: int = 0  # decode / verify forwards after the prefill
    head_forwards: int = 0
    accept_lengths: list = field(default_factory=list)  # draft tokens accepted per EAGLE cycle
    phase_s: dict = field(default_factory=dict)  # seconds spent per phase of the decode steps / EAGLE cycles
    phase_n: dict = field(default_factory=dict)  # times each phase ran

    @contextmanager
    def phase(self, name: str):
        """Time the block as one run of phase `name` (host time: CUDA kernels count where the host waits)."""
        start = time.perf_counter()
        yield
        self.phase_s[name] = self.phase_s.get(name, 0.0) + time.perf_counter() - start
        self.phase_n[name] = self.phase_n.get(name, 0) + 1

    def phase_ms(self) -> dict:
        """Mean milliseconds per run of each phase (vanilla: decode, sample; EAGLE: the four steps)."""
        return {name: 1000 * t / self.phase_n[name] for name, t in self.phase_s.items()}

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s else 0.0

    @property
    def tau(self) -> float:
        """Tokens committed per target forward, bonus token included."""
        return (sum(self.accept_lengths) + len(self.accept_lengths)) / max(1, len(self.accept_lengths))

    def acceptance_by_depth(self, max_depth: int) -> list:
        """Fraction of cycles whose accepted path reached depth d, d = 1..max_depth."""
        n = max(1, len(self.accept_lengths))
        return [sum(a >= d for a in self.accept_lengths) / n for d in range(1, max_depth + 1)]


class Session:
    """A target (and optional EAGLE head) with their caches and the tokens they hold: tokens[:target_len]
    are in the target cache, features[i] is the target's feature at position i, the head cache holds
    positions 0..head_len-1 (pairs (f_i, t_{i+1})). A prompt that extends `tokens` (the next chat turn)
    only prefills what is new. `steps` runs the model (default: eagerly)."""

    def __init__(self, model: Transformer, max_seq_len: int, head: Optional[EagleHead] = None,
                 tree: Optional["Tree | DynamicTree"] = None, steps: Optional[Steps] = None):
        self.model, self.head, self.tree, self.steps, self.max_seq_len = model, head, tree, steps or EAGER, max_seq_len
        # room for an unfinished cycle; one slot at least, so a live mask never spans the whole cache
        scratch = 1 if head is None else tree.num_nodes + tree.max_depth + 1
        model.setup_caches(1, max_seq_len + scratch)
        self.device = model.output.weight.device
        self.window = CacheWindow(live=self.device.type == "cpu")
        self.context = ContextLookup()  # the tree's context branch, if it has one
        if head is not None:
            head.setup_caches(max_seq_len + max(scratch, tree.draft_slots))
            if head.lm_head is None:  # a quantized target's head is bound by quantize.quantize_head_like
                head.bind(model.output.weight)
            self.features = torch.zeros(max_seq_len + scratch, head.feature_dim, device=self.device,
                                        dtype=model.output.weight.dtype)
        self.reset()

    def reset(self):
        """Forget the cached conversation: the next generate prefills its whole prompt."""
        self.tokens, self.target_len, self.head_len = [], 0, 0

    @torch.no_grad()
    def generate(self, prompt: list, max_new_tokens: int, sampling: Sampling, stop_ids=frozenset(),
                 on_tokens: Optional[Callable] = None):
        """Generate after `prompt` (a list of token ids). Returns (new token ids, Stats).
        on_tokens(list) is called with each batch of committed tokens (for streaming)."""
        check_fits(len(prompt), max_new_tokens, self.max_seq_len)
        # the target's features are what this session's head reads (EAGLE-3: fused layers' states); set per
        # call, as sessions with other heads may share the model
        self.model.feature_layers = None if self.head is None else self.head.feature_layers
        cached = self.tokens[: self.target_len]
        common = next((i for i, (a, b) in enumerate(zip(cached, prompt)) if a != b), min(len(cached), len(prompt)))
        self.target_len = min(common, len(prompt) - 1)  # at least one token to prefill
        self.head_len = min(self.head_len, self.target_len)
        self.tokens = list(prompt)
        self.context.reset()
        stats, start = Stats(), time.perf_counter()
        token = self._prefill(sampling)
        stats.prefill_s = time.perf_counter() - start
        out: list = []
        run = self._eagle_cycles if self.head is not None else self._vanilla_steps
        for new in run(token, sampling, stats):
            new = new[: max_new_tokens - len(out)]
            stop = next((i + 1 for i, t in enumerate(new) if t in stop_ids), None)  # cut after a stop token
            new = new[:stop]
            out += new
            if on_tokens:
                on_tokens(new)
            if stop is not None or len(out) >= max_new_tokens:
                break
        stats.total_s, stats.new_tokens = time.perf_counter() - start, len(out)
        self.tokens = list(prompt) + out
        self.target_len = min(self.target_len, len(self.tokens))
        self.head_len = min(self.head_len, len(self.tokens) - 1)
        return out, stats

    def _prefill(self, sampling: Sampling) -> int:
        new = torch.tensor(self.tokens[self.target_len:], device=self.device)
        input_pos = torch.arange(self.target_len, len(self.tokens), device=self.device)
        mask = self.window.causal(input_pos, len(self.tokens), self.model.max_seq_len, mark=False)
        logits, features = self.steps.prefill(self.model, new.view(1, -1), input_pos, mask)
        if self.head is not None:
            self.features[input_pos] = features[0]
        self.target_len = len(self.tokens)
        return int(sample(logits[0, -1], sampling))

    def _vanilla_steps(self, token: int, sampling: Sampling, stats: Stats):
        while True:
            yield [token]
            with stats.phase("decode"):
                pos = torch.tensor([self.target_len], device=self.device)
                mask = self.window.causal(pos, self.target_len + 1, self.model.max_seq_len)
                out = self.steps.decode(self.model, torch.tensor([[token]], device=self.device), pos, mask,
                                        sampling.greedy)
            stats.target_forwards += 1
            with stats.phase("sample"):
                self.tokens.append(token)
                self.target_len += 1
                token = int(out) if sampling.greedy else int(sample(out[0, -1], sampling))

    # ---------------------------------------------------------------- EAGLE
    def _eagle_cycles(self, token: int, sampling: Sampling, stats: Stats):
        """The EAGLE cycle: yields the tokens each cycle commits (first: the prefill's token, the first root)."""
        yield [token]
        self.tokens.append(token)
        start = self.head_len  # the head catches up on the prompt: pairs (f_i, t_{i+1}), i = head_len..
        root = self._feed_head(False, start, self.tokens[start + 1:], self.tokens[start:self.target_len],
                               self.features[start:self.target_len].clone(), self.target_len - start - 1, stats)
        self.head_len = self.target_len
        while True:
            with stats.phase("draft"):  # 1. the head grows a tree from the last committed token
                draft = self.tree.draft(self, token, root, sampling)
                stats.head_forwards += self.tree.draft_steps
            with stats.phase("verify"):  # 2. the target runs once over the whole tree
                mask = self.window.tree(self.target_len, draft.tree_mask, self.model.max_seq_len)
                base = torch.tensor(self.target_len, device=self.device)  # the root's cache slot
                out, features = self.steps.verify(self.model, draft.tokens, base, draft.depths, mask, sampling.greedy)
                stats.target_forwards += 1
            with stats.phase("accept"):  # 3. the longest path the target agrees with, and a bonus token
                path, bonus = accept(draft, out, sampling)
                tokens = draft.tokens.tolist()
                new = [tokens[i] for i in path[1:]] + [bonus]
                stats.accept_lengths.append(len(path) - 1)
            yield new
            with stats.phase("commit"):  # 4. the path into the caches, the true features into the head
                root = self.commit(path, new, features, stats)
                token = new[-1]

    def commit(self, path: list, new: list, features: Tensor, stats: Stats) -> HeadPrediction:
        """Step 4: the accepted nodes' KV entries move to contiguous slots after the prefix, and the head reads
        their true features (draft error never accumulates); returns its prediction for the next root."""
        base, n_acc, pad = self.target_len, len(path), self.tree.max_depth + 1  # the head's update: pad rows
        if path == list(range(n_acc)):  # always on a chain: every entry is in place already
            feats = features[0, :pad]
        else:  # the accepted nodes, then padding rows (the head's update ignores them)
            rows = torch.tensor(path + list(range(n_acc, pad)), device=self.device)
            dst = torch.arange(base, base + pad, device=self.device)
            for cache in self.model.kv_caches():
                cache.move(base + rows, dst)
            feats = features[0].index_select(0, rows)
        self.features[base: base + pad] = feats
        root = self._feed_head(True, base, new, [self.tokens[-1]] + new[:-1], feats, n_acc - 1, stats)
        self.tokens += new
        self.target_len = self.head_len = self.target_len + n_acc
        return root

    def _feed_head(self, update: bool, start: int, next_tokens: list, own_tokens: list, features: Tensor,
                   last: int, stats: Stats) -> HeadPrediction:
        """The head's prediction at row `last` after committed pairs (f_i, t_{i+1}) from position `start` on
        (features [n, dim], tokens zero-padded to n). update: a cycle's (max_depth + 1 rows), else the prompt's."""
        n = features.shape[0]
        paired = self.head.pair_tokens(next_tokens, own_tokens)
        pos = torch.arange(start, start + n, device=self.device)
        mask = self.window.causal(pos, start + n, self.head.max_seq_len, mark=update)
        stats.head_forwards += 1
        return (self.steps.head_update if update else self.steps.head_prefill)(
            self.model, self.head, torch.tensor(paired + [0] * (n - len(paired)), device=self.device).view(1, -1),
            features[None], pos, mask, torch.tensor([last], device=self.device), self.tree.max_rank + 1)


def accept(draft: Draft, out: Tensor, sampling: Sampling):
    """Step 3: the accepted path (node indices, root first) and the bonus token, from verify's output."""
    if sampling.greedy:
        return accept_greedy(draft.tokens.tolist(), out.tolist(), draft.parents.tolist())
    return accept_sampling(draft.tokens.tolist(), out, draft.children, sampling, draft.draft_probs,
                           draft.lookup_from)


# ---------------------------------------------------------------- command line
def load(args):
    """Target, tokenizer and (with --eagle) head and tree, as the arguments ask."""
    from tokenizer import Tokenizer, ensure_default_model

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError("--device cuda asked for, but this machine has no CUDA device; use --device cpu")
    auto = args.tree == "auto"
    tree = parse_tree(args.tree) if args.eagle and not auto else None  # a bad spec fails before any loading
    checkpoint = args.checkpoint or ensure_default_model()
    if checkpoint.is_dir():
        checkpoint = checkpoint / "model.pth"
    if not checkpoint.is_file():
        raise CheckpointError(f"{checkpoint} not found; prepare it with scripts/download.py and "
                              "scripts/convert_hf_checkpoint.py (see README)")
    default_model = checkpoint.resolve().parent == DEFAULT_CHECKPOINT.resolve().parent  # model.pth or a quantized one
    head_dir = (args.eagle_head or (DEFAULT_HEAD if default_model else None)) if args.eagle else None
    if args.eagle and head_dir is None:
        raise UsageError("--eagle with a --checkpoint other than the default model needs --eagle_head DIR")
    if args.precision:
        autotune = args.autotune if args.compile or args.compile_prefill else "off"
        precision = fastest_precision(ModelArgs.from_checkpoint_dir(checkpoint.parent), head_dir, args.temperature == 0,
                                      autotune) if args.precision == "auto" else args.precision
        if precision in ("int8", "int4"):
            args.quantize = precision
        else:  # fp32 / bf16: the dtype of that name
            args.dtype = next(name for name, dtype in DTYPES.items() if PRECISIONS.get(dtype) == precision)
    dtype = DTYPES.get(args.dtype)
    if args.quantize or checkpoint.name.startswith("model_int"):  # torchao is imported for quantized files only
        import quantize
        if args.quantize:
            if quantize.QUANTIZED_NAME.fullmatch(checkpoint.name):
                raise UsageError(f"{checkpoint.name} is quantized already; drop --quantize or give the float model.pth")
            checkpoint = quantize.quantized_checkpoint(checkpoint, args.quantize, args.device)
        model = quantize.load_quantized(checkpoint, args.device, dtype)
    else:
        model = Transformer.from_checkpoint(checkpoint, device=args.device, dtype=dtype)
    tokenizer, head = Tokenizer.load(checkpoint.parent), None
    compiled = args.compile or args.compile_prefill
    args.compile_kind = compile_kind(args.autotune, model, args.device) if compiled else "default"
    if args.eagle:
        head = load_head(head_dir, device=args.device, dtype=model.tok_embeddings.weight.dtype)
        head.check_fits(model.config, model.config.vocab_size)
        if model.quantization is not None:
            quantize.quantize_head_like(head, model)
        if auto:
            mode = "dynamic" if args.compile or args.compile_prefill else "eager"
            best = auto_tree_choice(Path(head_dir), model, args.device, args.temperature == 0, (head, mode),
                                    args.batch_size, args.compile_kind)
            if best is not None and best.speedup < 1:  # e.g. a large batch, whose matmuls no longer spare rows
                print("tree auto: plain decoding runs instead, the faster here (--tree TREE runs EAGLE anyway)",
                      file=sys.stderr)
                return model, tokenizer, None, None
            tree = parse_tree(best.spec if best else "chain-1")
        tree = tree.to(args.device)
    return model, tokenizer, head, tree



def print_stats(stats: Stats, tree, label: str = ""):
    line = (f"{label}{stats.new_tokens} tokens in {stats.total_s:.2f} s: {stats.tokens_per_s:.1f} tokens/s, "
            f"time to first token {stats.prefill_s * 1000:.0f} ms")
    if tree is not None and stats.accept_lengths:
        by_depth = " ".join(f"{a:.2f}" for a in stats.acceptance_by_depth(tree.max_depth))
        line += (f"\n  tau {stats.tau:.2f} tokens/forward, acceptance by depth [{by_depth}], "
                 f"{stats.target_forwards} target + {stats.head_forwards} head forwards")
    if stats.phase_s:
        per = ", ".join(f"{name} {ms:.1f}" for name, ms in stats.phase_ms().items())
        line += f"\n  ms per {'cycle' if tree is not None else 'step'}: {per}"
    print(line, file=sys.stderr)


def streamer(tokenizer, governor: Optional[ThreadGovernor] = None):
    """An on_tokens callback that prints the text of committed tokens as they come (stop tokens hidden), and lets
    the thread governor re-check the machine's load."""
    from tokenizer import StreamDecoder

    decoder = StreamDecoder(tokenizer)

    def stream(ids):
        print(decoder.push([t for t in ids if t not in tokenizer.stop_ids]), end="", flush=True)
        if governor is not None:
            governor.check()
    return stream


def chat(session: Session, tokenizer, args, sampling: Sampling, governor: Optional[ThreadGovernor] = None):
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("Chat (empty line or Ctrl-D to quit)", file=sys.stderr)
    while True:
        try:
            user = input("> ").strip()
        except EOFError:
            break
        if not user:
            break
        messages.append({"role": "user", "content": user})
        prompt = tokenizer.encode_chat(messages)
        budget = min(args.max_new_tokens, args.max_seq_len - len(prompt))
        if budget <= 0:
            raise UsageError(f"the conversation ({len(prompt)} tokens) fills --max_seq_len {args.max_seq_len}; "
                             "restart with a larger --max_seq_len")
        out, stats = session.generate(prompt, budget, sampling, tokenizer.stop_ids,
                                      on_tokens=streamer(tokenizer, governor))
        print(flush=True)
        print_stats(stats, session.tree)
        messages.append({"role": "assistant", "content": tokenizer.decode([t for t in out if t not in tokenizer.stop_ids])})


def run_batches(model: Transformer, head: Optional[EagleHead], tree, tokenizer, prompts: list, args,
                sampling: Sampling, governor: Optional[ThreadGovernor] = None):
    """--batch_size B: every prompt --num_samples times on the engine, B sequences at a time (a finished row takes
    the next sample at once); compiled, after a warm-up, so that the throughput leaves the compile out. Prints
    each text, then the throughput and (EAGLE) each sample's tau."""
    jobs = [(i, s) for i in range(len(prompts)) for s in range(args.num_samples)]
    longest = max(map(len, prompts)) + args.max_new_tokens
    engine = Engine(model, min(args.max_seq_len, longest), args.batch_size, head, tree, compile=args.compile,
                    inductor_config=COMPILE_KINDS[args.compile_kind])
    if args.compile:
        warm_up(lambda: engine.warm_up(prompts[0], [sampling], 8), governor)
    outs, stats = engine.generate([prompts[i] for i, _ in jobs], args.max_new_tokens, sampling, tokenizer.stop_ids)
    for (i, s), out in zip(jobs, outs):
        text = tokenizer.decode([t for t in out if t not in tokenizer.stop_ids])
        print(f"[prompt {i + 1}, sample {s + 1}] {text}", flush=True)
    line = (f"batch of {args.batch_size}, {len(jobs)} sequences: {sum(stats.new_tokens)} tokens in "
            f"{stats.total_s:.2f} s: {stats.tokens_per_s:.1f} tokens/s, {stats.target_forwards} target forwards")
    if head is not None:
        line += "\n  tau per sequence " + " ".join(f"{stats.tau(r):.2f}" for r in range(len(jobs)))
    print(line, file=sys.stderr)


def add_model_arguments(p: argparse.ArgumentParser):
    """The flags that choose and run the model, shared by generate.py and serve.py."""
    p.add_argument("--checkpoint", type=Path, help="model.pth or its directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top_k", type=int)
    p.add_argument("--top_p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="default: float32, or the dtype a quantized checkpoint was made for")
    p.add_argument("--max_seq_len", type=int, default=2048)
    p.add_argument("--threads", type=int, help="CPU threads (default: one per core that other processes leave "
                   "free, re-checked every second; OMP_NUM_THREADS, if set, instead)")
    p.add_argument("--precision", choices=["auto", "fp32", "bf16", "int8", "int4"], help="instead of --dtype and "
                   "--quantize; auto: the one this machine's cost profile predicts fastest (with --eagle: with EAGLE)")
    p.add_argument("--quantize", choices=["int8", "int4"], help="run int8 / int4 weights, quantized from the "
                   "float checkpoint on first use into a file beside it (quantize.py's, int4 with --quantize_lm_head)")
    p.add_argument("--compile", action="store_true", help="compile the decode / draft / verify steps")
    p.add_argument("--autotune", choices=["auto", *AUTOTUNE_CHOICES], default="auto", help="with --compile: "
                   "freeze the weights into the graphs (freeze) and add inductor's max-autotune GEMM kernels (on); "
                   "auto: what scripts/profile_costs.py --autotune measured fastest here among what inductor's cache "
                   "keeps between runs")
    p.add_argument("--eagle", action="store_true", help="EAGLE speculative decoding: in fp32 the same greedy text "
                   "as without it; in bf16 / int4 the texts may part where the two best tokens tie within bf16 "
                   "rounding (README)")
    p.add_argument("--eagle_head", type=Path, help="EAGLE head directory (default: the shipped head)")
    p.add_argument("--tree", default="auto", help="auto | chain-N | paper | dynamic-TOPK-DEPTH-NODES | list of paths "
                   "(auto: the tree predicted fastest on this machine, see auto_tree_for)")


def check_model_arguments(args):
    """A UsageError for model flags out of range."""
    if args.temperature < 0:
        raise UsageError(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top_p must be in (0, 1], got {args.top_p}")
    if args.top_k is not None and args.top_k < 1:
        raise UsageError(f"--top_k must be >= 1, got {args.top_k}")
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads must be >= 1, got {args.threads}")
    if args.precision and (args.dtype or args.quantize):
        raise UsageError("--precision replaces --dtype and --quantize; give one or the other")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Vanilla and EAGLE speculative generation (LLaMA family).")
    add_model_arguments(p)
    p.add_argument("--prompt", nargs="+", default=["Hello, my name is"],
                   help="prompt text; several prompts run one after another, or together with --batch_size")
    p.add_argument("--prompt_file", type=Path, help="prompts from this text file instead, one per line (blank lines "
                   "skipped; a literal \\n stands for a line break within a prompt)")
    p.add_argument("--chat", action="store_true", help="interactive multi-turn chat")
    p.add_argument("--raw", action="store_true", help="plain continuation of --prompt, without the chat template")
    p.add_argument("--chat_template", action="store_true",
                   help="wrap --prompt in the chat template (the default when the checkpoint has one)")
    p.add_argument("--system", help="system prompt for --chat / --chat_template")
    p.add_argument("--max_new_tokens", type=int, default=200)
    p.add_argument("--num_samples", type=int, default=1, help="samples per prompt")
    p.add_argument("--batch_size", type=int, default=1, help="sequences decoded together (engine.py): the "
                   "prompts x samples run this many at a time, a finished row taking the next at once")
    p.add_argument("--compile_prefill", action="store_true", help="also compile the prefill (dynamic shape)")
    args = p.parse_args(argv)
    check_model_arguments(args)
    if args.max_new_tokens < 1 or args.num_samples < 1 or args.batch_size < 1:
        raise UsageError("--max_new_tokens, --num_samples and --batch_size must be >= 1")
    if args.batch_size > 1 and (args.chat or args.compile_prefill):
        raise UsageError("--batch_size > 1 does not go with --chat or --compile_prefill (its prefill runs eagerly); "
                         "drop one")
    if args.raw and (args.chat_template or args.chat):
        raise UsageError("--raw (plain continuation) cannot go with --chat_template or --chat; drop one")
    if args.prompt_file:
        if not args.prompt_file.is_file():
            raise UsageError(f"--prompt_file {args.prompt_file} not found; give a text file, one prompt per line")
        lines = args.prompt_file.read_text(encoding="utf-8").splitlines()
        args.prompt = [line.replace("\\n", "\n") for line in lines if line.strip()]
        if not args.prompt:
            raise UsageError(f"--prompt_file {args.prompt_file} holds no prompt; write one per line")
    if not args.chat and not all(text.strip() for text in args.prompt):
        raise UsageError("a prompt is empty; give some text with --prompt")
    return args


def main(argv=None):
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    governor = None
    if args.threads:
        torch.set_num_threads(args.threads)
    elif "OMP_NUM_THREADS" not in os.environ and args.device == "cpu":
        governor = ThreadGovernor(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
        time.sleep(START_WINDOW_S)
        governor.check(force=True)  # before load: --tree auto and --precision auto read the thread count
    model, tokenizer, head, tree = load(args)
    sampling = Sampling(args.temperature, args.top_k, args.top_p)
    compiled = args.compile or args.compile_prefill
    steps = Steps.compiled(args.device, args.compile_prefill, COMPILE_KINDS[args.compile_kind]) if compiled else EAGER
    if args.chat:
        session = Session(model, args.max_seq_len, head, tree, steps)
        if compiled:
            warm_up(lambda: session.generate(tokenizer.encode_chat([{"role": "user", "content": "Hi"}]), 8, sampling),
                    governor)
            session.reset()
        return chat(session, tokenizer, args, sampling, governor)
    templated = args.chat_template or (not args.raw and tokenizer.has_own_chat_template)

    def encode(text: str) -> list:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": text})
        return tokenizer.encode_chat(messages) if templated else tokenizer.encode(text, bos=True)

    prompts = [encode(text) for text in args.prompt]
    if args.batch_size > 1:
        return run_batches(model, head, tree, tokenizer, prompts, args, sampling, governor)
    # a cache no longer than the prompts need: attention reads every cache slot
    session = Session(model, min(args.max_seq_len, max(map(len, prompts)) + args.max_new_tokens), head, tree, steps)
    if compiled:
        warm_up(lambda: session.generate(prompts[0], 8, sampling), governor)
        session.reset()
    for text, prompt in zip(args.prompt, prompts):
        for i in range(args.num_samples):
            session.reset()  # each sample starts from a fresh prefill, so timings compare
            if not templated:
                print(text, end="", flush=True)
            out, stats = session.generate(prompt, args.max_new_tokens, sampling, tokenizer.stop_ids,
                                          on_tokens=streamer(tokenizer, governor))
            print(flush=True)
            print_stats(stats, tree, label=f"[sample {i + 1}] " if args.num_samples > 1 else "")


if __name__ == "__main__":
    try:
        main()
    except (UsageError, CheckpointError, ValueError) as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        sys.exit(130)
