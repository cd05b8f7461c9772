"""Draft trees: their buffers, the tree attention mask, and the draft (step 1 of the EAGLE cycle).

A static tree (`Tree`, EAGLE-1) is a list of paths; a path lists child ranks from the root: [0, 1] is
the second-best draft child of the best draft child of the root. Node 0 is the root (the last committed
token); the other nodes are ordered by depth, so each draft level is a contiguous range of nodes.
EAGLE-2's dynamic tree (`DynamicTree`) picks its nodes per cycle from the draft's scores, with a fixed
node count so the verify shape stays static.

Both kinds answer num_nodes, max_depth, max_rank, draft_steps, draft_slots, to(device), and draft(session,
root_token, root, sampling) -> Draft, the nodes to verify. `tree_attention_mask` is the one mask builder
for the target (verify) and the head (draft steps): a node sees the committed prefix and its ancestors.

A static tree may also hold a context branch ("paper+lookup-3"): a chain of `lookup` nodes from the root,
after the head's nodes, whose tokens are copied from the text so far (ContextLookup, prompt lookup
decoding). They cost no head forward, only verify rows; verification treats them as one-hot proposals.
"""
import ast
import math
import platform
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Optional

import torch
from torch import Tensor

# The EAGLE paper's tree ("mc_sim_7b_63"): 25 draft nodes + root, depth 5.
PAPER_TREE = [
    [0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [2, 1], [3, 0],
    [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [0, 2, 0], [0, 2, 1], [1, 0, 0],
    [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1],
]


def chain(length: int) -> list:
    """A single path of `length` draft tokens (the draft's argmax at each step)."""
    return [[0] * d for d in range(1, length + 1)]


def parse_tree(spec: str):
    """'paper', 'chain-N', 'dynamic-K-D-N' (top_k, depth, total nodes) or a Python list of paths, a static
    one optionally followed by '+lookup-N' (a context branch of N nodes). Returns a Tree or a DynamicTree."""
    spec, lookup = split_lookup(spec)
    if spec.startswith("dynamic"):
        if lookup:
            raise ValueError(f"bad --tree {spec}+lookup-{lookup}: a context branch goes with static trees only")
        try:
            top_k, depth, total_tokens = (int(v) for v in spec.split("-")[1:])
        except ValueError:
            raise ValueError(f"bad --tree {spec!r}: write dynamic-TOPK-DEPTH-NODES, e.g. dynamic-8-5-24") from None
        return DynamicTree(top_k, depth, total_tokens)
    return build_tree(parse_paths(spec), lookup)


def split_lookup(spec: str):
    """'chain-2+lookup-3' -> ('chain-2', 3); a spec without '+lookup-N' -> (spec, 0)."""
    spec, plus, lookup = spec.partition("+lookup-")
    if plus and not (lookup.isdigit() and int(lookup) >= 1):
        raise ValueError(f"bad --tree {spec}+lookup-{lookup}: write +lookup-N with N >= 1, e.g. chain-1+lookup-3")
    return spec, int(lookup) if plus else 0


def parse_paths(spec: str) -> list:
    if spec == "paper":
        return PAPER_TREE
    if spec.startswith("chain-"):
        length = spec.split("-", 1)[1]
        if not length.isdigit() or int(length) < 1:
            raise ValueError(f"bad --tree {spec!r}: a chain needs a length >= 1, e.g. chain-4")
        return chain(int(length))
    try:
        paths = ast.literal_eval(spec)
    except (ValueError, SyntaxError):
        raise ValueError(f"bad --tree {spec!r}: use 'paper', 'chain-N', 'dynamic-K-D-N' or a list of paths") from None
    if not (isinstance(paths, list) and paths and all(isinstance(p, list) and p for p in paths)):
        raise ValueError(f"bad --tree {spec!r}: a tree is a non-empty list of non-empty paths of child ranks")
    return paths


@dataclass
class Draft:
    """One cycle's candidate tokens, what verify checks; node 0 is the root, parents precede children."""
    tokens: Tensor  # [n] node tokens
    parents: Tensor  # [n] (root: 0)
    depths: Tensor  # [n]: rotary position prefix_len + depth
    tree_mask: Tensor  # [n, n]: ancestors and self
    children: list  # children[i]: node i's children in node order
    draft_probs: Optional[Tensor] = None  # [n, vocab]: the law node i's children were drawn from (None: one-hot)
    lookup_from: Optional[int] = None  # nodes from this index on are context proposals (one-hot)


def children_of(parents: list) -> list:
    children = [[] for _ in parents]
    for child, parent in enumerate(parents[1:], 1):
        children[parent].append(child)
    return children


def tree_attention_mask(base: int, tree_mask: Tensor, slots: int) -> Tensor:
    """[rows, slots] bool: row i sees cache slots < base (the prefix) and slot base + j where tree_mask[i, j]
    (its ancestors among the nodes at slots base, base + 1, ...)."""
    m = tree_mask.shape[1]
    cols = torch.arange(slots, device=tree_mask.device)
    rel = cols - base
    return (cols < base)[None, :] | (tree_mask[:, rel.clamp(0, m - 1)] & ((rel >= 0) & (rel < m))[None, :])


@dataclass
class Tree:
    """A static tree's buffers (build_tree), all static in shape."""
    paths: list
    tree_mask: Tensor  # [n, n] bool: node i sees node j iff j is an ancestor of i or i itself
    depths: Tensor  # [n]: 0 for the root; node i's rotary position is prefix_len + depths[i]
    parents: Tensor  # [n] (root: 0)
    ranks: Tensor  # [n]: child rank among siblings
    levels: list  # per depth d >= 1: (first node, last node + 1, parent index within level d - 1); one head forward each
    children: list  # children[i]: node indices of i's children, in rank order
    lookup: int = 0  # context nodes: a chain from the root after the head's nodes

    def __post_init__(self):  # what both tree kinds answer (module docstring)
        self.num_nodes, self.max_rank = len(self.depths), int(self.ranks.max())
        self.max_depth = max(len(self.levels), self.lookup)  # the longest path a cycle can accept
        self.draft_steps = len(self.levels) - 1  # head forwards (the root's children come from the last update)
        self.draft_slots = len(self.paths)  # head cache slots past the prefix a draft writes: one per head node

    def to(self, device):
        for name in ("tree_mask", "depths", "parents", "ranks"):
            setattr(self, name, getattr(self, name).to(device))
        self.levels = [(a, b, p.to(device)) for a, b, p in self.levels]
        return self

    def draft(self, session, root_token: int, root, sampling) -> Draft:
        """EAGLE-1: one head forward per level on all its nodes, through the session's steps, model, head and
        window (the context branch: session.context's proposal); root: the head's prediction after the root.
        Greedy: a node of rank r is its parent's r-th most likely draft token. Sampling: the r-th draw without
        replacement from the head's q (through the target's temperature / top-k / top-p), kept in draft_probs
        (accepted with about sum_x min(p(x), q(x)), the argmax only with p(argmax q)). Node j's head slot:
        base + j - 1, depth d's rotary position: base + d - 1 (base: the root's slot)."""
        steps, target, head, window, base = session.steps, session.model, session.head, session.window, session.target_len
        device, k = root.hidden.device, self.max_rank + 1
        tokens, n_head = torch.full((self.num_nodes,), root_token, dtype=torch.long, device=device), len(self.paths) + 1
        if self.lookup:
            tokens[n_head:] = torch.tensor(session.context.propose(session.tokens, self.lookup), device=device)
        draft_probs = vocab_ids = None
        # [draft nodes, head slots]; a tree of depth 1 (chain-1) makes no draft step
        head_mask = window.tree(base, self.tree_mask[1:n_head, 1:n_head], head.max_seq_len) if self.draft_steps else None
        if not sampling.greedy:
            draft_probs = torch.zeros(self.num_nodes, target.config.vocab_size, device=device)
            vocab_ids = head.token_ids(torch.arange(root.logits.shape[-1], device=device))
        parent, parent_first = root, 0
        for depth, (first, end, parent_in_level) in enumerate(self.levels, 1):
            if sampling.greedy:
                tokens[first:end] = parent.top_tokens[0, parent_in_level, self.ranks[first:end]]
            else:  # k draws without replacement per parent, in draw order
                q = sampling.probs(parent.logits[0])  # [parents in level, draft vocab]
                draft_probs[parent_first:parent_first + q.shape[0], vocab_ids] = q
                tokens[first:end] = vocab_ids[sampling.draw(q, k)[parent_in_level, self.ranks[first:end]]]
            if depth == len(self.levels):
                break
            parent = steps.draft(target, head, head.pair_tokens(tokens[first:end], tokens[self.parents[first:end]]).view(1, -1),
                                 parent.hidden[:, parent_in_level], base + torch.arange(first - 1, end - 1, device=device),
                                 torch.full((end - first,), base + depth - 1, device=device),
                                 window.mark(head_mask[first - 1:end - 1]), k)
            parent_first = first
        return Draft(tokens, self.parents, self.depths, self.tree_mask, self.children, draft_probs,
                     n_head if self.lookup else None)


def build_tree(paths: list, lookup: int = 0) -> Tree:
    """The static tree of `paths` (plus a context branch of `lookup` nodes after them)."""
    paths = sorted({tuple(p) for p in paths}, key=lambda p: (len(p), p))
    present = set(paths)
    for p in paths:
        if any(r < 0 for r in p):
            raise ValueError(f"tree path {list(p)} has a negative rank")
        if len(p) > 1 and p[:-1] not in present:
            raise ValueError(f"tree path {list(p)} has no parent path {list(p[:-1])}")
        if p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in present:
            raise ValueError(f"tree path {list(p)} skips rank {p[-1] - 1}: child ranks must be contiguous")
    nodes = [()] + paths
    index = {p: i for i, p in enumerate(nodes)}
    parents = [index[p[:-1]] if p else 0 for p in nodes]
    parents += [len(nodes) + d - 1 if d else 0 for d in range(lookup)]  # the context chain
    tree_mask, depths = ancestor_mask(torch.tensor(parents), max(max(map(len, nodes)), lookup))
    levels = []
    for d in range(1, max(map(len, nodes)) + 1):
        members = [i for i in range(len(nodes)) if len(nodes[i]) == d]
        prev_first = min(i for i in range(len(nodes)) if len(nodes[i]) == d - 1)
        levels.append((members[0], members[-1] + 1, torch.tensor([parents[i] - prev_first for i in members])))
    return Tree(paths=[list(p) for p in paths], tree_mask=tree_mask, depths=depths, parents=torch.tensor(parents),
                ranks=torch.tensor([p[-1] if p else 0 for p in nodes] + [0] * lookup), levels=levels,
                children=children_of(parents), lookup=lookup)


@dataclass
class DynamicTree:
    """EAGLE-2: expand the top_k frontier nodes of highest cumulative draft log-probability for
    `depth` levels, then keep the best `total_tokens` draft nodes (plus the root)."""
    top_k: int
    depth: int
    total_tokens: int

    def __post_init__(self):
        pool = self.top_k + (self.depth - 1) * self.top_k ** 2
        if min(self.top_k, self.depth, self.total_tokens) < 1 or self.total_tokens > pool:
            raise ValueError(f"dynamic tree needs top_k, depth, total_tokens >= 1 and total_tokens <= "
                             f"{pool} (the nodes {self.depth} levels of top-{self.top_k} expansion produce)")
        self.num_nodes, self.max_depth, self.max_rank = self.total_tokens + 1, self.depth, self.top_k - 1
        self.draft_steps, self.draft_slots = self.depth - 1, (self.depth - 1) * self.top_k  # top_k per expanded level

    def to(self, device):
        return self  # nothing static to move

    def draft(self, session, root_token: int, root, sampling) -> Draft:
        """EAGLE-2 (its nodes are the draft's best tokens: one-hot proposals at any temperature). Frontier node
        i of depth d uses head scratch slot base + (d-1)*top_k + i (base: the root's slot)."""
        steps, target, head, window, base = session.steps, session.model, session.head, session.window, session.target_len
        device, K = root.hidden.device, self.top_k
        # the candidate pool in creation order, chunked: (tokens, cumulative log-probs, parents: pool index
        # (-1: the root), depths)
        pool = [(root.top_tokens[0, 0], root.top_logp[0, 0], torch.full((K,), -1, device=device),
                 torch.ones(K, dtype=torch.long, device=device))]
        frontier = torch.arange(K, device=device)  # pool indices of the frontier
        frontier_hidden = root.hidden.expand(1, K, -1)  # features their head inputs pair with
        frontier_slots = torch.zeros(K, self.draft_slots, dtype=torch.bool, device=device)  # scratch ancestors
        root_tokens = torch.tensor([root_token], device=device)
        for depth in range(1, self.depth):
            tokens, scores, pool_parents, _ = (torch.cat(chunks) for chunks in zip(*pool))
            own = torch.arange((depth - 1) * K, depth * K, device=device)
            frontier_slots[torch.arange(K, device=device), own] = True
            parent_tokens = torch.cat([root_tokens, tokens])[pool_parents[frontier] + 1]
            pred = steps.draft(target, head, head.pair_tokens(tokens[frontier], parent_tokens).view(1, -1),
                               frontier_hidden, base + own, torch.full((K,), base + depth - 1, device=device),
                               window.tree(base, frontier_slots, head.max_seq_len), K)
            child_scores = (scores[frontier, None] + pred.top_logp[0]).flatten()  # [K*K]
            pool.append((pred.top_tokens[0].flatten(), child_scores, frontier.repeat_interleave(K),
                         torch.full((K * K,), depth + 1, device=device)))
            best = child_scores.topk(K).indices  # the next frontier: the best K children (pool index tokens.numel() + best)
            frontier_slots, frontier_hidden = frontier_slots[best // K], pred.hidden[:, best // K]
            frontier = tokens.numel() + best
        tokens, scores, pool_parents, depths = (torch.cat(chunks) for chunks in zip(*pool))
        # best nodes by score; on equal score the shallower first, so a node's parent is always kept
        order = torch.sort(depths, stable=True).indices
        order = order[torch.sort(scores[order], descending=True, stable=True).indices]
        keep = order[: self.total_tokens]
        keep = keep[torch.sort(depths[keep], stable=True).indices]  # parents before children
        index_of = torch.zeros(tokens.numel() + 1, dtype=torch.long, device=device)  # pool index -> node
        index_of[keep + 1] = torch.arange(1, keep.numel() + 1, device=device)
        parents = torch.cat([torch.zeros(1, dtype=torch.long, device=device), index_of[pool_parents[keep] + 1]])
        tree_mask, node_depths = ancestor_mask(parents, self.depth)
        return Draft(torch.cat([root_tokens, tokens[keep]]), parents, node_depths, tree_mask, children_of(parents.tolist()))


def ancestor_mask(parents: Tensor, max_depth: int):
    """tree_mask [n, n] (ancestors and self) and depths [n] from parents [n] (root: 0; parents first)."""
    n = parents.shape[0]
    mask = torch.eye(n, dtype=torch.bool, device=parents.device)
    ancestor = parents
    for _ in range(max_depth):
        mask[torch.arange(n, device=parents.device), ancestor] = True
        ancestor = parents[ancestor]
    return mask, mask.sum(1) - 1


class ContextLookup:
    """Draft tokens copied from the text so far (prompt lookup decoding): find the latest earlier
    occurrence of the longest suffix (up to `ngram` tokens) of the committed tokens and propose what
    followed it; a continuation that runs into the suffix goes on copying its own proposal (periodic
    text). An index of every n-gram's latest end is kept as the text grows, so a proposal costs O(ngram)."""

    def __init__(self, ngram: int = 3):
        self.ngram = ngram
        self.reset()

    def reset(self):
        """Forget the text (a new prompt)."""
        self.end_of, self.indexed = {}, 1  # n-gram -> end of its latest occurrence; n-grams ending before
        # `indexed` are in end_of

    def propose(self, tokens: list, count: int) -> list:
        """`count` tokens to follow `tokens` (a list that only grows between resets); without any match,
        the last token repeated."""
        for end in range(self.indexed, len(tokens)):  # n-grams ending before the last token (not the suffix)
            for n in range(1, min(self.ngram, end) + 1):
                self.end_of[tuple(tokens[end - n:end])] = end
        self.indexed = max(self.indexed, len(tokens))
        for n in range(min(self.ngram, len(tokens)), 0, -1):
            end = self.end_of.get(tuple(tokens[-n:]))
            if end is not None:
                out = []
                for i in range(end, end + count):
                    out.append(tokens[i] if i < len(tokens) else out[i - len(tokens)])
                return out
        return [tokens[-1]] * count


# ---------------------------------------------------------------- tree auto
# The static tree a measured profile favours: the head's acceptance model (acceptance.json beside the
# head, written by `scripts/train_eagle.py eval`) and the machine's cost model (scripts/profile_costs.py)
# in, the tree of highest predicted tokens/s out.
#
# Acceptance model: p[d-1][r] = P(the target's greedy token is the rank-r draft child of a node at depth
# d - 1 | that node was accepted), the same for every node of that depth ("positional"), independent
# between depths. A node is on the accepted path with probability prod p along its path, so
# tau = 1 + sum of those products over the draft nodes (1: the bonus token).
#
# Why the greedy expansion is exact: a valid tree holds each node's parent and its lower-rank siblings.
# A node's value (its path product) is <= its parent's (p <= 1) and, when p[d] does not increase with
# rank, <= its lower-rank siblings'. So every prerequisite of a node is worth at least as much as the
# node, the n most valuable nodes form a valid tree, and repeatedly adding the frontier node of highest
# value (Sequoia's construction) yields exactly them: the highest tau over all trees of n nodes.
# Capping the depth keeps that true (the nodes of depth <= D form a valid tree too). Where measured p
# rises with rank (noise in deep, rare cells) the expansion is still valid, only not proven best.
#
# Cost: a tree of depth D costs verify(n nodes incl. the root) + one draft step per level 1..D-1 (rows =
# the level's width; the root's children come from the previous cycle's head update) + the head update
# (D + 1 rows) + the KV moves of the accepted path (not on a chain: its path is always in place) + a
# fixed host overhead. The best tree for each (node count, depth cap) is the greedy one; auto_tree
# evaluates tau / cost for every node count and every depth cap, and every chain (which saves the KV
# moves), and keeps the best. With costs growing with rows and draft costs that do not depend on the
# level width this search is exact (a tree is matched by the greedy tree of its size and depth, a chain
# by itself: at least its tau, at most its cost); with width-dependent draft costs the greedy tree's level
# widths are taken as they come (measured draft steps grow slowly with width).
import heapq  # noqa: E402


def path_value(path, p) -> float:
    """Probability that the node `path` is on the accepted path: the product of p along it (depths or
    ranks beyond p: probability 0)."""
    value = 1.0
    for d, r in enumerate(path):
        value *= p[d][r] if d < len(p) and r < len(p[d]) else 0.0
    return value


def tree_tau(paths, p) -> float:
    """Expected tokens per cycle (bonus included) of the tree `paths` under acceptance model p[d-1][r]."""
    return 1.0 + sum(path_value(path, p) for path in paths)


def accepted_depth(paths: set, ranks) -> int:
    """Draft tokens a tree accepts (greedy) when the target's token at depth d is the draft's rank
    ranks[d - 1] (a rank no node has: rejected there). paths: a set of tuples."""
    node = ()
    for r in ranks:
        if node + (r,) not in paths:
            break
        node += (r,)
    return len(node)


def greedy_order(p, max_nodes: int, max_depth: int) -> list:
    """Draft nodes (paths) in the order of the greedy expansion, at most max_nodes, depth <= max_depth:
    the first n of them are the tree of highest tau with n draft nodes (see above). Stops at value 0."""
    order, frontier = [], [(-path_value((0,), p), (0,))]
    while frontier and len(order) < max_nodes:
        neg_value, path = heapq.heappop(frontier)
        if neg_value == 0:
            break
        order.append(list(path))
        for new in (path[:-1] + (path[-1] + 1,), path + (0,)):  # its next sibling and its first child
            if len(new) <= max_depth:
                heapq.heappush(frontier, (-path_value(new, p), new))
    return order


def along(xs: list, x: float) -> float:
    """Piecewise-linear through the (rows, ms) points xs, sorted by rows, extended linearly past the last two."""
    if x <= xs[0][0]:
        return xs[0][1]
    for (x0, y0), (x1, y1) in zip(xs, xs[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = xs[-2], xs[-1]
    return y1 + (y1 - y0) * (x - x1) / (x1 - x0)


def frozen_ratio(profile: dict, precision: str, rows: int, kind: str = "autotuned") -> float:
    """A verify of `rows` rows compiled as `kind` ("frozen": weights frozen; "autotuned": frozen and inductor's
    max-autotune; generate.COMPILE_KINDS) over the default compile, from the fixed-shape verifies that
    profile_costs.py --autotune timed each way (profile["autotune"]; 1, 4 and 16 rows): piecewise linear in
    log(rows) between them, flat outside; 1.0 for "default" or where the profile has no such measurement."""
    at = profile.get("autotune", {}).get(precision, {})
    if f"{kind}_ms" not in at or kind == "default":
        return 1.0
    points = sorted((math.log(n), t / d) for n, d, t in zip(at["rows"], at["default_ms"], at[f"{kind}_ms"]))
    x = math.log(rows)
    if x >= points[-1][0]:
        return points[-1][1]
    return along(points, x)


@dataclass
class CycleCosts:
    """Milliseconds of the pieces of one cycle, as {rows: ms} measured points (scripts/profile_costs.py):
    verify: the target's forward over n rows (a vanilla decode step is verify(1) + decode_overhead_ms);
    draft: a head draft step over the m nodes of a level; update: the head's update forward over r rows;
    move: the accepted path's KV moves (r rows); overhead_ms: the rest of a cycle's host work."""
    verify: dict
    draft: dict
    update: dict
    move: dict
    overhead_ms: float = 0.0
    decode_overhead_ms: float = 0.0
    curves: dict = field(init=False, repr=False)  # the four as sorted (rows, ms) pairs, for `along`

    def __post_init__(self):
        self.curves = {name: sorted((int(k), v) for k, v in getattr(self, name).items())
                       for name in ("verify", "draft", "update", "move")}

    @classmethod
    def from_profile(cls, profile: dict, precision: str, batch_size: int = 1, kind: str = "default") -> "CycleCosts":
        """One precision ("fp32", "bf16", "int8", "int4") of a profile_costs.py JSON; batch_size > 1: its
        batched cycle's pieces (profile["batches"]), the host work taken as that of one row times the rows
        (each row's accept and commit are its own Python work). kind: how the target's steps are compiled
        (generate.py --autotune: "default", "frozen" or "autotuned"), the verify curve scaled by frozen_ratio."""
        c = profile["precisions"][precision] if batch_size == 1 else profile["batches"][str(batch_size)][precision]
        verify = c["verify_ms"]
        if kind != "default" and batch_size == 1:
            verify = {n: ms * frozen_ratio(profile, precision, int(n), kind) for n, ms in verify.items()}
        return cls(verify, c["draft_ms"], c["update_ms"], c["move_ms"],
                   profile.get("overhead_ms", 0.0) * batch_size, profile.get("decode_overhead_ms", 0.0) * batch_size)

    @staticmethod
    def in_profile(profile: Optional[dict], precision: str, batch_size: int = 1) -> bool:
        """Whether from_profile finds this precision and batch size in the profile."""
        if not profile:
            return False
        table = profile.get("precisions", {}) if batch_size == 1 else profile.get("batches", {}).get(str(batch_size), {})
        return precision in table

    @property
    def decode_ms(self) -> float:
        return along(self.curves["verify"], 1) + self.decode_overhead_ms

    def cycle_ms(self, paths, lookup: int = 0) -> float:
        """A cycle of the tree `paths` with a context branch of `lookup` nodes (whose accepted path is not
        in place: KV moves counted whenever there is one)."""
        widths = [0] * max(len(q) for q in paths)
        for q in paths:
            widths[len(q) - 1] += 1
        depth, in_place = max(len(widths), lookup), all(w == 1 for w in widths) and not lookup
        c = self.curves
        return (along(c["verify"], len(paths) + 1 + lookup) + sum(along(c["draft"], w) for w in widths[:-1])
                + along(c["update"], depth + 1) + (0.0 if in_place else along(c["move"], depth + 1)) + self.overhead_ms)


def reach(paths, p) -> list:
    """[1, P(A >= 1), ..., P(A >= depth), 0]: the chance that the tree's accepted path A reaches each depth
    (the nodes of one depth are disjoint events: one path is accepted)."""
    depth = max(map(len, paths))
    return [1.0] + [sum(path_value(q, p) for q in paths if len(q) == d) for d in range(1, depth + 1)] + [0.0]


def context_gain(at_least: list, joint, n: int) -> float:
    """Tokens per cycle a context branch of n nodes adds to a tree that reaches each depth with chance
    at_least (reach): a cycle accepts the longer of the head's path A and the branch's match B, P(A = a)
    from the positional model, P(B >= d | A = a) from joint[a][b], counts of cycle starts where the head's
    chain accepted a tokens and the context proposal matched b (a capped at the tree's depth; B and A
    measured together: both are long on the same easy stretches)."""
    depth = len(at_least) - 2
    rows = [list(r) for r in joint[:depth]] + [[sum(c) for c in zip(*joint[depth:])]]  # a = 0..depth
    gain = 0.0
    for a, row in enumerate(rows):
        if sum(row):  # given A = a, the branch adds its depths d = a + 1..n it reaches: E[min(B, n) - a]+
            gain += (at_least[a] - at_least[a + 1]) * sum(sum(row[d:]) for d in range(a + 1, n + 1)) / sum(row)
    return gain


def branch_taus(paths, p, lookup_joints=None) -> list:
    """tau of `paths` with a context branch of 0, 1, ... nodes; lookup_joints[n - 1]: the joint counts
    (context_gain) taken at the cycle starts of a walk with an n-node branch, so that each length is
    scored on the cycles it would run (acceptance.json's lookup.joints)."""
    at_least = reach(paths, p)
    tau = 1.0 + sum(at_least[1:])  # tree_tau
    return [tau] + [tau + context_gain(at_least, joint, n) for n, joint in enumerate(lookup_joints or [], 1)]


class AutoTree(NamedTuple):
    paths: list  # the head's nodes, for build_tree
    tau: float  # predicted tokens per cycle
    speedup: float  # predicted tokens/s over vanilla's
    lookup: int = 0  # context branch nodes

    @property
    def spec(self) -> str:
        """The --tree spec of this tree (parse_tree's input): chain-N for a chain, else its list of paths."""
        depth = len(self.paths)
        head = f"chain-{depth}" if self.paths == chain(depth) else str(self.paths)
        return head + (f"+lookup-{self.lookup}" if self.lookup else "")


def predict(spec: str, p, costs: Optional[CycleCosts], lookup_joints=None):
    """Predicted (tau, speedup over vanilla; None without costs) of the static tree `spec` (parse_tree's
    form), as auto_tree scores its candidates."""
    spec, lookup = split_lookup(spec)
    paths = parse_paths(spec)
    taus = branch_taus(paths, p, lookup_joints)
    tau = taus[min(lookup, len(taus) - 1)]  # a branch longer than any counted match adds nothing more
    return tau, None if costs is None else tau / costs.cycle_ms(paths, lookup) * costs.decode_ms


def auto_tree(p, costs: CycleCosts, max_nodes: int = 64, margin: float = 0.0, lookup_joints=None) -> AutoTree:
    """The static tree of at most max_nodes draft nodes with the highest predicted tokens/s,
    tau / cycle_ms, under acceptance model p[d-1][r] and `costs`; with lookup_joints (branch_taus) also
    the length of its context branch (0 included), head and context nodes counted together. Its
    predicted speedup over vanilla = (tau / cycle_ms) * decode_ms; below 1 vanilla decoding is predicted
    faster than any tree. With `margin` > 0 a tree must be predicted that much faster than every smaller
    one to be chosen (the smallest within margin of the best wins): the model's error then decides nothing.
    Never more nodes than the verify curve was measured for (past its last point it is only extrapolated)."""
    max_nodes = min(max_nodes, costs.curves["verify"][-1][0] - 1)
    candidates = []
    chains = [chain(n) for n in range(1, min(len(p), max_nodes) + 1)]
    for depth_cap in range(1, len(p) + 1):
        order = greedy_order(p, max_nodes, depth_cap)
        for paths in [order[:n] for n in range(1, len(order) + 1)] + (chains if depth_cap == 1 else []):
            taus = branch_taus(paths, p, lookup_joints)
            for lookup, tau in enumerate(taus[: max_nodes - len(paths) + 1]):
                candidates.append(AutoTree(paths, tau, tau / costs.cycle_ms(paths, lookup) * costs.decode_ms, lookup))
    best = max(c.speedup for c in candidates)
    return min((c for c in candidates if c.speedup >= best * (1 - margin) - 1e-12),
               key=lambda c: len(c.paths) + c.lookup)


def instruction_set(cpuinfo: Optional[str] = None) -> str:
    """The widest of amx / avx512_bf16 / avx512 / avx2 the CPU has (its flags in cpuinfo, default
    /proc/cpuinfo), else the machine (aarch64, ...): what the cost curves and the fastest precision depend on."""
    path = Path("/proc/cpuinfo")
    text = cpuinfo if cpuinfo is not None else path.read_text() if path.is_file() else ""
    flags = set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))
    for name, needs in (("amx", "amx_bf16"), ("avx512_bf16", "avx512_bf16"), ("avx512", "avx512f"), ("avx2", "avx2")):
        if needs in flags:
            return name
    return platform.machine() or "unknown"


def cpu_family(cpuinfo: Optional[str] = None) -> Optional[str]:
    """"family F model M" of the CPU (/proc/cpuinfo, or the text cpuinfo), None where it does not say: CPUs of
    one instruction set run the same steps at different speeds (on the two AVX-512 BF16 EPYC families met,
    max-autotune took a one-row bf16 step from 47.0 to 17.8 ms on one and from 24.9 to 27.6 ms on the other), so
    cost profiles record it."""
    path = Path("/proc/cpuinfo")
    text = cpuinfo if cpuinfo is not None else path.read_text() if path.is_file() else ""
    family, model = (re.search(rf"^{key}\s*:\s*(\d+)", text, re.M) for key in ("cpu family", "model"))
    return f"family {family.group(1)} model {model.group(1)}" if family and model else None


def same_cpu(recorded: Optional[str], machine: Optional[str]) -> bool:
    """Whether a profile measured on the CPU `recorded` ("family F model M", or "family F" where the model was not
    recorded) holds for this machine's `machine` (cpu_family())."""
    return bool(recorded and machine) and (machine == recorded or machine.startswith(recorded + " "))


def cost_profile_path(threads: int) -> Path:
    """Where scripts/profile_costs.py keeps this machine's cost profile: keyed by instruction set, thread
    count and torch version, what the curves depend on."""
    key = f"{instruction_set()}-t{threads}-torch{torch.__version__}"
    return Path.home() / ".cache" / "eagle-fast" / f"costs-{key}.json"
