"""Emulated multi-host cluster on one machine (network namespaces + veth + bridge + ``tc tbf``).

Modules: :mod:`.netns` (lifecycle: :class:`EmulatedCluster`, :func:`cleanup_stale`),
:mod:`.topology` (names, addresses, wiring commands), :mod:`.commands` (``ip``/``tc`` builders, the
tbf burst policy :func:`auto_burst`), :mod:`.schedule` (:class:`BandwidthSchedule`).
"""

from gradsync.cluster.commands import ClusterError, NetemUnavailable, auto_burst, netem_available
from gradsync.cluster.netns import EmulatedCluster, cleanup_stale
from gradsync.cluster.schedule import BandwidthSchedule
from gradsync.cluster.topology import Topology

__all__ = [
    "BandwidthSchedule",
    "ClusterError",
    "EmulatedCluster",
    "NetemUnavailable",
    "Topology",
    "auto_burst",
    "cleanup_stale",
    "netem_available",
]
