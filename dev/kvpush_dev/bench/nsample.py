"""Parallel sampling through P/D: TTFT of ``n > 1`` against ``n = 1`` (issue 43).

Starts one P/D stack (tiny model, prefix caching on the decode engine, vLLM's default), then
sends ``--requests`` streamed completions one at a time through kvpush's router for each ``n``
(a fresh prompt each, so nothing is a prefix hit on the prefill side), and prints the p50 and
p90 time to the first streamed token per ``n`` and each one's ratio to ``n = 1``. Before the
fix the children after the first waited out their registration deadline (tens of seconds).

    python scripts/bench_nsample.py [--ns 1,2,4] [--requests 10] [--prompt 650]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import urllib.request
from pathlib import Path

from kvpush_dev import vllm_env
from kvpush_dev.bench.ttft import pct
from kvpush_dev.pd_stack import PDStack
from kvpush_dev.tiny_model import prompt_ids


def ttft(url: str, body: dict) -> float:
    """Seconds to the first streamed chunk that carries text."""
    req = urllib.request.Request(url, json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first = None
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if first is None and line.startswith("data:") and line != "data: [DONE]":
                if any(c.get("text") for c in json.loads(line[5:]).get("choices", [])):
                    first = time.perf_counter() - t0
    assert first is not None, "no token streamed"
    return first


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ns", default="1,2,4")
    ap.add_argument("--requests", type=int, default=10)
    ap.add_argument("--prompt", type=int, default=650)
    ap.add_argument("--work", type=Path, default=None)
    a = ap.parse_args(argv)
    ns = [int(x) for x in a.ns.split(",")]
    model = vllm_env.ensure_tiny_model(vllm_env.ROOT / ".models" / "tiny")
    work = a.work or Path(tempfile.mkdtemp(prefix="bench-nsample-"))
    stack = PDStack(model, work, d_prefix_caching=True).start()
    try:
        url = f"{stack.router_url}/v1/completions"
        for i in range(2):  # warm both engines
            ttft(url, {"model": "tiny", "prompt": prompt_ids(a.prompt, seed=900 + i), "max_tokens": 4})
        res: dict[int, list[float]] = {n: [] for n in ns}
        for i in range(a.requests):  # interleaved, so drift hits every n alike
            for n in ns:
                body = {"model": "tiny", "prompt": prompt_ids(a.prompt, seed=10_000 * n + i), "max_tokens": 8,
                        "n": n, "temperature": 0.8, "seed": i, "ignore_eos": True}
                res[n].append(ttft(url, body))
    finally:
        stack.stop()
    base = pct(res[ns[0]], 50)
    print(f"TTFT through kvpush's router, tiny model, {a.prompt}-token prompts, {a.requests} requests per n")
    print(f"| n | p50 ms | p90 ms | p50 / n={ns[0]} |")
    print("|---|---|---|---|")
    for n in ns:
        p50, p90 = pct(res[n], 50), pct(res[n], 90)
        print(f"| {n} | {p50 * 1e3:.1f} | {p90 * 1e3:.1f} | {p50 / base:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
