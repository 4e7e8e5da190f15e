"""Revocation covers every node that ever got the decode daemon's metadata (issue 44, item 2).

D sends its NIXL metadata in the Hello it dials with. Before, D rotated its agent only for
nodes it still had a link to: prefill-only node W refused D's Hello, D dropped the link and
forgot it had exposed anything; W was then revoked, D did not rotate, and W wrote into a D
block and read D's region. Now D keeps the nodes its current agent's metadata went to
(``kvpush.daemon.core.peers.Exposure``) for as long as that agent lives, and revoking any of
them replaces the agent within 1 s, link or no link.

Real daemons, CURVE and NIXL over TCP (over shared memory a same-host process keeps READs:
``test_revocation.py``); W is played by this test: a CURVE server that keeps D's Hello and
answers it with a refusal, and a real NIXL agent that loads what it kept.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import numpy as np
import pytest

from kvpush import proto
from kvpush_dev.fleet import NODES, fleet
from kvpush_dev.kvref import small_engine as lay
from kvpush_dev.nixl_probe import MEDIA, FakeProducer, agent, register, xfer

pytestmark = pytest.mark.integration


def test_a_node_that_refused_our_hello_is_rotated_away_when_revoked(tmp_path, monkeypatch):
    tls = MEDIA["tcp"]
    monkeypatch.setenv("UCX_TLS", tls)
    with fleet(tmp_path, x_allowed_by="d", env={"UCX_TLS": tls}) as f, contextlib.ExitStack() as stack:
        w = stack.enter_context(contextlib.closing(
            FakeProducer(f.kx, NODES["x"][1], lay()[0], refuse_hello=True)))
        w.start()
        assert isinstance(f.transfer((4, 5, 6)), proto.Received)
        base = f.d.ops("status")["agent"]
        t = f"re{os.getpid()}"
        f.de.send(proto.Register(t, 0, (10, 11), 20, (w.endpoint,), 1, 8000))
        assert isinstance(f.de.result(t), proto.ReceiveFailed)  # W refused the Hello: no link
        assert w.hellos and w.hellos[0].agent_metadata, "D sent W no metadata: nothing to revoke"
        assert [r["node"] for r in f.d.ops("peers")["peers"]] == ["pnode"], "D still links to W"
        held = w.hellos[0]
        a = agent("wagent")
        junk = np.full(4096, 0xAB, dtype=np.uint8)
        register(a, junk)
        peer = a.add_remote_agent(held.agent_metadata)
        addr = held.region_bases[0]  # block 0: never a destination here

        def pending(dst: tuple[int, ...]) -> str:  # D drives NIXL progress while it waits on one
            tid = f"rp{os.getpid()}-{dst[0]}"
            f.de.send(proto.Register(tid, 0, dst, 40, (f.p.peer_endpoint,), 1, 8000))
            time.sleep(0.3)
            return tid

        tid = pending((7, 8, 9))
        assert xfer(a, "WRITE", junk, addr, peer) == "DONE"  # the control: W reaches D's region
        assert (f.de.bytes.view(np.uint8).reshape(-1)[:4096] == 0xAB).all()
        f.pe.send(proto.PrefillDone(tid, (1, 2, 3), 40, 8000))
        assert isinstance(f.de.result(tid), proto.Received)

        (Path(f.kd.authorized_dir) / "xnode.key").unlink()
        removed = time.monotonic()
        tid = pending((12, 13, 14))
        time.sleep(max(0.0, removed + 1.0 - time.monotonic()))
        agent_now = f.d.ops("status")["agent"]
        assert agent_now != base, "D did not replace its agent within 1 s of W's revocation"
        before = f.de.bytes.copy()
        junk[:] = 0xCD
        written = xfer(a, "WRITE", junk, addr, peer, wait_s=2.0)
        assert np.array_equal(f.de.bytes, before), f"revoked W wrote (WRITE {written})"
        f.pe.send(proto.PrefillDone(tid, (1, 2, 3), 40, 8000))
        f.de.result(tid)  # failed by the rotation (re-handshake), or landed: either is clean
        assert isinstance(f.transfer((15, 16, 17)), proto.Received)  # P re-handshook with the new agent
