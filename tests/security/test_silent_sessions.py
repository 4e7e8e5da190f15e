"""Sessions that never say Hello (issue 44, item 5), on real daemons: ZeroMQ CURVE + ZAP, NIXL.

X is an allowlisted node (a key P admits) that opens CURVE sessions to P's peer port and never
sends a Hello. Asserted:

* the per-identity session cap holds before the Hello: of 12 silent sessions only
  ``max_sessions_per_peer`` get through the handshake (before: all 12);
* a session with no Hello is closed after ``hello_deadline_s`` (before: never);
* P keeps ``reserved_fds`` descriptors for its own files: X's flood of sessions against a
  lowered descriptor limit neither empties P's allowlist (a node added meanwhile is admitted)
  nor fails D's transfer (before: the reload failed closed, "PEER ALLOWLIST EMPTY", D evicted);
* a reload that fails for a transient reason (out of descriptors) keeps the last good
  allowlist (before: it emptied it).
"""

from __future__ import annotations

import os
import resource
import shutil
import time
from pathlib import Path

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvpush import proto
from kvpush.daemon.trust.allowlist import Allowlist
from kvpush.daemon.trust.peerauth import PeerAuth, keygen
from kvpush_dev.fleet import fleet

pytestmark = pytest.mark.integration

EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED


def silent(endpoint: str, server: bytes, me: PeerAuth) -> tuple[zmq.Socket, zmq.Socket]:
    """A CURVE session as ``me`` that never says anything (no reconnect), and its monitor."""
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RECONNECT_IVL, 600_000)
    s.curve_publickey, s.curve_secretkey, s.curve_serverkey = me.me.public, me.secret, server
    mon = s.get_monitor_socket(EVENTS)
    s.connect(endpoint)
    return s, mon


def seen(mons: list[zmq.Socket], got: list[set[int]], secs: float) -> None:
    end = time.monotonic() + secs
    while time.monotonic() < end:
        for i, m in enumerate(mons):
            while m.poll(0):
                got[i].add(recv_monitor_message(m)["event"])
        time.sleep(0.05)


def close_all(socks: list[tuple[zmq.Socket, zmq.Socket]]) -> None:
    for s, m in socks:
        s.disable_monitor()
        m.close(0)
        s.close(0)


def test_silent_sessions_are_capped_before_the_hello_and_closed_after_the_deadline(tmp_path):
    with fleet(tmp_path, x_allowed_by="p", p_cfg={"max_sessions_per_peer": 4, "hello_deadline_s": 1.0}) as f:
        server = PeerAuth.load(f.kp.secret_file, f.kp.authorized_dir).me.public
        x = PeerAuth.load(f.kx.secret_file, f.kx.authorized_dir)
        socks = [silent(f.p.peer_endpoint, server, x) for _ in range(12)]
        try:
            got: list[set[int]] = [set() for _ in socks]
            seen([m for _, m in socks], got, 0.8)
            admitted = sum(zmq.EVENT_HANDSHAKE_SUCCEEDED in g for g in got)
            print(f"silent sessions admitted: {admitted} of {len(socks)} (max_sessions_per_peer 4)")
            assert 1 <= admitted <= 4
            seen([m for _, m in socks], got, 3.0)
            still = [i for i, g in enumerate(got) if zmq.EVENT_HANDSHAKE_SUCCEEDED in g
                     and zmq.EVENT_DISCONNECTED not in g]
            assert still == [], f"sessions {still} said no Hello and were never closed"
            assert isinstance(f.transfer(), proto.Received)
        finally:
            close_all(socks)


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_a_session_flood_leaves_the_daemon_its_descriptors(tmp_path):
    with fleet(tmp_path, x_allowed_by="p", p_cfg={"max_sessions_per_peer": 1000, "hello_deadline_s": 60.0,
                                                  "reserved_fds": 64}) as f:
        assert isinstance(f.transfer(), proto.Received)
        pid = f.p.proc.pid
        soft = open_fds(pid) + 120
        hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)[1]
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
        server = PeerAuth.load(f.kp.secret_file, f.kp.authorized_dir).me.public
        x = PeerAuth.load(f.kx.secret_file, f.kx.authorized_dir)
        socks = [silent(f.p.peer_endpoint, server, x) for _ in range(200)]
        try:
            time.sleep(2.5)  # the flood lands and two allowlist reloads run under it
            print(f"P holds {open_fds(pid)} descriptors under a soft limit of {soft} (64 reserved)")
            assert open_fds(pid) <= soft - 32
            # P's own files still open: its allowlist reloads are not emptied (D is not evicted)
            # and D's transfer lands; a node added meanwhile is admitted once the flood ends.
            assert isinstance(f.transfer((7, 8, 9)), proto.Received)
            pub, sec = keygen(tmp_path / "y", "ynode", ["127.0.0.9"])
            shutil.copy(pub, Path(f.kp.authorized_dir) / "ynode.key")
            close_all(socks)
            socks = []
            time.sleep(1.5)  # P sees the flood's connections end, and re-reads its allowlist
            y = PeerAuth.load(str(sec), f.kp.authorized_dir)
            ys, ym = silent(f.p.peer_endpoint, server, y)
            got: list[set[int]] = [set()]
            seen([ym], got, 2.5)
            close_all([(ys, ym)])
            assert zmq.EVENT_HANDSHAKE_SUCCEEDED in got[0], "a node added under the flood was not admitted"
            assert isinstance(f.transfer((10, 11, 12)), proto.Received)
        finally:
            close_all(socks)


def test_a_reload_out_of_descriptors_keeps_the_last_good_allowlist(tmp_path):
    from kvpush_dev.fleet import node_keys

    kp = node_keys(tmp_path, "p")
    allow = Allowlist(kp.authorized_dir)
    assert allow.names() == {"pnode"}
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    (Path(kp.authorized_dir) / "touch.key").write_text("changed")  # a reload must read again
    try:
        lowest_free = os.dup(0)
        os.close(lowest_free)
        resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))  # every number below is taken
        allow.reload()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert allow.names() == {"pnode"}
