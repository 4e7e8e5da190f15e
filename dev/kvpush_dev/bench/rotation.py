"""What a revocation's NIXL rotation costs (issue 28, item 2).

Two measurements, real NIXL and real daemons (CURVE on):

* ``rotate_ms``: :meth:`kvpush.daemon.io.transport.NixlTransport.rotate` alone (drop the agent,
  create one, register the region again) for regions of a few sizes, in this process;
* the decode daemon's side of it: transfers P -> D run back to back; node X (a prefill node
  D dialled, so it holds D's metadata) is removed from D's allowlist mid-run. Reported:
  transfer latency (Register to Received, PrefillDone sent at once) before and after, the
  transfers that failed (in flight during the rotation: failed cleanly, vLLM recomputes),
  and the gap from the certificate's removal to the first transfer that succeeds again.

    python scripts/bench_rotation.py [--out docs/results/rotation.md] [--ucx-tls tcp]
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvpush import proto
from kvpush.daemon.io.kv_mapping import MappedRegion
from kvpush.daemon.io.transport import NixlTransport
from kvpush_dev.kvref import small_layout as lay


class _Anon(MappedRegion):
    """Anonymous memory standing in for an engine's region (only base and size matter)."""

    def __init__(self, size: int) -> None:
        self._m = mmap.mmap(-1, size)
        self._a = np.frombuffer(self._m, dtype=np.uint8)
        self._a[:] = 1
        self.kind, self.mem_type, self.device = "anon", "DRAM", 0
        self.base, self.size = self._a.ctypes.data, size

    def view(self, dtype: Any = None) -> Any:
        return self._a

    def close(self) -> None:
        del self._a
        self._m.close()


def rotate_ms(size: int, reps: int = 5) -> float:
    """Median time of one rotation of a transport holding one ``size``-byte region."""
    region = _Anon(size)
    t = NixlTransport(f"rot-bench-{os.getpid()}")
    t.register(region)
    took = []
    for i in range(reps):
        t0 = time.perf_counter()
        t.rotate(f"rot-bench-{os.getpid()}-r{i + 1}")
        took.append((time.perf_counter() - t0) * 1e3)
    t.close()
    region.close()
    return statistics.median(took)


def daemons_run(tmp: Path, tls: str, before: int, after_s: float) -> dict[str, Any]:
    from kvpush_dev.fleet import NODES, fleet
    from kvpush_dev.nixl_probe import FakeProducer

    with fleet(tmp, x_allowed_by="d", env={"UCX_TLS": tls}) as f, \
            contextlib.closing(FakeProducer(f.kx, NODES["x"][1], lay())) as x:
        n = 0

        def one() -> tuple[float, float, bool]:
            nonlocal n
            n += 1
            t0 = time.monotonic()
            k = 12 + (n % 6) * 3  # destination blocks 12..29, cycled (10, 11: X's registration)
            got = f.transfer((k, k + 1, k + 2), t=f"rot{os.getpid()}-{n}", timeout=12.0)
            return t0, (time.monotonic() - t0) * 1e3, isinstance(got, proto.Received)

        for _ in range(5):
            one()  # warm
        pre = [one()[1] for _ in range(before)]
        t = f"rotx{os.getpid()}"
        f.de.send(proto.Register(t, 0, (10, 11), 20, (x.endpoint,), 1, 8000))
        x.serve(1.5)  # D dialled X: X holds D's metadata
        f.de.result(t)
        (Path(f.kd.authorized_dir) / "xnode.key").unlink()
        removed = time.monotonic()
        runs = []
        fenced = False
        while time.monotonic() - removed < after_s:
            try:
                runs.append(one())
            except TimeoutError:  # no answer: D fenced (a WRITE announced in flight at the rotation)
                fenced = not f.d.proc.is_alive() or f.d.proc.exitcode is not None
                break
        failed = [r for r in runs if not r[2]]
        ok_after = [r for r in runs if r[2] and r[0] > (failed[-1][0] if failed else removed)]
        first_ok = min((r[0] + r[1] / 1e3 for r in runs if r[2] and (not failed or r[0] > failed[-1][0])),
                       default=float("nan"))
        return {
            "ucx_tls": tls,
            "before_p50_ms": statistics.median(pre),
            "after_p50_ms": statistics.median([r[1] for r in ok_after]) if ok_after else float("nan"),
            "transfers_after_removal": len(runs),
            "failed": len(failed),
            "failed_latency_ms": [round(r[1], 1) for r in failed],
            "removal_to_first_ok_ms": (first_ok - removed) * 1e3,
            "max_after_ms": max((r[1] for r in runs), default=float("nan")),
            "fenced": fenced,
        }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="docs/results/rotation.md")
    ap.add_argument("--ucx-tls", default="tcp,shm,tcp", help="comma-separated media, each a UCX_TLS value "
                    "('tcp' or 'shm,tcp'); default both")
    ap.add_argument("--before", type=int, default=20)
    ap.add_argument("--after-s", type=float, default=3.0)
    args = ap.parse_args(argv)
    media = ["tcp", "shm,tcp"] if args.ucx_tls == "tcp,shm,tcp" else [args.ucx_tls]
    rows = []
    for tls in media:
        os.environ["UCX_TLS"] = tls
        sizes = {s: rotate_ms(s) for s in (1 << 20, 64 << 20, 256 << 20)}
        with tempfile.TemporaryDirectory(prefix="kvpush-rot-") as tmp:
            r = daemons_run(Path(tmp), tls, args.before, args.after_s)
        rows.append((tls, sizes, r))
        print(tls, {k >> 20: round(v, 1) for k, v in sizes.items()}, r, flush=True)
    lines = [
        "# NIXL rotation on revocation: what it costs",
        "",
        "Written by `scripts/bench_rotation.py` (`kvpush_dev.bench.rotation`): real NIXL (UCX),",
        "real daemons with CURVE, one 2-core host shared with other jobs (noisy; ratios matter).",
        "`rotate` is `NixlTransport.rotate` alone (new agent, region registered again), median of 5.",
        "Transfers: P -> D back to back (3 blocks, 40 tokens), latency from Register to Received;",
        "X (a prefill node D had dialled) is removed from D's allowlist mid-run. \"Fenced\": a WRITE",
        "announced in flight at the rotation may still land (over shm), so the decode daemon exits",
        "rather than hand its blocks back (its supervisor restarts it; the engine recomputes).",
        "",
        "| UCX_TLS | rotate 1 MiB (ms) | rotate 64 MiB (ms) | rotate 256 MiB (ms) | transfer p50 before (ms) "
        "| transfer p50 after (ms) | slowest after removal (ms) | failed | decode daemon fenced |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for tls, sizes, r in rows:
        lines.append(
            f"| `{tls}` | {sizes[1 << 20]:.1f} | {sizes[64 << 20]:.1f} | {sizes[256 << 20]:.1f} "
            f"| {r['before_p50_ms']:.2f} | {r['after_p50_ms']:.2f} | {r['max_after_ms']:.1f} "
            f"| {r['failed']} of {r['transfers_after_removal']} | {'yes' if r['fenced'] else 'no'} |")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0
