"""Least reach (issue 28, item 1): an allowlisted node reaches only what its role needs.

Push needs one thing: the destination (the decode engine's region) writable by its producer.
Measured here with NIXL's UCX backend, over shared memory and over TCP:

* the WRITE target receives the WRITE and its notification without ever loading the
  initiator's metadata (``test_a_write_target_needs_nothing_of_its_producer``), so a prefill
  daemon's Hello reply carries no NIXL metadata and no region address;
* an allowlisted node that says Hello to a prefill daemon therefore gets nothing to connect
  with, and reads and writes zero bytes of the prefill engine's region, with real daemons,
  CURVE and NIXL (``test_a_prefill_daemons_hello_reply_exposes_nothing``).

Each is shown to fail with the fix removed: a reply built with the metadata and bases (the
old ``make_hello``) lets the same attack read the whole region and write into it.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time

import numpy as np
import pytest

from kvpush import proto
from kvpush.daemon.trust.peerauth import PeerAuth
from kvpush_dev.daemon_harness import ops_request
from kvpush_dev.fleet import ask, curve_client, fleet
from kvpush_dev.kvref import small_layout as lay
from kvpush_dev.nixl_probe import MEDIA, agent, register, xfer

pytestmark = pytest.mark.integration


# ---------------------------------------------------------------- what the target needs


def _target(conn, tls: str) -> None:
    """A WRITE target that never loads anything of its initiator: it publishes its metadata
    and collects notifications and bytes."""
    os.environ["UCX_TLS"] = tls
    a = agent("target")
    buf = np.zeros(1 << 16, dtype=np.uint8)
    register(a, buf)
    conn.send((a.get_agent_metadata(), buf.ctypes.data))
    got: dict[str, list[bytes]] = {}
    end = time.monotonic() + 30
    while not conn.poll() and time.monotonic() < end:
        for k, v in a.get_new_notifs().items():
            got.setdefault(k, []).extend(bytes(m) for m in v)
        time.sleep(0.001)
    conn.send((got, int(buf.sum())))


@pytest.mark.parametrize("medium", MEDIA)
def test_a_write_target_needs_nothing_of_its_producer(medium, monkeypatch):
    """The minimum push needs: the initiator loads the target's metadata; the target loads
    nothing, yet the bytes land and the notification arrives, named by the initiator's agent."""
    monkeypatch.setenv("UCX_TLS", MEDIA[medium])
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    t = ctx.Process(target=_target, args=(theirs, MEDIA[medium]), daemon=True)
    t.start()
    try:
        assert mine.poll(60)
        md, base = mine.recv()
        a = agent("producer")
        src = np.full(4096, 7, dtype=np.uint8)
        register(a, src)
        peer = a.add_remote_agent(md)
        assert xfer(a, "WRITE", src, base, peer, b"landed") == "DONE"
        time.sleep(0.5)
        mine.send("stop")
        assert mine.poll(10)
        notifs, total = mine.recv()
        assert notifs == {"producer": [b"landed"]}
        assert total == 7 * 4096
    finally:
        t.join(10)
        if t.is_alive():
            t.kill()


# ---------------------------------------------------------------- what a Hello gets


def steal(a, reply: proto.Hello, size: int) -> tuple[np.ndarray | None, str, str]:
    """Everything an attacker can try with a Hello reply: load the metadata it carries, READ
    ``size`` bytes at the region address it carries, WRITE 4 KiB there. (read buffer or None,
    READ status, WRITE status)."""
    if not reply.agent_metadata:
        return None, "no metadata", "no metadata"
    peer = a.add_remote_agent(reply.agent_metadata)
    base = reply.region_bases[0] if reply.region_bases else 0
    got = np.zeros(size, dtype=np.uint8)
    register(a, got)
    read = xfer(a, "READ", got, base, peer)
    junk = np.full(4096, 0xAB, dtype=np.uint8)
    register(a, junk)
    written = xfer(a, "WRITE", junk, base + 8192, peer)
    return got, read, written


@pytest.mark.parametrize("medium", MEDIA)
def test_a_prefill_daemons_hello_reply_exposes_nothing(tmp_path, monkeypatch, medium):
    """Node X (allowlisted by both, both roles) says a valid Hello to the prefill daemon: the
    reply carries no metadata and no region address, and X reads and writes zero bytes of the
    prefill engine's region; the decode daemon answers X no Hello at all and links only to the
    producer its engine registered with; the real pair keeps transferring."""
    tls = MEDIA[medium]
    monkeypatch.setenv("UCX_TLS", tls)
    with fleet(tmp_path, x_allowed_by="pd", env={"UCX_TLS": tls}) as f, contextlib.ExitStack() as closing:
        p, d, pe, kp, kd, kx = f.p, f.d, f.pe, f.kp, f.kd, f.kx
        assert isinstance(f.transfer((4, 5, 6)), proto.Received)  # the real pair works on this medium

        x = PeerAuth.load(kx.secret_file, kx.authorized_dir)
        server = PeerAuth.load(kp.secret_file, kp.authorized_dir).me.public
        a = agent("xagent")
        mine = np.zeros(4096, dtype=np.uint8)
        register(a, mine)
        hello = proto.Hello("xagent", a.get_agent_metadata(), lay(), (mine.ctypes.data,), proto.PROTOCOL_VERSION,
                            lay().compat_key(), "X", 0, 1, "tcp://127.0.0.3:1", False)
        s = curve_client(p.peer_endpoint, server, (x.me.public, x.secret))
        closing.callback(s.close, 0)
        before = pe.bytes.copy()
        reply = ask(s, hello)
        assert isinstance(reply, proto.Hello), reply  # admitted: it is allowlisted, of the decode role
        got, read, written = steal(a, reply, pe.bytes.nbytes)
        time.sleep(0.3)
        same = 0 if got is None else int((got == pe.bytes.view(np.uint8).reshape(-1)).sum())
        assert got is None, f"X read the prefill region (READ {read}, {same} bytes equal), WRITE {written}"
        assert np.array_equal(pe.bytes, before), f"X wrote into the prefill engine's region (WRITE {written})"
        assert reply.agent_metadata == b"" and reply.region_bases == ()
        assert sorted(r["node"] for r in ops_request(p.cfg.ops_socket, "peers").data["peers"]) == ["dnode", "xnode"]

        # Nor does the decode daemon answer it, though X is in its allowlist too: it sends its
        # metadata only in the Hellos it dials, for its own engine's registrations (to P only).
        s2 = curve_client(d.peer_endpoint, PeerAuth.load(kd.secret_file, kd.authorized_dir).me.public,
                          (x.me.public, x.secret))
        try:
            answer = ask(s2, hello)
        finally:
            s2.close(0)
        assert isinstance(answer, proto.Error), answer
        assert [r["node"] for r in ops_request(d.cfg.ops_socket, "peers").data["peers"]] == ["pnode"]

        assert isinstance(f.transfer((7, 8, 9)), proto.Received)
