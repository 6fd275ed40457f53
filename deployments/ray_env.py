"""The environment a specserve process gives Ray: one place for the defaults every entry point applies.

`RAY_AUTH_MODE=token`: Ray's token authentication, on for every Ray that specserve (or its tests) starts on this
machine. Every Ray process then checks a shared secret on its gRPC and HTTP control-plane endpoints; `ray.init`
generates the token on first use and keeps it in `~/.ray/auth_token` (or `$RAY_AUTH_TOKEN_PATH`, or takes
`$RAY_AUTH_TOKEN`), where every later Ray process and CLI on this machine finds it. `RAY_USAGE_STATS_ENABLED=0`: no
usage reporting, and no prompt about it. Values already set in the environment win: `RAY_AUTH_MODE=disabled` turns
authentication off (needed where a process must join a cluster that runs without it).

`LOCAL_RAY_DEFAULTS`: for a Ray that a specserve process starts for this machine alone (`specserve serve` without
`--address`): `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` is Ray's one-machine mode (its default on macOS and Windows): the
node address is 127.0.0.1 (Ray turns a `_node_ip_address` of 127.0.0.1 into the machine's external address
otherwise), so its gRPC servers (GCS, raylet, object manager, workers), agents and metrics servers listen on loopback
and no other machine can join. Serve's inter-deployment gRPC server in each replica still listens on every interface
(Serve binds "[::]:0"): the token protects it. Ray's `ray up` clusters cannot use these defaults; cluster.yaml and
ops/deploy/cluster-local.yaml say what they do instead.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from typing import Any

RAY_DEFAULTS: Mapping[str, str] = {"RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0"}
LOCAL_RAY_DEFAULTS: Mapping[str, str] = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def ray_environment(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of `base` (default: this process's environment) with the Ray defaults where unset: the
    environment for a child process that starts or joins Ray."""
    env = dict(os.environ if base is None else base)
    for key, value in RAY_DEFAULTS.items():
        env.setdefault(key, value)
    return env


def apply_ray_defaults(environ: MutableMapping[str, str] | None = None) -> None:
    """Set the Ray defaults in `environ` (default: this process's environment) where unset; call it before
    `ray.init` or anything that imports Ray's CLI."""
    target = os.environ if environ is None else environ
    for key, value in RAY_DEFAULTS.items():
        target.setdefault(key, value)


def apply_local_ray_defaults(environ: MutableMapping[str, str] | None = None) -> None:
    """The Ray defaults plus those of a one-machine Ray, where unset. Call it before Ray is first imported (Ray reads
    the one-machine switch at import)."""
    target = os.environ if environ is None else environ
    apply_ray_defaults(target)
    for key, value in LOCAL_RAY_DEFAULTS.items():
        target.setdefault(key, value)


def local_ray_init_options() -> dict[str, Any]:
    """`ray.init` options for a Ray started for this machine alone (after `apply_local_ray_defaults`): a new local
    cluster, no dashboard (its HTTP server is not needed to serve)."""
    return {"address": "local", "include_dashboard": False}
