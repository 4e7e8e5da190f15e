"""Roles in certificates (issue 28, item 6): a decode daemon dials only allowlisted nodes of
the prefill role, so a request's ``kv_transfer_params`` cannot make it push its engine's
registrations (and its metadata) to a node that is no producer; a prefill daemon takes Hellos
only from nodes of the decode role. Real kvpushd, ZeroMQ CURVE and NIXL; node P at 127.0.0.1,
node D at 127.0.0.2, as in test_peers_auth.py. A certificate without roles has both (the
control: test_peers_auth.py's transfers)."""

from __future__ import annotations

import os

import pytest

from kvpush import proto
from kvpush.daemon.trust.allowlist import parse_cert
from kvpush.daemon.trust.peerauth import keygen
from kvpush_dev.daemon_harness import Daemon, Engine, device_config, ops_request
from kvpush_dev.keys import allow, lab_keys
from kvpush_dev.kvref import small_layout as lay

pytestmark = pytest.mark.integration


def keys(tmp_path, name, host, roles):
    """lab_keys with roles: the node's key pair made by keygen --role."""
    base = tmp_path / name
    pub, _ = keygen(base / "keys", name, [host], roles)
    (base / "authorized").mkdir(parents=True, mode=0o700)
    (base / "authorized" / pub.name).write_bytes(pub.read_bytes())
    return lab_keys(base, name, (host,))  # found made: reused


@pytest.mark.parametrize("p_roles, d_roles, why", [
    (["decode"], None, "not allowed the prefill role"),
    (None, ["prefill"], ""),  # P refuses D's Hello: D hears only "handshake refused"
], ids=["producer-without-prefill-role", "consumer-without-decode-role"])
def test_roles_are_enforced(tmp_path, p_roles, d_roles, why):
    kp = keys(tmp_path, "pnode", "127.0.0.1", p_roles)
    kd = keys(tmp_path, "dnode", "127.0.0.2", d_roles)
    allow(kp, kd)
    allow(kd, kp)
    p = Daemon(device_config(tmp_path, 0, **kp.config()))
    d = Daemon(device_config(tmp_path, 1, peer_host="127.0.0.2", advertise_host="127.0.0.2", **kd.config()))
    pe, de = Engine(p, lay(), "prefill", seed=3), Engine(d, lay(), "decode", fill="zeros")
    try:
        t = f"r{os.getpid()}"
        de.send(proto.Register(t, 0, (4, 5, 6), 40, (p.peer_endpoint,), 1, 8000))
        pe.send(proto.PrefillDone(t, (1, 2, 3), 40, 8000))
        got = de.result(t)
        assert isinstance(got, proto.ReceiveFailed), got
        assert why in got.reason, got.reason
        assert ops_request(p.cfg.ops_socket, "peers").data["peers"] == []
    finally:
        pe.close()
        de.close()
        p.stop()
        d.stop()


def test_roles_parse_and_default_to_both(tmp_path):
    pub, _ = keygen(tmp_path / "a", "a", ["10.0.0.1"], ["prefill"])
    assert parse_cert(pub.read_text(), "a").roles == ("prefill",)
    pub, _ = keygen(tmp_path / "b", "b", ["10.0.0.2"])
    assert parse_cert(pub.read_text(), "b").roles == ("prefill", "decode")
    bad = pub.read_text().replace('hosts = "10.0.0.2"', 'hosts = "10.0.0.2"\n    roles = "admin"')
    with pytest.raises(ValueError, match="roles"):
        parse_cert(bad, "b")
