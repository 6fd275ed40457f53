"""Tensor-parallel target replicas on Ray: N rank workers on one node, one torch.distributed group, rank 0
answering the coordinator.

Layout (bundles from `config.worker_bundles`, the same pure function the deployment options use): the Serve
host sits in bundle 0 of its STRICT_PACK placement group; rank 0 is the usual `TargetWorker` (named `...:0`,
the one the coordinator calls), ranks 1..N-1 are `RankFollower` actors (`...:i`), rank i in bundle i. The
host picks the rendezvous (its node's IP and a free TCP port; every bundle is on that node) and every rank
joins the group in its constructor: NCCL on GPUs, gloo on CPU, plus a gloo control group.

Rank 0's runner is a `pipeline.models.tensor_parallel.TensorParallelRunner`: each target pass (prefill or a
batched verify) is sent to the followers (a Unix socket each, `pipeline.models.tp_control`: the bundles share a
node), which replay it on their shards (`follow()`, in a thread); only rank 0 gets logits and answers. On CUDA
every rank wraps its shard in the static-shape graph runner.

A lost rank takes the replica down, without hangs: a broken collective or control connection, a collective past its
timeout, or (followers) no word from rank 0 within the control timeout makes that process exit. The
coordinator sees rank 0 gone (ActorDiedError), fails over to another target replica and replays the request's
committed tokens from Redis; the host's health check (a ping to every rank) fails, and Serve replaces the
replica, whose remaining ranks die with their owner.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Any, Optional

import ray
import torch
from ray import serve
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from deployments.config import Resources, worker_actor_options
from deployments.workers import WORKER_NAMESPACE, worker_name
from pipeline.models.tensor_parallel import (
    TensorParallelRunner,
    follow,
    init_tensor_parallel,
    load_tensor_parallel_model,
    tensor_parallel_graphs,
)

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 60.0  # a collective (or startup barrier) waiting longer than this fails the replica
CONTROL_TIMEOUT_S = 30.0  # a follower hearing nothing from rank 0 for this long exits
HEARTBEAT_S = 5.0  # rank 0 sends an idle follower a no-op this often
NOSET_CUDA_VISIBLE_DEVICES = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


def rendezvous() -> str:
    """init_method for the group: this node's IP and a free TCP port (call it on the node of the ranks)."""
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return f"tcp://{ray.util.get_node_ip_address()}:{port}"


def _exit_process(err: BaseException) -> None:
    logger.error("tensor-parallel group broken, exiting: %s", err)
    logging.shutdown()
    os._exit(1)


def cuda_index(gpu_ids: list, visible: Optional[str]) -> int:
    """torch's index of this actor's GPU when every GPU of the node stays visible (see `rank_actor_options`):
    the position of Ray's GPU id in CUDA_VISIBLE_DEVICES, or the id itself when that is unset."""
    assert len(gpu_ids) == 1, f"a tensor-parallel rank needs exactly one GPU, Ray gave it {gpu_ids}"
    gid = str(gpu_ids[0])
    return visible.split(",").index(gid) if visible else int(gid)


def rank_actor_options(resources: Resources) -> dict[str, Any]:
    """Actor options of a rank (bundle: added by the caller). On GPUs Ray is told not to narrow
    CUDA_VISIBLE_DEVICES to the rank's own card: NCCL's peer-to-peer (NVLink) transport needs to see the
    peers, else it falls back to copies through host memory (Ray Train and vLLM do the same)."""
    opts = worker_actor_options(resources, has_placement_group=True)
    if resources.num_gpus > 0:
        opts["runtime_env"] = {"env_vars": {NOSET_CUDA_VISIBLE_DEVICES: "1"}}
    return opts


def load_rank(model: Any, rank: int, world_size: int, init_method: str, device: str, dtype: str,
              collective_timeout_s: float = COLLECTIVE_TIMEOUT_S, control_timeout_s: float = CONTROL_TIMEOUT_S,
              allreduce: str = "auto"):
    """Join the group and load this rank's shard (graph-wrapped on CUDA, summing with `allreduce`, every rank
    the same: `TargetConfig.tp_allreduce`). -> (runner, TPContext)."""
    if device == "cuda" and os.environ.get(NOSET_CUDA_VISIBLE_DEVICES) == "1":
        device = f"cuda:{cuda_index(ray.get_gpu_ids(), os.environ.get('CUDA_VISIBLE_DEVICES'))}"
    tp = init_tensor_parallel(rank, world_size, init_method, device, collective_timeout_s, control_timeout_s)
    runner = load_tensor_parallel_model(model, tp, dtype)
    if tp.device.type == "cuda":
        runner = tensor_parallel_graphs(runner, allreduce=allreduce)
    logger.info("tensor-parallel rank %d/%d loaded %s on %s (all-reduce: %s)", rank, world_size, runner.info.name,
                tp.device, getattr(runner, "allreduce", "gloo"))
    return runner, tp


def leader_runner(model: Any, world_size: int, init_method: str, device: str, dtype: str,
                  heartbeat_s: float = HEARTBEAT_S, allreduce: str = "auto", **timeouts: float):
    """Rank 0's `CausalLM`: drives the followers; exits the process when the group breaks."""
    runner, tp = load_rank(model, 0, world_size, init_method, device, dtype, allreduce=allreduce, **timeouts)
    return TensorParallelRunner(runner, tp, heartbeat_s=heartbeat_s, on_failure=_exit_process)


class RankFollower:
    """Ranks 1..N-1 of a tensor-parallel replica: replay rank 0's passes on this rank's shard."""

    def __init__(self, model: Any, device: str = "cpu", dtype: str = "float32", torch_threads: int = 1,
                 rank: int = 1, world_size: int = 2, tp_init_method: str = "", tp_allreduce: str = "auto",
                 **timeouts: float) -> None:
        torch.set_num_threads(torch_threads)
        self.rank = rank
        self.runner, self.tp = load_rank(model, rank, world_size, tp_init_method, device, dtype,
                                         allreduce=tp_allreduce, **timeouts)
        threading.Thread(target=self._follow, name=f"tp-follow-{rank}", daemon=True).start()

    def _follow(self) -> None:
        try:
            follow(self.runner, self.tp)
        except BaseException as err:  # noqa: BLE001 - rank 0 or a peer is gone: this replica is done
            _exit_process(err)
        logger.info("rank %d released by rank 0", self.rank)
        os._exit(0)

    async def ping(self) -> bool:
        return True


def spawn_tensor_parallel_workers(leader_cls: type, role: str, resources: Resources, world_size: int,
                                  **init_kwargs: Any) -> list[Any]:
    """Start rank 0 (`leader_cls`, e.g. TargetWorker) and ranks 1..N-1 (`RankFollower`) for the calling Serve
    replica, rank i in bundle i of its placement group. All share one rendezvous picked here."""
    ctx = serve.get_replica_context()
    pg = get_current_placement_group()
    if pg is None:
        raise RuntimeError("tensor_parallel_size > 1 needs the replica's placement group (deployment_options)")
    init_method = rendezvous()
    follower_kwargs = {k: init_kwargs[k] for k in ("model", "device", "dtype", "torch_threads", "tp_allreduce")
                       if k in init_kwargs}
    workers = []
    for rank in range(world_size):
        opts = rank_actor_options(resources)
        opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=rank, placement_group_capture_child_tasks=True)
        name = worker_name(ctx.app_name, role, ctx.replica_id.unique_id, rank)
        cls, kwargs = (leader_cls, init_kwargs) if rank == 0 else (RankFollower, follower_kwargs)
        workers.append(ray.remote(cls).options(name=name, namespace=WORKER_NAMESPACE, max_restarts=0, **opts)
                       .remote(rank=rank, world_size=world_size, tp_init_method=init_method, **kwargs))
    logger.info("started %d tensor-parallel ranks of %s (%s)", world_size, role, init_method)
    return workers
