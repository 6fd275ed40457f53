"""The application builder: `build_app(config) -> serve.Application`.

Plain classes become deployments here, with options from the pure `deployment_options(config)`:

    EmbeddedRedis (only without redis_url)  <- Coordinator, Ingress
    Target  <- Coordinator                     (control calls; the hot loop calls the workers directly)
    Drafter <- Coordinator                     (only when drafter.draft names a model: "MODEL" or "lookup+MODEL")
    Coordinator <- Ingress (HTTP, FastAPI)

`serve run deployments.app:app_builder` / a Serve config file with `import_path: deployments.app:app_builder`
and `args:` (the fields of AppConfig) use `app_builder`; see ops/deploy/serve-demo.yaml.
"""

from __future__ import annotations

from typing import Any, Union

from ray import serve
from ray.serve import Application

from deployments.config import (
    COORDINATOR,
    DRAFTER,
    EMBEDDED_REDIS,
    INGRESS,
    TARGET,
    AppConfig,
    deployment_options,
)
from deployments.coordinator import Coordinator
from deployments.drafter_replica import DrafterServer
from deployments.ingress import make_ingress
from deployments.redis_conn import check_reachable
from deployments.redis_replica import RedisServer
from deployments.target_replica import TargetServer


def build_app(config: Union[AppConfig, dict[str, Any], None] = None) -> Application:
    cfg = config if isinstance(config, AppConfig) else AppConfig.model_validate(config or {})
    if cfg.redis_url is not None:
        check_reachable(cfg.redis_url, tls=cfg.redis_tls)  # a clear error now, not a replica stuck in a restart loop
    opts = deployment_options(cfg)
    args = cfg.model_dump(mode="json", context={"reveal_secrets": True})  # the replicas need the API keys
    redis = None
    if EMBEDDED_REDIS in opts:
        redis = serve.deployment(RedisServer, **opts[EMBEDDED_REDIS]).bind(cfg.embedded_redis_bind)
    target = serve.deployment(TargetServer, **opts[TARGET]).bind(args)
    drafter = serve.deployment(DrafterServer, **opts[DRAFTER]).bind(args) if DRAFTER in opts else None
    coordinator = serve.deployment(Coordinator, **opts[COORDINATOR]).bind(args, target, drafter, redis)
    return serve.deployment(make_ingress(), **opts[INGRESS]).bind(args, coordinator, redis)


def app_builder(args: AppConfig) -> Application:
    """For `serve run` / `serve deploy`: Serve validates the config file's `args:` into an AppConfig."""
    return build_app(args)
