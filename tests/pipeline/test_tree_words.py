"""`pipeline.tree_tune.parse_tree`: the tree words of the tree benchmarks (`--trees`), a tune-tree file among them."""

from __future__ import annotations

import json

import pytest

from pipeline.config import TreeConfig
from pipeline.tree_tune import parse_tree, tree_name


def test_tree_words_and_files(tmp_path):
    assert parse_tree("3,2,2,1:8") == TreeConfig((3, 2, 2, 1), max_nodes=8)
    assert parse_tree("dyn:4,4:6") == TreeConfig((4, 4), max_nodes=6, dynamic=True)
    path = tmp_path / "tree.json"
    path.write_text(json.dumps({"format": "specserve-tree/1", "paths": [[0], [1], [0, 0]]}))
    tree = parse_tree(str(path))
    assert tree.paths == ((0,), (1,), (0, 0)) and tree_name(tree) == "tuned tree (3 nodes, depth 2)"
    assert tree_name(parse_tree("dyn:4,4:6")) == "dynamic tree 4,4 budget 6"


@pytest.mark.parametrize("word, error, match", [
    ("3,x", ValueError, "bad tree '3,x'"),
    ("missing.json", FileNotFoundError, "tree file not found"),
])
def test_bad_tree_words(word, error, match):
    with pytest.raises(error, match=match):
        parse_tree(word)
