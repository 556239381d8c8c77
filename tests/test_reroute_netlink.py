"""The control plane's route operations refuse what must never be routed, before touching the kernel."""

from __future__ import annotations

import pytest

from ridethrough.actuators.commands import Route
from ridethrough.actuators.reroute_netlink import NetlinkRouteOps


@pytest.mark.parametrize("destination", ["127.192.7.11/32", "127.0.0.0/8", "127.45.0.0/16"])
def test_a_route_for_a_loopback_address_is_refused(destination: str) -> None:
    # 127/8 is the host itself: a main-table route inside it (the lab's loopback mode, where peers sit on
    # 127.x) is more specific than the local /8 and would send the host's own traffic out of the host
    ops = NetlinkRouteOps()
    try:
        with pytest.raises(ValueError, match="loopback addresses never leave the host"):
            ops.replace(Route(destination, "eth0", "192.0.2.1"))
    finally:
        ops.close()
