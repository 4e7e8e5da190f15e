"""A certificate's hosts and a dialled endpoint compare in one spelling (issue 27: host matching
was an exact string compare, so ``Node-A.example.`` in a certificate refused ``node-a.example``
in a router's config, and ``[::1]`` refused ``0:0::1``)."""

from __future__ import annotations

import pytest

from kvpush.daemon.trust.allowlist import canonical_host
from kvpush.daemon.trust.peerauth import endpoint_host


@pytest.mark.parametrize("cert, endpoint", [
    ("Node-A.Example.", "tcp://node-a.example:17500"),
    ("node-a.example", "tcp://NODE-A.EXAMPLE.:17500"),
    ("::1", "tcp://[0:0::1]:17500"),
    ("[2001:db8::5]", "tcp://[2001:0db8:0:0::5]:9"),
    ("10.0.0.5", "tcp://10.0.0.5:17500"),
])
def test_one_host_written_two_ways_is_one_host(cert: str, endpoint: str) -> None:
    assert canonical_host(cert) == endpoint_host(endpoint)


@pytest.mark.parametrize("cert, endpoint", [
    ("10.0.0.5", "tcp://10.0.0.50:17500"),
    ("node-a.example", "tcp://node-a.example.com:17500"),
    ("node-a", "tcp://10.0.0.5:17500"),  # no DNS: a name and an address stay two hosts
])
def test_two_hosts_stay_two(cert: str, endpoint: str) -> None:
    assert canonical_host(cert) != endpoint_host(endpoint)
