"""`specserve tune-tree` from given acceptance and cost files (no model loaded), and its bad input."""

from __future__ import annotations

import json

import pytest

from pipeline.tree import tree_shape
from pipeline.tree_tune import load_tree
from specserve.cli import main

ACCEPTANCE = {"rank_acceptance": [[0.6, 0.2, 0.1], [0.5, 0.2, 0.1], [0.4, 0.2, 0.1], [0.3, 0.1, 0.1]]}
COSTS = {"device": "test GPU", "verify_s": {str(t): 0.010 + 0.0005 * t for t in range(2, 18)}, "draft_level_s": 0.002}


@pytest.fixture
def files(tmp_path):
    (tmp_path / "acc.json").write_text(json.dumps(ACCEPTANCE))
    (tmp_path / "costs.json").write_text(json.dumps(COSTS))
    return tmp_path


def test_tune_tree_writes_a_tree_the_engine_loads(files, capsys):
    out = files / "tree.json"
    code = main(["tune-tree", "--acceptance", str(files / "acc.json"), "--costs", str(files / "costs.json"),
                 "--max-nodes", "16", "--max-depth", "4", "--out", str(out)])
    assert code == 0
    table = capsys.readouterr().out
    assert "| nodes | depth | E[tokens/pass] | step ms | tokens/s |" in table and "**chosen**" in table
    obj = json.loads(out.read_text())
    tree = load_tree(out)
    shape = tree_shape(tree)
    assert obj["predicted"]["nodes"] == shape.num_nodes and obj["predicted"]["depth"] == shape.depth
    assert [row["nodes"] for row in obj["table"]] == list(range(1, 17))
    assert obj["inputs"]["rank_acceptance"] == ACCEPTANCE["rank_acceptance"]
    assert obj["inputs"]["costs"]["device"] == "test GPU"
    # the chosen tree is the table's fastest; its value follows from the acceptance alone
    best = max(obj["table"], key=lambda r: r["tokens_per_s"])
    assert best["paths"] == obj["paths"]
    # reading the acceptance back from the tree file gives the same tree
    again = files / "again.json"
    assert main(["tune-tree", "--acceptance", str(out), "--costs", str(out), "--max-nodes", "16", "--max-depth", "4",
                 "--out", str(again)]) == 0
    assert json.loads(again.read_text())["paths"] == obj["paths"]


@pytest.mark.parametrize("args, needle", [
    (["--acceptance", "/nonexistent/acc.json"], "acceptance file not found"),
    (["--costs", "/nonexistent/costs.json"], "cost table not found"),
    (["--max-nodes", "0"], "--max-nodes must be in [1, 64]"),
    (["--max-nodes", "65"], "--max-nodes must be in [1, 64]"),
    (["--costs", "{bad}"], "cost table not found"),
])
def test_bad_input_is_one_line(files, capsys, args, needle):
    code = main(["tune-tree", "--out", str(files / "t.json"), *args])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code != 0 and len(err) == 1 and needle in err[0], err


def test_bad_cost_table_is_one_line(files, capsys):
    bad = files / "bad.json"
    bad.write_text(json.dumps({"device": "x", "verify_s": {"2": "fast"}, "draft_level_s": 0}))
    code = main(["tune-tree", "--acceptance", str(files / "acc.json"), "--costs", str(bad), "--out",
                 str(files / "t.json")])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code != 0 and len(err) == 1 and "cost table" in err[0], err
    assert not (files / "t.json").exists()


def test_the_measurement_tree_drafts_every_rank_at_every_depth():
    from specserve.cmd_tune_tree import measurement_tree

    tree = measurement_tree(ranks=6, depth=6, nodes=48)
    assert len(tree.paths) == 48 and tree.branching == (6,) * 6
    for d in range(6):
        assert {(0,) * d + (r,) for r in range(6)} <= set(tree.paths)
    assert len(measurement_tree(ranks=3, depth=2, nodes=1).paths) == 6  # the caterpillar at least
    with pytest.raises(ValueError, match="at most 64"):
        measurement_tree(ranks=9, depth=8, nodes=64)
