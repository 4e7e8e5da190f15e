"""What registrations can make a decode daemon dial is bounded (issue 28, item 6): a real
kvpushd (CURVE on, its node allowlisted), its engine sending hostile Registers.

Finding: 200 Registers naming closed ports on an allowlisted host (what ``kv_transfer_params``
sent straight to a decode engine can ask) took the decode daemon from 42 to 642 file
descriptors for 10 s. Asserted: with ``max_handshaking_producers`` (default 16) the daemon's
file descriptors stay within a bound set by that cap, the registrations over it fail at once
with the reason, and a registration naming a live prefill daemon still works afterwards.
"""

from __future__ import annotations

import os
import socket
import time

import pytest

from kvpush import proto
from kvpush_dev.daemon_harness import Daemon, Engine, device_config
from kvpush_dev.kvref import small_layout as lay

pytestmark = pytest.mark.integration

HOSTILE = 200


def closed_ports(n: int) -> list[int]:
    """Ports on 127.0.0.1 nobody listens on (bound then closed: refused, not filtered)."""
    out = []
    for _ in range(n):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            out.append(s.getsockname()[1])
    return out


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_hostile_registrations_keep_file_descriptors_bounded(tmp_path):
    p = Daemon(device_config(tmp_path, 0))
    d = Daemon(device_config(tmp_path, 1))
    pe, de = Engine(p, lay(), "prefill", seed=3), Engine(d, lay(), "decode", fill="zeros")
    try:
        cap = d.cfg.max_handshaking_producers
        base = fds(d.proc.pid)
        tids = []
        for i, port in enumerate(closed_ports(HOSTILE)):
            t = f"h{os.getpid()}-{i}"
            de.send(proto.Register(t, 0, (1,), 10, (f"tcp://127.0.0.1:{port}",), 1, 8000))
            tids.append(t)
        peak, end = base, time.monotonic() + 4
        while time.monotonic() < end:
            peak = max(peak, fds(d.proc.pid))
            de.pump()
            time.sleep(0.02)
        print(f"decode daemon fds: {base} -> peak {peak} under {HOSTILE} hostile Registers (cap {cap})")
        # A producer link is one ZeroMQ socket (its mailbox and at most a connecting TCP
        # socket): a few descriptors each, for at most ``cap`` of them at once.
        assert peak - base <= 4 * cap + 16, f"fds {base} -> {peak} for {HOSTILE} hostile Registers"
        failed_fast = [m for m in de.inbox if isinstance(m, proto.ReceiveFailed)
                       and "max_handshaking_producers" in m.reason]
        assert len(failed_fast) >= HOSTILE - cap - 8
        # The daemon still serves a real prefill daemon once the hostile links are gone.
        time.sleep(d.cfg.peer_timeout_s)
        t = f"ok{os.getpid()}"
        de.send(proto.Register(t, 0, (4, 5, 6), 40, (p.peer_endpoint,), 1, 8000))
        pe.send(proto.PrefillDone(t, (1, 2, 3), 40, 8000))
        assert isinstance(de.result(t), proto.Received)
    finally:
        pe.close()
        de.close()
        p.stop()
        d.stop()
