"""One load point's client: vLLM's own benchmark client (``vllm.benchmarks.serve``), capped.

It runs in its own process, forked from a server that imported vLLM once (a point does
not pay vLLM's import each time); every request is capped and so is the point as a whole.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpush_dev.sweep.grid import MODEL_NAME, Point

TIMEOUT_MARKERS = ("TimeoutError", "ServerTimeoutError", "asyncio.exceptions.TimeoutError")


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
