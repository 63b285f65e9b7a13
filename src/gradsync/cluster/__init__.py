"""Emulated multi-host cluster on one machine (network namespaces + veth + bridge + ``tc tbf``)."""

from gradsync.cluster.netns import (
    BandwidthSchedule,
    ClusterError,
    EmulatedCluster,
    NetemUnavailable,
    cleanup_stale,
    netem_available,
)

__all__ = [
    "BandwidthSchedule",
    "ClusterError",
    "EmulatedCluster",
    "NetemUnavailable",
    "cleanup_stale",
    "netem_available",
]
