"""Benchmark the pure cores: TransferPlanner plan time and Rendezvous event rate.

Prints one JSON object (``--json``) or a short table. Targets (benchmark, not test):
contiguous plan <= 1 ms with one descriptor per contiguous run; random block IDs
<= 10 ms; rendezvous events/s for 100k transfers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from kvpush.daemon.planner import plan
from kvpush.proto.layout import KVLayout, flash_layout, vllm_cpu_layout


def _runs(ids: np.ndarray) -> int:
    return int(1 + np.count_nonzero(np.diff(ids) != 1))


def bench_plan(layout: KVLayout, src: np.ndarray, dst: np.ndarray, repeat: int) -> dict:
    num_tokens = len(src) * layout.block_size
    times = []
    p = None
    for _ in range(repeat):
        t0 = time.perf_counter()
        p = plan(layout, src, layout, dst, num_tokens)
        times.append((time.perf_counter() - t0) * 1e3)
    assert p is not None
    return {
        "descriptors": len(p),
        "plan_ms": round(statistics.median(times), 4),
        "plan_ms_p99": round(sorted(times)[int(0.99 * (len(times) - 1))], 4),
        "bytes": p.nbytes,
    }


def bench_rendezvous(n_transfers: int) -> dict:
    """Register + PrefillDone + WriteDone for n transfers, then a Tick: events per second."""
    from kvpush.daemon import rendezvous as rv

    r = rv.Rendezvous(max_transfers=n_transfers + 1)
    blocks = tuple(range(8))
    events = []
    for i in range(n_transfers):
        tid = f"t{i}"
        events.append(rv.Register(tid, 0, "peer", 0, 1, blocks, 100, 0.0, 1e9))
        events.append(rv.PrefillDone(tid, blocks, 100, 0.0, 1e9))
        events.append(rv.WriteDone(tid, 0, 0, 0.0))
    t0 = time.perf_counter()
    writes = 0
    for ev in events:
        for action in r.handle(ev):
            writes += isinstance(action, rv.StartWrite)
    r.handle(rv.Tick(1.0))
    dt = time.perf_counter() - t0
    assert writes == n_transfers
    return {"transfers": n_transfers, "events": len(events) + 1, "events_per_s": round((len(events) + 1) / dt)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--transfers", type=int, default=100_000)
    args = ap.parse_args(argv)

    nb = args.blocks * 2  # room for random destination IDs
    layouts = {
        "vllm_cpu_amx": vllm_cpu_layout(num_layers=args.layers, num_blocks=nb, block_size=16,
                                        num_heads=8, head_size=128, dtype="bfloat16"),
        "flash": flash_layout(num_layers=args.layers, num_blocks=nb, block_size=16, num_heads=8,
                              head_size=128, dtype="bfloat16"),
    }
    rng = np.random.default_rng(0)
    out: dict = {"layers": args.layers, "blocks": args.blocks, "kv": 2, "cases": {}}
    for name, lay in layouts.items():
        contiguous = np.arange(args.blocks, dtype=np.int64)
        c = bench_plan(lay, contiguous, contiguous + args.blocks // 2, args.repeat)
        # The layout's own contiguity: K/V halves and layers may add runs.
        c["block_runs"] = _runs(contiguous)
        rs = rng.permutation(nb)[: args.blocks]
        rd = rng.permutation(nb)[: args.blocks]
        r = bench_plan(lay, rs, rd, args.repeat)
        out["cases"][name] = {"contiguous": c, "random": r}
    # Headline numbers for the vLLM-cpu layout (what this machine serves).
    head = out["cases"]["vllm_cpu_amx"]
    out["descriptors"] = head["contiguous"]["descriptors"]
    out["plan_ms"] = head["contiguous"]["plan_ms"]
    out["random_descriptors"] = head["random"]["descriptors"]
    out["random_plan_ms"] = head["random"]["plan_ms"]
    out["rendezvous"] = bench_rendezvous(args.transfers)
    if args.json:
        print(json.dumps(out))
    else:
        print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
