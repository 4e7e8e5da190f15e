"""Run the sweep's modes: start a mode, warm it up, measure idle CPU, run every point, stop.

Per point: scrape the engines' and daemons' metrics, run the client, scrape again, check a
few prompts' greedy text through the front end against the prefill engine alone, and write
``<mode>_qps<q>_in<in>_out<out>_iter<i>.json``; per mode ``mode_<mode>.json``.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpush_dev import vllm_env as ve
from kvpush_dev.procs import cpu_snapshot, shm_files
from kvpush_dev.prom import scrape
from kvpush_dev.sweep.grid import MODEL_NAME, Point
from kvpush_dev.sweep.launchers import ModeStack, start_mode
from kvpush_dev.sweep.load_client import ClientRunner, client_argv, point_cap, summarize_raw
from kvpush_dev.sweep.scrape_deltas import (
    DAEMON_COUNTERS,
    DAEMON_HISTOGRAMS,
    ENGINE_COUNTERS,
    ENGINE_HISTOGRAMS,
    counter_deltas,
    metric_summary,
)

WARMUP_PROMPTS = ("hello there", " ".join(["warm up the prefill and decode engines"] * 40))


def greedy_text(url: str, prompt: str, max_tokens: int, timeout: float) -> tuple[str | None, str]:
    """(text, error) of one greedy completion; never raises."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": False}
    try:
        out = ve.post_json(f"{url}/v1/completions", body, timeout=timeout)
        return str(out["choices"][0]["text"]), ""
    except Exception as exc:
        return None, f"{type(exc).__name__}: {str(exc)[:200]}"


def check_correctness(stack: ModeStack, prompts: list[str], k: int, seed: int, timeout: float,
                      max_tokens: int = 8) -> dict[str, Any]:
    """k of the point's prompts: front end (all at once, capped) vs the prefill engine alone."""
    if not prompts or k <= 0:
        return {"checked": 0, "matched": 0, "items": []}
    idx = sorted(random.Random(seed).sample(range(len(prompts)), min(k, len(prompts))))
    with cf.ThreadPoolExecutor(len(idx)) as ex:
        fronts = list(ex.map(lambda i: greedy_text(stack.front_url, prompts[i], max_tokens, timeout), idx))
    items = []
    for i, (front, ferr) in zip(idx, fronts, strict=True):
        ref, rerr = greedy_text(stack.p_url, prompts[i], max_tokens, timeout)
        items.append({"prompt_index": i, "match": front is not None and front == ref,
                      "front": front, "reference": ref, "error": ferr or rerr})
    return {"checked": len(items), "matched": sum(it["match"] for it in items), "items": items}


@dataclass
class SweepConfig:
    model: Path
    results: Path
    modes: list[str]
    points: list[Point]
    num_prompts: int
    base_seed: int
    request_timeout: float
    startup_timeout: float
    correct_prompts: int
    correct_timeout: float
    idle_seconds: float


def warm_up(stack: ModeStack, timeout: float) -> list[dict[str, Any]]:
    out = []
    for prompt in WARMUP_PROMPTS:
        t0 = time.monotonic()
        text, err = greedy_text(stack.front_url, prompt, 4, timeout)
        out.append({"ok": text is not None, "seconds": round(time.monotonic() - t0, 3), "error": err})
    return out


def idle_cpu(stack: ModeStack, seconds: float) -> dict[str, float]:
    if seconds <= 0:
        return {}
    a = cpu_snapshot(stack.groups)
    time.sleep(seconds)
    b = cpu_snapshot(stack.groups)
    return {k: round((b[k] - a[k]) / seconds, 4) for k in a}


def run_point(cfg: SweepConfig, stack: ModeStack, client: ClientRunner, pt: Point) -> dict[str, Any]:
    name = pt.name(stack.mode)
    raw_dir, log_dir = cfg.results / "raw", cfg.results / "logs" / stack.mode
    seed = pt.seed(cfg.base_seed)
    prompts_file = raw_dir / f"{name}.prompts.json"
    raw_file = raw_dir / f"{name}.json"
    for f in (prompts_file, raw_file):
        f.unlink(missing_ok=True)
    spec = {"argv": client_argv(stack.front_url, cfg.model, pt, cfg.num_prompts, seed, raw_dir, raw_file.name),
            "request_timeout_s": cfg.request_timeout, "prompts_out": str(prompts_file),
            "log": str(log_dir / f"client_{name}.log")}
    cap = point_cap(pt, cfg.num_prompts, cfg.request_timeout)
    m0 = {role: scrape(url) for role, url in stack.metrics.items()}
    c0 = cpu_snapshot(stack.groups)
    status, secs = client.run(spec, cap)
    c1 = cpu_snapshot(stack.groups)
    m1 = {role: scrape(url) for role, url in stack.metrics.items()}
    result: dict[str, Any] = {"mode": stack.mode, "qps": pt.qps, "input_len": pt.input_len,
                              "output_len": pt.output_len, "iteration": pt.iteration, "seed": seed,
                              "status": status, "client_seconds": round(secs, 2), "point_cap_s": cap,
                              "request_timeout_s": cfg.request_timeout}
    if status == "ok" and raw_file.exists():
        result.update(summarize_raw(json.loads(raw_file.read_text()), cfg.num_prompts, pt.output_len))
    else:
        if status == "ok":
            result["status"] = "client_error"
        result.update(completed=0, failed=0 if status == "point_timeout" else cfg.num_prompts,
                      timed_out=cfg.num_prompts if status == "point_timeout" else 0,
                      num_prompts=cfg.num_prompts, ttft=None, tpot=None, itl=None, e2el=None)
    result["cpu_seconds"] = {k: round(c1[k] - c0[k], 3) for k in c0}
    result["engine_metrics"] = {
        role: metric_summary(m0[role], m1[role], DAEMON_HISTOGRAMS if role == "daemon" else ENGINE_HISTOGRAMS,
                             DAEMON_COUNTERS if role == "daemon" else ENGINE_COUNTERS)
        for role in stack.metrics}
    prompts = json.loads(prompts_file.read_text()) if prompts_file.exists() else []
    d0 = scrape(stack.metrics.get("decode"))
    result["correctness"] = check_correctness(stack, prompts, cfg.correct_prompts, seed, cfg.correct_timeout)
    result["correctness"]["decode_counters"] = counter_deltas(d0, scrape(stack.metrics.get("decode")),
                                                              ("vllm:prompt_tokens_by_source_total",))
    (cfg.results / f"{name}.json").write_text(json.dumps(result, indent=1))
    return result


def run_mode(cfg: SweepConfig, mode: str, client: ClientRunner) -> dict[str, Any]:
    logs = cfg.results / "logs" / mode
    logs.mkdir(parents=True, exist_ok=True)
    info: dict[str, Any] = {"mode": mode, "status": "starting", "points": []}
    t0 = time.monotonic()
    stack: ModeStack | None = None
    shm: set[str] = set()
    work = Path(tempfile.mkdtemp(prefix=f"kvsw-{mode[:4]}-"))  # short: ipc socket paths
    try:
        stack = start_mode(mode, cfg.model, work, logs, cfg.startup_timeout, cfg.request_timeout)
        info["startup_s"] = round(time.monotonic() - t0, 1)
        info["warmup"] = warm_up(stack, cfg.correct_timeout)
        info["idle_cpu_cores"] = idle_cpu(stack, cfg.idle_seconds)
        shm = shm_files(stack.groups)
        load0 = cpu_snapshot(stack.groups)
        info["status"] = "running"
        for pt in cfg.points:
            r = run_point(cfg, stack, client, pt)
            info["points"].append(pt.name(mode))
            print(f"  {pt.name(mode)}: {r['status']} completed {r['completed']}/{r['num_prompts']} "
                  f"timed-out {r['timed_out']} failed {r['failed']} "
                  f"TTFT p50 {_ms(r['ttft'], 'median')} TPOT p50 {_ms(r['tpot'], 'median')} "
                  f"correct {r['correctness']['matched']}/{r['correctness']['checked']}", flush=True)
        load1 = cpu_snapshot(stack.groups)
        info["load_cpu_seconds"] = {k: round(load1[k] - load0[k], 3) for k in load0}
        info["status"] = "ok"
        shm |= shm_files(stack.groups)
    except (KeyboardInterrupt, SystemExit):
        info["status"] = "interrupted"
        raise
    except Exception as exc:
        info["status"] = "error"
        info["error"] = f"{type(exc).__name__}: {exc}"
        print(f"  {mode}: {info['error']}", flush=True)
    finally:
        client.kill()
        if stack is not None:
            shm |= shm_files(stack.groups)
            stack.stop()
        for path in shm:
            Path(path).unlink(missing_ok=True)
        info["shm_files_removed"] = len(shm)
        shutil.rmtree(work, ignore_errors=True)
        info["wall_s"] = round(time.monotonic() - t0, 1)
        (cfg.results / f"mode_{mode}.json").write_text(json.dumps(info, indent=1))
    return info


def _ms(m: dict[str, Any] | None, key: str) -> str:
    return "-" if not m or m.get(key) is None else f"{m[key]:.1f}ms"
