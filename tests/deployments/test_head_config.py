"""A Serve config refuses the feature-head and self-speculation drafter words with the reason (they run in process
only)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from deployments.config import DrafterConfig


@pytest.mark.parametrize("word", ["eagle3:/heads/e3", "medusa:/heads/m", "lookup+eagle3:/heads/e3", "self",
                                  "self:window=256,sinks=4", "lookup+self"])
def test_feature_heads_are_refused_in_a_serve_config(word):
    with pytest.raises(ValidationError, match="in process only"):
        DrafterConfig(draft=word)
