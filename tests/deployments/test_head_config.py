"""A Serve config takes a feature head alone (placed in the target or on drafter replicas) or behind prompt lookup (in
the target only), and refuses the self-speculation drafter words with the reason (they run in process only)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from deployments.config import DRAFTER, AppConfig, DrafterConfig, deployment_options


@pytest.mark.parametrize("word", ["self", "self:window=256,sinks=4", "lookup+self"])
def test_self_speculation_is_refused_in_a_serve_config(word):
    with pytest.raises(ValidationError, match="in process only"):
        DrafterConfig(draft=word)


def test_a_feature_head_behind_prompt_lookup_runs_in_the_target_only():
    in_target = AppConfig(drafter={"draft": "lookup+eagle3:/heads/e3"})
    assert in_target.drafter.head_in_target and DRAFTER not in deployment_options(in_target)
    with pytest.raises(ValidationError, match="in the target worker only"):
        DrafterConfig(draft="lookup+eagle3:/heads/e3", head_placement="drafter")


@pytest.mark.parametrize("word", ["eagle3:/heads/e3", "medusa:/heads/m"])
def test_a_feature_head_runs_drafter_replicas_only_when_placed_there(word):
    in_target = AppConfig(drafter={"draft": word})
    assert in_target.drafter.head == word and in_target.drafter.head_in_target
    assert DRAFTER not in deployment_options(in_target) and not in_target.drafter.uses_model
    on_drafter = AppConfig(drafter={"draft": word, "head_placement": "drafter"})
    assert not on_drafter.drafter.head_in_target and DRAFTER in deployment_options(on_drafter)
    with pytest.raises(ValidationError):
        DrafterConfig(draft=word, head_placement="ingress")


def test_a_feature_head_needs_a_target_of_one_shard():
    with pytest.raises(ValidationError, match="tensor_parallel_size must be 1"):
        AppConfig(drafter={"draft": "eagle3:/heads/e3"}, target={"tensor_parallel_size": 2})


def test_token_trees_take_a_feature_head_alone_in_the_target():
    cfg = AppConfig(drafter={"draft": "eagle3:/heads/e3", "tree": {"branching": [4, 4, 4], "max_nodes": 12,
                                                                    "dynamic": True}})
    tree = cfg.drafter.tree.config()
    assert tree.branching == (4, 4, 4) and tree.max_nodes == 12 and tree.dynamic
    for bad in ({"draft": "lookup+eagle3:/heads/e3"}, {"draft": "prompt-lookup"},
                {"draft": "eagle3:/heads/e3", "head_placement": "drafter"}):  # a draft model's: test_serve_trees.py
        with pytest.raises(ValidationError, match="feature head alone"):
            DrafterConfig(**bad, tree={"branching": [2, 2]})
    with pytest.raises(ValidationError, match="node budget"):  # TreeConfig's own checks
        DrafterConfig(draft="eagle3:/heads/e3", tree={"branching": [2, 2], "dynamic": True})
    with pytest.raises(ValidationError):
        DrafterConfig(draft="eagle3:/heads/e3", tree={"branching": []})
    tuned = DrafterConfig(draft="eagle3:/heads/e3", tree={"paths": [[0], [1], [0, 0], [0, 1], [1, 0]]}).tree.config()
    assert tuned.branching == (2, 2) and len(tuned.paths) == 5
    with pytest.raises(ValidationError, match="closed under parents|parent"):
        DrafterConfig(draft="eagle3:/heads/e3", tree={"paths": [[0], [1, 0]]})
