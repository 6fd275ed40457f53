"""docs/configuration.md names every setting the code has: each field of the algorithm's dataclasses, of the graph
path's config and of the Serve app config (nested models included), each environment variable of `pipeline.envs`
and each CLI subcommand. A field added without a line in the doc fails here."""

from __future__ import annotations

import dataclasses
import re

import pytest
from pydantic import BaseModel

from deployments.config import AppConfig
from pipeline import envs
from pipeline.config import EngineConfig, SamplingParams, SpecParams
from pipeline.models.graphs import GraphConfig
from specserve.cli import build_parser
from tests.support import ROOT

DOC = (ROOT / "docs" / "configuration.md").read_text()
TABLE_NAMES = set(re.findall(r"^\| `([^`]+)` \|", DOC, re.M))  # first column of every table row


def _model_fields(model: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, field in model.model_fields.items():
        out.append(prefix + name)
        sub = field.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            out += _model_fields(sub, prefix + name + ".")
    return out


@pytest.mark.parametrize("cls", [SamplingParams, SpecParams, EngineConfig, GraphConfig], ids=lambda c: c.__name__)
def test_every_dataclass_field_is_documented(cls):
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in TABLE_NAMES]
    assert not missing, f"docs/configuration.md has no row for {cls.__name__}: {missing}"


def test_every_serve_config_field_is_documented():
    missing = [path for path in _model_fields(AppConfig) if path.rsplit(".", 1)[-1] not in TABLE_NAMES]
    assert not missing, f"docs/configuration.md has no row for AppConfig fields {missing}"


def test_every_environment_variable_and_subcommand_is_documented():
    missing = [name for name in envs.environment_variables if f"`{name}`" not in DOC]
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    missing += [f"specserve {name}" for name in sub.choices if f"| `{name}` |" not in DOC]
    assert not missing, f"docs/configuration.md does not name {missing}"


def test_the_check_sees_a_missing_row():
    """Negative control: the row finder does not match a name the doc lacks."""
    assert "no_such_field" not in TABLE_NAMES and "max_seq_len" in TABLE_NAMES
