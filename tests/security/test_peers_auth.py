"""Peer authentication by default: real daemons, real ZeroMQ CURVE + ZAP, real NIXL.

Two "nodes" on loopback: P advertises 127.0.0.1, D 127.0.0.2, each with its own key pair;
both allowlist both. Asserted: a client without an allowlisted key gets no session, so no
NIXL metadata, no region address and no way to cause a WRITE; an allowlisted node cannot
claim another node's endpoint, evict it, or take over its transfer; revoking a node's key
(removing its certificate) drops its sessions and it can no longer transfer; insecure mode
is explicit and visible.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from kvpush import proto
from kvpush.daemon.trust.peerauth import PeerAuth
from kvpush_dev.daemon_harness import Daemon, device_config, ops_request
from kvpush_dev.fleet import ask, curve_client, node_keys, transfer
from kvpush_dev.keys import allow
from kvpush_dev.kvref import small_layout as lay

pytestmark = pytest.mark.integration

def test_status_says_the_peer_port_is_authenticated(nodes):
    p, d, *_ = nodes
    st = ops_request(p.cfg.ops_socket, "status").data
    assert st["peer_auth"] == "curve" and st["node"] == "pnode"


def test_no_session_without_an_allowlisted_key(nodes):
    """No key, or a valid key pair that is not allowlisted: nothing comes back, not even an
    error (so no NIXL metadata and no region base), and no WRITE into anyone's memory."""
    p, d, pe, de, kp, _ = nodes
    before = de.bytes.copy()
    server = PeerAuth.load(kp.secret_file, kp.authorized_dir).me.public
    hello = proto.Hello("intruder", b"x", lay(), (0,), proto.PROTOCOL_VERSION, lay().compat_key(), "X", 0, 1,
                        "tcp://127.0.0.9:1", False)
    stranger = zmq.curve_keypair()
    for keys in (None, stranger):
        s = curve_client(p.peer_endpoint, server, keys)
        try:
            assert ask(s, hello, 1.5) is None
            assert ask(s, proto.PeerRegister("evil", 0, (0, 1), 20, 0, 1, 1, 5000), 1.5) is None
        finally:
            s.close(0)
    assert isinstance(transfer(p, pe, de), proto.Received)  # the real pair is untouched
    assert ops_request(p.cfg.ops_socket, "peers").data["peers"][0]["node"] == "dnode"
    assert not np.array_equal(de.bytes, before)


def test_an_allowlisted_node_cannot_claim_another_nodes_endpoint(nodes, tmp_path):
    """Node X (allowlisted, hosts 127.0.0.3) says Hello as D's endpoint: refused with only
    "handshake refused", D is not evicted and keeps transferring."""
    p, d, pe, de, kp, kd = nodes
    assert isinstance(transfer(p, pe, de), proto.Received)
    kx = node_keys(tmp_path, "x")
    allow(kp, kx)
    time.sleep(1.5)  # the allowlist is re-read within a second
    x = PeerAuth.load(kx.secret_file, kx.authorized_dir)
    server = PeerAuth.load(kp.secret_file, kp.authorized_dir).me.public
    s = curve_client(p.peer_endpoint, server, (x.me.public, x.secret))
    try:
        hello = proto.Hello("xagent", b"junk", lay(), (0,), proto.PROTOCOL_VERSION, lay().compat_key(), "X", 0, 1,
                            d.peer_endpoint, False)
        reply = ask(s, hello)
        assert isinstance(reply, proto.Error) and "refused" in reply.message
        assert "dnode" not in reply.message and "127.0.0.2" not in reply.message
        # Nor may it register anything (no handshake): the transfer of D stays D's.
        assert isinstance(ask(s, proto.PeerRegister("t-x", 5, (0, 1), 20, 0, 1, 1, 5000)), proto.Error)
    finally:
        s.close(0)
    # Its Hello was refused: what it sends next is unauthenticated (not a known peer's lost handshake).
    assert 'cause="unauthenticated"' in ops_request(p.cfg.ops_socket, "metrics").data["text"]
    assert 'cause="handshake_lost"' not in ops_request(p.cfg.ops_socket, "metrics").data["text"]
    peers = ops_request(p.cfg.ops_socket, "peers").data["peers"]
    assert [r["node"] for r in peers] == ["dnode"]
    assert isinstance(transfer(p, pe, de), proto.Received)


def test_revoking_a_node_drops_it_and_it_can_no_longer_transfer(nodes):
    p, d, pe, de, kp, kd = nodes
    assert isinstance(transfer(p, pe, de), proto.Received)
    (Path(kp.authorized_dir) / "dnode.key").unlink()
    deadline = time.monotonic() + 5
    while ops_request(p.cfg.ops_socket, "peers").data["peers"]:
        assert time.monotonic() < deadline, "revoked node still a peer"
        time.sleep(0.2)
    before = de.bytes.copy()
    got = transfer(p, pe, de, (10, 11, 12))
    assert isinstance(got, proto.ReceiveFailed)
    assert np.array_equal(de.bytes, before), "a revoked node received KV"


def test_insecure_mode_is_explicit_and_visible(tmp_path):
    p = Daemon(device_config(tmp_path, 0, insecure_peers=True))
    try:
        st = ops_request(p.cfg.ops_socket, "status").data
        assert st["peer_auth"] == "insecure" and st["node"] == ""
        # Without authentication a peer still needs a Hello before anything reaches NIXL.
        s = curve_client(p.peer_endpoint, b"", None)
        try:
            reply = ask(s, proto.PeerRegister("evil", 0, (0, 1), 20, 0, 1, 1, 5000))
            assert isinstance(reply, proto.Error) and reply.code == "handshake"
        finally:
            s.close(0)
    finally:
        p.stop()
