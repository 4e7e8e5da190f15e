"""Follow one registration through the decode daemon's code: which product files it visits,
in order, and how often it comes back to one it already left.

Why: a path that bounces between files (the shell asks the core, the core answers, the shell
asks again) is hard to read and to change; the count makes that visible and comparable
between two checkouts. Reproducible: one registration through the in-memory daemons
(:mod:`kvpush_dev.inmemory`: real parts, real codec, in-memory ports), under
``sys.setprofile``.

What is counted: every Python call made while the *decode* daemon handles something of the
registration (the engine's Register, its producer's messages, the NIXL polls that found the
notification), from the engine's Register until Received goes to the engine. Each entry ends
as a step of the real loop does (``DeviceDaemon.step``): with both sides' ``poll_cap``. Polls
that found nothing are left out (the real loop polls whatever is in flight). Only product
modules count (``kvpush.daemon.*``, ``kvpush.proto.*``, ``kvpush.common.*``); a module is a
file. A *stay* is a consecutive run of calls within one file; a *return* is a stay in a file
visited before (so returns = stays - distinct files). With ``--follow-returns`` a stay is a
run of execution within one file instead: control coming back to the caller's file counts
too (what a reader following the code sees: the shell asks the core, reads the answer, asks
again).

    python -m kvpush_dev.trace_stays              # the link is up, the decode side registers first
    python -m kvpush_dev.trace_stays --prefill-first --follow-returns --show
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvpush import proto
from kvpush_dev.inmemory import Fabric, MemNode, Net
from kvpush_dev.kvref import make

PRODUCT = ("kvpush.daemon", "kvpush.proto", "kvpush.common")


def _module(frame: Any) -> str | None:
    name = frame.f_globals.get("__name__", "")
    return name if isinstance(name, str) and name.startswith(PRODUCT) else None


class Recorder:
    """The product modules called, in order, while recording (a profile hook); with
    ``returns``, also the caller's module each time a product function returns to it."""

    def __init__(self, returns: bool = False) -> None:
        self.calls: list[str] = []
        self.returns = returns

    def _hook(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            mod = _module(frame)
            if mod is not None:
                self.calls.append(mod)
        elif event == "return" and self.returns and _module(frame) is not None and frame.f_back is not None:
            mod = _module(frame.f_back)
            if mod is not None:
                self.calls.append(mod)

    def record(self, fn: Callable[..., Any], *args: Any, keep: Callable[[Any], bool] = lambda _: True) -> Any:
        """Call ``fn`` under the hook; its calls are kept only if ``keep(result)``."""
        mark = len(self.calls)
        sys.setprofile(self._hook)
        try:
            result = fn(*args)
        finally:
            sys.setprofile(None)
        if not keep(result):
            del self.calls[mark:]
        return result


def stays(calls: list[str]) -> list[str]:
    """The files in the order they were visited, consecutive calls in one file counted once."""
    out: list[str] = []
    for mod in calls:
        if not out or out[-1] != mod:
            out.append(mod)
    return out


def _layout() -> Any:
    lay, _ = make("row", num_layers=2, num_blocks=16, block_size=16, num_heads=2, head_size=8,
                  dtype="bfloat16", head_start=0, total_heads=2)
    return lay


def trace(prefill_first: bool = False, returns: bool = False) -> list[str]:
    """One registration's product calls in the decode daemon (see the module docstring)."""
    net, fab = Net(), Fabric()
    lay = _layout()
    p, d = MemNode(net, fab, "p"), MemNode(net, fab, "d")
    p.attach(lay, np.random.default_rng(1).integers(0, 256, lay.region_size, dtype=np.uint8), role="prefill")
    d.attach(lay, np.zeros(lay.region_size, dtype=np.uint8), role="decode")

    def transfer(tid: str) -> None:
        steps = [lambda: p.engine(proto.PrefillDone(tid, (5, 1, 9), 40, 5000)),
                 lambda: d.engine(proto.Register(tid, 0, (2, 7, 3), 40, (p.endpoint,), 1, 20000))]
        for step in steps if prefill_first else steps[::-1]:
            step()
            net.run()

    transfer("warm-up")  # the link's handshake and the prepared lists: not this registration's
    rec = Recorder(returns)
    session, decode, poll = d.session.on_engine, d.decode.on_producer, d.poll

    def loop_tail(result: Any = None) -> Any:
        now = time.monotonic()
        d.decode.poll_cap(now)
        d.prefill.poll_cap()
        return result

    def on_engine(*a: Any) -> Any:
        return rec.record(lambda: loop_tail(session(*a)))

    def on_producer(*a: Any) -> Any:
        return rec.record(lambda: loop_tail(decode(*a)))

    def polled() -> bool:
        return bool(rec.record(lambda: loop_tail(poll()), keep=bool))

    d.session.on_engine, d.decode.on_producer, d.poll = on_engine, on_producer, polled  # type: ignore[method-assign]
    before = len(d.answers())
    transfer("traced")
    got = [type(m).__name__ for m in d.answers()[before:]]
    if got != ["Received"]:
        raise SystemExit(f"the traced registration did not end in Received: {got}")
    return rec.calls


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill-first", action="store_true", help="the prefill engine's PrefillDone comes first")
    ap.add_argument("--follow-returns", action="store_true",
                    help="control coming back to a caller's file counts as a visit too")
    ap.add_argument("--skip", action="append", default=[], metavar="PREFIX",
                    help="leave modules under PREFIX out (e.g. kvpush.common.machine: the table machinery "
                         "a reader does not step into)")
    ap.add_argument("--show", action="store_true", help="print the stays in order")
    args = ap.parse_args(argv)
    calls = [m for m in trace(args.prefill_first, args.follow_returns)
             if not any(m == p or m.startswith(p + ".") for p in args.skip)]
    path = stays(calls)
    seen: set[str] = set()
    if args.show:
        for i, mod in enumerate(path, 1):
            print(f"{i:4d}  {'return ' if mod in seen else '       '}{mod}")
            seen.add(mod)
    files = len(set(path))
    print(f"{'visits' if args.follow_returns else 'calls'} {len(calls)}  stays {len(path)}  files {files}  returns {len(path) - files}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
