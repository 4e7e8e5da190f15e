"""Rotated agent names nobody can guess (issue 44, item 3).

NIXL refuses a second agent under a name already loaded. When a decode daemon's agent was
named ``{base}-r{n}`` after a rotation, an insider X that knew D's agent name (D's Hello to
X carries it) said a Hello to P with an agent of the next name, ``{base}-r1``: after D rotated,
P could not load D's new agent and every P->D transfer failed for as long as X kept that
session. The new name ends in 64 random bits: X has nothing to pre-claim.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import numpy as np
import pytest

from kvpush import proto
from kvpush.daemon.trust.peerauth import PeerAuth
from kvpush_dev.fleet import NODES, ask, curve_client, fleet
from kvpush_dev.kvref import small_engine as lay
from kvpush_dev.nixl_probe import FakeProducer, agent, register

pytestmark = pytest.mark.integration


def test_an_insider_that_preclaims_the_next_agent_name_blocks_nobody(tmp_path):
    with fleet(tmp_path, x_allowed_by="pd") as f, contextlib.ExitStack() as closing:
        x = closing.enter_context(contextlib.closing(FakeProducer(f.kx, NODES["x"][1], lay()[0])))
        x.start()
        assert isinstance(f.transfer((4, 5, 6)), proto.Received)
        base = f.d.ops("status")["agent"]
        # D dials X (its engine named it): X learns D's agent name, as any producer does.
        t = f"rn{os.getpid()}"
        f.de.send(proto.Register(t, 0, (10, 11), 20, (x.endpoint,), 1, 8000))
        assert isinstance(f.de.result(t), proto.ReceiveFailed)
        assert x.hellos and x.hellos[0].agent_name == base
        # X says Hello to P with agents of the names D's next agent could have: loaded at P.
        xk = PeerAuth.load(f.kx.secret_file, f.kx.authorized_dir)
        server = PeerAuth.load(f.kp.secret_file, f.kp.authorized_dir).me.public
        for i, guess in enumerate((f"{base}-r1", f"{base}-r0")):
            a = agent(guess)
            mine = np.zeros(4096, dtype=np.uint8)
            register(a, mine)
            closing.callback(lambda a=a, m=mine: (a, m))  # keep them alive
            hello = proto.Hello(guess, a.get_agent_metadata(), lay()[0], (mine.ctypes.data,),
                                proto.PROTOCOL_VERSION, lay()[0].compat_key(), "X", 0, 1,
                                f"tcp://{NODES['x'][1]}:{40000 + i}", False)
            s = curve_client(f.p.peer_endpoint, server, (xk.me.public, xk.secret))
            closing.callback(s.close, 0)
            assert isinstance(ask(s, hello), proto.Hello)  # admitted: X is allowlisted by P
        # D revokes X: it rotates its agent, and P must load the new one.
        (Path(f.kd.authorized_dir) / "xnode.key").unlink()
        end = time.monotonic() + 5
        while f.d.ops("status")["agent"] == base and time.monotonic() < end:
            time.sleep(0.1)
        assert f.d.ops("status")["agent"] != base, "D did not rotate"
        time.sleep(0.5)
        for dst in ((7, 8, 9), (12, 13, 14)):
            assert isinstance(f.transfer(dst), proto.Received)
