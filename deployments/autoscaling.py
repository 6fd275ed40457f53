"""Serve autoscaling policy for the model deployments (Drafter, Target).

The coordinator calls a model replica's worker actors directly (deployments/workers.py), not through
Serve, so Serve's own "ongoing requests" count of a Drafter or Target replica stays near zero under any
load. Instead each model host replica reports, from `record_autoscaling_stats()`, how many requests called
its rank-0 worker in the last 10 seconds (`ONGOING_REQUESTS`; a request calls once per step, so this is
the requests it is decoding) plus the requests waiting in its queue for a KV-cache slot, and this policy
applies Serve's default rule to that number:

    desired replicas = sum over replicas of ongoing requests / target_ongoing_requests

Serve wraps the policy with the deployment's autoscaling_config as for its default policy: min/max replicas,
upscale/downscale delays and factors. Where no replica reports the metric (a deployment without
`record_autoscaling_stats`, e.g. the Coordinator), Serve's own request count is used, so the policy is
also the default one there.

In a Serve config file:
    autoscaling_config:
      target_ongoing_requests: 8
      policy: {policy_function: deployments.autoscaling:ongoing_requests_policy}
"""

from __future__ import annotations

from typing import Any

ONGOING_REQUESTS = "ongoing_requests"  # the key host replicas return from record_autoscaling_stats()


def ongoing_requests_policy(ctx: Any) -> tuple[float, dict[str, Any]]:
    """`ctx` is a ray.serve.config.AutoscalingContext. Returns (desired replicas, policy state)."""
    if ctx.current_num_replicas == 0:
        return ctx.target_num_replicas, {}
    per_replica = (ctx.aggregated_metrics or {}).get(ONGOING_REQUESTS) or {}
    total = sum(per_replica.values()) if per_replica else ctx.total_num_requests
    return total / ctx.config.get_target_ongoing_requests(), {}
