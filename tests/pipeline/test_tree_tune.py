"""The Sequoia tree optimiser (pipeline.tree_tune) against brute force, and explicit tree shapes (TreeConfig.paths)."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from pipeline.config import InvalidParam, TreeConfig
from pipeline.tree import TreeShape, tree_shape
from pipeline.tree_tune import (
    Costs,
    RankCounter,
    TunedTree,
    acceptance_from_counts,
    best_trees,
    choose,
    expected_accepted,
    load_costs,
    load_rank_acceptance,
    load_tree,
    save_tree,
)


def all_trees(n: int, ranks: int, depth: int) -> set[frozenset]:
    """Every tree of n nodes (rank paths closed under parents, children a run of ranks) within ranks and depth."""
    trees = {frozenset()}
    for _ in range(n):
        grown = set()
        for t in trees:
            for parent in [()] + [p for p in t if len(p) < depth]:
                c = sum(1 for p in t if p[:-1] == parent and len(p) == len(parent) + 1)
                if c < ranks:
                    grown.add(t | {parent + (c,)})
        trees = grown
    return trees


@pytest.mark.parametrize("seed", range(4))
def test_best_trees_match_brute_force(seed):
    rng = random.Random(seed)
    ranks, depth = 3, 3
    acc = []
    for _ in range(depth):  # not monotone in rank: the program must not rely on it
        row = [rng.random() for _ in range(ranks)]
        scale = rng.uniform(0.3, 1.0) / sum(row)
        acc.append([a * scale for a in row])
    trees = best_trees(acc, max_nodes=5, max_depth=depth)
    for n in range(1, 6):
        for bound in range(1, depth + 1):
            candidates = all_trees(n, ranks, bound)
            if not candidates:  # more nodes than ranks ** bound allow
                assert (n, bound) not in trees
                continue
            brute = max(expected_accepted(tuple(t), acc) for t in candidates)
            got = trees[(n, bound)]
            assert got.accepted == pytest.approx(brute)
            assert got.accepted == pytest.approx(expected_accepted(got.paths, acc))
            assert got.num_nodes == n and got.depth <= bound
            assert tree_shape(TreeConfig(paths=got.paths)).num_nodes == n  # a valid shape


def test_literal_small_trees():
    acc = [[0.5, 0.3], [0.5, 0.3]]
    trees = best_trees(acc, max_nodes=3, max_depth=2)
    assert trees[(2, 2)].paths == ((0,), (1,))  # 0.8 against the chain's 0.75
    assert trees[(2, 2)].accepted == pytest.approx(0.8)
    assert trees[(3, 2)].paths == ((0,), (1,), (0, 0))
    assert trees[(3, 2)].accepted == pytest.approx(1.05)
    assert (3, 1) not in trees  # two ranks: one level holds two nodes


def test_rank_zero_mass_gives_a_chain():
    acc = [[0.8, 0.0, 0.0]] * 5
    tree = best_trees(acc, max_nodes=5, max_depth=5)[(5, 5)]
    assert tree.paths == ((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 0, 0))
    shape = tree_shape(TreeConfig(paths=tree.paths))
    assert shape == TreeShape.chain(5)


def test_more_nodes_or_depth_never_predict_less():
    rng = random.Random(7)
    acc = [sorted((rng.random() * 0.3 for _ in range(4)), reverse=True) for _ in range(5)]
    trees = best_trees(acc, max_nodes=20, max_depth=5)
    for (n, bound), t in trees.items():
        if (n + 1, bound) in trees:
            assert trees[(n + 1, bound)].accepted >= t.accepted
        if (n, bound + 1) in trees:
            assert trees[(n, bound + 1)].accepted >= t.accepted - 1e-12


def test_monotone_acceptance_equals_the_top_paths():
    """Where acceptance falls with the rank, the best tree holds the n paths of highest value (module docstring)."""
    acc = [[0.6, 0.2, 0.1], [0.5, 0.25, 0.05], [0.4, 0.3, 0.2]]
    values = sorted((expected_accepted([p], acc) for d in range(1, 4) for p in itertools.product(range(3), repeat=d)),
                    reverse=True)
    trees = best_trees(acc, max_nodes=12, max_depth=3)
    for n in range(1, 13):
        assert trees[(n, 3)].accepted == pytest.approx(sum(values[:n]))


def test_acceptance_from_counts():
    assert acceptance_from_counts([[6, 2], [1, 0]], [[10, 8], [4, 0]]) == [[0.6, 0.25], [0.25, 0.0]]
    assert acceptance_from_counts([[9, 3]], [[10, 3]])[0] == pytest.approx([0.9 / 1.9, 1 / 1.9])  # scaled to 1


def test_choose_weighs_verify_and_draft_costs():
    acc = [[0.6, 0.3], [0.6, 0.3], [0.6, 0.3]]
    trees = best_trees(acc, max_nodes=4, max_depth=3)
    flat = Costs("flat", {2: 1.0, 3: 1.0, 4: 1.0, 5: 1.0}, 0.0)  # nodes are free: the most nodes win
    best, rows = choose(trees, flat)
    assert best.tree.num_nodes == 4 and [c.tree.num_nodes for c in rows] == [1, 2, 3, 4]
    steep = Costs("steep", {2: 1.0, 3: 3.0, 4: 5.0, 5: 7.0}, 0.0)  # every node beyond the first costs 2x a pass
    best, _ = choose(trees, steep)
    assert best.tree.paths == ((0,),) and best.tokens_per_s == pytest.approx(1.6)
    deep = Costs("deep", {2: 1.0, 3: 1.0, 4: 1.0, 5: 1.0}, 10.0)  # a draft level dearer than anything: depth 1
    best, rows = choose(trees, deep)
    assert best.tree.depth == 1 and all(c.tree.depth == 1 for c in rows if c.tree.num_nodes <= 2)
    with pytest.raises(ValueError, match="times none"):
        choose(trees, Costs("x", {40: 1.0}, 0.0))


def test_explicit_paths_build_the_same_shape_as_branching():
    cfg = TreeConfig((3, 2, 2, 1), max_nodes=8)
    shape = tree_shape(cfg)
    paths = [()] * shape.num_nodes
    for i, (p, r) in enumerate(zip(shape.parents, shape.ranks)):
        paths[i] = (paths[p] if p >= 0 else ()) + (r,)
    explicit = TreeConfig(paths=tuple(reversed(paths)))  # any order
    assert tree_shape(explicit) == shape
    assert explicit.branching == (2, 2, 2, 1) and len(explicit.branching) == shape.depth


@pytest.mark.parametrize("paths, match", [
    ([(0,), (0, 1)], "no sibling of rank 0"),
    ([(0,), (1, 0)], "no parent"),
    ([(0,), (0,)], "distinct"),
    ([], "1 to 64"),
    ([(0,), ()], "one or more ranks"),
    ([(0,), ("a",)], "integers"),
    ([(r,) for r in range(65)], "1 to 64"),
])
def test_bad_paths_are_refused(paths, match):
    with pytest.raises(InvalidParam, match=match):
        TreeConfig(paths=paths)


def test_explicit_paths_refuse_a_budget_or_a_dynamic_tree():
    with pytest.raises(InvalidParam, match="leave out max_nodes and dynamic"):
        TreeConfig(paths=((0,),), max_nodes=1)
    with pytest.raises(InvalidParam, match="leave out max_nodes and dynamic"):
        TreeConfig(paths=((0,),), dynamic=True)


def test_tree_file_round_trip(tmp_path):
    acc = [[0.6, 0.3], [0.5, 0.2]]
    trees = best_trees(acc, max_nodes=3, max_depth=2)
    costs = Costs("test machine", {2: 0.1, 3: 0.11, 4: 0.2}, 0.01)
    best, rows = choose(trees, costs)
    path = tmp_path / "tree.json"
    save_tree(path, best, rows, acc, costs, {"drafter": "x", "date": "today"})
    cfg = load_tree(path)
    assert cfg.paths == best.tree.paths
    assert load_rank_acceptance(path) == acc
    assert load_costs(path) == costs
    obj = json.loads(path.read_text())
    assert obj["parents"] == list(tree_shape(cfg).parents)
    assert obj["predicted"]["tokens_per_pass"] == pytest.approx(best.tokens_per_pass)
    cost_file = tmp_path / "costs.json"
    cost_file.write_text(json.dumps({"device": "H200", "verify_s": {"2": 0.001, "3": 0.001}, "draft_level_s": 0}))
    assert load_costs(cost_file) == Costs("H200", {2: 0.001, 3: 0.001}, 0.0)


def test_bad_files_say_what_is_wrong(tmp_path):
    with pytest.raises(FileNotFoundError, match="tree file not found"):
        load_tree(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="is not JSON"):
        load_tree(bad)
    bad.write_text(json.dumps({"format": "specserve-tree/1", "paths": [[1]]}))
    with pytest.raises(ValueError, match="bad tree file .*no sibling"):
        load_tree(bad)
    bad.write_text(json.dumps({"paths": [[0]]}))
    with pytest.raises(ValueError, match="not a tree file"):
        load_tree(bad)
    bad.write_text(json.dumps({"verify_s": {"2": 1.0}}))
    with pytest.raises(ValueError, match="draft_level_s"):
        load_costs(bad)
    bad.write_text(json.dumps({"rank_acceptance": [[0.9, 0.5]]}))
    with pytest.raises(ValueError, match="at most 1"):
        load_rank_acceptance(bad)


def test_tuned_tree_properties():
    t = TunedTree(((0,), (1,), (0, 0)), 1.0)
    assert (t.num_nodes, t.depth) == (3, 2)


def test_rank_counter_walks_the_accepted_path():
    counter = RankCounter(depth=3, ranks=2)
    # pending -> nodes 0 (rank 0, token 5), 1 (rank 1, token 6); node 1 -> node 2 (token 7), node 3 (token 8)
    parents, tokens = [-1, -1, 1, 1], [5, 6, 7, 8]
    counter.observe(parents, tokens, truth=[6, 8, 9])  # rank 1, then rank 1, then nothing drafted
    counter.observe(parents, tokens, truth=[4])  # neither child
    counter.observe([-1, 0], [5, 2], truth=[5, 2, 3])  # a chain: rank 0 twice, depth 2 not drafted
    assert counter.exposures == [[3, 2], [2, 1], [0, 0]]
    assert counter.hits == [[1, 1], [1, 1], [0, 0]]
    got = counter.rank_acceptance()
    assert got[0] == pytest.approx([1 / 3, 0.5]) and got[1] == pytest.approx([1 / 3, 2 / 3])  # 0.5 + 1.0: scaled
    assert got[2] == [0.0, 0.0]

