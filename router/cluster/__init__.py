"""The cluster module: the only router code that imports Ray (DESIGN §1).

:mod:`router.cluster.ray_cluster` launches the worker actors and keeps the router's worker pool in
step with them; :mod:`router.cluster.registry` is the registry actor that extra routers follow.
"""

from __future__ import annotations

from router.cluster.ray_cluster import (
    MAX_WORKERS_PER_ROLE,
    ClusterSpec,
    RayCluster,
    local_resources,
    shutdown_ray,
)
from router.cluster.registry import NAMESPACE, REGISTRY_NAME, RegistryFollower, WorkerRegistry

__all__ = [
    "MAX_WORKERS_PER_ROLE",
    "NAMESPACE",
    "REGISTRY_NAME",
    "ClusterSpec",
    "RayCluster",
    "RegistryFollower",
    "WorkerRegistry",
    "local_resources",
    "shutdown_ray",
]
