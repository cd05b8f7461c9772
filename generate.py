"""Vanilla and EAGLE speculative generation, and an interactive chat, for LLaMA-family models.

    python generate.py --prompt "Tell me about owls"                 # default model, vanilla
    python generate.py --prompt "Tell me about owls" --eagle         # with the shipped EAGLE head
    python generate.py --chat --eagle --compile

Generation runs on engine.py: one sequence at a time is engine.Session (the engine's one-row use, which keeps a
chat's tokens cached between turns), several at once (--batch_size) engine.Engine's rows; the EAGLE cycle (draft,
verify, accept, commit) is written there once. What is chosen from measurements of the machine (threads, compile
kind, --tree auto, --precision auto) comes from tuning.py. This file is the command line and the chat.
"""
import argparse
import os
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from eagle_head import EagleHead, load_head
from engine import EAGER, Adaptation, Engine, Sampling, Session, Stats, Steps, UsageError, compiles_prefills
from model import DEFAULT_CHECKPOINT, DTYPES, REPO_ROOT, CheckpointError, ModelArgs, Transformer
from tree import parse_tree
from tuning import (AUTOTUNE_CHOICES, COMPILE_KINDS, PRECISIONS, START_WINDOW_S, ThreadGovernor, auto_tree_choice,
                    compile_kind, fastest_precision, warm_up)

DEFAULT_HEAD = REPO_ROOT / "heads" / "SmolLM2-135M-Instruct-eagle"


# ---------------------------------------------------------------- command line
def load(args):
    """Target, tokenizer and (with --eagle) head and tree, as the arguments ask."""
    from tokenizer import Tokenizer, ensure_default_model

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError("--device cuda asked for, but this machine has no CUDA device; use --device cpu")
    auto = args.tree == "auto"
    args.prior_tau = None  # --tree auto's predicted tokens per cycle: the adaptation's prior
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
        if precision in ("int8", "int4", "w8a8"):
            args.quantize = precision
        else:  # fp32 / bf16: the dtype of that name
            args.dtype = next(name for name, dtype in DTYPES.items() if PRECISIONS.get(dtype) == precision)
    dtype = DTYPES.get(args.dtype)
    if args.quantize or checkpoint.name.startswith(("model_int", "model_w8a8")):  # torchao: for quantized files only
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
            args.prior_tau = best.tau if best else None
        tree = tree.to(args.device)
    return model, tokenizer, head, tree



def adaptation_for(args, head) -> Optional[Adaptation]:
    """--tree auto with EAGLE: an Adaptation (engine.py) that decodes plainly while cycles run slower here; a tree
    named with --tree runs EAGLE at every step."""
    return Adaptation(args.prior_tau) if head is not None and args.tree == "auto" else None


def print_stats(stats: Stats, tree, label: str = ""):
    line = (f"{label}{stats.new_tokens} tokens in {stats.total_s:.2f} s: {stats.tokens_per_s:.1f} tokens/s, "
            f"time to first token {stats.prefill_s * 1000:.0f} ms")
    if tree is not None and stats.accept_lengths:
        by_depth = " ".join(f"{a:.2f}" for a in stats.acceptance_by_depth(tree.max_depth))
        line += (f"\n  tau {stats.tau:.2f} tokens/forward, acceptance by depth [{by_depth}], "
                 f"{stats.target_forwards} target + {stats.head_forwards} head forwards")
    if tree is not None and stats.plain_steps:
        line += (f"\n  {stats.plain_steps} of {stats.target_forwards} steps decoded plainly (the adaptation: steps "
                 "that price plain decoding, and stretches where cycles ran slower; --tree TREE speculates always)")
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
                sampling: Sampling, steps: Steps, governor: Optional[ThreadGovernor] = None):
    """--batch_size B: every prompt --num_samples times on the engine, B sequences at a time (a finished row takes
    the next sample at once); compiled, after a warm-up, so that the throughput leaves the compile out. Prints
    each text, then the throughput and (EAGLE) each sample's tau."""
    jobs = [(i, s) for i in range(len(prompts)) for s in range(args.num_samples)]
    longest = max(map(len, prompts)) + args.max_new_tokens
    engine = Engine(model, min(args.max_seq_len, longest), args.batch_size, head, tree, steps=steps,
                    adapt=adaptation_for(args, head))
    if steps.is_compiled:
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
    p.add_argument("--precision", choices=["auto", "fp32", "bf16", "int8", "int4", "w8a8"], help="instead of "
                   "--dtype and --quantize; auto: the one this machine's cost profile predicts fastest (with --eagle: with EAGLE)")
    p.add_argument("--quantize", choices=["int8", "int4", "w8a8"], help="run int8 / int4 weights (w8a8: int8 "
                   "weights and activations), quantized from the float checkpoint on first use into a file beside "
                   "it (quantize.py's, int4 with --quantize_lm_head)")
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
    p.add_argument("--compile_prefill", action="store_true", help="also compile the prefill (dynamic shape; "
                   "a --compile batch of several rows on a CPU compiles its prefills anyway)")
    args = p.parse_args(argv)
    check_model_arguments(args)
    if args.max_new_tokens < 1 or args.num_samples < 1 or args.batch_size < 1:
        raise UsageError("--max_new_tokens, --num_samples and --batch_size must be >= 1")
    if args.batch_size > 1 and args.chat:
        raise UsageError("--batch_size > 1 does not go with --chat (one conversation); drop one")
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
    prefills = args.compile_prefill or compiles_prefills(args.batch_size, args.device)  # the engine's rule
    steps = Steps.compiled(args.device, prefills, COMPILE_KINDS[args.compile_kind]) if compiled else EAGER
    if args.chat:
        session = Session(model, args.max_seq_len, head, tree, steps, adaptation_for(args, head))
        if compiled:
            warm_up(lambda: session.generate(tokenizer.encode_chat([{"role": "user", "content": "Hi"}]), 8, sampling),
                    governor)
            session.reset(measurements=True)
        return chat(session, tokenizer, args, sampling, governor)
    templated = args.chat_template or (not args.raw and tokenizer.has_own_chat_template)

    def encode(text: str) -> list:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": text})
        return tokenizer.encode_chat(messages) if templated else tokenizer.encode(text, bos=True)

    prompts = [encode(text) for text in args.prompt]
    if args.batch_size > 1:
        return run_batches(model, head, tree, tokenizer, prompts, args, sampling, steps, governor)
    # a cache no longer than the prompts need: attention reads every cache slot
    session = Session(model, min(args.max_seq_len, max(map(len, prompts)) + args.max_new_tokens), head, tree, steps,
                      adaptation_for(args, head))
    if compiled:
        warm_up(lambda: session.generate(prompts[0], 8, sampling), governor)
        session.reset(measurements=True)
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
