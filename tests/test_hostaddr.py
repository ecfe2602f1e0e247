"""cannikin.runtime.hostaddr on loopback only (no traffic leaves the machine); the case of
two hosts, one owning the endpoint, is tests/test_netns.py's."""

from __future__ import annotations

import socket

from cannikin.runtime.hostaddr import is_loopback, probe_endpoint, route_source


def test_loopback_names() -> None:
    assert is_loopback("localhost") and is_loopback("127.0.0.5") and is_loopback("::1")
    assert not is_loopback("10.0.0.1") and not is_loopback("node1")


def test_an_own_address_is_owned_and_served_once_something_listens() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        port = server.getsockname()[1]
        view = probe_endpoint("127.0.0.1", port)  # bound, not listening: nothing is served
        assert view is not None and view.owned and not view.served, view
        assert view.local_addr == "127.0.0.1"
        server.listen()
        view = probe_endpoint("127.0.0.1", port)
        assert view is not None and view.owned and view.served, view


def test_route_source_of_an_own_address_is_itself() -> None:
    assert route_source("127.0.0.1", 9, socket.AF_INET) == "127.0.0.1"


def test_an_address_of_no_interface_is_not_owned_and_the_route_gives_ours() -> None:
    """127.0.0.3 is routed locally (the 127/8 route) but is no interface's address: the kernel
    answers from 127.0.0.1, as it answers a remote endpoint from the host's own address."""
    view = probe_endpoint("127.0.0.3", 9)
    assert view is not None and not view.owned and not view.served, view
    assert view.local_addr == "127.0.0.1"
