#!/usr/bin/env python3
"""Push vs pull, side by side: kvpush against vLLM's own P/D connectors, in one run.

Modes (each a prefill engine pinned to core 0 and a decode engine pinned to core 1, the same
engine flags: float32, eager, 64 MiB KV, decode-side prefix caching off, the same env):

- ``kvpush``: kvpushd + KVPushConnector + the kvpush router (kvpush_dev.pd_stack, unchanged);
- ``pull``: vLLM's NixlConnector (``kv_buffer_device: cpu``, ``kv_both``) behind a
  sequential proxy (kvpush_dev.baseline_proxy --mode pull): P first, then D with P's params;
- ``vllm-push``: vLLM's NixlPushConnector behind a concurrent proxy (--mode push);
- ``colocated``: one engine, no connector, given both cores (what disaggregation has to beat
  on the same machine; not in the default modes).

For each mode: start, wait healthy, warm up, measure idle CPU, run every load point, stop
everything (also on errors and Ctrl-C). A load point is vLLM's own benchmark client
(``vllm.benchmarks.serve.main``) in its own process, forked from a pre-imported server so
that a point does not pay vLLM's import each time; every request is capped
(``--request-timeout``: a timed-out request is recorded as such) and so is the point as a
whole (killed, all its requests recorded as timed out). After each point a few of its prompts
are sent greedily through the mode's front end and to the prefill engine directly (no KV
parameters): the texts must match.

Per point it writes ``<mode>_qps<q>_in<in>_out<out>_iter<i>.json`` into --results-dir
(TTFT/TPOT/ITL/E2E mean/median/p99, throughput, completed/failed/timed-out, correctness,
CPU seconds per process group, the decode engine's own inter-token latency histogram and
KV-source counters); per mode ``mode_<mode>.json`` (start-up, warm-up, idle CPU); vLLM's
raw result files and every log under raw/ and logs/. Plot with scripts/plot_sweep.py.

Modules: ``grid`` (points), ``launchers`` (modes), ``client`` (vLLM's benchmark client),
``metrics`` (Prometheus deltas), ``runner`` (a mode, a point), ``cli`` (this command).

    .venv/bin/python scripts/bench_sweep.py --quick --results-dir results/sweep-quick
    .venv/bin/python scripts/bench_sweep.py --results-dir DIR \\
        [--modes kvpush,pull,vllm-push] [--qps 1,2,4,8] [--input-lens 256,512,1024,1536] \\
        [--output-len 32] [--num-prompts 32] [--iterations 1] [--env UCX_TLS=...]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvpush_dev import vllm_env as ve
from kvpush_dev.sweep.grid import build_points
from kvpush_dev.sweep.launchers import MODES
from kvpush_dev.sweep.load_client import ClientRunner
from kvpush_dev.sweep.runner import SweepConfig, run_mode

ROOT = ve.ROOT


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _pairs(s: str) -> list[tuple[float, int]]:
    out = []
    for item in s.split(","):
        q, _, n = item.partition("x")
        out.append((float(q), int(n)))
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench_sweep.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results-dir", required=True)
    ap.add_argument("--model-dir", default=str(ROOT / ".models" / "tiny"), help="built if missing (scripts/build_tiny_model.py)")
    ap.add_argument("--model-preset", default="tiny", help="tiny_model preset built into --model-dir if missing (deep)")
    ap.add_argument("--modes", default="kvpush,pull,vllm-push", help=f"comma separated, from {MODES}")
    ap.add_argument("--qps", type=_floats, default=[1, 2, 4, 8])
    ap.add_argument("--input-lens", type=_ints, default=[256, 512, 1024, 1536])
    ap.add_argument("--points", type=_pairs, default=None, help="QPSxIN,... instead of the --qps x --input-lens grid")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--iterations", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0, help="base seed; every point's seed derives from it")
    ap.add_argument("--request-timeout", type=float, default=120.0, help="cap per benchmark request (s)")
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--correct-prompts", type=int, default=4, help="prompts per point checked against P alone")
    ap.add_argument("--correct-timeout", type=float, default=60.0)
    ap.add_argument("--idle-seconds", type=float, default=5.0, help="idle CPU sample per mode (0: skip)")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VAL",
                    help="set for every process of every mode (e.g. UCX settings)")
    ap.add_argument("--quick", action="store_true",
                    help="2 points (QPS 2 x in 256, QPS 4 x in 1024), 16 prompts, 1 iteration, short caps")
    args = ap.parse_args(argv)
    if args.quick:
        args.points = [(2.0, 256), (4.0, 1024)]
        args.num_prompts, args.iterations = 16, 1
        args.request_timeout, args.correct_timeout = 40.0, 20.0
        args.startup_timeout, args.idle_seconds = 300.0, 3.0
    bad = [m for m in args.modes.split(",") if m not in MODES]
    if bad:
        ap.error(f"unknown mode(s) {bad}; choose from {MODES}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for kv in args.env:
        k, _, v = kv.partition("=")
        os.environ[k] = v
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    results = Path(args.results_dir).resolve()
    (results / "raw").mkdir(parents=True, exist_ok=True)
    model = ve.ensure_tiny_model(args.model_dir, preset=args.model_preset)
    pairs = args.points or [(q, n) for q in args.qps for n in args.input_lens]
    cfg = SweepConfig(model=model, results=results, modes=args.modes.split(","),
                      points=build_points(pairs, args.output_len, args.iterations),
                      num_prompts=args.num_prompts, base_seed=args.seed,
                      request_timeout=args.request_timeout, startup_timeout=args.startup_timeout,
                      correct_prompts=args.correct_prompts, correct_timeout=args.correct_timeout,
                      idle_seconds=args.idle_seconds)

    def on_term(_signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    t0 = time.monotonic()
    client = ClientRunner()
    client.warm()
    summary: dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if k != "points"},
                               "points": [asdict(p) for p in cfg.points], "modes": {}}
    rc = 0
    try:
        for mode in cfg.modes:
            print(f"[{time.monotonic() - t0:6.0f}s] mode {mode}: starting", flush=True)
            info = run_mode(cfg, mode, client)
            summary["modes"][mode] = {k: info.get(k) for k in ("status", "startup_s", "wall_s", "error")}
            print(f"[{time.monotonic() - t0:6.0f}s] mode {mode}: {info['status']} in {info['wall_s']} s", flush=True)
            rc |= info["status"] != "ok"
    except KeyboardInterrupt:
        print("interrupted: everything started was stopped", flush=True)
        rc = 130
    finally:
        summary["wall_s"] = round(time.monotonic() - t0, 1)
        (results / "sweep.json").write_text(json.dumps(summary, indent=1))
    print(f"sweep done in {summary['wall_s']} s; results in {results}", flush=True)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
