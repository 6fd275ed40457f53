"""Offline validation of a `ray up` cluster config together with a `serve deploy` config.

    python -m deployments.cluster_config cluster.yaml ops/deploy/serve-cluster.yaml

Ray's own checks first (the autoscaler's `prepare_config` + `validate_config`, Serve's `ServeDeploySchema`),
then the app's `AppConfig` from each specserve application's `args`, then what only the two files together
can tell:
- every accelerator type and custom resource the Serve config asks for is provided by a node type;
- a node type's GPU count fits (a multiple of) tensor_parallel_size x num_gpus of the replicas it hosts
  (tensor-parallel workers are STRICT_PACKed onto one node);
- autoscaling max_replicas of a GPU deployment fits the node type's max_workers;
- `deployments:` overrides name deployments the app has;
- model paths exist: locally, or under a `file_mounts` destination whose local source holds them;
  the target's attention heads divide by tensor_parallel_size.

Every problem is a `ConfigError` whose message starts with the field path, e.g.
`applications[0].args.target.tensor_parallel_size: ...`.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any, Iterable

SPECSERVE_IMPORT_PATHS = ("deployments.app:app_builder", "deployments.app:build_app")
LOCAL_NODE_TYPE = "local.cluster.node"


class ConfigError(ValueError):
    """A bad config value; `field` is its path in the file (dots for keys, [i] for list items)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class ConfigErrors(ValueError):
    """Several ConfigErrors at once (validation reports everything it finds)."""

    def __init__(self, errors: list[ConfigError]):
        super().__init__("\n".join(str(e) for e in errors))
        self.errors = errors


def _path(parts: Iterable[Any]) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def load_yaml(path_or_dict: str | Path | dict[str, Any]) -> dict[str, Any]:
    if isinstance(path_or_dict, dict):
        return copy.deepcopy(path_or_dict)
    import yaml

    with open(path_or_dict) as f:
        data = yaml.safe_load(f)
    if not isinstance(data, dict):
        raise ConfigError(str(path_or_dict), "not a YAML mapping")
    return data


# -- the cluster config ------------------------------------------------------------------------------------

def validate_cluster(cluster: str | Path | dict[str, Any]) -> dict[str, Any]:
    """Ray's own validation of a `ray up` config. Returns the prepared config (defaults filled in)."""
    import jsonschema
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = load_yaml(cluster)
    if raw.get("provider", {}).get("type") == "local":
        for key in ("head_ip", "worker_ips"):
            if key not in raw.get("provider", {}):
                raise ConfigError(f"provider.{key}", "required by the local provider")
    try:
        prepared = prepare_config(raw)
        validate_config(prepared)
    except jsonschema.ValidationError as err:
        raise ConfigError(_path(err.absolute_path) or "cluster", err.message) from None
    except ValueError as err:
        msg = str(err)
        field = re.match(r"`?(\w+)`?", msg)
        raise ConfigError(field.group(1) if field and field.group(1) in raw else "cluster", msg) from None
    except SystemExit as err:  # the local provider's preparation aborts through the CLI logger
        raise ConfigError("provider", f"rejected by Ray: {err}") from None
    return prepared


def _start_resources(commands: list[str]) -> dict[str, float]:
    """Resources a `ray start` command line declares (--resources JSON, --num-gpus, --num-cpus)."""
    out: dict[str, float] = {}
    for command in commands:
        try:
            words = shlex.split(command)
        except ValueError:
            continue
        for i, w in enumerate(words):
            key, eq, value = w.partition("=")
            if not eq and i + 1 < len(words):
                value = words[i + 1]
            if key == "--resources":
                out.update({k: float(v) for k, v in json.loads(value).items()})
            elif key == "--num-gpus":
                out["GPU"] = float(value)
            elif key == "--num-cpus":
                out["CPU"] = float(value)
    return out


def node_types(prepared: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{node type: {"resources": {...}, "max_workers": int}} as the autoscaler will see them. For the local
    provider (one node type, resources detected by Ray) the resources are those the start commands declare."""
    types = {}
    head = prepared["head_node_type"]
    for name, spec in prepared["available_node_types"].items():
        resources = dict(spec.get("resources") or {})
        max_workers = int(spec.get("max_workers", 0))
        if prepared.get("provider", {}).get("type") == "local":
            resources.update(_start_resources(prepared.get("head_start_ray_commands", [])))
            max_workers = len(prepared["provider"].get("worker_ips", []))
        types[name] = {"resources": resources, "max_workers": max_workers + (1 if name == head else 0)}
    return types


# -- the Serve config ---------------------------------------------------------------------------------------

def validate_serve(serve: str | Path | dict[str, Any]) -> dict[str, Any]:
    """Serve's own schema check of a `serve deploy` config. Returns the raw mapping."""
    from pydantic import ValidationError
    from ray.serve.config import AutoscalingConfig
    from ray.serve.schema import ServeDeploySchema

    raw = load_yaml(serve)
    try:
        ServeDeploySchema.model_validate(raw)
    except ValidationError as err:
        first = err.errors()[0]
        raise ConfigError(_path(first["loc"]) or "serve", first["msg"].removeprefix("Value error, ")) from None
    # The schema keeps deployment overrides' autoscaling_config as a plain dict: check it as Serve will.
    for i, app in enumerate(raw.get("applications") or []):
        for j, dep in enumerate(app.get("deployments") or []):
            auto = dep.get("autoscaling_config")
            if auto is None:
                continue
            field = f"applications[{i}].deployments[{j}].autoscaling_config"
            try:
                AutoscalingConfig(**auto)
            except ValidationError as err:
                first = err.errors()[0]
                raise ConfigError(_path([field, *first["loc"]]), first["msg"].removeprefix("Value error, ")) from None
    return raw


def _app_config(app: dict[str, Any], where: str) -> Any:
    from pydantic import ValidationError

    from deployments.config import AppConfig

    try:
        return AppConfig.model_validate(app.get("args") or {})
    except ValidationError as err:
        first = err.errors()[0]
        msg = first["msg"].removeprefix("Value error, ")
        raise ConfigError(_path([f"{where}.args", *first["loc"]]), msg) from None


def _known_model(spec: str | None, prepared_cluster: dict[str, Any] | None, base: Path) -> str | None:
    """None if `spec` names a model that will exist where it runs; else why not."""
    from pipeline.models.store import DEMO_TARGET

    if spec is None or spec == DEMO_TARGET:
        return None
    local = Path(spec).expanduser()
    if local.exists():
        return None if (local.is_dir() and (local / "config.json").exists()) or local.suffix == ".gguf" else (
            f"{spec!r} exists but is neither a model folder (with config.json) nor a .gguf file")
    for remote, source in ((prepared_cluster or {}).get("file_mounts") or {}).items():
        remote_norm = os.path.normpath(remote)
        spec_norm = os.path.normpath(spec)
        if spec_norm == remote_norm or spec_norm.startswith(remote_norm + os.sep):
            rel = os.path.relpath(spec_norm, remote_norm)
            src = (base / Path(source).expanduser()).resolve() / rel
            if (src / "config.json").exists() or src.suffix == ".gguf" and src.exists():
                return None
            return f"{spec!r} is under file_mounts[{remote!r}], but its local source {str(src)!r} holds no model"
    return (f"model path {spec!r} not found: not a local folder, not the demo name {DEMO_TARGET!r}, and not "
            "under any file_mounts destination of the cluster config")


def _model_config(spec: str | None, prepared_cluster: dict[str, Any] | None, base: Path) -> dict | None:
    """The model's config.json, where it can be read here."""
    if spec is None:
        return None
    candidates = [Path(spec).expanduser()]
    for remote, source in ((prepared_cluster or {}).get("file_mounts") or {}).items():
        r, s = os.path.normpath(remote), os.path.normpath(spec)
        if s == r or s.startswith(r + os.sep):
            candidates.append((base / Path(source).expanduser()).resolve() / os.path.relpath(s, r))
    for c in candidates:
        if (c / "config.json").exists():
            return json.loads((c / "config.json").read_text())
    return None


def check(serve: str | Path | dict[str, Any], cluster: str | Path | dict[str, Any] | None = None,
          check_models: bool = True) -> list[ConfigError]:
    """Every problem found (an empty list: the pair is good). Raises nothing but a ConfigError from Ray's
    schema checks, which stop the rest. `check_models=False` skips model paths (models that setup
    commands fetch onto the nodes cannot be seen from here)."""
    from deployments.config import DRAFTER, TARGET, deployment_options

    errors: list[ConfigError] = []
    base = Path(cluster).resolve().parent if isinstance(cluster, (str, Path)) else Path.cwd()
    prepared = validate_cluster(cluster) if cluster is not None else None
    types = node_types(prepared) if prepared is not None else None
    raw = validate_serve(serve)

    def provided(resource: str) -> dict[str, float]:
        assert types is not None
        return {n: t["resources"][resource] for n, t in types.items() if t["resources"].get(resource, 0) > 0}

    for i, app in enumerate(raw.get("applications") or []):
        where = f"applications[{i}]"
        if app.get("import_path") not in SPECSERVE_IMPORT_PATHS:
            continue
        try:
            config = _app_config(app, where)
        except ConfigError as err:
            errors.append(err)
            continue
        options = deployment_options(config)
        overrides = {d["name"]: (j, d) for j, d in enumerate(app.get("deployments") or []) if "name" in d}
        for name, (j, _) in overrides.items():
            if name not in options:
                errors.append(ConfigError(f"{where}.deployments[{j}].name",
                                          f"the app has no deployment {name!r} (it has {', '.join(options)})"))

        # Models.
        roles = [("target", config.target, config.target.tensor_parallel_size)]
        if config.drafter.uses_model:
            roles.append(("drafter", config.drafter, 1))
        for role, cfg, _ in roles if check_models else ():
            problem = _known_model(cfg.model, prepared, base)
            if problem:  # the drafter names its model in `draft` (the drafter vocabulary: "lookup+MODEL", "MODEL")
                errors.append(ConfigError(f"{where}.args.{role}.{'draft' if role == 'drafter' else 'model'}", problem))
        tp = config.target.tensor_parallel_size
        target_hf = _model_config(config.target.model, prepared, base)
        if target_hf and tp > 1:
            heads = target_hf.get("num_attention_heads")
            kv = target_hf.get("num_key_value_heads", heads)
            if heads and (heads % tp or (kv and kv % tp and tp % kv)):
                errors.append(ConfigError(
                    f"{where}.args.target.tensor_parallel_size",
                    f"{tp} does not divide the target's {heads} attention heads / {kv} KV heads"))

        if types is None:
            continue
        # Model placement: accelerator types and GPU counts.
        for role, cfg, world in roles:
            res = cfg.resources
            field = f"{where}.args.{role}.resources"
            per_replica = res.num_gpus * world
            hosts = None
            if res.accelerator_type:
                hosts = provided(f"accelerator_type:{res.accelerator_type}")
                if not hosts:
                    have = {n: sorted(k for k in t["resources"] if k.startswith("accelerator_type:"))
                            for n, t in types.items()}
                    errors.append(ConfigError(
                        f"{field}.accelerator_type",
                        f"{res.accelerator_type!r}: no node type in available_node_types provides resource "
                        f"'accelerator_type:{res.accelerator_type}' (node types: {have})"))
                    continue
            elif per_replica > 0:
                hosts = {n: t["resources"].get("GPU", 0) for n, t in types.items()
                         if t["resources"].get("GPU", 0) > 0}
                if not hosts:
                    errors.append(ConfigError(f"{field}.num_gpus",
                                              f"{res.num_gpus} GPUs per worker, but no node type declares GPUs"))
                    continue
            if not hosts or per_replica == 0:
                continue
            for node, _ in hosts.items():
                gpus = types[node]["resources"].get("GPU")
                if gpus is None:
                    errors.append(ConfigError(
                        f"available_node_types.{node}.resources.GPU",
                        f"hosts {role} replicas ({res.accelerator_type}) but does not declare its GPU count"))
                    continue
                tp_field = f"{where}.args.target.tensor_parallel_size" if role == "target" else f"{field}.num_gpus"
                if gpus < per_replica:
                    errors.append(ConfigError(tp_field, (
                        f"a {role} replica needs {world} worker(s) x {res.num_gpus} GPU = {per_replica:g} GPUs on "
                        f"one node, but node type {node!r} has {gpus:g}")))
                elif gpus % per_replica:
                    errors.append(ConfigError(tp_field, (
                        f"{world} worker(s) x {res.num_gpus} GPU = {per_replica:g} GPUs per {role} replica does not "
                        f"divide node type {node!r}'s {gpus:g} GPUs ({gpus % per_replica:g} would idle)")))
                else:
                    name = TARGET if role == "target" else DRAFTER
                    j, override = overrides.get(name, (None, {}))
                    auto = override.get("autoscaling_config") or {}
                    max_replicas = auto.get("max_replicas") or override.get("num_replicas") or res.num_replicas
                    if not isinstance(max_replicas, int):
                        continue
                    per_node = int(gpus // per_replica)
                    nodes = -(-max_replicas // per_node)
                    capacity = sum(types[n]["max_workers"] for n in hosts)
                    if nodes > capacity:
                        errors.append(ConfigError(
                            f"{where}.deployments[{j}].autoscaling_config.max_replicas" if j is not None
                            else f"{field}.num_replicas",
                            f"{max_replicas} {role} replicas need {nodes} nodes of {sorted(hosts)} "
                            f"({per_node} per node), but max_workers allows {capacity}"))

        # Custom resources that deployment overrides claim.
        for name, (j, override) in overrides.items():
            claims = (override.get("ray_actor_options") or {}).get("resources") or {}
            for resource in claims:
                if not provided(resource):
                    errors.append(ConfigError(
                        f"{where}.deployments[{j}].ray_actor_options.resources.{resource}",
                        f"no node type provides custom resource {resource!r}"))
    return errors


def validate(serve: str | Path | dict[str, Any], cluster: str | Path | dict[str, Any] | None = None,
             check_models: bool = True) -> None:
    """Raise ConfigErrors (all problems) or the first ConfigError from Ray's own checks."""
    errors = check(serve, cluster, check_models)
    if errors:
        raise ConfigErrors(errors)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Validate a ray-up cluster config with a serve-deploy config.")
    parser.add_argument("cluster", help="cluster YAML for `ray up` ('-' to check the Serve config alone)")
    parser.add_argument("serve", help="Serve config YAML for `serve deploy`")
    parser.add_argument("--skip-model-check", action="store_true",
                        help="do not look for model paths (they are fetched onto the nodes by setup commands)")
    args = parser.parse_args(argv)
    try:
        errors = check(args.serve, None if args.cluster == "-" else args.cluster,
                       check_models=not args.skip_model_check)
    except ConfigError as err:
        errors = [err]
    for err in errors:
        print(f"error: {err}", file=sys.stderr)
    if not errors:
        print(f"ok: {args.cluster} + {args.serve}")
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
