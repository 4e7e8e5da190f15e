"""kvpushd end to end vs a raw NIXL two-process WRITE vs memcpy, on the same bytes, in one run.

Daemon end to end = from the prefill engine publishing PrefillDone (the decode side
registered first) to the decode engine hearing Received: the plan, a fresh NIXL transfer,
the WRITE, its notification, the counter and two engine-link hops. Raw NIXL = back-to-back
WRITEs of one prepared transfer between two processes that do nothing else
(scripts/bench_raw_nixl.py), on /dev/shm memory like the engines' KV (``raw_nixl_gbps``,
the baseline of ``daemon_vs_raw``) and on anonymous memory (``raw_nixl_anon_gbps``).
memcpy = one numpy copy.

    python scripts/bench_transfer.py --json [--sizes 1,16,256] [--modes none,peer]

Targets (benchmark, not test): daemon >= 0.8x raw NIXL at 16 MiB and 256 MiB; an idle
daemon <= 2 % of a core.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from kvpush import proto
from kvpush.proto.layout import vllm_cpu_layout
from kvpush_dev.bench.raw_nixl import SHM_ENV, memcpy_gbps, raw_nixl_write_gbps
from kvpush_dev.daemon_harness import Daemon, Engine, device_config, engines

MiB = 1 << 20
BLOCK_BYTES = 64 << 10  # one block slab: 16 tokens x 8 heads x K/V x 128 x bf16


def layout(num_blocks: int):  # type: ignore[no-untyped-def]
    return vllm_cpu_layout(num_layers=1, num_blocks=num_blocks, block_size=16, num_heads=8,
                           head_size=128, dtype="bfloat16", packing="row")


def daemon_e2e_gbps(p: Daemon, d: Daemon, pe: Engine, de: Engine, size: int, scattered: bool,
                    iters: int, seed: int, back_to_back: bool = False, depth: int = 1) -> dict[str, float]:
    """Median GB/s of PrefillDone -> Received, the registration already at the producer
    (``gbps``), and of the prefill daemon's own span of the same pushes (``write_gbps``).

    ``write_gbps`` is timed as a raw NIXL WRITE is (post -> DONE at the initiator), from the
    daemon's trace: from its ``p.daemon.prefill_done_in`` (so the rendezvous, the plan and
    the transfer's creation count, which a raw loop that reposts one prepared handle never
    pays) to its ``p.daemon.write_done`` (the batch's last). ``gbps`` adds what no raw
    WRITE has: the two engine <-> daemon hops, the notification and the count.

    ``back_to_back``: every registration is made first, then the pushes run one after the
    other (as under load, when decode sides register ahead), like a raw baseline's
    back-to-back WRITEs; otherwise each push follows its own registration after an idle
    50 ms (a quiet server's one request at a time). ``depth`` > 1 (implies back to back):
    that many pushes at once, each on its own blocks on both sides (the layouts must hold
    ``depth`` times the blocks), timed until the last one's Received; the rate counts
    every byte of the batch."""
    nb = size // BLOCK_BYTES
    back_to_back = back_to_back or depth > 1
    if nb * depth > min(pe.layout.num_blocks, de.layout.num_blocks):
        raise ValueError(f"layouts of {pe.layout.num_blocks} / {de.layout.num_blocks} blocks cannot hold "
                         f"{depth} x {nb} blocks")
    rng = np.random.default_rng(seed)
    if scattered:
        src = rng.permutation(pe.layout.num_blocks)[:nb * depth].tolist()
        dst = rng.permutation(de.layout.num_blocks)[:nb * depth].tolist()
    else:
        src, dst = list(range(nb * depth)), list(range(nb * depth))
    n_tok = nb * 16
    times = []
    batches = [[f"bench-{size}-{int(scattered)}-{int(back_to_back)}-{depth}-{seed}-{i}.{j}" for j in range(depth)]
               for i in range(iters + 1)]

    def blocks(ids: list[int], j: int) -> tuple[int, ...]:
        return tuple(ids[j * nb:(j + 1) * nb])

    if back_to_back:  # distinct transfers may share destination blocks: they run one at a time
        for batch in batches:
            for j, tid in enumerate(batch):
                de.send(proto.Register(tid, 0, blocks(dst, j), n_tok, (p.peer_endpoint,), 1, 60_000))
        time.sleep(0.2)
    for i, batch in enumerate(batches):
        if not back_to_back:
            de.send(proto.Register(batch[0], 0, blocks(dst, 0), n_tok, (p.peer_endpoint,), 1, 60_000))
            time.sleep(0.05)  # the registration reached the producer: measure the push alone
        t0 = time.perf_counter()
        for j, tid in enumerate(batch):
            pe.send(proto.PrefillDone(tid, blocks(src, j), n_tok, 60_000))
        for tid in batch:
            res = de.result(tid, timeout=120)
            assert isinstance(res, proto.Received), res
        dt = time.perf_counter() - t0
        for tid in batch:
            assert isinstance(pe.result(tid, timeout=60), proto.Sent)
        if i:  # the first one pays connection set-up
            times.append(dt)
    # Read after the run, so that the pacing has no ops round trips in it.
    spans = [_write_span(p, batch) for batch in batches[1:]]
    med, wmed = statistics.median(times), statistics.median(spans)
    return {"gbps": size * depth / med / 1e9, "median_ms": med * 1e3,
            "write_gbps": size * depth / wmed / 1e9, "write_median_ms": wmed * 1e3}


def _write_span(p: Daemon, batch: list[str]) -> float:
    """Seconds from the prefill daemon's first PrefillDone in to its last WRITE done."""
    starts, ends = [], []
    for tid in batch:
        hops = dict(p.ops("trace", tid)["events"])
        starts.append(hops["p.daemon.prefill_done_in"])
        ends.append(hops["p.daemon.write_done"])
    return (max(ends) - min(starts)) / 1e9


def idle_cpu(pid: int, seconds: float) -> float:
    proc = psutil.Process(pid)
    c0 = sum(proc.cpu_times()[:2])
    time.sleep(seconds)
    return (sum(proc.cpu_times()[:2]) - c0) / seconds


def auth_cost(mode: str, blocks: int, sizes: list[int], rows: dict[str, Any]) -> dict[str, float]:
    """The same daemon end-to-end runs with insecure_peers = true: authenticated GB/s over
    insecure GB/s per size (the CURVE cost is on the control messages, not the WRITE)."""
    out: dict[str, float] = {}
    with daemon_pair(mode, blocks, insecure_peers=True) as (p, d, pe, de):
        for size in sizes:
            iters = 20 if size <= 16 * MiB else 5
            for scattered in (False, True):
                key = f"{size // MiB}MiB_{'scattered' if scattered else 'contiguous'}"
                e2e = daemon_e2e_gbps(p, d, pe, de, size, scattered, iters, seed=size)
                out[key] = round(rows[key]["daemon_gbps"] / e2e["gbps"], 3)
                out[f"{key}_insecure_median_ms"] = round(e2e["median_ms"], 3)
    return out


@contextmanager
def daemon_pair(mode: str, blocks: int, **cfg: Any) -> Iterator[tuple[Daemon, Daemon, Engine, Engine]]:
    """A prefill and a decode daemon (real processes) with an engine stand-in each."""
    with tempfile.TemporaryDirectory(prefix="kvpush-bench-") as tmp, ExitStack() as stack:
        p, d = (stack.enter_context(Daemon(device_config(Path(tmp), i, ucx_error_handling_mode=mode, **cfg)))
                for i in (0, 1))
        pe, de = stack.enter_context(engines(p, d, layout(blocks), seed=1))
        yield p, d, pe, de


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--sizes", default="1,16,256", help="MiB, comma separated")
    ap.add_argument("--modes", default="none,peer", help="UCX error handling modes to measure")
    ap.add_argument("--idle-seconds", type=float, default=5.0)
    ap.add_argument("--auth-cost", action="store_true",
                    help="also run the daemons with insecure_peers = true and report authenticated / insecure")
    args = ap.parse_args(argv)
    sizes = [int(s) * MiB for s in args.sizes.split(",")]
    # NIXL logs to stdout (in this process and in the daemons it spawns): keep stdout for
    # the result alone by pointing fd 1 at stderr until the end.
    sys.stdout.flush()
    real_stdout = os.dup(1)
    os.dup2(2, 1)
    blocks = 2 * max(sizes) // BLOCK_BYTES
    out: dict[str, Any] = {"block_bytes": BLOCK_BYTES, "modes": {}}
    for mode in args.modes.split(","):
        rows: dict[str, Any] = {}
        with daemon_pair(mode, blocks) as (p, d, pe, de):
            for size in sizes:
                iters = 20 if size <= 16 * MiB else 5
                for scattered in (False, True):
                    key = f"{size // MiB}MiB_{'scattered' if scattered else 'contiguous'}"
                    e2e = daemon_e2e_gbps(p, d, pe, de, size, scattered, iters, seed=size)
                    params = {"ucx_error_handling_mode": mode}
                    raw_anon = raw_nixl_write_gbps(size, scattered, iters, backend_params=params)
                    os.environ[SHM_ENV] = "1"  # same kind of memory as the engines' KV
                    try:
                        raw = raw_nixl_write_gbps(size, scattered, iters, backend_params=params)
                    finally:
                        os.environ.pop(SHM_ENV, None)
                    mem = memcpy_gbps(size, iters)
                    rows[key] = {
                        "daemon_gbps": round(e2e["gbps"], 3), "daemon_median_ms": round(e2e["median_ms"], 3),
                        "raw_nixl_gbps": round(raw, 3), "raw_nixl_anon_gbps": round(raw_anon, 3),
                        "memcpy_gbps": round(mem, 3),
                        "daemon_vs_raw": round(e2e["gbps"] / raw, 3) if raw else None,
                    }
                    if not args.json:
                        print(mode, key, rows[key], flush=True)
            idle = {
                "prefill_daemon_cores": round(idle_cpu(p.proc.pid, args.idle_seconds), 4),
                "decode_daemon_cores": round(idle_cpu(d.proc.pid, args.idle_seconds), 4),
                "prefill_daemon_rss_mib": round(psutil.Process(p.proc.pid).memory_info().rss / MiB, 1),
            }
        out["modes"][mode] = {"sizes": rows, "idle": idle}
        if args.auth_cost:
            out["modes"][mode]["auth_vs_insecure"] = auth_cost(mode, blocks, sizes, rows)
    sys.stdout.flush()
    os.dup2(real_stdout, 1)
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
