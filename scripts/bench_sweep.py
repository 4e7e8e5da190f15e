#!/usr/bin/env python3
"""Push vs pull, side by side: kvpush against vLLM's own P/D connectors, in one run.

Modes (each a prefill engine pinned to core 0 and a decode engine pinned to core 1, the same
engine flags: float32, eager, 64 MiB KV, decode-side prefix caching off, the same env):

- ``kvpush``: kvpushd + KVPushConnector + the kvpush router (scripts/pd_stack.py, unchanged);
- ``pull``: vLLM's NixlConnector (``kv_buffer_device: cpu``, ``kv_both``) behind a
  sequential proxy (scripts/baseline_proxy.py --mode pull): P first, then D with P's params;
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

    .venv/bin/python scripts/bench_sweep.py --quick --results-dir results/sweep-quick
    .venv/bin/python scripts/bench_sweep.py --results-dir DIR \\
        [--modes kvpush,pull,vllm-push] [--qps 1,2,4,8] [--input-lens 256,512,1024,1536] \\
        [--output-len 32] [--num-prompts 32] [--iterations 1] [--env UCX_TLS=...]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_env as ve  # noqa: E402
from pd_stack import PDStack, free_port  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODES = ("kvpush", "pull", "vllm-push", "colocated")
MODEL_NAME = "tiny"
# Prometheus families worth keeping per point (deltas over the load).
ENGINE_HISTOGRAMS = ("vllm:inter_token_latency_seconds", "vllm:request_time_per_output_token_seconds",
                     "vllm:time_to_first_token_seconds", "vllm:request_queue_time_seconds",
                     "vllm:request_prefill_time_seconds", "vllm:nixl_xfer_time_seconds")
ENGINE_COUNTERS = ("vllm:prompt_tokens_by_source_total", "vllm:nixl_num_failed_transfers",
                   "vllm:nixl_num_failed_notifications", "vllm:nixl_num_kv_expired_reqs",
                   "vllm:num_preemptions_total")
DAEMON_HISTOGRAMS = ("kvpush_write_latency_seconds",)
DAEMON_COUNTERS = ("kvpush_transfers_total", "kvpush_failures_total", "kvpush_timeouts_total",
                   "kvpush_bytes_written_total")
TIMEOUT_MARKERS = ("TimeoutError", "ServerTimeoutError", "asyncio.exceptions.TimeoutError")
WARMUP_PROMPTS = ("hello there", " ".join(["warm up the prefill and decode engines"] * 40))


# ---------------------------------------------------------------------------- the grid

@dataclass(frozen=True)
class Point:
    """One load point; its seed depends on the point only, so every mode sees the same prompts."""

    qps: float
    input_len: int
    output_len: int
    iteration: int

    def name(self, mode: str) -> str:
        return f"{mode}_qps{fmt_qps(self.qps)}_in{self.input_len}_out{self.output_len}_iter{self.iteration}"

    def seed(self, base: int) -> int:
        key = f"{fmt_qps(self.qps)}|{self.input_len}|{self.output_len}|{self.iteration}".encode()
        return (base + zlib.crc32(key)) % (2**31 - 1)


def fmt_qps(qps: float) -> str:
    return str(int(qps)) if float(qps).is_integer() else f"{qps:g}"


def build_points(pairs: list[tuple[float, int]], output_len: int, iterations: int) -> list[Point]:
    return [Point(q, i, output_len, it) for it in range(iterations) for q, i in pairs]


# ---------------------------------------------------------------------------- metrics

def parse_prometheus(text: str) -> dict[str, float]:
    """Series key (name plus labels, as printed) -> value; comments and junk are skipped."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, val = line.rpartition(" ")
        try:
            out[key] = float(val)
        except ValueError:
            continue
    return out


def scrape(url: str | None, timeout: float = 5.0) -> dict[str, float]:
    if not url:
        return {}
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return parse_prometheus(r.read().decode(errors="replace"))
    except (urllib.error.URLError, OSError, TimeoutError):
        return {}


def _le(key: str) -> float | None:
    if 'le="' not in key:
        return None
    raw = key.split('le="', 1)[1].split('"', 1)[0]
    return float("inf") if raw == "+Inf" else float(raw)


def histogram_delta(before: dict[str, float], after: dict[str, float], family: str) -> dict[str, Any] | None:
    """count/sum/mean and interpolated p50/p99 of a histogram family over an interval (all label sets summed)."""
    def total(suffix: str) -> float:
        return sum(v - before.get(k, 0.0) for k, v in after.items() if k.split("{", 1)[0] == family + suffix)

    count, ssum = total("_count"), total("_sum")
    if count <= 0:
        return None
    buckets: dict[float, float] = {}
    for k, v in after.items():
        if k.split("{", 1)[0] == family + "_bucket" and (le := _le(k)) is not None:
            buckets[le] = buckets.get(le, 0.0) + v - before.get(k, 0.0)
    edges = sorted(buckets.items())
    return {"count": count, "sum": ssum, "mean": ssum / count,
            "p50": hist_quantile(edges, 0.5), "p99": hist_quantile(edges, 0.99)}


def hist_quantile(edges: list[tuple[float, float]], q: float) -> float | None:
    """Prometheus-style: linear inside the bucket that holds the q-th observation (cumulative buckets)."""
    if not edges or edges[-1][1] <= 0:
        return None
    rank = q * edges[-1][1]
    lo_edge, lo_cnt = 0.0, 0.0
    for le, cnt in edges:
        if cnt >= rank:
            if le == float("inf"):
                return lo_edge
            span = cnt - lo_cnt
            return lo_edge + (le - lo_edge) * ((rank - lo_cnt) / span if span > 0 else 0.0)
        lo_edge, lo_cnt = le, cnt
    return lo_edge


def counter_deltas(before: dict[str, float], after: dict[str, float], families: tuple[str, ...]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()
            if k.split("{", 1)[0] in families and v - before.get(k, 0.0) != 0}


def metric_summary(before: dict[str, float], after: dict[str, float], hists: tuple[str, ...],
                   counters: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {h: d for h in hists if (d := histogram_delta(before, after, h)) is not None}
    out["counters"] = counter_deltas(before, after, counters)
    return out


def group_cpu_seconds(proc: subprocess.Popen[bytes] | None) -> float:
    """CPU seconds of a process and all its live descendants, plus what reaped children used."""
    if proc is None:
        return 0.0
    try:
        root = psutil.Process(proc.pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.NoSuchProcess:
            pass
    return total


def shm_files(groups: dict[str, subprocess.Popen[bytes]]) -> set[str]:
    """/dev/shm files mapped by the groups' processes (vLLM's queues, torch's KV segments).

    Why: engines that are SIGKILLed leave them behind (hundreds of MiB each); these are
    ours to remove once the mode is stopped.
    """
    out: set[str] = set()
    for proc in groups.values():
        try:
            root = psutil.Process(proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for p in procs:
            try:
                with open(f"/proc/{p.pid}/maps") as f:
                    for line in f:
                        if " /dev/shm/" in line and not line.rstrip().endswith("(deleted)"):
                            out.add(line.split(" /dev/shm/", 1)[1].strip())
            except OSError:
                pass
    return {f"/dev/shm/{name}" for name in out if "/" not in name}


def cpu_snapshot(groups: dict[str, subprocess.Popen[bytes]]) -> dict[str, float]:
    return {name: group_cpu_seconds(p) for name, p in groups.items()}


# ---------------------------------------------------------------------------- the stacks

@dataclass
class ModeStack:
    """What the sweep needs from a running mode: URLs, process groups, metrics endpoints."""

    mode: str
    front_url: str
    p_url: str
    d_url: str
    groups: dict[str, subprocess.Popen[bytes]]
    metrics: dict[str, str]  # role -> /metrics URL (prefill, decode, daemon)
    stop: Any  # () -> None




def quiet_port(lo: int = 20000, hi: int = 32000) -> int:
    """A free port below the kernel's ephemeral range (see pd_stack.free_port)."""
    return free_port(lo, hi)


def nixl_transfer_config(connector: str, engine_id: str) -> dict[str, Any]:
    """vLLM's NIXL connectors as the baselines run them: CPU buffers, both roles, fixed engine id."""
    return {"kv_connector": connector, "kv_role": "kv_both", "kv_buffer_device": "cpu",
            "engine_id": engine_id, "kv_load_failure_policy": "recompute"}


def start_kvpush(model: Path, work: Path, logs: Path, startup_timeout: float) -> ModeStack:
    stack = PDStack(model, work)

    def stop() -> None:
        stack.stop()
        for log in work.glob("*.log"):
            shutil.copy(log, logs / log.name)

    try:
        stack.start(timeout=startup_timeout)
    except BaseException:
        stop()
        raise
    return ModeStack("kvpush", stack.router_url, stack.p_url, stack.d_url, dict(stack.procs),
                     {"prefill": f"{stack.p_url}/metrics", "decode": f"{stack.d_url}/metrics",
                      "daemon": f"http://127.0.0.1:{stack.metrics_port}/metrics"}, stop)


def start_colocated(model: Path, logs: Path, startup_timeout: float) -> ModeStack:
    """One engine on both cores, no connector: the non-disaggregated alternative."""
    port = quiet_port()
    proc = ve.start_engine(model, port, logs / "colocated.log", cpu_bind="0-1")

    def stop() -> None:
        ve.stop_group(proc, grace=10)

    url = f"http://127.0.0.1:{port}"
    try:
        ve.wait_healthy(f"{url}/health", startup_timeout, proc)
    except BaseException:
        stop()
        raise
    return ModeStack("colocated", url, url, url, {"engine": proc}, {"decode": f"{url}/metrics"}, stop)


def start_nixl(mode: str, model: Path, logs: Path, startup_timeout: float, request_timeout: float) -> ModeStack:
    connector = "NixlConnector" if mode == "pull" else "NixlPushConnector"
    p_port, d_port, px_port, p_side, d_side = (quiet_port() for _ in range(5))
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def stop() -> None:
        for name in ("proxy", "decode", "prefill"):
            if (p := procs.pop(name, None)) is not None:
                try:
                    ve.stop_group(p, grace=10)
                except Exception as exc:  # keep cleaning the others
                    print(f"warning: stopping {name}: {exc}", flush=True)

    side = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}
    try:
        procs["prefill"] = ve.start_engine(
            model, p_port, logs / "prefill.log", cpu_bind="0",
            kv_transfer_config=nixl_transfer_config(connector, "prefill"),
            env_extra={**side, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(p_side)})
        procs["decode"] = ve.start_engine(
            model, d_port, logs / "decode.log", cpu_bind="1", extra_args=["--no-enable-prefix-caching"],
            kv_transfer_config=nixl_transfer_config(connector, "decode"),
            env_extra={**side, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(d_side)})
        p_url, d_url = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
        cmd = [ve.vllm_python(), str(ROOT / "scripts" / "baseline_proxy.py"),
               "--mode", "pull" if mode == "pull" else "push", "--port", str(px_port),
               "--prefill", p_url, "--decode", d_url, "--prefill-engine-id", "prefill",
               "--prefill-side-port", str(p_side), "--request-timeout", str(request_timeout),
               "--prefill-timeout", str(request_timeout)]
        with open(logs / "proxy.log", "ab") as log:
            procs["proxy"] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, start_new_session=True)
        ve.wait_healthy(f"{p_url}/health", startup_timeout, procs["prefill"])
        ve.wait_healthy(f"{d_url}/health", startup_timeout, procs["decode"])
        front = f"http://127.0.0.1:{px_port}"
        ve.wait_healthy(f"{front}/health", 120, procs["proxy"])
    except BaseException:
        stop()
        raise
    return ModeStack(mode, front, p_url, d_url, dict(procs),
                     {"prefill": f"{p_url}/metrics", "decode": f"{d_url}/metrics"}, stop)


# ---------------------------------------------------------------------------- the client

def _client_entry(spec: dict[str, Any]) -> None:
    """Runs in a forked child: vLLM's benchmark client with a per-request cap; records the prompts.

    Why patch: the client's session has a fixed 6 h timeout and no flag for it; a hung P/D
    request must end as a recorded timeout, not hold the point until it is killed.
    """
    os.setsid()  # its own group: the sweep kills the whole client on the point cap
    fd = os.open(spec["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    import types

    import aiohttp
    import vllm.benchmarks.serve as vs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cap = float(spec["request_timeout_s"])
    shim = types.ModuleType("aiohttp_capped")
    shim.__dict__.update(aiohttp.__dict__)

    def capped_session(*a: Any, **kw: Any) -> aiohttp.ClientSession:
        kw["timeout"] = aiohttp.ClientTimeout(total=cap)
        return aiohttp.ClientSession(*a, **kw)

    shim.ClientSession = capped_session  # type: ignore[attr-defined]
    vs.aiohttp = shim  # type: ignore[attr-defined]
    orig_samples = vs.get_samples

    def recording_samples(args: Any, tokenizer: Any) -> Any:
        reqs = orig_samples(args, tokenizer)
        Path(spec["prompts_out"]).write_text(json.dumps([r.prompt for r in reqs]))
        return reqs

    vs.get_samples = recording_samples  # type: ignore[attr-defined]
    parser = FlexibleArgumentParser()
    vs.add_cli_args(parser)
    vs.main(parser.parse_args(spec["argv"]))
    sys.stdout.flush()


def _noop() -> None:
    pass


@dataclass
class ClientRunner:
    """vLLM's benchmark client, one process per point, forked from a server that imported vLLM once."""

    ctx: Any = field(default_factory=lambda: mp.get_context("forkserver"))
    current: Any = None
    _warming: threading.Thread | None = None

    def warm(self) -> None:
        """Start the fork server in the background: it imports vLLM while the engines boot."""
        def go() -> None:
            self.ctx.set_forkserver_preload(["vllm.benchmarks.serve"])
            p = self.ctx.Process(target=_noop, daemon=False)
            p.start()
            p.join(timeout=600)

        self._warming = threading.Thread(target=go, name="forkserver-warm", daemon=True)
        self._warming.start()

    def run(self, spec: dict[str, Any], cap_s: float) -> tuple[str, float]:
        """Returns (status, seconds): ok | client_error | point_timeout."""
        if self._warming is not None:
            self._warming.join()
        t0 = time.monotonic()
        p = self.ctx.Process(target=_client_entry, args=(spec,), daemon=False)
        p.start()
        self.current = p
        try:
            p.join(timeout=cap_s)
            if p.is_alive():
                self.kill()
                return "point_timeout", time.monotonic() - t0
            return ("ok" if p.exitcode == 0 else "client_error"), time.monotonic() - t0
        finally:
            self.current = None

    def kill(self) -> None:
        p = self.current
        if p is None or p.pid is None:
            return
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            p.kill()
        p.join(timeout=10)


def client_argv(front_url: str, model: Path, pt: Point, num_prompts: int, seed: int, raw_dir: Path,
                raw_name: str) -> list[str]:
    return ["--backend", "openai", "--base-url", front_url, "--endpoint", "/v1/completions",
            "--model", MODEL_NAME, "--tokenizer", str(model), "--dataset-name", "random",
            "--random-input-len", str(pt.input_len), "--random-output-len", str(pt.output_len),
            "--num-prompts", str(num_prompts), "--request-rate", str(pt.qps), "--seed", str(seed),
            "--ignore-eos", "--temperature", "0", "--save-result", "--save-detailed",
            "--result-dir", str(raw_dir), "--result-filename", raw_name,
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--ready-check-timeout-sec", "0", "--disable-tqdm"]


def point_cap(pt: Point, num_prompts: int, request_timeout: float) -> float:
    """Arrivals (Poisson, so up to ~2x the mean span) + one request cap + client start-up."""
    return 2.0 * num_prompts / pt.qps + request_timeout + 90.0


def summarize_raw(raw: dict[str, Any], num_prompts: int, output_len: int) -> dict[str, Any]:
    """The point's latency numbers from vLLM's result file; None where nothing completed."""
    completed = int(raw.get("completed", 0))
    errors = [e for e in raw.get("errors", []) if e]
    timed_out = sum(1 for e in errors if any(m in e for m in TIMEOUT_MARKERS))
    failed_total = int(raw.get("failed", len(errors)))
    out: dict[str, Any] = {
        "completed": completed, "failed": max(failed_total - timed_out, 0), "timed_out": timed_out,
        "num_prompts": num_prompts, "duration_s": raw.get("duration"),
        "short_outputs": sum(1 for n in raw.get("output_lens", []) if 0 < n < output_len),
        "throughput": {"requests_per_s": raw.get("request_throughput"),
                       "output_tokens_per_s": raw.get("output_throughput"),
                       "total_tokens_per_s": raw.get("total_token_throughput")},
        "error_samples": sorted({e.strip().splitlines()[-1][:300] for e in errors})[:5],
    }
    for m in ("ttft", "tpot", "itl", "e2el"):
        out[m] = None if completed == 0 else {
            "mean": raw.get(f"mean_{m}_ms"), "median": raw.get(f"median_{m}_ms"), "p99": raw.get(f"p99_{m}_ms")}
    return out


# ---------------------------------------------------------------------------- correctness

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


# ---------------------------------------------------------------------------- one mode

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
        if mode == "kvpush":
            stack = start_kvpush(cfg.model, work, logs, cfg.startup_timeout)
        elif mode == "colocated":
            stack = start_colocated(cfg.model, logs, cfg.startup_timeout)
        else:
            stack = start_nixl(mode, cfg.model, logs, cfg.startup_timeout, cfg.request_timeout)
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


# ---------------------------------------------------------------------------- CLI

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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results-dir", required=True)
    ap.add_argument("--model-dir", default=str(ROOT / ".models" / "tiny"), help="built if missing (scripts/build_tiny_model.py)")
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
    model = ve.ensure_tiny_model(args.model_dir)
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
