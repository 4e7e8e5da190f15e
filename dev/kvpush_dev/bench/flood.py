"""Floods against a real prefill daemon's peer port, with its RSS before and after each.

What a stranger who reaches the port can do, one flood each (the daemon must stay bounded):

* ``quota``: a handshaken peer sends many PeerRegisters, far over its quota
  (``max_transfers_per_peer``): refused with "quota: ...", nothing stored;
* ``partial``: many connections each announce a frame of ``max_message_bytes`` and send all
  but its last byte (ZeroMQ buffers each), plus one announcing a frame over the limit (closed);
* ``half_open``: many TCP connections that never say anything (closed after
  ``peer_handshake_s``);
* ``junk_hello``: Hellos with junk (incompatible layouts, garbage NIXL metadata), each told
  only "handshake refused".

The partial-frame and Hello floods speak ZMTP 3.0 with the NULL mechanism, i.e. they need a
daemon with ``insecure_peers = true`` (the worst case: with CURVE a stranger cannot finish
the handshake at all, and HANDSHAKE_IVL closes it).

    python scripts/bench_flood.py [--floods quota,partial,half_open,junk_hello] [--conns 16]
        [--out docs/results/peer-flood-rss.md]

It prints each flood's RSS before and after, and the whole run's (the daemon's RSS at start
and after the last flood: what a peer-port fuzz run leaves behind, issue 44 item 5), and
writes them to ``--out`` ("" writes nothing).
"""

from __future__ import annotations

import argparse
import socket
import struct
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import zmq

from kvpush import proto
from kvpush.daemon.io.heap import TrimPolicy
from kvpush.proto.layout import KVLayout
from kvpush_dev.daemon_harness import Daemon, Engine, device_config
from kvpush_dev.kvref import make

MiB = 1 << 20


def layout(num_blocks: int = 256) -> KVLayout:
    lay, _ = make("amx", num_layers=2, num_blocks=num_blocks, block_size=16, num_heads=2, head_size=64,
                  dtype="bfloat16")
    return lay


def rss(d: Daemon) -> int:
    """The daemon process's resident set, read from outside (its loop may be busy)."""
    return int(psutil.Process(d.proc.pid).memory_info().rss)


def _host_port(endpoint: str) -> tuple[str, int]:
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    return host, int(port)


# ------------------------------------------------------------------ ZMTP 3.0, by hand


def zmtp_greet(endpoint: str, timeout_s: float = 5.0) -> socket.socket:
    """A raw TCP connection that completed ZMTP 3.0 NULL as a DEALER (no libzmq on our side,
    so we can send a frame's header and stop in the middle of its body)."""
    s = socket.create_connection(_host_port(endpoint), timeout=timeout_s)
    greeting = b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" + b"\0" * 31
    s.sendall(greeting)
    got = b""
    while len(got) < 64:
        chunk = s.recv(64 - len(got))
        if not chunk:
            raise ConnectionError("peer closed during the greeting")
        got += chunk
    name, value = b"Socket-Type", b"DEALER"
    body = b"\x05READY" + bytes([len(name)]) + name + struct.pack(">I", len(value)) + value
    s.sendall(b"\x04" + bytes([len(body)]) + body)  # short command frame
    return s


def frame_header(size: int) -> bytes:
    """The header of one final (no MORE) message frame of ``size`` bytes."""
    return b"\x02" + struct.pack(">Q", size) if size > 255 else b"\x00" + bytes([size])


def closed_within(s: socket.socket, timeout_s: float) -> float | None:
    """Seconds until the daemon closed ``s`` (reading and dropping what it sends), or None."""
    t0 = time.monotonic()
    s.settimeout(0.2)
    while time.monotonic() - t0 < timeout_s:
        try:
            if not s.recv(65536):
                return time.monotonic() - t0
        except TimeoutError:
            continue
        except OSError:
            return time.monotonic() - t0
    return None


# ------------------------------------------------------------------ the floods


@dataclass
class Result:
    flood: str
    rss_before: int
    rss_after: int
    detail: dict[str, Any]

    @property
    def grew(self) -> int:
        return self.rss_after - self.rss_before

    def line(self) -> str:
        extra = " ".join(f"{k}={v}" for k, v in self.detail.items())
        return (f"{self.flood:<11} rss {self.rss_before / MiB:8.1f} -> {self.rss_after / MiB:8.1f} MiB "
                f"({self.grew / MiB:+.1f})  {extra}")


def _peer_hello(lay: KVLayout, transport: Any, base: int, endpoint: str) -> proto.Hello:
    return proto.Hello(transport.name, transport.metadata(), lay, (base,), proto.PROTOCOL_VERSION,
                       lay.compat_key(), "flood", 0, 1, endpoint, False)


def _recv_all(s: zmq.Socket, timeout_s: float, want: int) -> list[Any]:
    out: list[Any] = []
    end = time.monotonic() + timeout_s
    while len(out) < want and time.monotonic() < end:
        if s.poll(100):
            out.append(proto.decode(s.recv()))
    return out


def flood_quota(p: Daemon, lay: KVLayout, n: int = 5000) -> Result:
    """A peer that handshakes properly (real NIXL metadata) then registers ``n`` transfers."""
    import torch

    from kvpush.daemon.io.kv_mapping import open_region
    from kvpush.daemon.io.transport import NixlTransport
    from kvpush.engine_plugin.worker.export import export_cpu_tensor, unlink_export

    kv = torch.zeros(lay.region_size, dtype=torch.uint8)
    handle = export_cpu_tensor(kv)
    region = open_region(handle)
    tr = NixlTransport(f"flood-{time.monotonic_ns()}", "UCX")
    tr.register(region)
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(p.peer_endpoint)
    try:
        before = rss(p)
        s.send(proto.encode(_peer_hello(lay, tr, region.base, "tcp://127.0.0.1:1")))
        hello = _recv_all(s, 10, 1)
        assert hello and isinstance(hello[0], proto.Hello), hello
        for i in range(n):
            s.send(proto.encode(proto.PeerRegister(f"flood-{i}", 0, (i % lay.num_blocks,), 16, 0, 1, 1,
                                                   60_000, key=bytes(32))))
        replies = _recv_all(s, 30, n - p.cfg.max_transfers_per_peer)
        quota = sum(isinstance(m, proto.WriteFailedNotice) and m.reason.startswith("quota: ") for m in replies)
        time.sleep(0.5)
        return Result("quota", before, rss(p), {"sent": n, "refused_quota": quota,
                                                "held": n - quota})
    finally:
        s.close(0)
        tr.close()
        region.close()
        unlink_export(handle)


def flood_partial(p: Daemon, conns: int = 16, oversize: bool = True) -> Result:
    """``conns`` connections, each stopping one byte short of a max-size frame."""
    limit = p.cfg.max_message_bytes
    before = rss(p)
    socks = []
    try:
        for _ in range(conns):
            s = zmtp_greet(p.peer_endpoint)
            s.sendall(frame_header(limit) + b"\0" * (limit - 1))
            socks.append(s)
        time.sleep(1.0)
        after = rss(p)
        detail: dict[str, Any] = {"conns": conns, "frame_bytes": limit}
        if oversize:
            big = zmtp_greet(p.peer_endpoint)
            big.sendall(frame_header(limit + 1))
            t = closed_within(big, 5.0)
            detail["oversize_closed_s"] = None if t is None else round(t, 3)
            big.close()
    finally:
        for s in socks:
            s.close()
    time.sleep(1.0)
    detail["rss_after_close_mib"] = round(rss(p) / MiB, 1)  # the buffers go back with the connections
    return Result("partial", before, after, detail)


def flood_half_open(p: Daemon, conns: int = 64) -> Result:
    """``conns`` TCP connections that never send a byte; how long until each is closed."""
    before = rss(p)
    socks = [socket.create_connection(_host_port(p.peer_endpoint), timeout=5) for _ in range(conns)]
    try:
        times = [closed_within(s, p.cfg.peer_handshake_s + 5) for s in socks[:1]]
        time.sleep(0.5)
        left = sum(closed_within(s, 0.3) is None for s in socks[1:])
        return Result("half_open", before, rss(p), {
            "conns": conns, "closed_after_s": None if times[0] is None else round(times[0], 2),
            "still_open": left})
    finally:
        for s in socks:
            s.close()


def junk_hellos(lay: KVLayout, n: int) -> list[proto.Hello]:
    """Hellos a stranger might try: other layouts, other versions, garbage metadata."""
    out = []
    for i in range(n):
        other = make("amx", num_layers=1 + i % 5, num_blocks=64, block_size=16, num_heads=2,
                     head_size=64 * (1 + i % 2), dtype=("bfloat16", "float16")[i % 2])[0]
        cand = lay if i % 3 == 0 else other
        out.append(proto.Hello(f"junk-{i}", bytes([i % 256]) * (64 + i % 1000), cand, (0,),
                               proto.PROTOCOL_VERSION if i % 4 else 99, cand.compat_key(), "junk", 0, 1,
                               f"tcp://10.9.{i % 250}.1:1", False))
    return out


def flood_junk_hello(p: Daemon, lay: KVLayout, n: int = 2000) -> Result:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(p.peer_endpoint)
    try:
        before = rss(p)
        for h in junk_hellos(lay, n):
            s.send(proto.encode(h))
        replies = _recv_all(s, 30, n)
        texts = sorted({m.message for m in replies if isinstance(m, proto.Error)})
        return Result("junk_hello", before, rss(p), {"sent": n, "replies": len(replies), "texts": texts})
    finally:
        s.close(0)


FLOODS: dict[str, Callable[[Daemon, KVLayout, argparse.Namespace], Result]] = {
    "quota": lambda p, lay, a: flood_quota(p, lay, a.registers),
    "partial": lambda p, lay, a: flood_partial(p, a.conns),
    "half_open": lambda p, lay, a: flood_half_open(p, a.conns * 4),
    "junk_hello": lambda p, lay, a: flood_junk_hello(p, lay, a.hellos),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--floods", default=",".join(FLOODS))
    ap.add_argument("--conns", type=int, default=16)
    ap.add_argument("--registers", type=int, default=5000)
    ap.add_argument("--hellos", type=int, default=2000)
    ap.add_argument("--out", default="docs/results/peer-flood-rss.md")
    ap.add_argument("--max-message", type=int, default=0,
                    help="the daemon's max_message_bytes (default: its default; 67108864 = before)")
    a = ap.parse_args(argv)
    lay = layout()
    with tempfile.TemporaryDirectory(prefix="kvflood") as tmp:
        extra = {"max_message_bytes": a.max_message} if a.max_message else {}
        p = Daemon(device_config(Path(tmp), 0, insecure_peers=True, max_transfers_per_peer=64,
                                 register_timeout_s=60.0, **extra))
        eng = Engine(p, lay, "prefill")
        try:
            head = (f"max_message_bytes={p.cfg.max_message_bytes} peer_handshake_s={p.cfg.peer_handshake_s} "
                    f"max_transfers_per_peer={p.cfg.max_transfers_per_peer}")
            print(head)
            start, lines = rss(p), []
            for name in a.floods.split(","):
                lines.append(FLOODS[name](p, lay, a).line())
                print(lines[-1], flush=True)
            end = rss(p)
            total = f"whole run  rss {start / MiB:8.1f} -> {end / MiB:8.1f} MiB ({(end - start) / MiB:+.1f})"
            print(total, flush=True)
            settle = TrimPolicy().every_s + 2  # the daemon's heap trim reads its memory this often
            time.sleep(settle)
            late = rss(p)
            total += (f"\nsettled    rss {start / MiB:8.1f} -> {late / MiB:8.1f} MiB ({(late - start) / MiB:+.1f})"
                      f"  {settle:.0f} s after the last flood (daemon/io/heap.py gives freed buffers back)")
            print(total.splitlines()[-1], flush=True)
            if a.out:
                Path(a.out).write_text(
                    "# Peer-port floods: the prefill daemon's RSS before and after\n\n"
                    "Written by `scripts/bench_flood.py` (`kvpush_dev.bench.flood`): one daemon "
                    "(`insecure_peers`, the worst case), each flood in turn, RSS from `psutil`. "
                    "What grows is bounded by configuration: partial frames by sessions x "
                    "`max_message_bytes` (ZeroMQ's buffers), registrations by "
                    "`max_transfers_per_peer`. The allocator keeps freed buffers until the daemon's "
                    "heap trim gives them back (the `settled` line).\n\n"
                    f"```\n{head}\n" + "\n".join(lines) + f"\n{total}\n```\n")
        finally:
            eng.close()
            p.stop()
    return 0
