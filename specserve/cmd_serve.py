"""`specserve serve`: start Ray locally, Redis (embedded unless --redis-url / REDIS_URL), every deployment on
this machine's CPU with the demo pair, print the URL, serve until Ctrl-C, then shut everything down.

    specserve serve                                  # demo target + lookup+eagle3:smollm2-135m-eagle3, port 8000
    specserve serve --config ops/deploy/serve-demo.yaml --port 8001
    specserve serve --draft path/to/drafter -k 4 --redis-url redis://host:6379/0

For a cluster, use Ray Serve's own CLI with a config file: `serve run ops/deploy/serve-demo.yaml`
or `serve deploy ops/deploy/serve-cluster.yaml` (import_path deployments.app:app_builder).

Ray, Serve, PyYAML, pydantic and torch are imported inside the functions, not at the top: `specserve --help` does not
need them.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from typing import Any

from deployments.ray_env import apply_local_ray_defaults, apply_ray_defaults, local_ray_init_options

DEFAULT_METRICS_PORT = 8080  # Ray's conventional metrics export port (KubeRay's default; cluster.yaml's)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="serve the OpenAI-compatible API on Ray Serve (Ctrl-C stops)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None,
                   help="YAML: a Serve config file (its first application's args) or AppConfig fields")
    p.add_argument("--host", default="127.0.0.1",
                   help="HTTP host (default 127.0.0.1; 0.0.0.0 for all, which needs an API key)")
    p.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="a key clients must send as 'Authorization: Bearer KEY' (repeatable, or a comma list; "
                        "default: the config's ingress.api_keys, else $SPECSERVE_API_KEY)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--metrics-port", type=int, default=DEFAULT_METRICS_PORT,
                   help=f"Prometheus port of the local Ray node's metrics agent: /metrics with specserve's "
                        f"ray_specserve_* and Ray's own metrics (default {DEFAULT_METRICS_PORT}; 0 picks a free one). "
                        f"Ignored with --address: a cluster's nodes export on their own --metrics-export-port")
    p.add_argument("--address", default=None,
                   help="Ray cluster to join (default: start a local one; 'auto' joins a running one)")
    p.add_argument("--name", default="specserve", help="Serve application name")
    p.add_argument("--target", default=None, help="target model folder or .gguf (default: the demo model)")
    p.add_argument("--draft", default=None,
                   help="drafter: 'prompt-lookup', 'suffix', 'none', a drafter model folder, or 'lookup+MODEL' "
                        "(prompt lookup where the context matches, the model on drafter replicas elsewhere). Default: "
                        "the config file's; without one, lookup+eagle3:smollm2-135m-eagle3 for the demo target, else "
                        "prompt-lookup")
    p.add_argument("-k", "--num-draft-tokens", type=int, default=None, help="default K per request")
    p.add_argument("--redis-url", default=None, help="external Redis (default: $REDIS_URL, else embedded)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--max-seq-len", type=int, default=None)
    p.add_argument("--max-batch-size", type=int, default=None, help="KV-cache slots per target replica")
    p.add_argument("--target-replicas", type=int, default=None)
    p.add_argument("--drafter-replicas", type=int, default=None)
    p.add_argument("--coordinators", type=int, default=None, help="coordinator replicas")
    p.add_argument("--target-threads", type=int, default=None, help="torch threads per target worker")
    p.add_argument("--no-overlap", action="store_true", help="do not draft the next block during verification")
    p.set_defaults(func=run)


def load_config(args: argparse.Namespace):  # -> deployments.config.AppConfig
    """AppConfig from --config (if any) with the command-line overrides applied. Pure (no Ray)."""
    import yaml

    from deployments.config import AppConfig

    data: dict[str, Any] = {}
    if args.config:
        with open(args.config) as f:
            raw = yaml.safe_load(f) or {}
        if "applications" in raw:  # a Serve config file
            apps = raw["applications"]
            if not apps:
                raise ValueError(f"{args.config}: no applications")
            data = dict(apps[0].get("args") or {})
        else:
            data = dict(raw)

    def put(path: str, value: Any) -> None:
        if value is None:
            return
        node = data
        *parents, leaf = path.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value

    put("target.model", args.target)
    draft = args.draft
    if draft in (None, "default") and "draft" not in (data.get("drafter") or {}):
        from pipeline.engine import default_draft  # as `generate`: the target's default drafter

        draft = default_draft((data.get("target") or {}).get("model"))
    if draft not in (None, "default"):
        put("drafter.draft", draft)  # the same words as the config's drafter.draft
    put("speculation.num_draft_tokens", args.num_draft_tokens)
    put("redis_url", args.redis_url)
    put("served_model_name", args.served_model_name)
    put("target.max_seq_len", args.max_seq_len)
    put("target.max_batch_size", args.max_batch_size)
    put("target.resources.num_replicas", args.target_replicas)
    put("drafter.resources.num_replicas", args.drafter_replicas)
    put("coordinator.num_replicas", args.coordinators)
    put("target.resources.torch_threads", args.target_threads)
    if args.no_overlap:
        put("coordinator.overlap", False)
    if args.api_key:
        put("ingress.api_keys", [key.strip() for arg in args.api_key for key in arg.split(",") if key.strip()])
    return AppConfig.model_validate(data)


def is_loopback(host: str) -> bool:
    """Whether an HTTP host binds the loopback interface only (127.0.0.0/8, ::1, localhost)."""
    import ipaddress

    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve beyond loopback


def check_exposure(host: str, cfg: Any) -> None:
    """Nothing listens beyond loopback without a key: raise (one line) when `host` is not loopback and `cfg`
    (an AppConfig) has no API key."""
    if not cfg.ingress.api_keys and not is_loopback(host):
        raise ValueError(f"refusing to serve on {host} without an API key: pass --api-key KEY (or set "
                         "SPECSERVE_API_KEY, or ingress.api_keys in the config), or serve on 127.0.0.1")


def run(args: argparse.Namespace) -> int:
    if args.address:
        apply_ray_defaults()
    else:  # a Ray of its own: node address 127.0.0.1, token authentication on (ray_env)
        apply_local_ray_defaults()
    from pydantic import ValidationError

    try:
        cfg = load_config(args)
    except ValidationError as err:
        raise ValueError(f"invalid configuration: {err.errors()[0]['loc']}: {err.errors()[0]['msg']}") from None
    check_exposure(args.host, cfg)

    # Ray's metrics agent listens on loopback when the node's IP is 127.0.0.1, else on every interface.
    metrics = {} if args.address else {"_metrics_export_port": _check_metrics_port(args.metrics_port)}

    from deployments.redis_conn import RedisUnavailable, check_reachable, redact

    if cfg.redis_url is not None:
        try:
            check_reachable(cfg.redis_url, tls=cfg.redis_tls)
        except RedisUnavailable as err:
            raise ConnectionError(str(err)) from None

    # Resolve (and on first use download + convert) the models once here, not in every replica.
    from pipeline.config import is_synthetic
    from pipeline.models.loader import runner_choice
    from pipeline.models.store import resolve

    print("specserve: preparing models ...", flush=True)
    cfg.target.model = str(resolve(cfg.target.model))
    print(f"specserve: target {runner_choice(cfg.target.model, cfg.target.device)}", flush=True)
    if cfg.drafter.uses_model and not is_synthetic(cfg.drafter.model):  # a synthetic word names no folder
        cfg.drafter = cfg.drafter.with_model(str(resolve(cfg.drafter.model)))

    import ray
    from ray import serve

    from deployments.app import build_app

    print("specserve: starting Ray and Serve ...", flush=True)
    where = {"address": args.address, "include_dashboard": False} if args.address else local_ray_init_options()
    ray.init(**where, **metrics, logging_level="WARNING")
    stop, calm = threading.Event(), threading.Event()  # calm: signals only set `stop` (serving, or shutting down)
    got: list[int] = []  # the signals received

    def on_signal(signum: int, _frame: Any) -> None:
        got.append(signum)
        stop.set()
        if not calm.is_set():  # the first one during Serve's start-up: interrupt it, as Ctrl-C does, and shut down
            calm.set()
            raise KeyboardInterrupt

    # Right after ray.init, whose own SIGTERM handler dumps a stack and aborts the process.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    print("specserve: Ray is up; deploying the target, drafter and coordinator replicas ...", flush=True)
    try:
        quiet = {"log_level": "WARNING", "enable_access_log": False}
        serve.start(http_options={"host": args.host, "port": args.port}, logging_config=quiet)
        serve.run(build_app(cfg), name=args.name, route_prefix="/", blocking=False, logging_config=quiet)
        shown_host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
        url = f"http://{shown_host}:{args.port}"
        model = cfg.served_model_name or os.path.basename(cfg.target.model.rstrip("/"))
        redis_where = redact(cfg.redis_url) if cfg.redis_url else f"embedded, {cfg.embedded_redis_bind}, password"
        print(f"specserve: serving {model} at {url}  (drafter: {cfg.drafter.draft}, Redis: {redis_where})")
        print(f"  curl -N {url}/v1/completions -H 'Content-Type: application/json' "
              f"-d '{{\"model\": \"{model}\", \"prompt\": \"Hello\", \"max_tokens\": 32, \"stream\": true}}'")
        metrics_url = _metrics_url()
        if metrics_url:
            print(f"  metrics (Prometheus): {metrics_url}")
        calm.set()
        print("Press Ctrl-C to stop.", flush=True)
        while not stop.wait(0.5):
            pass
        print("\nspecserve: shutting down ...", flush=True)
    finally:
        calm.set()  # a second signal must not interrupt the shutdown itself
        try:
            if got[-1:] == [signal.SIGTERM] and not args.address and _local_ray_hit():
                # The signal went to the whole process group (`timeout`, a systemd stop) and reached this driver's
                # own Ray daemons too: Serve's graceful shutdown would wait 30 s and fail. Ray's shutdown below
                # stops every process of this local cluster; requests in flight stay resumable from Redis.
                print("specserve: the signal reached Ray's own processes too; skipping Serve's graceful shutdown",
                      flush=True)
            else:
                _shutdown_serve()
        finally:
            ray.shutdown()
            # Stopped: a late stop signal (the group's, or one Ray's own shutdown passes on) must not kill the
            # process on its way out and turn its exit status into "killed by SIGINT" (seen once in CI: -2, not 130).
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_IGN)
    print("specserve: stopped.", flush=True)
    return 0


def _check_metrics_port(port: int) -> int:
    """`port` if this machine can listen on it (0: Ray picks one); a clear error now rather than a Ray start-up
    that fails deep inside its metrics agent."""
    import socket

    if not 0 <= port <= 65535:
        raise ValueError(f"--metrics-port must be 0-65535, got {port}")
    if port:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                raise ConnectionError(f"metrics port {port} is in use: pass --metrics-port with a free port "
                                      f"(0 picks one)") from None
    return port


def _metrics_url() -> str | None:
    """The /metrics URL of this driver's Ray node (its metrics agent's export port), as Ray reports it."""
    import ray

    try:
        node_id = ray.get_runtime_context().get_node_id()
        for node in ray.nodes():
            if node.get("NodeID") == node_id and node.get("MetricsExportPort"):
                host = node.get("NodeManagerAddress") or "127.0.0.1"
                return f"http://{host}:{node['MetricsExportPort']}/metrics"
    except Exception:  # noqa: BLE001 - an informational line; serving goes on without it
        pass
    return None


def _shutdown_serve(timeout_s: float = 30.0) -> None:
    """`serve.shutdown()`, without its line of noise. Serve's controller is an actor with infinite task retries, and
    its `graceful_shutdown` call returns only by failing, when the controller kills itself at the end of the shutdown;
    the driver then reports "Task ServeController.graceful_shutdown failed. There are infinite retries remaining"
    (no retry runs: the actor is gone for good). The same call made with no retries fails quietly. Private API
    (Serve's client): when it changes, the usual `serve.shutdown()`."""
    import ray
    from ray import serve

    try:
        from ray.serve.context import _disconnect, _get_global_client

        client = _get_global_client(raise_if_no_controller_running=False)
        controller, done = client._controller, client._shutdown
    except Exception:  # noqa: BLE001 - private API changed, or no Serve: Serve's own shutdown
        serve.shutdown()
        return
    if not done:
        client.shutdown_cached_handles()
        try:
            ray.get(controller.graceful_shutdown.options(max_task_retries=0).remote(), timeout=timeout_s)
        except ray.exceptions.RayActorError:
            pass  # the controller has shut everything down and exited: the only way this call returns
        except ray.exceptions.GetTimeoutError:
            print(f"specserve: Serve's controller did not shut down within {timeout_s:g} s", flush=True)
        client._shutdown = True
    _disconnect()


def _local_ray_hit(wait_s: float = 1.0) -> bool:
    """Whether any Ray head process this driver started (raylet, GCS, dashboard, its agent, the log monitor) has
    died, allowing `wait_s` for it: a signal to the whole process group reaches them too (they block only SIGINT;
    the dashboard, its agent and the log monitor die at once), and Serve's graceful shutdown then cannot finish (it
    waited its full 30 s and failed). False when this driver joined a cluster (it started none) or Ray's internals
    do not say."""
    try:
        from ray._private import worker

        node = worker._global_node
        if node is None or not node.all_processes:
            return False
        deadline = time.monotonic() + wait_s
        while not node.dead_processes():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True
    except Exception:  # noqa: BLE001 - private API: when it changes, shut down the usual way
        return False


if __name__ == "__main__":  # pragma: no cover
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    a = parser.parse_args(["serve", *sys.argv[1:]])
    raise SystemExit(a.func(a))
