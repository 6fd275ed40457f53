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
    ([], "measuring acceptance needs --prompts FILE"),
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



def test_the_tree_option_loads_a_tree_file_the_engine_drafts(tmp_path):
    """`--tree FILE.json` (generate, bench) gives the file's shape; an engine drafting it keeps the target's greedy
    output (tiny random models: token ids, no tokenizer)."""
    import argparse
    import dataclasses

    from pipeline.config import EngineConfig, SamplingParams, SpecParams
    from pipeline.drafters import ModelDrafter
    from pipeline.engine import SpeculativeEngine
    from pipeline.models.loader import load_model
    from specserve.cmd_generate import tree_config
    from tests.support.models import make_tiny_llama

    tree_file = tmp_path / "tree.json"
    paths = [[0], [1], [0, 0], [0, 1], [0, 0, 0]]
    tree_file.write_text(json.dumps({"format": "specserve-tree/1", "paths": paths}))
    tree = tree_config(argparse.Namespace(tree=str(tree_file), tree_nodes=None, tree_dynamic=False))
    assert tree.paths == tuple(map(tuple, paths)) and tree.branching == (2, 2, 1)
    target = load_model(make_tiny_llama(tmp_path / "t", vocab_size=128))[0]
    draft = load_model(make_tiny_llama(tmp_path / "d", vocab_size=128, hidden=32, layers=1, heads=2,
                                       kv_heads=1))[0]
    cfg = EngineConfig(max_batch_size=2, max_seq_len=128)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    prompts = [[5, 17, 33, 17, 33, 9], [100, 7]]
    want = [r.token_ids for r in SpeculativeEngine(target, None, None, cfg).generate_batch(prompts, params)]
    engine = SpeculativeEngine(target, None, ModelDrafter(draft), dataclasses.replace(cfg, tree=tree))
    got = engine.generate_batch(prompts, params, SpecParams(3))
    assert [r.token_ids for r in got] == want and sum(r.stats["drafted"] for r in got) > 0


def test_the_drafter_word_a_tree_drafts_with(capsys):
    """`--tree` keeps a feature head behind prompt lookup in process (the lookup's rows stay chains), drafts Serve's
    trees with the head alone, and a draft model's trees with the model alone (said on stderr)."""
    from pipeline.config import TreeConfig
    from specserve.cmd_generate import tree_draft

    tree = TreeConfig((2, 1))
    assert tree_draft(tree, "lookup+eagle3:DIR") == "lookup+eagle3:DIR"
    assert tree_draft(tree, "lookup+eagle3:DIR", serve=True) == "eagle3:DIR"
    assert tree_draft(tree, "lookup+smollm2-135m-distill") == "smollm2-135m-distill"
    assert tree_draft(None, "lookup+smollm2-135m-distill") == "lookup+smollm2-135m-distill"
    assert capsys.readouterr().err.count("without prompt lookup") == 2
