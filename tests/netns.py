"""Two emulated hosts on one machine: network namespaces joined by a veth pair, ``tc`` shaped.

Usage from a test::

    with netns_pair() as hosts:            # pytest.skip(reason) where it cannot be built
        hosts.shape("200mbit")             # token bucket on both ends (both directions)
        subprocess.run([*hosts.a.exec_prefix, "python", ...])   # runs inside host a

* Each host is a namespace of its own with ``lo`` up and one end of the veth, addressed in a
  private /24 that exists only inside the two namespaces: nothing the hosts send can leave
  them, and two pairs (concurrent tests) may reuse the same addresses.
* Names carry this process's pid, so concurrent runs never collide; leaving the ``with``
  block deletes both namespaces (and so the veth), also when the body raised, and a pair
  whose process is gone (killed before its clean-up) is deleted by the next one.
* ``tc tbf`` rather than ``netem`` (not in every kernel): a rate limit with a 50 ms queue.
  Set ``GLOO_SOCKET_IFNAME`` to ``host.ifname`` so gloo uses the veth.
* Needs root, ``ip`` and ``tc``; :func:`netns_pair` skips the test with the reason otherwise.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

SUBNET = "10.77.0"
"""The /24 of the pair (host a is .1, host b is .2); it exists only inside the namespaces."""
COMMAND_TIMEOUT_S = 10.0


class NetnsUnavailable(RuntimeError):
    """This machine cannot build the pair (not root, no ``ip``/``tc``, or the kernel refused)."""


@dataclass(frozen=True)
class Host:
    """One emulated host: a network namespace with one veth end."""

    netns: str
    ifname: str
    address: str

    @property
    def exec_prefix(self) -> list[str]:
        """Prepend to a command line to run it inside this host's namespace."""
        return ["ip", "netns", "exec", self.netns]


@dataclass(frozen=True)
class HostPair:
    """Two hosts joined by a veth pair; ``shape`` limits the link's rate in both directions."""

    a: Host
    b: Host

    def shape(self, rate: str | None) -> None:
        """Put a token bucket of ``rate`` (tc syntax, e.g. ``"200mbit"``) on both ends, or
        remove it (``None``): the hosts' egress queues, so each direction is limited."""
        for host in (self.a, self.b):
            if rate is None:
                _ip(host, "tc", "qdisc", "del", "dev", host.ifname, "root", check=False)
            else:
                _ip(host, "tc", "qdisc", "replace", "dev", host.ifname, "root", "tbf",
                    "rate", rate, "burst", "32kbit", "latency", "50ms")

    def set_link(self, host: Host, *, up: bool) -> None:
        """Take ``host``'s end of the veth down, a cut link (the other end loses its carrier;
        no reset reaches either side's sockets), or up again."""
        _ip(host, "ip", "link", "set", host.ifname, "up" if up else "down")


def _run(cmd: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        result = subprocess.run(list(cmd), capture_output=True, text=True,
                                timeout=COMMAND_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise NetnsUnavailable(f"{' '.join(cmd)}: {error}") from error
    if check and result.returncode != 0:
        raise NetnsUnavailable(f"{' '.join(cmd)} exited {result.returncode}: "
                               f"{result.stderr.strip()}")
    return result


def _ip(host: Host, *cmd: str, check: bool = True) -> None:
    _run([*host.exec_prefix, *cmd], check=check)


def _delete(netns: str) -> None:
    _run(["ip", "netns", "del", netns], check=False)


def _delete_orphans() -> None:
    """Delete pairs left by a test process that was killed before it could clean up."""
    for line in _run(["ip", "netns", "list"]).stdout.splitlines():
        match = re.fullmatch(r"cnk(\d+)[ab]", line.split()[0]) if line.strip() else None
        if match and not Path(f"/proc/{match.group(1)}").exists():
            _delete(match.group(0))


@contextlib.contextmanager
def host_pair() -> Iterator[HostPair]:
    """Build the pair (raising :class:`NetnsUnavailable` with the reason); delete it on exit."""
    if os.geteuid() != 0:
        raise NetnsUnavailable("network namespaces need root (euid is not 0)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise NetnsUnavailable(f"'{tool}' is not installed (package iproute2)")
    _delete_orphans()
    tag = f"cnk{os.getpid()}"  # + "a"/"b": within the 15 characters of an interface name
    a = Host(f"{tag}a", f"{tag}a", f"{SUBNET}.1")
    b = Host(f"{tag}b", f"{tag}b", f"{SUBNET}.2")
    created: list[str] = []
    try:
        for host in (a, b):
            _run(["ip", "netns", "add", host.netns])
            created.append(host.netns)
        # created in a's namespace, one end moved to b's: never present in the root namespace
        _ip(a, "ip", "link", "add", a.ifname, "type", "veth", "peer", "name", b.ifname,
            "netns", b.netns)
        for host in (a, b):
            _ip(host, "ip", "addr", "add", f"{host.address}/24", "dev", host.ifname)
            _ip(host, "ip", "link", "set", host.ifname, "up")
            _ip(host, "ip", "link", "set", "lo", "up")
        pair = HostPair(a, b)
        pair.shape("1gbit")  # tc tbf works here, or the pair is unusable for shaping tests
        pair.shape(None)
        yield pair
    finally:
        for netns in created:
            _delete(netns)


@contextlib.contextmanager
def netns_pair() -> Iterator[HostPair]:
    """:func:`host_pair` for pytest: skips the test, with the reason, where it cannot be built."""
    with contextlib.ExitStack() as stack:
        try:
            pair = stack.enter_context(host_pair())
        except NetnsUnavailable as error:
            pytest.skip(f"two network namespaces with a shaped veth are unavailable: {error}")
        yield pair
