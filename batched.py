"""Batched EAGLE: B sequences in one draft-verify cycle (the EAGLE paper's Section 4.4).

A BatchedSession holds B rows. Each row keeps its own length: its tokens sit at slots 0..len-1 of its batch
row of the target's and the head's KV caches (model.py takes per-row slots input_pos [B, T] and per-row masks
[B, 1, T, S]). One cycle runs every row at once:

1. draft: the head grows the same static tree from each row's last committed token, one head forward of
   B x (the level's nodes) per tree level;
2. verify: the target runs once over the B x n tree nodes, each row at its own slots and rotary positions;
3. accept: each row takes its own path, by the single-sequence rules (generate.accept_greedy and the lossless
   generate.accept_sampling), so each row's output is what a Session would give it;
4. commit: each row's accepted KV entries move into place, and the head reads each row's true features.

A row that finishes (stop token, token budget) stops committing and rides along, its results ignored, until
every row is done. Vanilla (no head) decodes the B rows one token each per step, so that the comparison with
EAGLE is fair. Static trees only (chains, the paper tree, lists of paths, a context branch); the dynamic tree
is single-sequence (generate.Session). compile=True runs the steps as full graphs of static shape, the live
slot count of their masks dynamic, so nothing recompiles as rows advance and finish.
"""
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from eagle_head import EagleHead
from generate import (Sampling, UsageError, accept_greedy, accept_sampling, argmax_tokens, check_fits, compile_step,
                      draft_step, head_prediction, sample)
from model import Transformer, causal_mask
from tree import ContextLookup, Tree, tree_attention_mask


@dataclass
class Row:
    """One sequence: `tokens` is its prompt and the tokens committed so far (in EAGLE the last of them, the
    cycle's root, is not in the target cache yet); `length` tokens are in the target cache."""
    tokens: list
    budget: int  # new tokens still wanted
    length: int = 0
    out: list = field(default_factory=list)
    done: bool = False
    accept_lengths: list = field(default_factory=list)
    context: ContextLookup = field(default_factory=ContextLookup)

    def emit(self, new: list, stop_ids) -> list:
        """Add new tokens to the output, cut at the budget and after a stop token; finishes the row."""
        new = new[: self.budget]
        stop = next((i + 1 for i, t in enumerate(new) if t in stop_ids), None)
        new = new[:stop]
        self.out += new
        self.budget -= len(new)
        self.done = stop is not None or self.budget == 0
        return new


@dataclass
class BatchStats:
    """Per row: new tokens and (EAGLE) accepted drafts per cycle; for the batch: target forwards and time."""
    new_tokens: list
    accept_lengths: list
    target_forwards: int
    total_s: float

    @property
    def tokens_per_s(self) -> float:
        return sum(self.new_tokens) / max(self.total_s, 1e-9)

    def tau(self, row: int) -> float:
        """Tokens a cycle committed in this row (accepted drafts + the bonus token), on average."""
        lengths = self.accept_lengths[row]
        return (sum(lengths) + len(lengths)) / max(1, len(lengths))


# ---------------------------------------------------------------- the model steps (eager, or compiled)
def decode_rows(model: Transformer, tokens: Tensor, input_pos: Tensor, mask: Tensor, greedy: bool) -> Tensor:
    """One token per row [B, 1] at slots input_pos [B, 1]: greedy tokens [B] or logits [B, V]."""
    logits, _ = model(tokens, input_pos, mask=mask)
    return argmax_tokens(logits[:, -1]) if greedy else logits[:, -1]


def verify_rows(model: Transformer, tokens: Tensor, input_pos: Tensor, rope_pos: Tensor, mask: Tensor, greedy: bool):
    """Every row's tree nodes [B, n]: greedy tokens [B, n] (or logits [B, n, V]) after each node, and features."""
    logits, features = model(tokens, input_pos, mask=mask, rope_pos=rope_pos)
    return (argmax_tokens(logits) if greedy else logits), features


def update_rows(model: Transformer, head: EagleHead, tokens: Tensor, features: Tensor, input_pos: Tensor,
                mask: Tensor, last: Tensor, k: int):
    """The head reads pairs (features [B, m, dim], tokens [B, m]); its prediction at index last[b] of each row."""
    hidden = head(model.tok_embeddings(tokens), features, input_pos, mask)
    return head_prediction(head, hidden[torch.arange(hidden.shape[0], device=hidden.device), last][:, None], k)


def rows_tensor(values: list, device) -> Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def row_masks(bases: Tensor, tree_mask: Tensor) -> Tensor:
    """[B, 1, n, S] bool: row b's nodes at slots bases[b].. see its prefix and their ancestors (tree_mask
    [n, n]); S: the live slots of the longest row (attention reads no slot past them)."""
    slots = int(bases.max()) + tree_mask.shape[0]
    return torch.stack([tree_attention_mask(int(b), tree_mask, slots) for b in bases])[:, None]


class BatchedSession:
    """B sequences decoded together by a target (and an optional EAGLE head with a static tree)."""

    def __init__(self, model: Transformer, max_seq_len: int, batch_size: int, head: Optional[EagleHead] = None,
                 tree: Optional[Tree] = None, compile: bool = False):
        if head is not None and not isinstance(tree, Tree):
            raise UsageError("batched EAGLE drafts static trees (chain-N, paper, a list of paths, +lookup-N); "
                             "run a dynamic tree one sequence at a time")
        self.model, self.head, self.tree, self.batch_size = model, head, tree, batch_size
        self.max_seq_len, self.device, self.compiled = max_seq_len, model.output.weight.device, compile
        steps = (decode_rows, verify_rows, draft_step, update_rows)
        if compile:
            steps = [compile_step(f, fullgraph=True, dynamic=False) for f in steps]
        self.decode, self.verify, self.draft_step, self.update = steps
        scratch = 1 if head is None else tree.num_nodes + tree.max_depth + 1  # an unfinished cycle's slots
        model.setup_caches(batch_size, max_seq_len + scratch)
        if head is not None:
            self.tree = tree.to(self.device)
            head.setup_caches(max_seq_len + max(scratch, tree.draft_slots), batch_size=batch_size)
            if head.lm_head is None:
                head.bind(model.output.weight)
            self.features = torch.zeros(batch_size, max_seq_len + scratch, head.feature_dim, device=self.device,
                                        dtype=model.output.weight.dtype)

    def live(self, mask: Tensor) -> Tensor:
        """A step's mask over the live slots: their count is dynamic in the compiled graphs (one graph serves
        every length; see generate.CacheWindow)."""
        if self.compiled:
            torch._dynamo.mark_dynamic(mask, mask.dim() - 1)
        return mask

    @torch.no_grad()
    def generate(self, prompts: list, max_new_tokens: int, sampling: Sampling, stop_ids=frozenset()):
        """New tokens for up to batch_size prompts (lists of token ids) at once, and BatchStats."""
        if not 1 <= len(prompts) <= self.batch_size:
            raise UsageError(f"{len(prompts)} prompts for a batch of {self.batch_size}: give 1 to {self.batch_size}")
        for p in prompts:
            check_fits(len(p), max_new_tokens, self.max_seq_len)
        self.model.feature_layers = None if self.head is None else self.head.feature_layers
        # rows without a prompt ride along from the start, done
        rows = [Row(list(p), max_new_tokens) for p in prompts]
        rows += [Row([0], 0, done=True) for _ in range(self.batch_size - len(prompts))]
        start = time.perf_counter()
        first = self._prefill(rows, sampling)
        for row, token in zip(rows, first):
            if not row.done:
                row.emit([token], stop_ids)
        forwards = (self._eagle if self.head is not None else self._vanilla)(rows, first, sampling, stop_ids)
        stats = BatchStats([len(r.out) for r in rows[:len(prompts)]], [r.accept_lengths for r in rows[:len(prompts)]],
                           forwards, time.perf_counter() - start)
        return [r.out for r in rows[:len(prompts)]], stats

    def _prefill(self, rows: list, sampling: Sampling) -> list:
        """All prompts in one forward, right-padded: a row's padding lies at slots its own tokens never see
        (causal), and later tokens overwrite it. Returns each row's first new token."""
        T = max(len(r.tokens) for r in rows)
        tokens = rows_tensor([r.tokens + [0] * (T - len(r.tokens)) for r in rows], self.device)
        pos = torch.arange(T, device=self.device)
        ends = sorted({len(r.tokens) - 1 for r in rows})  # logits only where some row's prompt ends
        logits, features = self.model(tokens, pos, mask=causal_mask(pos, T), logits_at=rows_tensor(ends, self.device))
        if self.head is not None:
            self.features[:, :T] = features
        for r in rows:
            r.length = len(r.tokens)
        last = logits[torch.arange(len(rows)), rows_tensor([ends.index(r.length - 1) for r in rows], self.device)]
        return sample(last, sampling).tolist()

    # ---------------------------------------------------------------- vanilla
    def _vanilla(self, rows: list, tokens: list, sampling: Sampling, stop_ids) -> int:
        """One token per row per step; a finished row re-runs its slot (its output is ignored)."""
        forwards = 0
        while not all(r.done for r in rows):
            pos = rows_tensor([[r.length] for r in rows], self.device)  # [B, 1]
            mask = self.live(causal_mask(pos, int(pos.max()) + 1)[:, None])  # [B, 1, 1, S]
            out = self.decode(self.model, rows_tensor([[t] for t in tokens], self.device), pos, mask, sampling.greedy)
            forwards += 1
            nxt = (out if sampling.greedy else sample(out, sampling)).tolist()
            for b, r in enumerate(rows):
                if not r.done:
                    r.tokens.append(tokens[b])
                    r.length += 1
                    tokens[b] = nxt[b]
                    r.emit([nxt[b]], stop_ids)
        return forwards

    # ---------------------------------------------------------------- EAGLE
    def _eagle(self, rows: list, roots: list, sampling: Sampling, stop_ids) -> int:
        for r, token in zip(rows, roots):
            r.tokens.append(token)
        root = self._head_prefill(rows)
        forwards = 0
        while not all(r.done for r in rows):
            bases = rows_tensor([r.length for r in rows], self.device)  # each row's root slot
            tokens, draft_probs = self._draft(rows, bases, root, sampling)  # 1. [B, n]
            out, features = self._verify(tokens, bases, sampling)  # 2.
            forwards += 1
            paths, new = [], []
            for b, r in enumerate(rows):  # 3. each row its own path and bonus token
                if r.done:
                    paths.append([0])
                    new.append([tokens[b, 0].item()])
                    continue
                path, bonus = self._accept(tokens[b], out[b], sampling, None if draft_probs is None else draft_probs[b])
                paths.append(path)
                new.append([tokens[b, i].item() for i in path[1:]] + [bonus])
                r.accept_lengths.append(len(path) - 1)
            root = self._commit(rows, bases, paths, new, features)  # 4.
            for r, path, tokens_b in zip(rows, paths, new):
                if not r.done:
                    r.tokens += tokens_b
                    r.length += len(path)
                    r.emit(tokens_b, stop_ids)
        return forwards

    def _head_prefill(self, rows: list):
        """The head reads each row's prompt pairs (f_i, t_{i+1}), the first new token last; its prediction at
        each row's last pair drafts that row's first tree."""
        T = max(r.length for r in rows)
        next_tokens = rows_tensor([r.tokens[1:r.length + 1] + [0] * (T - r.length) for r in rows], self.device)
        own = rows_tensor([r.tokens[:r.length] + [0] * (T - r.length) for r in rows], self.device)
        pos = torch.arange(T, device=self.device)
        # eager: the prompts' length varies (self.update is the compiled fixed-shape step)
        return update_rows(self.model, self.head, self.head.pair_tokens(next_tokens, own), self.features[:, :T], pos,
                           causal_mask(pos, T), rows_tensor([r.length - 1 for r in rows], self.device),
                           self.tree.max_rank + 1)

    def _draft(self, rows: list, bases: Tensor, root, sampling: Sampling):
        """Step 1, as tree.Tree.draft for each row at once: a node of rank r is its parent's r-th most likely
        draft token (greedy) or r-th draw without replacement from the head's q (sampling, q kept in
        draft_probs [B, n, vocab]). Node j's head slot: base + j - 1; depth d's rotary position base + d - 1."""
        tree, head, B = self.tree, self.head, len(rows)
        k, n_head = tree.max_rank + 1, len(tree.paths) + 1
        tokens = rows_tensor([[r.tokens[-1]] for r in rows], self.device).repeat(1, tree.num_nodes)
        if tree.lookup:  # the context branch: each row's own text
            tokens[:, n_head:] = rows_tensor([r.context.propose(r.tokens, tree.lookup) for r in rows], self.device)
        draft_probs = vocab_ids = None
        if not sampling.greedy:
            draft_probs = torch.zeros(B, tree.num_nodes, self.model.config.vocab_size, device=self.device)
            vocab_ids = head.token_ids(torch.arange(root.logits.shape[-1], device=self.device))
        head_mask = row_masks(bases, tree.tree_mask[1:n_head, 1:n_head]) if tree.draft_steps else None
        parent, parent_first = root, 0
        for depth, (first, end, parent_in_level) in enumerate(tree.levels, 1):
            if sampling.greedy:
                tokens[:, first:end] = parent.top_tokens[:, parent_in_level, tree.ranks[first:end]]
            else:
                q = sampling.probs(parent.logits)  # [B, parents in level, draft vocab]
                draft_probs[:, parent_first:parent_first + q.shape[1], vocab_ids] = q
                tokens[:, first:end] = vocab_ids[sampling.draw(q, k)[:, parent_in_level, tree.ranks[first:end]]]
            if depth == len(tree.levels):
                break
            m = end - first
            pos = bases[:, None] + torch.arange(first - 1, end - 1, device=self.device)  # [B, m]
            paired = head.pair_tokens(tokens[:, first:end], tokens[:, tree.parents[first:end]])
            parent = self.draft_step(self.model, head, paired, parent.hidden[:, parent_in_level], pos,
                                     (bases + depth - 1)[:, None].expand(B, m),
                                     self.live(head_mask[:, :, first - 1:end - 1]), k)
            parent_first = first
        return tokens, draft_probs

    def _verify(self, tokens: Tensor, bases: Tensor, sampling: Sampling):
        """Step 2: the target over every row's nodes: greedy tokens (or logits) after each node, and features."""
        n = tokens.shape[1]
        input_pos = bases[:, None] + torch.arange(n, device=self.device)
        return self.verify(self.model, tokens, input_pos, bases[:, None] + self.tree.depths,
                           self.live(row_masks(bases, self.tree.tree_mask)), sampling.greedy)

    def _accept(self, tokens: Tensor, out: Tensor, sampling: Sampling, draft_probs: Optional[Tensor]):
        tree = self.tree
        if sampling.greedy:
            return accept_greedy(tokens.tolist(), out.tolist(), tree.parents.tolist())
        lookup_from = len(tree.paths) + 1 if tree.lookup else None
        return accept_sampling(tokens.tolist(), out, tree.children, sampling, draft_probs, lookup_from)

    def _commit(self, rows: list, bases: Tensor, paths: list, new: list, features: Tensor):
        """Step 4: each row's accepted nodes' KV entries move to the slots after its prefix, and the head reads
        their true features (pairs with the tokens that follow them), max_depth + 1 rows per row (a row's
        padding is overwritten later); returns the head's prediction after each row's last new token."""
        pad, B = self.tree.max_depth + 1, len(rows)
        feats = torch.zeros(B, pad, features.shape[-1], device=self.device, dtype=features.dtype)
        for b, path in enumerate(paths):
            base, index = int(bases[b]), rows_tensor(path + list(range(len(path), pad)), self.device)
            if not rows[b].done and path != list(range(len(path))):  # a chain's entries are in place already
                for cache in self.model.kv_caches():
                    cache.k_cache[b][:, base:base + pad] = cache.k_cache[b][:, base + index]
                    cache.v_cache[b][:, base:base + pad] = cache.v_cache[b][:, base + index]
            feats[b] = features[b].index_select(0, index)
            if not rows[b].done:
                self.features[b, base:base + pad] = feats[b]
        next_tokens = rows_tensor([t + [0] * (pad - len(t)) for t in new], self.device)
        own = rows_tensor([[r.tokens[-1]] + t[:-1] + [0] * (pad - len(t)) for r, t in zip(rows, new)], self.device)
        pos = bases[:, None] + torch.arange(pad, device=self.device)
        return self.update(self.model, self.head, self.head.pair_tokens(next_tokens, own), feats, pos,
                           self.live(causal_mask(pos, int(pos.max()) + 1)[:, None]),
                           rows_tensor([len(p) - 1 for p in paths], self.device), self.tree.max_rank + 1)


def run_batches(model: Transformer, head: Optional[EagleHead], tree, tokenizer, prompts: list, args,
                sampling: Sampling):
    """generate.py --batch_size B: every prompt --num_samples times, B sequences at a time; prints each text, then
    each batch's throughput and (EAGLE) each row's tau."""
    import sys

    jobs = [(i, prompt) for i, prompt in enumerate(prompts) for _ in range(args.num_samples)]
    longest = max(map(len, prompts)) + args.max_new_tokens
    session = BatchedSession(model, min(args.max_seq_len, longest), args.batch_size, head, tree, compile=args.compile)
    for start in range(0, len(jobs), args.batch_size):
        batch = jobs[start: start + args.batch_size]
        outs, stats = session.generate([p for _, p in batch], args.max_new_tokens, sampling, tokenizer.stop_ids)
        for row, ((i, _), out) in enumerate(zip(batch, outs)):
            text = tokenizer.decode([t for t in out if t not in tokenizer.stop_ids])
            print(f"[prompt {i + 1}, row {row + 1}] {text}", flush=True)
        line = (f"batch of {len(batch)}: {sum(stats.new_tokens)} tokens in {stats.total_s:.2f} s: "
                f"{stats.tokens_per_s:.1f} tokens/s, {stats.target_forwards} target forwards")
        if head is not None:
            line += "\n  tau per row " + " ".join(f"{stats.tau(r):.2f}" for r in range(len(batch)))
        print(line, file=sys.stderr)
