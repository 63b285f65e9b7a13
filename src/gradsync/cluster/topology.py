"""Topology of the emulated cluster: names, addresses and the commands that wire it.

Each host ``i`` is a network namespace ``<prefix>h<i>`` with loopback up and one interface
``<prefix>e<i>`` (address ``10.X.Y.(i+1)/24``). Its veth peer ``<prefix>b<i>`` is enslaved to the
bridge ``<prefix>br0``, which lives in its own namespace ``<prefix>br`` so nothing in the root
namespace changes. Both ends of every host link are shaped (see :mod:`gradsync.cluster.commands`).
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass

from gradsync.validation import check_int

__all__ = ["PREFIX_PATTERN", "Topology"]

#: a run prefix: ``gs`` + 6 hex digits
PREFIX_PATTERN = r"gs[0-9a-f]{6}"


@dataclass(frozen=True)
class Topology:
    """Names and addresses of ``hosts`` emulated hosts of one run.

    Args:
        hosts: number of hosts, 1..250.
        prefix: run prefix (``gs`` + 6 hex digits).
        subnet: ``(X, Y)`` of the ``10.X.Y.0/24`` host network, each 0..255.

    Raises:
        ValueError: for a bad host count, prefix or subnet.
    """

    hosts: int
    prefix: str
    subnet: tuple[int, int]

    def __post_init__(self) -> None:
        check_int("hosts", self.hosts, 1, 250)
        if not isinstance(self.prefix, str) or not re.fullmatch(PREFIX_PATTERN, self.prefix):
            raise ValueError(f"prefix must be 'gs' followed by 6 hex digits, got {self.prefix!r}")
        if len(self.subnet) != 2:
            raise ValueError(f"subnet must be two octets (X, Y), got {self.subnet!r}")
        for j, octet in enumerate(self.subnet):
            check_int(f"subnet[{j}]", octet, 0, 255)

    @classmethod
    def random(cls, hosts: int, prefix: str | None = None) -> Topology:
        """A topology with a random prefix (unless given) and a random ``10.X.Y.0/24`` subnet,
        ``X`` in 20..219 and ``Y`` in 1..250."""
        if prefix is None:
            prefix = "gs" + secrets.token_hex(3)
        return cls(hosts, prefix, (secrets.randbelow(200) + 20, secrets.randbelow(250) + 1))

    # -- names ---------------------------------------------------------------------------------
    def host_index(self, i: int) -> int:
        """``i`` checked against ``0 .. hosts-1`` (``ValueError`` otherwise)."""
        return check_int("host index", i, 0, self.hosts - 1)

    @property
    def bridge_ns(self) -> str:
        """Namespace holding the bridge."""
        return f"{self.prefix}br"

    @property
    def bridge(self) -> str:
        """The bridge device (in :attr:`bridge_ns`)."""
        return f"{self.prefix}br0"

    def namespace(self, i: int) -> str:
        """Namespace of host ``i``."""
        return f"{self.prefix}h{self.host_index(i)}"

    def host_if(self, i: int) -> str:
        """Interface of host ``i`` inside its namespace."""
        return f"{self.prefix}e{self.host_index(i)}"

    def bridge_port(self, i: int) -> str:
        """Bridge-side veth peer of host ``i`` (in :attr:`bridge_ns`)."""
        return f"{self.prefix}b{self.host_index(i)}"

    def address(self, i: int) -> str:
        """IPv4 address of host ``i``: ``10.X.Y.(i+1)``."""
        return f"10.{self.subnet[0]}.{self.subnet[1]}.{self.host_index(i) + 1}"

    def namespaces(self) -> list[str]:
        """Every namespace of the run, bridge first."""
        return [self.bridge_ns] + [self.namespace(i) for i in range(self.hosts)]

    def shaped_links(self, i: int) -> list[tuple[str, str]]:
        """``(namespace, device)`` of both shaped ends of host ``i``'s link: host side, bridge side."""
        return [(self.namespace(i), self.host_if(i)), (self.bridge_ns, self.bridge_port(i))]

    # -- commands --------------------------------------------------------------------------------
    def bridge_commands(self) -> list[list[str]]:
        """Create the bridge namespace, bring up its loopback, create and bring up the bridge."""
        br, brif = self.bridge_ns, self.bridge
        return [["ip", "netns", "add", br],
                ["ip", "-n", br, "link", "set", "lo", "up"],
                ["ip", "-n", br, "link", "add", brif, "type", "bridge"],
                ["ip", "-n", br, "link", "set", brif, "up"]]

    def host_commands(self, i: int) -> list[list[str]]:
        """Create host ``i``'s namespace and its veth link to the bridge, address it, bring it up
        (no shaping)."""
        ns, eif, bif, br = self.namespace(i), self.host_if(i), self.bridge_port(i), self.bridge_ns
        return [["ip", "netns", "add", ns],
                ["ip", "-n", ns, "link", "set", "lo", "up"],
                ["ip", "-n", br, "link", "add", bif, "type", "veth", "peer", "name", eif, "netns", ns],
                ["ip", "-n", br, "link", "set", bif, "master", self.bridge],
                ["ip", "-n", br, "link", "set", bif, "up"],
                ["ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", eif],
                ["ip", "-n", ns, "link", "set", eif, "up"]]
