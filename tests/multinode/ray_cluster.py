"""A Ray cluster on this machine for tests: a head and worker nodes on loopback addresses, engine replicas on it.

Nodes listen on 127.0.0.x addresses other than 127.0.0.1, which Ray rewrites to the host's interface address.
Token authentication is off: the cluster is reachable from this machine only. Every worker node offers one
``engine_slot`` resource and every replica asks for one, so each replica lands on its own node.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import ray
from ray import serve
from ray.cluster_utils import Cluster

from omnigate.engines.remote import admin
from omnigate.engines.remote.serve import DEFAULT_APP_PREFIX, EngineAppArgs

HEAD_ADDRESS = "127.0.0.2"
ENGINE_SLOT = "engine_slot"


@dataclass
class LocalRayCluster:
    cluster: Cluster
    replicas: list[str]

    @property
    def address(self) -> str:
        address: str = self.cluster.address
        return address


def engine_args(spec: str, **extra: float) -> EngineAppArgs:
    """A synthetic engine replica that fits a test machine: a sliver of a CPU, one engine slot."""
    return EngineAppArgs(
        engine="synthetic",
        model=spec,
        num_cpus=0.1,
        resources={ENGINE_SLOT: 1.0},
        graceful_shutdown_timeout_s=5.0,
        admission="slots",  # the tests count live streams per replica; headroom would refuse by measured speed
        **extra,  # type: ignore[arg-type]
    )


@contextmanager
def ray_cluster(
    workers: int, spec: str, *, replicas: int | None = None, gateway_lease_s: float = 30.0
) -> Iterator[LocalRayCluster]:
    """Start the cluster, join it from this process, deploy ``replicas`` (default: one per worker) and tear it all
    down afterwards."""
    os.environ["RAY_AUTH_MODE"] = "disabled"
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "node_ip_address": HEAD_ADDRESS,
            "num_cpus": 1,
            "include_dashboard": False,
            "object_store_memory": 128 * 1024 * 1024,
        },
    )
    try:
        for i in range(workers):
            cluster.add_node(
                node_ip_address=f"127.0.0.{3 + i}",
                num_cpus=1,
                resources={ENGINE_SLOT: 1.0},
                object_store_memory=128 * 1024 * 1024,
            )
        admin.connect(cluster.address)
        serve.start(proxy_location="Disabled")
        args = engine_args(spec, gateway_lease_s=gateway_lease_s)
        names = admin.deploy(args, workers if replicas is None else replicas, DEFAULT_APP_PREFIX)
        yield LocalRayCluster(cluster, names)
    finally:
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
        cluster.shutdown()
