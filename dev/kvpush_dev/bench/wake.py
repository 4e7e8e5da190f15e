"""What one local hop costs between two idle processes, three ways in the same run: a ZeroMQ
ipc round trip (the engine link's transport until 2026-12-02), the engine link itself (the
plugin's DaemonClient against the daemon's EngineListener, a unix stream socket), and a bare
Unix datagram round trip (the floor). Each carries an Abort out and its Released back
through the codec, so they differ only in transport and shell. A fourth, ``daemon``, is the
whole product path: the plugin's client against a real kvpushd (its loop, the engine
session answering an Abort of nothing with Released).

Why: at low load every transfer crosses the engine link twice on its critical path
(PrefillDone in, Received out), each after the processes slept. libzmq moves a frame through
an I/O thread on each side, so a hop wakes three threads instead of one; on a small VM a wake
of an idle vCPU is the expensive part.

    python scripts/bench_wake.py --json [--gaps-ms 0,2,50] [--n 60]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from kvpush import proto
from kvpush.engine_plugin.link.client import DaemonClient
from kvpush_dev.bench.ttft import pct
from kvpush_dev.engine_peer import FakeDaemon

STOP = b"q"
PING = proto.Abort("wake", 0, "ping")  # every variant carries these, through the codec


def _answer(payload: bytes) -> bytes:
    """The echo's work in every variant: decode the request, encode the daemon's answer."""
    msg = proto.decode(payload)
    return proto.encode(proto.Released(msg.transfer_id, msg.attempt))


def _zmq_echo(endpoint: str) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    s.bind(endpoint)
    while True:
        ident, payload = s.recv_multipart()
        if payload == STOP:
            break
        s.send_multipart([ident, _answer(payload)])
    s.close(0)
    ctx.term()


def _unix_echo(path: str) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    while True:
        data, addr = s.recvfrom(4096)
        if data == STOP:
            break
        s.sendto(_answer(data), addr)
    s.close()


def _link_echo(endpoint: str) -> None:
    """The daemon's side of the engine link, answering as the daemon does: Heartbeat with
    HeartbeatAck, an Abort of nothing known with Released; an Abort "stop" ends it."""
    d = FakeDaemon(endpoint, "wake", max_message=1 << 20)
    d.answer_aborts = True
    try:
        while True:
            d.listener.wait(1.0)
            if any(isinstance(m, proto.Abort) and m.reason == "stop" for m in d.serve()):
                return
    finally:
        d.close()


def _rtts(ping: Callable[[], None], n: int, gap_s: float) -> list[float]:
    for _ in range(3):  # connection set-up and first wake-ups
        ping()
    out = []
    for _ in range(n):
        time.sleep(gap_s)  # both processes idle, as between a quiet server's requests
        t = time.perf_counter()
        ping()
        out.append(time.perf_counter() - t)
    return out


def zmq_rtts(tmp: Path, n: int, gap_s: float) -> list[float]:
    endpoint = f"ipc://{tmp}/wake-zmq.sock"
    proc = mp.get_context("spawn").Process(target=_zmq_echo, args=(endpoint,), daemon=True)
    proc.start()
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.connect(endpoint)

    def ping() -> None:
        s.send(proto.encode(PING))
        if not s.poll(5000):
            raise TimeoutError("zmq echo did not answer")
        proto.decode(s.recv())

    try:
        return _rtts(ping, n, gap_s)
    finally:
        s.send(STOP)
        proc.join(10)
        s.close(0)
        ctx.term()


def link_rtts(tmp: Path, n: int, gap_s: float) -> list[float]:
    endpoint = f"ipc://{tmp}/wake-link.sock"
    proc = mp.get_context("spawn").Process(target=_link_echo, args=(endpoint,), daemon=True)
    proc.start()
    c = DaemonClient(endpoint)
    end = time.monotonic() + 30
    while not c.available:  # the listener is up and answered a heartbeat
        if time.monotonic() > end:
            raise TimeoutError("engine link echo did not come up")
        c.poll()
        c.wait(0.01)

    def ping() -> None:
        assert c.send(PING)
        end = time.monotonic() + 5
        while not any(isinstance(m, proto.Released) for m in c.poll()):
            if time.monotonic() > end:
                raise TimeoutError("engine link echo did not answer")
            c.wait(1.0)

    try:
        return _rtts(ping, n, gap_s)
    finally:
        c.send(proto.Abort("wake", 0, "stop"))
        c.poll()
        proc.join(10)
        c.close()


def daemon_rtts(tmp: Path, n: int, gap_s: float) -> list[float]:
    from kvpush_dev.daemon_harness import Daemon, Engine, device_config
    from kvpush_dev.kvref import make

    lay, _ = make("amx", num_layers=2, num_blocks=32, block_size=16, num_heads=2, head_size=64,
                  dtype="bfloat16")
    d = Daemon(device_config(tmp, 0))
    e = Engine(d, lay, "decode", fill="zeros")
    seq = iter(range(1 << 30))

    def ping() -> None:
        tid = f"wake-{next(seq)}"
        assert e.client.send(proto.Abort(tid, 0, "ping"))
        e.wait_for(lambda m: isinstance(m, proto.Released) and m.transfer_id == tid, 5)

    try:
        return _rtts(ping, n, gap_s)
    finally:
        e.close()
        d.stop()


def unix_rtts(tmp: Path, n: int, gap_s: float) -> list[float]:
    server, client = str(tmp / "wake-u1.sock"), str(tmp / "wake-u2.sock")
    proc = mp.get_context("spawn").Process(target=_unix_echo, args=(server,), daemon=True)
    proc.start()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(client)
    s.settimeout(5)
    end = time.monotonic() + 30
    while not os.path.exists(server) and time.monotonic() < end:
        time.sleep(0.01)

    def ping() -> None:
        s.sendto(proto.encode(PING), server)
        proto.decode(s.recv(4096))

    try:
        return _rtts(ping, n, gap_s)
    finally:
        s.sendto(STOP, server)
        proc.join(10)
        s.close()
        for path in (server, client):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def _us(xs: list[float], q: float) -> float:
    return round(pct(xs, q) * 1e6, 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench_wake.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gaps-ms", default="0,2,50", help="idle time before each round trip")
    ap.add_argument("--n", type=int, default=60, help="round trips per gap and transport")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvpush-wake-") as d:
        for gap in (float(g) / 1e3 for g in args.gaps_ms.split(",")):
            z, lk, dm, u = (f(Path(d), args.n, gap) for f in (zmq_rtts, link_rtts, daemon_rtts, unix_rtts))
            out[f"{gap * 1e3:g}ms"] = {
                "zmq_ipc_rtt_us": {"p50": _us(z, 50), "p90": _us(z, 90)},
                "engine_link_rtt_us": {"p50": _us(lk, 50), "p90": _us(lk, 90)},
                "daemon_rtt_us": {"p50": _us(dm, 50), "p90": _us(dm, 90)},
                "unix_dgram_rtt_us": {"p50": _us(u, 50), "p90": _us(u, 90)},
                "zmq_over_unix_p50": round(statistics.median(z) / statistics.median(u), 2),
                "zmq_over_engine_link_p50": round(statistics.median(z) / statistics.median(lk), 2),
            }
    print(json.dumps(out, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
