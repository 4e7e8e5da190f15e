"""A stand-in for the daemon worker (``run_device_daemon``'s contract), for supervisor tests.

What each child does is read from ``modes.json`` / ``<name>.hold`` files in its runtime
dir, so a test steers crashes, hangs and stubborn children without code in the child.
It lives in the package because the supervisor spawns children that import it by name.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

from kvpush.daemon.config import DeviceConfig
from kvpush.daemon.metrics import DaemonMetrics


def target(cfg: DeviceConfig, ready: Any) -> int:
    """Fake worker: 'sleep' (default) | 'crash' | 'stubborn' (ignores SIGTERM) | 'hang'
    (never ready) | 'ops' (serves metrics on its ops socket like the real worker)."""
    modes = json.loads(Path(cfg.runtime_dir, "modes.json").read_text())
    mode = modes.get(cfg.name, "sleep")
    if mode == "crash":
        time.sleep(0.1)
        return 3
    hold = Path(cfg.runtime_dir, f"{cfg.name}.hold")
    while hold.exists():
        time.sleep(0.05)
    stop = threading.Event()
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if mode == "ops":
        threading.Thread(target=_serve_ops, args=(cfg, stop), daemon=True).start()
        time.sleep(0.2)
    if mode != "hang":
        ready.set()
    while not stop.wait(1.0):
        pass
    return 0


def _serve_ops(cfg: DeviceConfig, stop: threading.Event) -> None:
    import zmq

    from kvpush.proto.codec import decode, encode
    from kvpush.proto.messages import OpsReply

    metrics = DaemonMetrics(cfg.name)
    metrics.write_done(4096 * (cfg.index + 1), 0.003)
    sock = zmq.Context.instance().socket(zmq.ROUTER)  # like the worker's ops endpoint
    sock.bind(cfg.ops_socket)
    while not stop.is_set():
        if sock.poll(200):
            ident, payload = sock.recv_multipart()
            req = decode(payload)
            assert req.cmd == "metrics"
            sock.send_multipart([ident, encode(OpsReply(ok=True, data={"text": metrics.render()}))])
