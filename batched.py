"""Batched EAGLE: B sequences in one draft-verify cycle (the EAGLE paper's Section 4.4).

A BatchedSession holds B rows. Each row keeps its own length: its tokens sit at slots 0..len-1 of its batch
row of the target's and the head's KV caches (model.py takes per-row slots input_pos [B, T] and per-row masks
[B, 1, T, S]). One cycle runs every row at once:

1. draft: the head grows a tree from each row's last committed token, one head forward of B x (the level's
   nodes) per tree level;
2. verify: the target runs once over the B x n tree nodes, each row at its own slots and rotary positions;
3. accept: each row takes its own path, by the single-sequence rules (generate.accept_greedy and the lossless
   generate.accept_sampling), so each row's output is what a Session would give it;
4. commit: each row's accepted KV entries move into place, and the head reads each row's true features.

Each row is prefilled alone (a batch-1 forward into its row of the caches). A row that finishes (stop token,
token budget) is refilled at once with the next prompt waiting (continuous batching); with none left it rides
along, its results ignored, until every row is done. Vanilla (no head) decodes the B rows one token each per
step, so that the comparison with EAGLE is fair. Static trees (chains, the paper tree, lists of paths, a
context branch) share one structure across rows; the dynamic tree (EAGLE-2) grows each row's own tree, its
mask and depths per row. compile=True runs the steps as full graphs of static shape, the live slot count of
their masks dynamic, so nothing recompiles as rows advance, finish and are refilled.
"""
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from eagle_head import EagleHead
from generate import (HeadPrediction, Sampling, UsageError, accept_greedy, accept_sampling, argmax_tokens, check_fits,
                      compile_step, draft_step, head_prediction, sample)
from model import Transformer, causal_mask, narrow_caches
from tree import ContextLookup, DynamicTree, Tree, ancestor_mask, children_of, tree_attention_mask


@dataclass
class Row:
    """One sequence: `tokens` is its prompt and the tokens committed so far (in EAGLE the last of them, the
    cycle's root, is not in the target cache yet); `length` tokens are in the target cache."""
    tokens: list
    budget: int  # new tokens still wanted
    index: int = -1  # which prompt (-1: none, a spare row riding along)
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
class RowsDraft:
    """One cycle's drafts of every row: tokens [B, n]; a static tree's structure, shared (depths [n], tree_mask
    [n, n]), or a dynamic tree's, each row its own (depths [B, n], tree_mask [B, n, n]); parents and children:
    lists per row."""
    tokens: Tensor
    depths: Tensor
    tree_mask: Tensor
    parents: list
    children: list
    draft_probs: Optional[Tensor] = None  # [B, n, vocab] (static trees, sampling; None: one-hot proposals)
    lookup_from: Optional[int] = None  # context nodes from this index on


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
    [n, m], or [B, n, m] each row its own; m: the slots past the prefix they may see); S: the live slots of
    the longest row (attention reads no slot past them)."""
    slots = int(bases.max()) + tree_mask.shape[-1]
    masks = [tree_mask if tree_mask.dim() == 2 else tree_mask[i] for i in range(len(bases))]
    return torch.stack([tree_attention_mask(int(b), m, slots) for b, m in zip(bases, masks)])[:, None]


class BatchedSession:
    """B sequences decoded together by a target (and an optional EAGLE head with a static or dynamic tree)."""

    def __init__(self, model: Transformer, max_seq_len: int, batch_size: int, head: Optional[EagleHead] = None,
                 tree: Optional["Tree | DynamicTree"] = None, compile: bool = False):
        if head is not None and not isinstance(tree, (Tree, DynamicTree)):
            raise UsageError("batched EAGLE needs a tree: chain-N, paper, a list of paths, +lookup-N or dynamic-K-D-N")
        self.model, self.head, self.tree, self.batch_size = model, head, tree, batch_size
        self.max_seq_len, self.device, self.compiled = max_seq_len, model.output.weight.device, compile
        steps = (decode_rows, verify_rows, draft_step, update_rows)
        if compile:
            steps = [compile_step(f, fullgraph=True, dynamic=False) for f in steps]
        self.decode, self.verify, self.draft_step, self.update = steps
        scratch = 1 if head is None else tree.num_nodes + tree.max_depth + 1  # an unfinished cycle's slots
        self.cache_len = max_seq_len + scratch
        self.head_cache_len = None if head is None else max_seq_len + max(scratch, tree.draft_slots)
        self.setup_caches()
        if head is not None:
            self.tree = tree.to(self.device)
            if head.lm_head is None:
                head.bind(model.output.weight)

    def setup_caches(self, cache_len: int = 0, head_cache_len: int = 0):
        """The target's (and head's) KV caches for batch_size rows of at least cache_len (head_cache_len) slots,
        this session's by default: sessions sharing a model share its caches, and each generate call makes
        sure they fit it (reallocated only when they do not)."""
        self.cache_len, model = max(self.cache_len, cache_len), self.model
        if model.max_batch_size != self.batch_size or model.max_seq_len < self.cache_len:
            model.setup_caches(self.batch_size, self.cache_len)
        if self.head is not None:
            self.head_cache_len = max(self.head_cache_len, head_cache_len)
            cache = self.head.attention.kv_cache
            if cache is None or cache.k_cache.shape[0] != self.batch_size or self.head.max_seq_len < self.head_cache_len:
                self.head.setup_caches(self.head_cache_len, batch_size=self.batch_size)

    def live(self, mask: Tensor) -> Tensor:
        """A step's mask over the live slots: their count is dynamic in the compiled graphs (one graph serves
        every length; see generate.CacheWindow)."""
        if self.compiled:
            torch._dynamo.mark_dynamic(mask, mask.dim() - 1)
        return mask

    @torch.no_grad()
    def generate(self, prompts: list, max_new_tokens: int, sampling: Sampling, stop_ids=frozenset()):
        """New tokens for each of the prompts (lists of token ids), batch_size at a time: a row that finishes is
        refilled with the next prompt at once (continuous batching), so the batch stays full while prompts are
        left. Returns the outputs in the prompts' order and BatchStats."""
        if not prompts:
            raise UsageError("no prompts to generate for: give at least one")
        for p in prompts:
            check_fits(len(p), max_new_tokens, self.max_seq_len)
        self.setup_caches()
        self.model.feature_layers = None if self.head is None else self.head.feature_layers
        queue, finished = [(i, list(p)) for i, p in enumerate(prompts)], []
        start = time.perf_counter()
        rows, roots = [], []
        for b in range(self.batch_size):
            row, root = self._refill(b, queue, finished, max_new_tokens, sampling, stop_ids)
            rows.append(row)
            roots.append(root)
        if self.head is None:
            forwards = self._vanilla(rows, queue, finished, max_new_tokens, sampling, stop_ids)
        else:
            root = HeadPrediction(*(torch.cat(parts) for parts in zip(*roots)))
            forwards = self._eagle(rows, root, queue, finished, max_new_tokens, sampling, stop_ids)
        finished.sort(key=lambda r: r.index)
        stats = BatchStats([len(r.out) for r in finished], [r.accept_lengths for r in finished], forwards,
                           time.perf_counter() - start)
        return [r.out for r in finished], stats

    def _refill(self, b: int, queue: list, finished: list, max_new_tokens: int, sampling: Sampling, stop_ids):
        """Batch row b takes the next prompt of the queue (and the one after, if the first new token already
        ends it): prefill, first token and (EAGLE) the head's prompt, all in row b alone. With the queue empty
        the row rides along, done, its results ignored. Returns the row and (EAGLE) the head's prediction
        for its first tree."""
        while True:
            index, prompt = queue.pop(0) if queue else (-1, [0])
            row = Row(prompt, max_new_tokens if index >= 0 else 0, index=index, done=index < 0)
            root = self._prefill(b, row, sampling)
            if index < 0:
                return row, root
            finished.append(row)
            row.emit([row.tokens[-1]], stop_ids)
            if not row.done or not queue:
                return row, root

    def _prefill(self, b: int, row: Row, sampling: Sampling) -> Optional[HeadPrediction]:
        """Row b's prompt through the target (a batch-1 forward into row b of its cache), its first new token
        appended to row.tokens (it is not in the cache yet); with a head, the head reads the prompt's pairs
        (f_i, t_{i+1}), the first new token last, and its prediction there drafts the row's first tree."""
        T = len(row.tokens)
        pos = torch.arange(T, device=self.device)
        with self.model.cache_row(b):
            logits, features = self.model(rows_tensor([row.tokens], self.device), pos, mask=causal_mask(pos, T),
                                          logits_at=slice(-1, None))
        row.length = T
        row.tokens.append(int(sample(logits[0, -1], sampling)))
        if self.head is None:
            return None
        with narrow_caches(self.head.kv_caches(), b):  # eager: the prompts' length varies
            return update_rows(self.model, self.head, rows_tensor([self.head.pair_tokens(row.tokens[1:], row.tokens[:T])],
                                                                  self.device),
                               features, pos, causal_mask(pos, T), rows_tensor([T - 1], self.device),
                               self.tree.max_rank + 1)

    # ---------------------------------------------------------------- vanilla
    def _vanilla(self, rows: list, queue: list, finished: list, max_new_tokens: int, sampling: Sampling,
                 stop_ids) -> int:
        """One token per row per step (each row's last token, at its slot `length`); a finished row re-runs its
        slot until it is refilled or every row is done."""
        forwards = 0
        while not all(r.done for r in rows):
            pos = rows_tensor([[r.length] for r in rows], self.device)  # [B, 1]
            mask = self.live(causal_mask(pos, int(pos.max()) + 1)[:, None])  # [B, 1, 1, S]
            out = self.decode(self.model, rows_tensor([[r.tokens[-1]] for r in rows], self.device), pos, mask,
                              sampling.greedy)
            forwards += 1
            nxt = (out if sampling.greedy else sample(out, sampling)).tolist()
            for b, r in enumerate(rows):
                if r.done:
                    continue
                r.length += 1
                r.tokens.append(nxt[b])
                r.emit([nxt[b]], stop_ids)
                if r.done and queue:
                    rows[b], _ = self._refill(b, queue, finished, max_new_tokens, sampling, stop_ids)
        return forwards

    # ---------------------------------------------------------------- EAGLE
    def _eagle(self, rows: list, root: HeadPrediction, queue: list, finished: list, max_new_tokens: int,
               sampling: Sampling, stop_ids) -> int:
        forwards = 0
        while not all(r.done for r in rows):
            bases = rows_tensor([r.length for r in rows], self.device)  # each row's root slot
            draft = (self._draft_dynamic(rows, bases, root) if isinstance(self.tree, DynamicTree)
                     else self._draft(rows, bases, root, sampling))  # 1.
            out, features = self._verify(draft, bases, sampling)  # 2.
            forwards += 1
            paths, new, node_tokens = [], [], draft.tokens.tolist()
            for b, (r, tokens) in enumerate(zip(rows, node_tokens)):  # 3. each row its own path and bonus token
                if r.done:
                    paths.append([0])
                    new.append([tokens[0]])
                    continue
                path, bonus = self._accept(draft, b, tokens, out[b], sampling)
                paths.append(path)
                new.append([tokens[i] for i in path[1:]] + [bonus])
                r.accept_lengths.append(len(path) - 1)
            root = self._commit(rows, bases, paths, new, features)  # 4.
            for b, (r, path, tokens_b) in enumerate(zip(rows, paths, new)):
                if r.done:
                    continue
                r.tokens += tokens_b
                r.length += len(path)
                r.emit(tokens_b, stop_ids)
                if r.done and queue:
                    rows[b], one = self._refill(b, queue, finished, max_new_tokens, sampling, stop_ids)
                    for full, part in zip(root, one):
                        full[b] = part[0]
        return forwards

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
        parents = tree.parents.tolist()
        return RowsDraft(tokens, tree.depths, tree.tree_mask, [parents] * B, [tree.children] * B, draft_probs,
                         n_head if tree.lookup else None)

    def _draft_dynamic(self, rows: list, bases: Tensor, root) -> RowsDraft:
        """Step 1 with EAGLE-2's dynamic tree, as tree.DynamicTree.draft for each row at once: every row expands its
        own top_k frontier for depth levels (one head forward of B x top_k nodes per level; frontier node i of
        depth d at head slot base + (d - 1) * top_k + i), then keeps its best total_tokens nodes: each row its
        own tree (parents, depths and mask per row; one-hot proposals at any temperature)."""
        tree, head, B, K, device = self.tree, self.head, len(rows), self.tree.top_k, self.device
        batch = torch.arange(B, device=device)[:, None]
        # the candidate pool in creation order, chunked [B, ...]: tokens, cumulative log-probs, parents (pool
        # index, -1: the root), depths
        pool = [(root.top_tokens[:, 0], root.top_logp[:, 0], torch.full((B, K), -1, device=device),
                 torch.ones(B, K, dtype=torch.long, device=device))]
        frontier = torch.arange(K, device=device).repeat(B, 1)  # [B, K] pool indices
        frontier_hidden = root.hidden.expand(B, K, -1)
        frontier_slots = torch.zeros(B, K, tree.draft_slots, dtype=torch.bool, device=device)  # scratch ancestors
        root_tokens = rows_tensor([[r.tokens[-1]] for r in rows], device)  # [B, 1]
        for depth in range(1, tree.depth):
            tokens, scores, pool_parents, _ = (torch.cat(chunks, dim=1) for chunks in zip(*pool))
            own = torch.arange((depth - 1) * K, depth * K, device=device)
            frontier_slots[:, torch.arange(K, device=device), own] = True
            parent_tokens = torch.cat([root_tokens, tokens], 1).gather(1, pool_parents.gather(1, frontier) + 1)
            pred = self.draft_step(self.model, head, head.pair_tokens(tokens.gather(1, frontier), parent_tokens),
                                   frontier_hidden, bases[:, None] + own, (bases + depth - 1)[:, None].expand(B, K),
                                   self.live(row_masks(bases, frontier_slots)), K)
            child_scores = (scores.gather(1, frontier)[:, :, None] + pred.top_logp).flatten(1)  # [B, K * K]
            pool.append((pred.top_tokens.flatten(1), child_scores, frontier.repeat_interleave(K, dim=1),
                         torch.full((B, K * K), depth + 1, device=device)))
            best = child_scores.topk(K).indices  # each row's next frontier: its best K children
            frontier_slots, frontier_hidden = frontier_slots[batch, best // K], pred.hidden[batch, best // K]
            frontier = tokens.shape[1] + best
        tokens, scores, pool_parents, depths = (torch.cat(chunks, dim=1) for chunks in zip(*pool))
        # each row's best nodes by score; on equal score the shallower first, so a node's parent is always kept
        order = torch.sort(depths, dim=1, stable=True).indices
        order = order.gather(1, torch.sort(scores.gather(1, order), dim=1, descending=True, stable=True).indices)
        keep = order[:, : tree.total_tokens]
        keep = keep.gather(1, torch.sort(depths.gather(1, keep), dim=1, stable=True).indices)  # parents first
        index_of = torch.zeros(B, tokens.shape[1] + 1, dtype=torch.long, device=device)  # pool index -> node
        index_of.scatter_(1, keep + 1, torch.arange(1, tree.total_tokens + 1, device=device).repeat(B, 1))
        parents = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=device),
                             index_of.gather(1, pool_parents.gather(1, keep) + 1)], 1)  # [B, n]
        masks, node_depths = zip(*(ancestor_mask(p, tree.depth) for p in parents))
        parents = parents.tolist()
        return RowsDraft(torch.cat([root_tokens, tokens.gather(1, keep)], 1), torch.stack(node_depths),
                         torch.stack(masks), parents, [children_of(p) for p in parents])

    def _verify(self, draft: RowsDraft, bases: Tensor, sampling: Sampling):
        """Step 2: the target over every row's nodes: greedy tokens (or logits) after each node, and features."""
        n = draft.tokens.shape[1]
        input_pos = bases[:, None] + torch.arange(n, device=self.device)
        return self.verify(self.model, draft.tokens, input_pos, bases[:, None] + draft.depths,
                           self.live(row_masks(bases, draft.tree_mask)), sampling.greedy)

    def _accept(self, draft: RowsDraft, b: int, tokens: list, out: Tensor, sampling: Sampling):
        """Step 3 for row b (its node tokens as a list): its accepted path (node indices, root first) and bonus
        token."""
        if sampling.greedy:
            return accept_greedy(tokens, out.tolist(), draft.parents[b])
        return accept_sampling(tokens, out, draft.children[b], sampling,
                               None if draft.draft_probs is None else draft.draft_probs[b], draft.lookup_from)

    def _commit(self, rows: list, bases: Tensor, paths: list, new: list, features: Tensor):
        """Step 4: each row's accepted nodes' KV entries move to the slots after its prefix, and the head reads
        their true features (pairs with the tokens that follow them), max_depth + 1 rows per row (a row's
        padding is overwritten later; a done row's path [0] moves nothing); returns the head's prediction
        after each row's last new token."""
        pad = self.tree.max_depth + 1
        index = rows_tensor([path + list(range(len(path), pad)) for path in paths], self.device)  # [B, pad]
        if any(path != list(range(len(path))) for path in paths):  # a chain's entries are in place already
            slots = bases[:, None] + torch.arange(pad, device=self.device)
            for cache in self.model.kv_caches():
                cache.move(bases[:, None] + index, slots)
        feats = features.gather(1, index[..., None].expand(-1, -1, features.shape[-1]))
        next_tokens = rows_tensor([t + [0] * (pad - len(t)) for t in new], self.device)
        own = rows_tensor([[r.tokens[-1]] + t[:-1] + [0] * (pad - len(t)) for r, t in zip(rows, new)], self.device)
        pos = bases[:, None] + torch.arange(pad, device=self.device)
        return self.update(self.model, self.head, self.head.pair_tokens(next_tokens, own), feats, pos,
                           self.live(causal_mask(pos, int(pos.max()) + 1)[:, None]),
                           rows_tensor([len(p) - 1 for p in paths], self.device), self.tree.max_rank + 1)


def run_batches(model: Transformer, head: Optional[EagleHead], tree, tokenizer, prompts: list, args,
                sampling: Sampling):
    """generate.py --batch_size B: every prompt --num_samples times, B sequences at a time (a finished row takes
    the next sample at once); prints each text, then the throughput and (EAGLE) each sample's tau."""
    import sys

    jobs = [(i, s) for i in range(len(prompts)) for s in range(args.num_samples)]
    longest = max(map(len, prompts)) + args.max_new_tokens
    session = BatchedSession(model, min(args.max_seq_len, longest), args.batch_size, head, tree, compile=args.compile)
    outs, stats = session.generate([prompts[i] for i, _ in jobs], args.max_new_tokens, sampling, tokenizer.stop_ids)
    for (i, s), out in zip(jobs, outs):
        text = tokenizer.decode([t for t in out if t not in tokenizer.stop_ids])
        print(f"[prompt {i + 1}, sample {s + 1}] {text}", flush=True)
    line = (f"batch of {args.batch_size}, {len(jobs)} sequences: {sum(stats.new_tokens)} tokens in "
            f"{stats.total_s:.2f} s: {stats.tokens_per_s:.1f} tokens/s, {stats.target_forwards} target forwards")
    if head is not None:
        line += "\n  tau per sequence " + " ".join(f"{stats.tau(r):.2f}" for r in range(len(jobs)))
    print(line, file=sys.stderr)
