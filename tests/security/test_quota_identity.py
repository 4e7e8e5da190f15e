"""Quotas count per certificate identity, across its sessions (issue 28, item 5): real
kvpushd, ZeroMQ CURVE and NIXL.

Finding: an insider opened 25 sessions and held 100,000 live transfers, and legit transfers
then failed "overloaded"; nothing capped one node's sessions. Here node D runs two decode
daemons under one certificate (two sessions with P, as two accelerators of one node do):
together they get one share of P (``max_transfers_per_peer``), node E's transfers are not
affected, and with ``max_sessions_per_peer = 1`` D's second daemon gets no session at all.
"""

from __future__ import annotations

import itertools
import os

import pytest

from kvpush import proto
from kvpush_dev.daemon_harness import Daemon, Engine, device_config, ops_request
from kvpush_dev.keys import allow, lab_keys
from kvpush_dev.kvref import small_layout as lay

pytestmark = pytest.mark.integration

_ids = itertools.count()


def tid() -> str:
    return f"q{os.getpid()}-{next(_ids)}"


@pytest.fixture
def fleet(tmp_path, request):
    kp = lab_keys(tmp_path / "P", "pnode", ("127.0.0.1",))
    kd = lab_keys(tmp_path / "D", "dnode", ("127.0.0.2",))
    ke = lab_keys(tmp_path / "E", "enode", ("127.0.0.3",))
    allow(kp, kd, ke)
    allow(kd, kp)
    allow(ke, kp)
    p = Daemon(device_config(tmp_path, 0, max_transfers_per_peer=2, register_timeout_s=60.0, **request.param, **kp.config()))
    ds = [Daemon(device_config(tmp_path, i, peer_host="127.0.0.2", advertise_host="127.0.0.2",
                        register_timeout_s=60.0, **kd.config()))
          for i in (1, 2)]
    e = Daemon(device_config(tmp_path, 3, peer_host="127.0.0.3", advertise_host="127.0.0.3",
                       register_timeout_s=60.0, **ke.config()))
    pe = Engine(p, lay(), "prefill", seed=3)
    engines = [Engine(x, lay(), "decode", fill="zeros") for x in (*ds, e)]
    yield p, engines
    for en in (pe, *engines):
        en.close()
    for x in (p, *ds, e):
        x.stop()


def register(de: Engine, p: Daemon, blocks: tuple[int, ...]) -> str:
    t = tid()
    de.send(proto.Register(t, 0, blocks, 20, (p.peer_endpoint,), 1, 30_000))
    return t


def refused(de: Engine, t: str, timeout: float = 4.0) -> str:
    """Why the registration failed at once, or "" if it is still waiting (held by P)."""
    try:
        m = de.result(t, timeout)
    except (TimeoutError, AssertionError):
        return ""
    return getattr(m, "reason", "") if isinstance(m, proto.ReceiveFailed) else ""


@pytest.mark.parametrize("fleet", [{}], indirect=True)
def test_one_identity_gets_one_share_across_its_sessions(fleet):
    p, (d1, d2, e) = fleet
    t1, t2 = register(d1, p, (1, 2)), register(d2, p, (3, 4))
    assert refused(d1, t1, 2) == "" and refused(d2, t2, 2) == ""  # held: 2 transfers of dnode
    nodes = [r["node"] for r in ops_request(p.cfg.ops_socket, "peers").data["peers"]]
    assert nodes.count("dnode") == 2  # two sessions of one identity
    t3 = register(d2, p, (5, 6))  # a third for dnode, on either session: over its share
    assert "quota" in refused(d2, t3)
    t4 = register(e, p, (7, 8))  # another node is not affected
    assert refused(e, t4, 2) == ""


@pytest.mark.parametrize("fleet", [{"max_sessions_per_peer": 1}], indirect=True)
def test_one_identity_may_hold_at_most_its_sessions(fleet):
    p, (d1, d2, e) = fleet
    t1 = register(d1, p, (1, 2))
    assert refused(d1, t1, 2) == ""
    t2 = register(d2, p, (3, 4))  # D's second daemon: its Hello is refused, so is this
    assert refused(d2, t2, 10) != ""
    nodes = [r["node"] for r in ops_request(p.cfg.ops_socket, "peers").data["peers"]]
    assert nodes.count("dnode") == 1
    t3 = register(e, p, (7, 8))
    assert refused(e, t3, 2) == ""
