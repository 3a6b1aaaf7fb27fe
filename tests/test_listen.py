"""The listen-address probe (appliance.listen.taken_address) refuses no address gRPC binds (a
taken port and an address not this host's: tests/gateway/test_hostile.py, tests/engine)."""

from __future__ import annotations

import errno
import socket

import pytest

from appliance.listen import taken_address


@pytest.mark.parametrize("address", ["0.0.0.0:0", "127.0.0.1:0", "localhost:0", "[::]:0"])
def test_what_grpc_binds_is_not_refused(address: str) -> None:
    assert taken_address(address) is None


class _NoInet6(socket.socket):
    """A socket of a kernel without IPv6 (booted with ipv6.disable=1): AF_INET6 is refused as
    that kernel refuses it. This host has IPv6, and no namespace takes the family away."""

    def __init__(self, family: int = -1, *args: object, **kwargs: object) -> None:
        if family == socket.AF_INET6:
            raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")
        super().__init__(family, *args, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("address", ["localhost:0", "[::]:0", "0.0.0.0:0"])
def test_a_host_without_ipv6_is_not_refused_what_grpc_binds_there(
    address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gRPC binds localhost's IPv4 address, and [::] as 0.0.0.0, on such a host."""
    monkeypatch.setattr(socket, "socket", _NoInet6)
    assert taken_address(address) is None
