"""kvpushd across lab hosts (network namespaces on one bridge): real daemons, UCX over TCP
across the veths, authenticated peers, and network faults.

Each fault case checks the three promises: no Received for a transfer whose bytes are not
exactly the reference copy (no answer from wrong KV), no result later than the configured
bounds (no request waits beyond its timeout), and transfers succeed again once the fault is
gone without restarting a daemon (recovery).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from kvpush import proto
from kvpush_dev import daemon_harness as harness
from kvpush_dev.daemon_harness import (
    Daemon,
    Engine,
    amx_layout,
    check_tp1_to_tp2,
    check_tp2_to_tp1,
    prefill_done,
)
from kvpush_dev.kvref import reference_copy
from kvpush_dev.labstack import UCX_NETWORK_ENV, host_keys, lab_device_config, ucx_transports
from kvpush_dev.netlab import Lab, sweep_stale

pytestmark = pytest.mark.lab

HOSTS = ("p0", "p1", "d0")
REGISTER_TIMEOUT_MS = 8_000
PEER_TIMEOUT_S = 3.0
WRITE_TIMEOUT_S = 5.0
# A result must come before the registration's deadline plus the tick and the notice hop.
BOUND_S = REGISTER_TIMEOUT_MS / 1000 + 2.0
_ids = itertools.count()


def tid() -> str:
    return f"lab{os.getpid()}-{next(_ids)}"


def cpu(heads: int = 2, head_start: int = 0, total_heads: int = 0, num_blocks: int = 64):
    return amx_layout(heads, head_start, total_heads, num_blocks=num_blocks)


class Net:
    """The module's lab: hosts p0, p1 (prefill), d0 (decode); daemons p0[0], p0[1] (a TP=2
    prefill host), p1, d0[0], d0[1] (a TP=2 decode host)."""

    def __init__(self, tmp: Path) -> None:
        sweep_stale()
        self.tmp = tmp
        self.lab = Lab(HOSTS, name=f"t{os.getpid()}").up()
        os.environ.setdefault("PYTHONFAULTHANDLER", "1")  # a daemon that crashes says where
        self.keys = host_keys(self.lab, tmp)
        self.daemons: dict[str, Daemon] = {}
        for name, host, index in (("p0", "p0", 0), ("p0b", "p0", 3), ("p1", "p1", 2),
                                  ("d0", "d0", 1), ("d0b", "d0", 4)):
            cfg = lab_device_config(self.lab, host, tmp, index, self.keys, register_timeout_s=30.0,
                                    peer_timeout_s=PEER_TIMEOUT_S, write_timeout_s=WRITE_TIMEOUT_S)
            self.daemons[name] = Daemon(cfg, netns=self.lab.ns(host), env=UCX_NETWORK_ENV)

    def __getitem__(self, name: str) -> Daemon:
        return self.daemons[name]

    def restart(self, name: str) -> Daemon:
        """What the supervisor does for a daemon that fenced itself: the same config again."""
        old = self.daemons[name]
        old.stop()
        self.daemons[name] = Daemon(old.cfg, netns=old.netns, env=UCX_NETWORK_ENV)
        return self.daemons[name]

    def close(self) -> None:
        for d in self.daemons.values():
            d.stop()
        self.lab.down()


@pytest.fixture(scope="module")
def net(lab_ok, tmp_path_factory):
    n = Net(tmp_path_factory.mktemp("lab"))
    yield n
    n.close()


@pytest.fixture
def pair(net):
    """A prefill engine on p0 and a decode engine on d0 (TP 1 each)."""
    lay, meta = cpu()
    pe = Engine(net["p0"], lay, "prefill", seed=11, engine_id="P")
    de = Engine(net["d0"], lay, "decode", fill="zeros", engine_id="D")
    yield pe, de, lay, meta
    pe.close()
    de.close()


FENCED = "fenced"


def outcome(de: Engine, daemon: Daemon, t: str, timeout: float) -> object:
    """The decode engine's result for ``t``, or FENCED: its daemon exited with the fence code
    (a producer's WRITE could still land, so it gives nothing back; the supervisor restarts it)."""
    from kvpush.daemon.context import FENCE_EXIT_CODE

    kinds = (proto.Received, proto.ReceiveFailed)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        de.pump()
        for i, m in enumerate(de.inbox):
            if isinstance(m, kinds) and m.transfer_id == t:
                return de.inbox.pop(i)
        if not daemon.proc.is_alive():
            daemon.proc.join(5)
            assert daemon.proc.exitcode == FENCE_EXIT_CODE, f"decode daemon died: exit {daemon.proc.exitcode}"
            return FENCED
        de.client.wait(0.01)
    raise AssertionError(f"{t}: no result and no fence within {timeout}s")


def reattached(de: Engine) -> None:
    de.wait_for(lambda m: isinstance(m, proto.AttachAck), 30)


def register(de: Engine, producers: list[str], t: str, blocks, n: int, timeout_ms: int = REGISTER_TIMEOUT_MS) -> None:
    """The harness's register, with this module's registration timeout by default."""
    harness.register(de, producers, t, blocks, n, timeout_ms=timeout_ms)


def transfer(net: Net, pe: Engine, de: Engine, meta: dict, *, src=(1, 2, 3), dst=(7, 8, 9), n: int = 40,
             endpoint: str | None = None, quarantine: tuple[int, ...] = ()) -> tuple[object, float]:
    """One transfer p0 -> d0; returns (result, seconds). A Received must carry the exact
    reference bytes; whatever the result, it must come within the bound. ``quarantine``:
    blocks of an earlier failed transfer, not compared (see test_no_late_write_after_heal)."""
    before = de.bytes.copy()
    t = tid()
    t0 = time.monotonic()
    register(de, [endpoint or net["p0"].peer_endpoint], t, dst, n)
    prefill_done(pe, t, src, n)
    res = outcome(de, net["d0"], t, BOUND_S + 5)
    took = time.monotonic() - t0
    prefill_result(pe, t)
    assert took <= BOUND_S, f"{t}: {res if res == FENCED else type(res).__name__} after {took:.1f}s (bound {BOUND_S}s)"
    if res == FENCED:  # the supervisor's part: restart it; the engine re-attaches by itself
        net.restart("d0")
        reattached(de)
    elif isinstance(res, proto.Received):
        want, dont_care = reference_copy(meta, pe.layout, pe.bytes, list(src), meta, de.layout, before,
                                         list(dst), n, 0)
        for b in quarantine:
            for layer in range(de.layout.num_layers):
                off = de.layout.layer_offsets[layer] + b * de.layout.block_stride
                dont_care[off:off + de.layout.block_stride] = True
        bad = np.flatnonzero((de.bytes != want) & ~dont_care)
        assert bad.size == 0, f"{t}: Received but {bad.size} bytes differ, in blocks {blocks_of(de.layout, bad)}"
    else:
        assert isinstance(res, proto.ReceiveFailed), res
    return res, took


def blocks_of(layout, offsets: np.ndarray) -> list[int]:
    """Which blocks (of any layer) the byte offsets fall in (the AMX layout is block-major per layer)."""
    return sorted({int(o // layout.block_stride) % layout.num_blocks for o in offsets})


def prefill_result(pe: Engine, t: str) -> object:
    """The prefill engine hears how its held blocks ended (Sent, SendFailed or Released)."""
    kinds = (proto.Sent, proto.SendFailed, proto.Released)
    return pe.wait_for(lambda m: isinstance(m, kinds) and m.transfer_id == t, BOUND_S + 15)


def recovers(net: Net, pe: Engine, de: Engine, meta: dict, within_s: float = 40.0,
             quarantine: tuple[int, ...] = ()) -> int:
    """Transfers succeed again without restarting anything; returns the tries it took."""
    end = time.monotonic() + within_s
    tries = 0
    while True:
        tries += 1
        res, _ = transfer(net, pe, de, meta, src=(4, 5), dst=(20 + tries % 8, 62), n=30, quarantine=quarantine)
        if isinstance(res, proto.Received):
            break
        assert time.monotonic() < end, f"no transfer succeeded {within_s}s after the fault ended: {res}"
        time.sleep(0.5)
    assert all(d.proc.is_alive() for d in net.daemons.values()), "a daemon died"
    return tries


# ------------------------------------------------------------------------ the lab itself

def _ns_list() -> set[str]:
    return set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())


def test_lab_up_down_idempotent_and_leaves_nothing(lab_ok, tmp_path):
    lab = Lab(("a", "b"), name=f"t{os.getpid()}x")
    lab.up()
    lab.up()  # again: removes and recreates, no error
    assert set(lab.namespaces()) <= _ns_list()
    root_addrs = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
    assert "198.18." not in root_addrs, "the lab put an address into the machine's own namespace"
    assert "198.18." in lab.exec("a", "ip", "-4", "-o", "addr").stdout

    # TCP from a to b across the bridge (and nothing from the machine's own namespace)
    def serve() -> socket.socket:
        s = socket.socket()
        s.bind((lab.addr("b"), 0))
        s.listen()
        return s

    srv = lab.call("b", serve)
    port = srv.getsockname()[1]

    def hello() -> bytes:
        with socket.create_connection((lab.addr("b"), port), timeout=5) as c:
            c.sendall(b"hi")
        conn, _ = srv.accept()
        with conn:
            return conn.recv(2)

    assert lab.call("a", hello, timeout=10) == b"hi"
    srv.close()
    with pytest.raises(OSError):
        socket.create_connection((lab.addr("b"), port), timeout=1)
    sleeper = lab.popen("a", ["sleep", "600"], tmp_path / "sleep.log")
    lab.down()
    lab.down()
    assert sleeper.poll() is not None, "a process of the lab survived down()"
    assert not set(lab.namespaces()) & _ns_list()


def test_fault_rules_count_what_they_drop(lab_ok):
    """``Lab.dropped``, the fault tests' proof that a fault hit: 0 without rules and for a
    0 % loss, every blocked connection attempt under a partition or a 100 % loss."""
    lab = Lab(("a", "b"), name=f"t{os.getpid()}n").up()

    def attempts(n: int) -> None:
        for _ in range(n):
            with socket.socket() as s, contextlib.suppress(OSError):
                s.settimeout(0.3)
                s.connect((lab.addr("b"), 9))

    try:
        lab.call("a", attempts, 2, timeout=10)
        assert lab.dropped("a") == 0
        lab.partition("a", "b")
        assert lab.dropped("a") == 0
        lab.call("a", attempts, 3, timeout=10)
        assert lab.dropped("a") >= 3
        lab.loss("a", 0)
        lab.call("a", attempts, 3, timeout=10)
        assert lab.dropped("a") == 0
        lab.loss("a", 100, "b")
        lab.call("a", attempts, 2, timeout=10)
        assert lab.dropped("a") >= 2
        lab.clear_faults("a")
        assert lab.dropped("a") == 0
    finally:
        lab.down()


# ------------------------------------------------------------------------ transfers across hosts

def test_transfer_across_hosts_over_tcp_authenticated(net, pair):
    pe, de, lay, meta = pair
    res, took = transfer(net, pe, de, meta)
    assert isinstance(res, proto.Received)
    assert net["p0"].peer_endpoint.startswith("tcp://198.18.")
    consumers = net["p0"].ops("peers")["peers"]
    d0 = next(p for p in consumers if p["endpoint"] == net["d0"].peer_endpoint)
    assert d0["node"] == "d0" and d0["state"] == "ready"  # authenticated as the d0 host's key


def test_ucx_says_tcp_between_hosts(net, tmp_path):
    """What UCX itself logged for the endpoint between two lab hosts (UCX_LOG_LEVEL=info,
    flushed when the daemon exits): inter-node, TCP on the veth, no shared-memory lane."""
    env = {**UCX_NETWORK_ENV, "UCX_LOG_LEVEL": "info", "UCX_LOG_FILE": str(tmp_path / "ucx.%p.log")}
    p = Daemon(lab_device_config(net.lab, "p1", tmp_path, 6, net.keys), netns=net.lab.ns("p1"), env=env)
    d = Daemon(lab_device_config(net.lab, "d0", tmp_path, 7, net.keys), netns=net.lab.ns("d0"), env=env)
    lay, meta = cpu()
    pe, de = Engine(p, lay, "prefill", seed=3, engine_id="PU"), Engine(d, lay, "decode", fill="zeros", engine_id="DU")
    try:
        t = tid()
        register(de, [p.peer_endpoint], t, (1, 2), 20)
        prefill_done(pe, t, (3, 4), 20)
        assert isinstance(de.result(t), proto.Received)
    finally:
        pe.close()
        de.close()
        p.stop()
        d.stop()
    picked = [line for log in tmp_path.glob("ucx.*.log") for line in ucx_transports(log)]
    assert len(picked) >= 2 and all("inter-node" in line for line in picked), picked
    for line in picked:
        lanes = line.split("cfg#", 1)[1]
        assert "tcp/eth0" in lanes and not any(t in lanes for t in ("cma", "posix", "sysv", "xpmem", "knem")), line


def test_tp2_prefill_host_to_tp1_decode_host(net):
    check_tp2_to_tp1(net["p0"], net["p0b"], net["d0"], tid())


def test_tp1_prefill_host_to_tp2_decode_host(net):
    check_tp1_to_tp2(net["p1"], net["d0"], net["d0b"], tid())


# ------------------------------------------------------------------------ faults

def test_link_down_mid_transfer_then_up(net, pair):
    """The fast fault case every CI run keeps: P's cable out between Register and PrefillDone."""
    pe, de, lay, meta = pair
    assert isinstance(transfer(net, pe, de, meta)[0], proto.Received)  # handshaken, warm
    before = de.bytes.copy()
    t, n, dst = tid(), 40, (30, 31, 32)
    t0 = time.monotonic()
    register(de, [net["p0"].peer_endpoint], t, dst, n)
    time.sleep(0.3)  # the registration reached p0
    net.lab.link("p0", up=False)
    try:
        prefill_done(pe, t, (1, 2, 3), n)  # p0 posts a WRITE that cannot cross
        res = outcome(de, net["d0"], t, BOUND_S + 5)
        took = time.monotonic() - t0
        # Either a plain failure, or (a WRITE may still be on its way) the decode daemon fences.
        assert res == FENCED or isinstance(res, proto.ReceiveFailed), res
        assert took <= BOUND_S, f"{res} after {took:.1f}s"
        assert isinstance(prefill_result(pe, t), proto.SendFailed | proto.Released)
        assert np.array_equal(de.bytes, before), "bytes landed over a link that was down"
    finally:
        net.lab.link("p0", up=True)
    if res == FENCED:
        net.restart("d0")
        reattached(de)
    recovers(net, pe, de, meta, quarantine=dst)


def test_no_late_write_after_heal(net, tmp_path):
    """A WRITE posted while the link was down must never land after the heal in blocks the
    decode side gave back. Found by this lab (the WRITE was delivered once the producer's loop
    drove UCX again); main now fences: the decode daemon exits (code 75) instead of handing the
    blocks back, and is restarted. Own daemons (p1 -> d0), so the module's are not disturbed."""
    p = Daemon(lab_device_config(net.lab, "p1", tmp_path, 8, net.keys, peer_timeout_s=PEER_TIMEOUT_S,
                                 write_timeout_s=WRITE_TIMEOUT_S), netns=net.lab.ns("p1"), env=UCX_NETWORK_ENV)
    d = Daemon(lab_device_config(net.lab, "d0", tmp_path, 9, net.keys, peer_timeout_s=PEER_TIMEOUT_S,
                                 write_timeout_s=WRITE_TIMEOUT_S), netns=net.lab.ns("d0"), env=UCX_NETWORK_ENV)
    lay, meta = cpu()
    pe, de = Engine(p, lay, "prefill", seed=31, engine_id="PL"), Engine(d, lay, "decode", fill="zeros", engine_id="DL")
    try:
        for round_ in range(2):  # two partitions and heals
            t = tid()
            register(de, [p.peer_endpoint], t, (1, 2), 20)
            prefill_done(pe, t, (3, 4), 20)
            assert isinstance(de.result(t), proto.Received)
            before = de.bytes.copy()
            t, n, dst = tid(), 40, (33 + 3 * round_, 34 + 3 * round_, 35 + 3 * round_)
            register(de, [p.peer_endpoint], t, dst, n)
            time.sleep(0.3)
            net.lab.link("p1", up=False)
            try:
                prefill_done(pe, t, (1, 2, 3), n)
                res = outcome(de, d, t, BOUND_S + 5)
                assert res == FENCED or isinstance(res, proto.ReceiveFailed), res
            finally:
                net.lab.link("p1", up=True)
            if res == FENCED:  # the supervisor's part
                d.stop()
                d = Daemon(d.cfg, netns=d.netns, env=UCX_NETWORK_ENV)
                reattached(de)
            # Work after the heal: the producer's loop drives UCX progress again (an idle
            # daemon does not), as the next request would in service.
            end = time.monotonic() + 15.0
            while time.monotonic() < end and d.proc.is_alive():
                t2 = tid()
                register(de, [p.peer_endpoint], t2, (60, 61), 20)
                prefill_done(pe, t2, (5, 6), 20)
                res = de.result(t2, timeout=BOUND_S + 5)
                if isinstance(res, proto.Received):
                    break
            time.sleep(1.0)
            care = np.ones(before.size, dtype=bool)
            for b in (60, 61):  # the recovery transfer's own blocks
                for off in de.layout.layer_offsets:
                    care[off + b * de.layout.block_stride: off + (b + 1) * de.layout.block_stride] = False
            bad = np.flatnonzero((de.bytes != before) & care)
            assert bad.size == 0, f"{bad.size} bytes landed in blocks {blocks_of(de.layout, bad)} after ReceiveFailed"
            assert d.proc.is_alive() and p.proc.is_alive(), f"daemon died: d {d.proc.exitcode}, p {p.proc.exitcode}"
            assert isinstance(res, proto.Received), f"no transfer after the heal: {res}"
    finally:
        pe.close()
        de.close()
        p.stop()
        d.stop()


@pytest.mark.parametrize("percent", [1, 10])
def test_random_loss(net, pair, percent):
    """nftables drops ``percent`` % of d0's packets both ways: TCP retransmits; every
    transfer is either exact or failed in time, most succeed, and all do once it is gone."""
    pe, de, lay, meta = pair
    net.lab.loss("d0", percent)
    try:
        results = [transfer(net, pe, de, meta, src=(i % 60, i % 60 + 1), dst=(10 + i % 40, 55), n=20)[0]
                   for i in range(12)]
    finally:
        net.lab.clear_faults("d0")
    ok = sum(isinstance(r, proto.Received) for r in results)
    assert ok >= len(results) // 2, f"{ok} of {len(results)} transfers at {percent} % loss"
    recovers(net, pe, de, meta)


def test_bandwidth_cap(net, pair):
    """tbf at 1 Gbit/s on both ends: a 1 MiB-class transfer is exact and in time."""
    pe, de, lay, meta = pair
    for h in ("p0", "d0"):
        net.lab.cap(h, "1gbit")
    try:
        for _ in range(3):
            res, took = transfer(net, pe, de, meta, src=tuple(range(0, 32)), dst=tuple(range(32, 64)), n=32 * 16)
            assert isinstance(res, proto.Received)
    finally:
        for h in ("p0", "d0"):
            net.lab.clear_faults(h)


def test_partition_between_p_and_d_then_heal(net, pair):
    """nftables drops everything between p0 and d0 (each still reaches p1): the decode side
    gives up within its bounds, nothing is Received from half-written blocks, and the pair
    transfers again after the partition heals."""
    pe, de, lay, meta = pair
    assert isinstance(transfer(net, pe, de, meta)[0], proto.Received)
    net.lab.partition("p0", "d0")
    try:
        res, took = transfer(net, pe, de, meta, src=tuple(range(0, 20)), dst=tuple(range(40, 60)), n=20 * 16)
        assert res == FENCED or isinstance(res, proto.ReceiveFailed), res
    finally:
        net.lab.clear_faults("p0")
    recovers(net, pe, de, meta, quarantine=tuple(range(40, 60)))  # see test_no_late_write_after_heal


def test_delay_on_the_control_path(net, pair, tmp_path):
    """A user-space relay adds 150 ms each way between d0 and p0's peer port (ZeroMQ:
    Hello, PeerRegister, notices); the NIXL WRITE still goes straight across."""
    pe, de, lay, meta = pair
    p0 = net["p0"]
    port = int(p0.peer_endpoint.rsplit(":", 1)[1])
    relay_port = port + 1 if port < 65000 else port - 1
    net.lab.relay("p0", relay_port, f"{net.lab.addr('p0')}:{port}", 150, tmp_path / "relay.log")
    slow = f"tcp://{net.lab.addr('p0')}:{relay_port}"
    res, took = transfer(net, pe, de, meta, endpoint=slow)  # first: handshake through the relay
    assert isinstance(res, proto.Received)
    assert took >= 0.6, f"a Hello and a PeerRegister round trip through a 150 ms relay took {took:.3f}s"
    res, took = transfer(net, pe, de, meta, endpoint=slow)
    assert isinstance(res, proto.Received) and took >= 0.15
    fast = min(transfer(net, pe, de, meta)[1] for _ in range(3))
    assert fast < took


def test_prefill_host_killed_while_the_others_serve(net):
    """Every process of host p1 SIGKILLed (a machine gone): the decode daemon fails what was
    registered there within its peer timeout; p0 keeps serving d0."""
    lay, meta = cpu()
    pe0 = Engine(net["p0"], lay, "prefill", seed=21, engine_id="PA")
    pe1 = Engine(net["p1"], lay, "prefill", seed=22, engine_id="PB")
    de = Engine(net["d0"], lay, "decode", fill="zeros", engine_id="DK")
    try:
        t1 = tid()
        register(de, [net["p1"].peer_endpoint], t1, (5, 6), 30, timeout_ms=30_000)
        time.sleep(0.5)
        killed = net.lab.kill_host("p1")
        assert net["p1"].proc.pid in killed
        t0 = time.monotonic()
        res = de.result(t1, timeout=PEER_TIMEOUT_S + 10)
        assert isinstance(res, proto.ReceiveFailed), res
        assert time.monotonic() - t0 <= PEER_TIMEOUT_S + 3
        for _ in range(3):
            assert isinstance(transfer(net, pe0, de, meta)[0], proto.Received)
    finally:
        for e in (pe0, pe1, de):
            e.close()
