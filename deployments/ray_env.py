"""The environment a specserve process gives Ray: one place for the defaults every entry point applies.

`RAY_AUTH_MODE=disabled`: specserve runs its local clusters without Ray's token authentication (a cluster
that needs it sets the variable itself). `RAY_USAGE_STATS_ENABLED=0`: no usage reporting, and no prompt
about it. Values already set in the environment win. The YAML and shell configs under ops/deploy/ and
cluster.yaml set the same two variables for the processes they start.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

RAY_DEFAULTS: Mapping[str, str] = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


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
