"""cluster.yaml + ops/deploy/serve-cluster.yaml pass Ray's own validation and ours; bad configs fail naming the
field."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deployments import cluster_config as cc
from deployments.ray_env import apply_ray_defaults
from tests.support import ROOT

apply_ray_defaults()
SERVE_CLUSTER = ROOT / "ops" / "deploy" / "serve-cluster.yaml"  # the Serve config for cluster.yaml


def _fake_model(folder: Path, heads: int = 32, kv_heads: int = 8) -> None:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_attention_heads": heads,
         "num_key_value_heads": kv_heads, "hidden_size": 4096, "vocab_size": 128256}))


@pytest.fixture
def shipped(tmp_path):
    """The shipped files, copied verbatim next to a ./models folder like the one cluster.yaml mounts."""
    shutil.copy(ROOT / "cluster.yaml", tmp_path / "cluster.yaml")
    (tmp_path / "ops" / "deploy").mkdir(parents=True)
    shutil.copy(SERVE_CLUSTER, tmp_path / SERVE_CLUSTER.relative_to(ROOT))
    _fake_model(tmp_path / "models" / "target")
    _fake_model(tmp_path / "models" / "drafter", heads=8, kv_heads=8)
    return tmp_path


def _errors(tmp_path: Path, cluster: dict | None, serve: dict, **kw) -> list[str]:
    """Write both (cluster next to ./models so file_mounts resolve) and check them."""
    serve_path = tmp_path / "serve-x.yaml"
    serve_path.write_text(yaml.safe_dump(serve))
    cluster_path = None
    if cluster is not None:
        cluster_path = tmp_path / "cluster-x.yaml"
        cluster_path.write_text(yaml.safe_dump(cluster))
    return [str(e) for e in cc.check(serve_path, cluster_path, **kw)]


def _load(shipped: Path) -> tuple[dict, dict]:
    return (yaml.safe_load((shipped / "cluster.yaml").read_text()),
            yaml.safe_load((shipped / SERVE_CLUSTER.relative_to(ROOT)).read_text()))


def test_shipped_cluster_yaml_passes_rays_validation():
    prepared = cc.validate_cluster(ROOT / "cluster.yaml")
    types = cc.node_types(prepared)
    assert set(types) == {"head", "drafter_gpu", "target_gpu8"}
    assert types["target_gpu8"]["resources"]["GPU"] == 8
    assert prepared["available_node_types"]["target_gpu8"]["min_workers"] == 1
    assert prepared["provider"]["type"] == "aws"


def test_shipped_pair_is_consistent(shipped):
    assert cc.check(shipped / SERVE_CLUSTER.relative_to(ROOT), shipped / "cluster.yaml") == []


def test_shipped_local_variant_passes(tmp_path):
    """ops/deploy/cluster-local.yaml + ops/deploy/serve-cluster-local.yaml: what the ray-up test launches."""
    local = yaml.safe_load((ROOT / "ops" / "deploy" / "cluster-local.yaml").read_text())
    prepared = cc.validate_cluster(local)
    types = cc.node_types(prepared)
    assert types[cc.LOCAL_NODE_TYPE]["resources"]["specserve_head"] > 0
    serve = yaml.safe_load((ROOT / "ops" / "deploy" / "serve-cluster-local.yaml").read_text())
    assert _errors(tmp_path, local, serve, check_models=False) == []


def test_missing_node_type_names_the_accelerator_field(shipped):
    cluster, serve = _load(shipped)
    del cluster["available_node_types"]["target_gpu8"]
    (err,) = _errors(shipped, cluster, serve)
    assert err.startswith("applications[0].args.target.resources.accelerator_type: 'A100'")
    assert "no node type" in err


def test_gpu_count_not_matching_tensor_parallel_size(shipped):
    cluster, serve = _load(shipped)
    cluster["available_node_types"]["target_gpu8"]["resources"]["GPU"] = 4
    (err,) = _errors(shipped, cluster, serve)
    assert err.startswith("applications[0].args.target.tensor_parallel_size:")
    assert "8 GPUs on one node" in err and "has 4" in err

    cluster, serve = _load(shipped)
    serve["applications"][0]["args"]["target"]["tensor_parallel_size"] = 3
    errs = _errors(shipped, cluster, serve)
    assert any(e.startswith("applications[0].args.target.tensor_parallel_size: 3 worker(s)") and
               "would idle" in e for e in errs), errs
    assert any("does not divide the target's 32 attention heads" in e for e in errs), errs


def test_unknown_model_path_names_the_model_field(shipped):
    cluster, serve = _load(shipped)
    serve["applications"][0]["args"]["drafter"]["draft"] = "/nonexistent/drafter"
    (err,) = _errors(shipped, cluster, serve)
    assert err.startswith("applications[0].args.drafter.draft: model path '/nonexistent/drafter' not found")
    # A path under a file_mounts destination whose source lacks it.
    serve["applications"][0]["args"]["drafter"]["draft"] = "~/models/missing"
    (err,) = _errors(shipped, cluster, serve)
    assert err.startswith("applications[0].args.drafter.draft: '~/models/missing' is under file_mounts")
    # Models fetched by setup commands: the check can be skipped.
    assert _errors(shipped, cluster, serve, check_models=False) == []


def test_app_config_errors_name_the_arg(shipped):
    cluster, serve = _load(shipped)
    serve["applications"][0]["args"]["target"]["tensor_parallel_size"] = 0
    (err,) = _errors(shipped, cluster, serve)
    assert err.startswith("applications[0].args.target.tensor_parallel_size: Input should be greater")
    cluster, serve = _load(shipped)
    serve["applications"][0]["args"]["target"]["resourcez"] = {}
    (err,) = _errors(shipped, cluster, serve)
    assert err.startswith("applications[0].args.target.resourcez: Extra inputs are not permitted")


def test_overrides_must_name_real_deployments_and_provided_resources(shipped):
    cluster, serve = _load(shipped)
    deps = serve["applications"][0]["deployments"]
    deps[1]["name"] = "Coordinater"
    deps[0]["ray_actor_options"]["resources"] = {"frontend_node": 1}
    errs = _errors(shipped, cluster, serve)
    assert "applications[0].deployments[1].name: the app has no deployment 'Coordinater'" in errs[0]
    assert any(e.startswith("applications[0].deployments[0].ray_actor_options.resources.frontend_node:")
               for e in errs), errs


def test_autoscaling_beyond_node_capacity(shipped):
    cluster, serve = _load(shipped)
    target = next(d for d in serve["applications"][0]["deployments"] if d["name"] == "Target")
    target["autoscaling_config"]["max_replicas"] = 5
    j = serve["applications"][0]["deployments"].index(target)
    (err,) = _errors(shipped, cluster, serve)
    assert err.startswith(f"applications[0].deployments[{j}].autoscaling_config.max_replicas: 5 target")
    assert "max_workers allows 3" in err


def test_rays_own_schema_errors_name_the_field(shipped):
    cluster, serve = _load(shipped)
    cluster["available_node_types"]["target_gpu8"]["max_workers"] = "three"
    with pytest.raises(cc.ConfigError) as e:
        _errors(shipped, cluster, serve)
    assert e.value.field == "available_node_types.target_gpu8.max_workers"

    cluster, serve = _load(shipped)
    cluster["head_node_type"] = "nope"
    with pytest.raises(cc.ConfigError, match="head_node_type"):
        _errors(shipped, cluster, serve)

    cluster, serve = _load(shipped)
    serve["applications"][0]["deployments"][1]["autoscaling_config"]["max_replicas"] = 0
    with pytest.raises(cc.ConfigError) as e:
        _errors(shipped, cluster, serve)
    assert e.value.field == "applications[0].deployments[1].autoscaling_config.max_replicas"

    cluster, serve = _load(shipped)
    serve["applications"][0]["deployments"][1]["num_replicas"] = 2  # and an autoscaling_config
    with pytest.raises(cc.ConfigError, match=r"^applications\[0\].deployments\[1\]: Manually setting num_replicas"):
        _errors(shipped, cluster, serve)


def test_cli_reports_errors_and_exit_code(shipped):
    cluster, serve = _load(shipped)
    del cluster["available_node_types"]["drafter_gpu"]
    (shipped / "bad.yaml").write_text(yaml.safe_dump(cluster))

    def run(*a):
        return subprocess.run([sys.executable, "-m", "deployments.cluster_config", *a], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)

    bad = run(str(shipped / "bad.yaml"), str(shipped / SERVE_CLUSTER.relative_to(ROOT)))
    assert bad.returncode == 1
    assert "error: applications[0].args.drafter.resources.accelerator_type: 'L4'" in bad.stderr
    good = run(str(shipped / "cluster.yaml"), str(shipped / SERVE_CLUSTER.relative_to(ROOT)))
    assert good.returncode == 0, good.stderr
