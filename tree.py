"""Draft trees: their buffers and the tree attention mask (engine.py drafts with them, step 1 of the EAGLE cycle).

A static tree (`Tree`, EAGLE-1) is a list of paths; a path lists child ranks from the root: [0, 1] is
the second-best draft child of the best draft child of the root. Node 0 is the root (the last committed
token); the other nodes are ordered by depth, so each draft level is a contiguous range of nodes.
EAGLE-2's dynamic tree (`DynamicTree`) picks its nodes per cycle from the draft's scores, with a fixed
node count so the verify shape stays static.

Both kinds answer num_nodes, max_depth, max_rank, draft_steps, draft_slots and to(device); engine.Engine's _draft
and _draft_dynamic grow them. `tree_attention_mask` is the one mask builder for the target (verify) and the head
(draft steps): a node sees the committed prefix and its ancestors.

A static tree may also hold a context branch ("paper+lookup-3"): a chain of `lookup` nodes from the root,
after the head's nodes, whose tokens are copied from the text so far (ContextLookup, prompt lookup
decoding). They cost no head forward, only verify rows; verification treats them as one-hot proposals.
"""
import ast
from dataclasses import dataclass

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
