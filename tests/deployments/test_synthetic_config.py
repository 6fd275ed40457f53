"""The Serve config accepts the synthetic drafter word, refuses a malformed one with its expected form, and runs it
on drafter replicas (it names a model part, like a draft model) unless it spends self-speculation's time."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from deployments.config import DRAFTER, AppConfig, DrafterConfig, deployment_options


def test_a_synthetic_word_runs_on_drafter_replicas_placed_by_gpu():
    cfg = AppConfig.model_validate({
        "target": {"device": "cuda", "dtype": "bfloat16", "resources": {"num_gpus": 1}},
        "drafter": {"draft": "synthetic:0.8:llama-1b:/tmp/rec.json", "device": "cuda", "dtype": "bfloat16",
                    "resources": {"num_gpus": 1}},
    })
    assert cfg.drafter.uses_model and cfg.drafter.model == "synthetic:0.8:llama-1b:/tmp/rec.json"
    opts = deployment_options(cfg)
    assert opts[DRAFTER]["placement_group_bundles"] == [{"GPU": 1.0}]


@pytest.mark.parametrize("word, message", [("synthetic:0.8:llama-1b", "synthetic:ALPHA:SHAPE:RECORDING"),
                                           ("synthetic:1.2:llama-1b:r.json", "ALPHA must be in")])
def test_a_malformed_synthetic_word_is_refused(word, message):
    with pytest.raises(ValidationError, match=message):
        DrafterConfig(draft=word)


def test_a_self_timed_synthetic_word_is_refused_like_self():
    with pytest.raises(ValidationError, match="in process only"):
        DrafterConfig(draft="synthetic:0.8:self:/tmp/rec.json")
