"""The Serve replica that owns the embedded redis-server (`EmbeddedRedis` deployment; dev / single-node, use
`redis_url` in production).

Ray Serve imports a deployment class's module in each of its replica processes, so this one imports Ray and the
redis-server launcher only: no torch, transformers or model code.
"""

from __future__ import annotations

from typing import Optional

import ray

from deployments.embedded_redis import EmbeddedRedis


class RedisServer:
    """Serve replica owning the embedded redis-server process.

    It listens on 127.0.0.1 (`embedded_redis_bind: loopback`, the default) or on its node's IP (`node_ip`), with a
    password generated at each start that `url` hands to the replicas that connect."""

    def __init__(self, bind: str = "loopback") -> None:
        self.loopback = bind == "loopback"
        self.node_id = ray.get_runtime_context().get_node_id()
        host = "127.0.0.1" if self.loopback else ray.util.get_node_ip_address()
        self.server = EmbeddedRedis(host=host).start()

    async def url(self, client_node_id: Optional[str] = None) -> str:
        """The URL, password included. `client_node_id`: the asking replica's Ray node; one on another node than a
        loopback server is refused with what to change."""
        if self.loopback and client_node_id and client_node_id != self.node_id:
            raise RuntimeError(
                f"the embedded Redis listens on 127.0.0.1 of Ray node {self.node_id}, which a replica on node "
                f"{client_node_id} cannot reach: set embedded_redis_bind: node_ip, place the Ingress and Coordinator "
                "replicas on the EmbeddedRedis node, or set redis_url"
            )
        return self.server.url

    async def check_health(self) -> None:
        if not self.server.running:
            raise RuntimeError("embedded redis-server exited")

    def __del__(self) -> None:
        server = getattr(self, "server", None)
        if server is not None:
            server.stop()
