"""Draft trees and their static buffers.

A tree is a list of paths; a path lists child ranks from the root: [0, 1] is the second-best draft
child of the best draft child of the root. Node 0 is the root (the last committed token); the other
nodes are ordered by depth, so each draft level is a contiguous range of nodes.

Buffers (all static in shape for a given tree):
- tree_mask [n, n] bool: node i sees node j iff j is an ancestor of i or i itself;
- depths [n]: 0 for the root; the rotary position of node i is prefix_len + depths[i];
- parents [n] (root: 0), ranks [n] (child rank among its siblings);
- retrieve_indices [n_leaves, max_depth + 1]: root-to-leaf node indices, padded with -1 (the
  candidate paths, for a port that gathers them; generate.py walks `parents` instead, which also
  serves the dynamic tree);
- levels: for each depth d >= 1, the node range of that depth and, per node, its parent's index
  within level d - 1 (the draft runs one head forward per level).
EAGLE-2's dynamic tree (`DynamicTree`, drafted in generate.py) picks its nodes per cycle from the
draft's scores, with a fixed node count so the verify shape stays static; `ancestor_mask` gives
its tree mask and depths.
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
    """'paper', 'chain-N', 'dynamic-K-D-N' (top_k, depth, total nodes) or a Python list of paths.
    Returns a Tree or a DynamicTree."""
    if spec.startswith("dynamic"):
        try:
            top_k, depth, total_tokens = (int(v) for v in spec.split("-")[1:])
        except ValueError:
            raise ValueError(f"bad --tree {spec!r}: write dynamic-TOPK-DEPTH-NODES, e.g. dynamic-8-5-24") from None
        return DynamicTree(top_k, depth, total_tokens)
    return build_tree(parse_paths(spec))


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
class Tree:
    paths: list
    tree_mask: Tensor
    depths: Tensor
    parents: Tensor
    ranks: Tensor
    retrieve_indices: Tensor
    levels: list  # per depth d >= 1: (first node, last node + 1, parent index within level d - 1)
    children: list  # children[i]: node indices of i's children, in rank order

    @property
    def num_nodes(self) -> int:
        return len(self.depths)

    @property
    def max_depth(self) -> int:
        return len(self.levels)

    @property
    def max_rank(self) -> int:
        return int(self.ranks.max())

    @property
    def draft_slots(self) -> int:
        """Head cache slots past the prefix that one draft writes: one per non-root node."""
        return self.num_nodes - 1

    def to(self, device):
        for name in ("tree_mask", "depths", "parents", "ranks", "retrieve_indices"):
            setattr(self, name, getattr(self, name).to(device))
        self.levels = [(a, b, p.to(device)) for a, b, p in self.levels]
        return self


def build_tree(paths: list) -> Tree:
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
    n = len(nodes)
    tree_mask = torch.zeros(n, n, dtype=torch.bool)
    parents, children = [0] * n, [[] for _ in range(n)]
    for i, p in enumerate(nodes):
        for d in range(len(p) + 1):
            tree_mask[i, index[p[:d]]] = True
        if p:
            parents[i] = index[p[:-1]]
            children[parents[i]].append(i)
    depths = torch.tensor([len(p) for p in nodes])
    max_depth = int(depths.max())
    leaves = [i for i in range(n) if not children[i]]
    retrieve = torch.full((len(leaves), max_depth + 1), -1, dtype=torch.long)
    for row, leaf in enumerate(leaves):
        path = [index[nodes[leaf][:d]] for d in range(len(nodes[leaf]) + 1)]
        retrieve[row, : len(path)] = torch.tensor(path)
    levels = []
    for d in range(1, max_depth + 1):
        members = [i for i in range(n) if len(nodes[i]) == d]
        prev_first = min(i for i in range(n) if len(nodes[i]) == d - 1)
        levels.append((members[0], members[-1] + 1, torch.tensor([parents[i] - prev_first for i in members])))
    return Tree(paths=[list(p) for p in paths], tree_mask=tree_mask, depths=depths,
                parents=torch.tensor(parents), ranks=torch.tensor([p[-1] if p else 0 for p in nodes]),
                retrieve_indices=retrieve, levels=levels, children=children)


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

    @property
    def num_nodes(self) -> int:
        return self.total_tokens + 1

    @property
    def max_depth(self) -> int:
        return self.depth

    @property
    def max_rank(self) -> int:
        return self.top_k - 1

    @property
    def draft_slots(self) -> int:
        """Head cache slots past the prefix that one draft writes: top_k per expanded level."""
        return (self.depth - 1) * self.top_k


def ancestor_mask(parents: Tensor, max_depth: int):
    """tree_mask [n, n] (ancestors and self) and depths [n] from parents [n] (root: its own parent),
    for nodes ordered so that parents precede children."""
    n = parents.shape[0]
    mask = torch.eye(n, dtype=torch.bool, device=parents.device)
    ancestor = parents
    for _ in range(max_depth):
        mask[torch.arange(n, device=parents.device), ancestor] = True
        ancestor = parents[ancestor]
    return mask, mask.sum(1) - 1
