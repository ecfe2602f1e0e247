"""What this host is to a rendezvous endpoint: its owner or not, and its address toward it.

torchrun decides whether an agent hosts the c10d rendezvous store by comparing the endpoint
with the addresses of the machine's *hostname*, so on a host whose name resolves elsewhere
(to 127.0.0.1, or to another interface) the agent that owns the endpoint address does not
host the store and every agent waits 60 s for a store nobody serves. Each agent also
advertises ``socket.getfqdn()`` as the address of the workers' store (rank 0's), which other
hosts may not reach for the same reason. Asking the kernel instead answers both: the source
address it picks for a route to the endpoint is one of this host's interface addresses, the
endpoint address itself exactly when this host owns it (a local route), and otherwise the
address the endpoint's host sees this host's connections come from. A UDP ``connect`` only
looks the route up; nothing is sent.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import socket
from dataclasses import dataclass

logger = logging.getLogger(__name__)

SERVED_PROBE_TIMEOUT_S = 1.0
"""How long to wait for a connection to an owned endpoint (local: refused or accepted at once)."""


@dataclass(frozen=True)
class EndpointView:
    """This host's view of a rendezvous endpoint ``host:port``."""

    owned: bool
    """The endpoint address is one of this host's own: its agent should host the store."""
    served: bool
    """Something on this host already accepts connections there (another agent hosts it)."""
    local_addr: str
    """This host's address on the route to the endpoint: the one its peers can reach."""


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback address: every agent is on this machine, and torchrun's own
    host detection handles it."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def route_source(address: str, port: int, family: int) -> str:
    """The source address the kernel picks for a route to ``address`` (no packet is sent)."""
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.connect((address, port))
        return str(sock.getsockname()[0])


def _accepts(address: str, port: int, family: int) -> bool:
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.settimeout(SERVED_PROBE_TIMEOUT_S)
        try:
            sock.connect((address, port))
        except OSError:
            return False
        return True


def probe_endpoint(host: str, port: int) -> EndpointView | None:
    """Look ``host:port`` up from this host; None where it does not resolve or has no route
    (torchrun then reports it in its own words)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as error:
        logger.debug("rendezvous endpoint %s:%d does not resolve: %s", host, port, error)
        return None
    local_addr: str | None = None
    owned: tuple[str, int] | None = None
    for family, _, _, _, sockaddr in infos:
        address = str(sockaddr[0])
        try:
            source = route_source(address, port, family)
        except OSError as error:
            logger.debug("no route to %s: %s", address, error)
            continue
        local_addr = local_addr or source
        with contextlib.suppress(ValueError):
            if ipaddress.ip_address(source.split("%")[0]) == ipaddress.ip_address(
                    address.split("%")[0]):
                owned = (address, family)
                local_addr = source
                break
    if local_addr is None:
        return None
    served = owned is not None and _accepts(owned[0], port, owned[1])
    return EndpointView(owned=owned is not None, served=served, local_addr=local_addr)
