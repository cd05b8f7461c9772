"""tree.py: the static tree buffers (paper tree, chains, custom path lists), their validation, the
dynamic tree's parameters, and ancestor_mask."""
import pytest
import torch

from tree import PAPER_TREE, DynamicTree, Tree, ancestor_mask, build_tree, chain, parse_tree, tree_attention_mask


def expected_nodes(paths):
    """Node order the buffers promise: the root, then the paths by depth, then by ranks."""
    return [()] + sorted({tuple(p) for p in paths}, key=lambda p: (len(p), p))


def root_path(tree: Tree, node: int) -> list:
    """Node indices from the root to `node`, by the parents buffer."""
    path = [node]
    while path[-1]:
        path.append(int(tree.parents[path[-1]]))
    return path[::-1]


def leaf_paths(tree: Tree) -> list:
    """The candidate paths: root-to-leaf node indices, one per leaf in node order."""
    return [root_path(tree, leaf) for leaf in range(tree.num_nodes) if not tree.children[leaf]]


def check_buffers(tree: Tree, paths):
    """Every buffer of `tree` against a direct reading of its path list."""
    nodes = expected_nodes(paths)
    n = len(nodes)
    index = {p: i for i, p in enumerate(nodes)}
    assert tree.num_nodes == n
    assert tree.paths == [list(p) for p in nodes[1:]]
    assert tree.depths.tolist() == [len(p) for p in nodes]
    assert tree.parents.tolist() == [0] + [index[p[:-1]] for p in nodes[1:]]
    assert tree.ranks.tolist() == [p[-1] if p else 0 for p in nodes]
    assert tree.max_depth == max(len(p) for p in nodes)
    assert tree.max_rank == max(p[-1] for p in nodes[1:])
    # tree_mask: node i sees node j iff j's path is a prefix of i's (ancestor or itself)
    want = torch.tensor([[nodes[i][:len(nodes[j])] == nodes[j] for j in range(n)] for i in range(n)])
    assert tree.tree_mask.dtype == torch.bool and torch.equal(tree.tree_mask, want)
    # children in rank order
    for i, p in enumerate(nodes):
        kids = [index[q] for q in nodes if len(q) == len(p) + 1 and q[:-1] == p]
        assert tree.children[i] == sorted(kids, key=lambda c: nodes[c][-1])
    # levels: contiguous node ranges per depth, with each node's parent index within the level above
    first_of = {}
    for d, (first, end, parent_in_level) in enumerate(tree.levels, 1):
        members = [i for i, p in enumerate(nodes) if len(p) == d]
        assert list(range(first, end)) == members
        first_of[d] = first
        prev_first = first_of.get(d - 1, 0)
        assert (parent_in_level + prev_first).tolist() == tree.parents[first:end].tolist()
    # candidate paths: one per leaf, root to leaf, each node's path one step longer than its parent's
    leaves = [i for i, p in enumerate(nodes) if not any(q[:-1] == p for q in nodes[1:])]
    assert [path[-1] for path in leaf_paths(tree)] == leaves
    for path in leaf_paths(tree):
        assert path[0] == 0 and len(path) == len(nodes[path[-1]]) + 1 <= tree.max_depth + 1
        assert all(nodes[b][:-1] == nodes[a] and tree.depths[b] == d for d, (a, b) in enumerate(zip(path, path[1:]), 1))
    # ancestor_mask (used for the dynamic tree) rebuilds the same mask and depths from the parents
    mask, depths = ancestor_mask(tree.parents, tree.max_depth)
    assert torch.equal(mask, tree.tree_mask) and torch.equal(depths, tree.depths)


def test_paper_tree():
    tree = parse_tree("paper")
    assert len(PAPER_TREE) == 25
    check_buffers(tree, PAPER_TREE)
    assert tree.num_nodes == 26 and tree.max_depth == 5 and tree.max_rank == 3
    assert len(leaf_paths(tree)) == 15 and max(map(len, leaf_paths(tree))) == 6  # 15 leaves
    assert [end - first for first, end, _ in tree.levels] == [4, 8, 8, 3, 2]
    assert [int((tree.depths == d).sum()) for d in range(6)] == [1, 4, 8, 8, 3, 2]
    # spot checks against the paper's path list: node 1 is [0], node 5 is [0, 0], the deepest is [0,0,0,0,1]
    assert tree.paths[0] == [0] and tree.paths[4] == [0, 0] and tree.paths[-1] == [0, 0, 0, 0, 1]
    assert root_path(tree, 9) == [0, 2, 9] and not tree.children[9]  # leaf [1, 1]
    assert root_path(tree, 25) == [0, 1, 5, 13, 21, 25] and not tree.children[25]  # leaf [0, 0, 0, 0, 1]


@pytest.mark.parametrize("length", [1, 2, 4, 7])
def test_chain(length):
    tree = parse_tree(f"chain-{length}")
    check_buffers(tree, chain(length))
    n = length + 1
    assert torch.equal(tree.tree_mask, torch.ones(n, n, dtype=torch.bool).tril())
    assert tree.depths.tolist() == list(range(n))
    assert tree.parents.tolist() == [0] + list(range(length))
    assert leaf_paths(tree) == [list(range(n))]
    assert [(first, end) for first, end, _ in tree.levels] == [(d, d + 1) for d in range(1, n)]


def test_custom_path_list():
    spec = "[[0, 1], [1], [0], [0, 0], [0], [1, 0, 0], [1, 0], [2]]"  # any order, a duplicate
    tree = parse_tree(spec)
    paths = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [1, 0, 0]]
    check_buffers(tree, paths)
    assert tree.paths == paths
    assert tree.parents.tolist() == [0, 0, 0, 0, 1, 1, 2, 6]
    assert leaf_paths(tree) == [[0, 3], [0, 1, 4], [0, 1, 5], [0, 2, 6, 7]]
    assert torch.equal(build_tree(paths).tree_mask, tree.tree_mask)


def test_tree_to_device_keeps_buffers():
    tree = parse_tree("paper").to("cpu")
    check_buffers(tree, PAPER_TREE)


@pytest.mark.parametrize("paths, words", [
    ([[0, 0]], "no parent path [0]"),
    ([[0], [0, 0, 0]], "no parent path [0, 0]"),
    ([[0], [2]], "skips rank 1"),
    ([[0], [0, 1]], "skips rank 0"),
    ([[-1]], "negative rank"),
    ([[0], [0, -1]], "negative rank"),
])
def test_invalid_paths(paths, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        build_tree(paths)
    with pytest.raises(ValueError):
        parse_tree(str(paths))


@pytest.mark.parametrize("spec", ["bogus", "[]", "[[]]", "[0, 1]", "[[0], 1]", "{'a': 1}", "[[0],",
                                  "dynamic", "dynamic-8-4", "dynamic-a-b-c", "dynamic-8-4-16-2",
                                  "chain-2+lookup-", "chain-2+lookup-0", "paper+lookup-x", "dynamic-8-4-16+lookup-2"])
def test_unparseable_specs(spec):
    with pytest.raises(ValueError):
        parse_tree(spec)


def test_lookup_branch_buffers():
    """A context branch: a chain from the root after the head's nodes; the head's levels are unchanged."""
    tree, plain = parse_tree("[[0], [1], [0, 0]]+lookup-3"), parse_tree("[[0], [1], [0, 0]]")
    assert tree.parents.tolist() == [0, 0, 0, 1, 0, 4, 5] and tree.depths.tolist() == [0, 1, 1, 2, 1, 2, 3]
    assert tree.children[0] == [1, 2, 4] and tree.tree_mask[6].tolist() == [True, False, False, False, True, True, True]
    assert (tree.num_nodes, tree.max_depth, tree.draft_steps, tree.draft_slots) == (7, 3, 1, 3)
    assert tree.levels[0][:2] == plain.levels[0][:2] and len(tree.levels) == len(plain.levels) == 2
    assert parse_tree("chain-1+lookup-4").max_depth == 4


def test_dynamic_tree():
    tree = parse_tree("dynamic-8-4-16")
    assert isinstance(tree, DynamicTree) and (tree.top_k, tree.depth, tree.total_tokens) == (8, 4, 16)
    assert (tree.num_nodes, tree.max_depth, tree.max_rank) == (17, 4, 7)
    # total_tokens may be as large as the pool: top_k + (depth - 1) * top_k**2 candidates
    assert DynamicTree(2, 3, 2 + 2 * 4).num_nodes == 11
    assert DynamicTree(1, 1, 1).num_nodes == 2
    for bad in [(0, 4, 8), (4, 0, 8), (4, 4, 0), (2, 3, 11), (4, 1, 5), (-1, 2, 2)]:
        with pytest.raises(ValueError, match="dynamic tree"):
            DynamicTree(*bad)


def test_ancestor_mask_of_a_dynamic_shape():
    # a tree as the dynamic draft builds one: parents precede children, the root is its own parent
    parents = torch.tensor([0, 0, 0, 1, 1, 2, 3, 6, 3])
    mask, depths = ancestor_mask(parents, 4)
    assert depths.tolist() == [0, 1, 1, 2, 2, 2, 3, 4, 3]
    assert mask[7].nonzero().flatten().tolist() == [0, 1, 3, 6, 7]
    assert mask[5].nonzero().flatten().tolist() == [0, 2, 5]
    assert mask.sum().item() == int((depths + 1).sum())


def test_tree_attention_mask_sees_prefix_and_ancestors():
    """One builder for verify (the whole tree at slots base..) and the head's draft steps (rows of some
    nodes over scratch slots): row i sees slots < base and slot base + j where tree_mask[i, j]."""
    tree = parse_tree("[[0], [1], [0, 0]]")
    mask = tree_attention_mask(3, tree.tree_mask, 9)
    assert mask.shape == (4, 9) and mask[:, :3].all() and not mask[:, 7:].any()
    assert torch.equal(mask[:, 3:7], tree.tree_mask)
    rows = tree_attention_mask(5, tree.tree_mask[2:, 1:], 8)  # nodes 2, 3 over the 3 scratch slots of nodes 1..3
    assert rows.tolist() == [[True] * 5 + [False, True, False], [True] * 5 + [True, False, True]]
