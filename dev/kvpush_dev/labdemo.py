"""The 2P2D demo across lab hosts (``scripts/demo.sh --hosts``).

Like the 1P1D demo (same prompts, same per-request table and verdict), but every engine
runs with its kvpushd in its own network namespace ("host"), the router in another, and
the daemons move KV with UCX over TCP across veths, authenticated with per-host keys:

1. a colocated engine (no disaggregation, the machine's own namespace) answers the prompts;
2. the lab comes up (hosts p0 p1 d0 d1 rt on one bridge, 198.18.0.0/15 only);
3. kvpushd + a vLLM engine per engine host, the router on rt choosing P and D per request;
4. the prompts go through the router from rt; the table says whether each equals the
   colocated run, the decode engines' kvpush counters and which engines served are
   printed, and after the stop, what UCX said it used between the hosts.
"""

from __future__ import annotations

import asyncio
import signal
import tempfile
from pathlib import Path
from typing import Any

from kvpush_dev import vllm_env as ve
from kvpush_dev.demo_report import report
from kvpush_dev.labstack import EngineSpec, LabStack
from kvpush_dev.netlab import Lab, LabUnavailable, sweep_stale, unavailable_reason
from kvpush_dev.procs import free_port
from kvpush_dev.sse import run_prompts

TOPOLOGY = [EngineSpec("p0", "prefill", "0"), EngineSpec("p1", "prefill", "0"),
            EngineSpec("d0", "decode", "1"), EngineSpec("d1", "decode", "1")]


def colocated(model: Path, work: Path, ps: list[str], max_tokens: int, concurrency: int) -> list[dict[str, Any]]:
    """The reference: one engine, no connector, the same flags (in the machine's namespace)."""
    port = free_port()
    ref = ve.start_engine(model, port, work / "colocated.log", cpu_bind="0")
    try:
        ve.wait_healthy(f"http://127.0.0.1:{port}/health", 600, ref)
        url = f"http://127.0.0.1:{port}/v1/completions"
        asyncio.run(run_prompts(url, ps[:1], 2, 1))  # warm-up
        return asyncio.run(run_prompts(url, ps, max_tokens, concurrency))
    finally:
        ve.stop_group(ref, grace=10)


def run(model: Path, work: Path, ps: list[str], max_tokens: int, concurrency: int) -> int:
    why = unavailable_reason(need_nft=False)
    if why:
        print(f"kvpush lab demo: cannot run here: {why}")
        return 2
    print("starting the colocated reference engine ...", flush=True)
    reference = colocated(model, work, ps, max_tokens, concurrency)
    sweep_stale()
    lab = Lab(("p0", "p1", "d0", "d1", "rt"), name="demo")
    stack: LabStack | None = None

    def on_signal(signum: int, _frame: Any) -> None:
        if stack is not None:
            stack.stop()
        lab.down()
        raise SystemExit(130)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        lab.up()
        print("lab up: " + ", ".join(f"{h} {lab.addr(h)} ({lab.ns(h)})" for h in lab.hosts), flush=True)
        stack = LabStack(lab, model, work / "lab", list(TOPOLOGY))
        print("starting kvpushd + a vLLM engine on p0 p1 (prefill) and d0 d1 (decode), the router on rt ...",
              flush=True)
        stack.start()
        url = f"{stack.router_url}/v1/completions"
        stack.client(asyncio.run, run_prompts(url, ps[:2], 2, 2))  # warm-up
        before = {h: stack.tokens_by_source(h).get("external_kv_transfer", 0.0) for h in stack.hosts("decode")}
        pd = stack.client(asyncio.run, run_prompts(url, ps, max_tokens, concurrency))
        after = {h: stack.tokens_by_source(h).get("external_kv_transfer", 0.0) for h in stack.hosts("decode")}
        status = stack.router_status()
    except LabUnavailable as exc:
        print(f"kvpush lab demo: cannot run here: {exc}")
        return 2
    finally:
        if stack is not None:
            stack.stop()
        lab.down()
    rc = report(ps, reference, pd, sum(after[h] - before[h] for h in after))
    for h in after:
        print(f"  {h}: {after[h] - before[h]:.0f} prompt tokens through kvpush")
    for side in ("prefill", "decode"):
        print(f"  router {side}: " + ", ".join(f"{b['url']} served {b['served']} failed {b['failed']}"
                                              for b in status[side]))
    # the lanes, without the agent names: e.g. "inter-node cfg#1 rma_am(tcp/eth0) ... am(tcp/eth0)"
    seen = {line.split(" ", 1)[-1] for lines in stack.transports().values() for line in lines} if stack else set()
    print("UCX between hosts (its own log): " + ("; ".join(sorted(seen)) or "not logged"))
    if any(after[h] - before[h] <= 0 for h in after):
        print("FAILED: a decode engine got no prompt through kvpush")
        rc = rc or 1
    return rc


def main(args: Any, ps: list[str]) -> int:
    work = Path(args.workdir or tempfile.mkdtemp(prefix="kvpush-labdemo-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"kvpush lab demo (2P2D across network namespaces): logs in {work}")
    model = ve.ensure_tiny_model(args.model_dir)
    return run(model, work, ps, args.max_tokens, args.concurrency)
