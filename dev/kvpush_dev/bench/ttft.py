"""TTFT at low load, side by side in one run: where does a request's first token go?

Modes, one after the other on the same machine, engines with the same flags, each engine's
whole process group pinned to one core (``vllm_env.start_engine``):

- ``colocated``: one engine, no connector (core 0): the floor;
- ``prefill``: the kvpush stack's prefill engine asked directly (no KV parameters);
- ``kvpush``: kvpushd + KVPushConnector + the kvpush router (``kvpush_dev.pd_stack.PDStack``),
  each device daemon on its own engine's core, the router on the decode engine's;
- ``kvpush_shared``: the same, both daemons on the decode engine's core (the placement before);
- ``kvpush_insecure``: the same stack with ``insecure_peers = true`` (what peer authentication costs);
- ``kvpush_serial``: the kvpush stack behind the same sequential (serial) proxy as ``pull``
  (P first; P's answered ``kv_transfer_params`` forwarded to D): a drop-in behind serial proxies;
- ``pull``: vLLM's NixlConnector behind the sequential proxy (``kvpush_dev.sweep.launchers.start_nixl``).

Per mode: sequential streaming requests (one at a time, greedy, ``--output-len`` tokens) at
each prompt length (exact token counts: prompts are token-ID lists, distinct per request and
identical across modes, so no prefix cache hides a transfer), then a concurrency pass
(``--concurrency`` clients, lengths cycling). It prints TTFT p50/p90/p99 per mode and length,
what kvpush adds over colocated, and for kvpush the median request's breakdown by hop from
the timeline (router + both daemons + both engine plugins, ``kvpushctl trace``).

A new user's measurement (``--user-way``): the same prompts sent back to back (no pause),
8 output tokens, colocated on one core against kvpush, one table in docs/results/.

    .venv/bin/python scripts/bench_ttft.py [--json] [--lengths 16,256,1024,2000] [--requests 20]
        [--modes colocated,prefill,kvpush,kvpush_insecure,pull] [--out FILE]

Targets (GOALS.md): kvpush p50 <= colocated p50 + 10 ms and p90 <= colocated p90 + 25 ms at
every length; no request slower than 3x its length's p50; concurrency: p50 <= 1.5x colocated.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvpush import proto
from kvpush.daemon.ops.ctl import Target, ask, fetch_router_trace, merge_trace
from kvpush.proto.trace import breakdown
from kvpush_dev import vllm_env as ve
from kvpush_dev.pd_stack import PDStack, prompt_tokens_by_source
from kvpush_dev.procs import free_port, group_cpu_seconds
from kvpush_dev.sse import sse_data
from kvpush_dev.sweep.launchers import start_nixl

ROOT = ve.ROOT
MODES = ("colocated", "prefill", "kvpush", "kvpush_shared", "kvpush_insecure", "kvpush_serial", "pull")
VOCAB = 1000  # token IDs drawn below the tiny model's vocabulary size


def prompt_ids(length: int, index: int, seed: int) -> list[int]:
    rng = random.Random(f"{seed}:{length}:{index}")
    return [rng.randrange(10, VOCAB) for _ in range(length)]


def pct(vals: list[float], q: float) -> float:
    s = sorted(vals)
    k = max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))
    return s[k]


def stats(vals: list[float]) -> dict[str, float]:
    if not vals:
        return {}
    return {"n": len(vals), "p50": round(pct(vals, 50), 2), "p90": round(pct(vals, 90), 2),
            "p99": round(pct(vals, 99), 2), "max": round(max(vals), 2),
            "mean": round(statistics.fmean(vals), 2)}


async def one(session: Any, url: str, ids: list[int], out_len: int) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": ids, "max_tokens": out_len, "temperature": 0.0,
            "stream": True, "ignore_eos": True}
    t0 = time.perf_counter()
    stamps: list[float] = []
    text: list[str] = []
    async with session.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            return {"error": f"HTTP {r.status}: {(await r.text())[:200]}"}
        tid = r.headers.get("x-kvpush-transfer-id")
        async for data in sse_data(r):
            if "error" in data:
                return {"error": str(data["error"])[:200]}
            if len(stamps) < 2:  # the first two tokens' chunks (a text may be empty: a partial UTF-8 char)
                stamps.append(time.perf_counter())
            text.append(data["choices"][0].get("text", ""))
    ms = [(t - t0) * 1e3 for t in stamps] + [None, None]
    return {"ttft_ms": ms[0], "second_ms": ms[1], "text": "".join(text), "transfer_id": tid}


async def run_mode(url: str, lengths: list[int], n: int, out_len: int, conc: int, seed: int,
                   pause_s: float = 0.05) -> dict[str, Any]:
    """``pause_s`` between sequential requests (0: back to back, the way a user's client loop
    sends them); ``conc`` 0 skips the concurrency pass."""
    import aiohttp

    res: dict[str, Any] = {"sequential": {}, "concurrent": []}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
        for L in lengths:  # warm-up (not measured): one request per length
            await one(s, url, prompt_ids(L, -1, seed + 1), out_len)
        for L in lengths:
            rows = []
            for i in range(n):
                rows.append(await one(s, url, prompt_ids(L, i, seed), out_len))
                if pause_s:
                    await asyncio.sleep(pause_s)
            res["sequential"][L] = rows
        sem = asyncio.Semaphore(conc)

        async def limited(i: int) -> dict[str, Any]:
            async with sem:
                L = lengths[i % len(lengths)]
                return {"len": L, **await one(s, url, prompt_ids(L, 1000 + i, seed), out_len)}

        t0 = time.perf_counter()
        res["concurrent"] = await asyncio.gather(*(limited(i) for i in range(conc * 8)))
        res["concurrent_wall_s"] = max(time.perf_counter() - t0, 1e-9)
    return res


def timelines(stack: PDStack, router_url: str, tids: list[str]) -> dict[str, dict[str, int]]:
    """Transfer ID -> {hop: first stamp ns} from both daemons and the router."""
    out = {}
    for tid in tids:
        targets = [Target(stack.ops_socket(i), f"cpu{i}") for i in (0, 1)]
        ask(targets, proto.OpsRequest("trace", tid), 5.0)
        rows = merge_trace(targets, fetch_router_trace(router_url, tid))
        first: dict[str, int] = {}
        for r in rows:
            first.setdefault(r["hop"], int(r["t_ms"] * 1e6))
        out[tid] = first
    return out


def write_latencies(stack: PDStack) -> dict[str, Any]:
    """The prefill daemon's recent WRITEs (post to completion), by size: p50/p99 ms."""
    t = Target(stack.ops_socket(0), "cpu0")
    ask([t], proto.OpsRequest("transfers"), 5.0)
    by: dict[int, list[float]] = {}
    for r in (t.data or {}).get("recent") or []:
        if r.get("side") == "prefill" and r.get("result") == "ok":
            by.setdefault(int(r["bytes"]), []).append(float(r["latency_ms"]))
    return {f"{b / 2**20:.2f}MiB": {"n": len(v), "p50_ms": round(pct(v, 50), 3), "p99_ms": round(pct(v, 99), 3)}
            for b, v in sorted(by.items())}


def idle_cores(groups: dict[str, Any], settle_s: float, seconds: float) -> dict[str, float]:
    """Cores each process group uses while nothing is sent (after vLLM's 1 s queue spin)."""
    time.sleep(settle_s)
    c0 = {k: group_cpu_seconds(p) for k, p in groups.items()}
    time.sleep(seconds)
    return {k: round((group_cpu_seconds(p) - c0[k]) / seconds, 4) for k, p in groups.items()}


def summarize(mode_res: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"sequential": {}, "errors": 0}
    for L, rows in mode_res["sequential"].items():
        ok = [r["ttft_ms"] for r in rows if r.get("ttft_ms") is not None]
        out["errors"] += len(rows) - len(ok)
        out["sequential"][str(L)] = stats(ok)
    conc = [r["ttft_ms"] for r in mode_res["concurrent"] if r.get("ttft_ms") is not None]
    out["errors"] += len(mode_res["concurrent"]) - len(conc)
    out["concurrent"] = stats(conc)
    n = len(mode_res["concurrent"])
    if not n:
        return out
    out["concurrent"]["requests_per_s"] = round(n / mode_res["concurrent_wall_s"], 2)
    out["concurrent"]["p50_by_length"] = {
        str(L): round(pct([r["ttft_ms"] for r in mode_res["concurrent"] if r["len"] == L and r.get("ttft_ms")], 50), 2)
        for L in sorted({r["len"] for r in mode_res["concurrent"]})}
    return out


def table_md(result: dict[str, Any], argv: list[str]) -> str:
    """The run as a markdown table: per length, each mode's p50/p90 and kvpush's delta over colocated,
    then the median kvpush request's hops."""
    cfg, summary = result["config"], result["summary"]
    modes = [m for m in cfg["modes"] if m in summary]
    base = summary.get("colocated", {}).get("sequential", {})
    load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else []
    lines = [f"# TTFT, streaming, {cfg['requests']} requests per length, {cfg['output_len']} output tokens, "
             f"pause {cfg['pause_ms']:g} ms between requests",
             "", f"Command: `scripts/bench_ttft.py {' '.join(argv)}`  ",
             f"Load average at the end: {' '.join(load)} (figures are noisy when it exceeds 2).", "",
             "| tokens | " + " | ".join(f"{m} p50 / p90 ms" for m in modes) + " | minus colocated, p50 / p90 ms |",
             "|---:|" + "---:|" * (len(modes) + 1)]
    for L in map(str, cfg["lengths"]):
        cells = [f"{summary[m]['sequential'][L]['p50']:.1f} / {summary[m]['sequential'][L]['p90']:.1f}"
                 if summary[m]["sequential"].get(L) else "–" for m in modes]
        deltas = [f"{m}: {summary[m]['sequential'][L]['p50'] - base[L]['p50']:+.1f} / "
                  f"{summary[m]['sequential'][L]['p90'] - base[L]['p90']:+.1f}"
                  for m in modes if m.startswith("kvpush") and summary[m]["sequential"].get(L) and base.get(L)]
        lines.append(f"| {L} | " + " | ".join(cells) + f" | {'; '.join(deltas) or '–'} |")
    same = [f"{m} {summary[m]['tokens_equal_reference']}/{summary[m]['requests']}" for m in modes
            if summary[m].get("tokens_equal_reference") is not None and m != "colocated"]
    if same:
        lines += ["", "Requests whose tokens equal the reference mode's (colocated): " + ", ".join(same) + "."]
    hops = result.get("kvpush_segment_p50") or {}
    if hops:
        segs = list(dict.fromkeys(s for h in hops.values() for s in h))
        lines += ["", "kvpush, each segment's p50 over the requests of a length, ms between consecutive hops "
                  "(kvpushctl trace; a segment missing from half the requests is left out):", "",
                  "| segment | " + " | ".join(hops) + " |", "|---|" + "---:|" * len(hops)]
        for seg in segs:
            lines.append(f"| {seg} | " + " | ".join(f"{h[seg]:.2f}" if seg in h else "–" for h in hops.values()) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default=str(ROOT / ".models" / "tiny"))
    ap.add_argument("--lengths", default="16,256,1024,2000")
    ap.add_argument("--requests", type=int, default=20, help="sequential requests per length")
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--idle-seconds", type=float, default=5.0, help="idle CPU sample per mode (0: skip)")
    ap.add_argument("--pause-ms", type=float, default=50.0, help="pause between sequential requests (0: back to back)")
    ap.add_argument("--user-way", action="store_true",
                    help="a new user's measurement: colocated and kvpush only, requests back to back "
                         "(no pause), no concurrency pass, no idle sample; writes --table")
    ap.add_argument("--aux-cpus", default=None,
                    help="cores of the kvpush stack's daemons and router (default: PDStack's, the decode engine's)")
    ap.add_argument("--router-cpus", default=None, help="cores of the kvpush router (default: with the daemons)")
    ap.add_argument("--table", default=None, help="write a markdown table of p50/p90 and kvpush's delta here")
    ap.add_argument("--rounds", type=int, default=1,
                    help="colocated and kvpush this many times each, A B B A, on fresh engines; requests pooled")
    args = ap.parse_args(argv)
    if args.user_way:
        args.modes = args.modes if args.modes != ",".join(MODES) else "colocated,kvpush"
        args.pause_ms, args.concurrency, args.idle_seconds = 0.0, 0, 0.0
        args.table = args.table or str(ROOT / "docs" / "results" / "ttft_back_to_back.md")
    lengths = [int(x) for x in args.lengths.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    bad = set(modes) - set(MODES)
    if bad:
        ap.error(f"unknown modes {sorted(bad)}; choose from {MODES}")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="kvpush-ttft-"))
    work.mkdir(parents=True, exist_ok=True)
    model = ve.ensure_tiny_model(args.model_dir)
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
    raw: dict[str, Any] = {}
    idle: dict[str, dict[str, float]] = {}
    writes: dict[str, Any] = {}
    hops: dict[str, Any] = {}
    seg_p50: dict[str, dict[str, float]] = {}
    texts: dict[str, dict[str, str]] = {}

    segs_by_len: dict[str, dict[str, list[float]]] = {}  # every round's kvpush hops
    tids_by_len: dict[str, int] = {}
    rnd = 0

    def measure(mode: str, url: str) -> dict[str, Any]:
        """This round's requests; pooled into ``raw`` with the earlier rounds' (texts keyed
        ``L:i`` in round 0, ``L:i#r`` after: the same prompt, another engine)."""
        log(f"[{mode}] measuring at {url}" + (f" (round {rnd + 1})" if args.rounds > 1 else ""))
        res = asyncio.run(run_mode(url, lengths, args.requests, args.output_len, args.concurrency, args.seed,
                                   args.pause_ms / 1e3))
        if mode in raw:
            for L, rows in res["sequential"].items():
                raw[mode]["sequential"][L] = raw[mode]["sequential"][L] + rows
        else:
            raw[mode] = res
        suffix = f"#{rnd}" if rnd else ""
        texts.setdefault(mode, {}).update({f"{L}:{i}{suffix}": r.get("text", "") for L, rows in res["sequential"].items()
                                           for i, r in enumerate(rows)})
        return res

    def run_colocated() -> None:
        port = free_port()
        proc = ve.start_engine(model, port, work / f"colocated-{rnd}.log", cpu_bind="0")
        try:
            ve.wait_healthy(f"http://127.0.0.1:{port}/health", 600, proc)
            measure("colocated", f"http://127.0.0.1:{port}")
            if args.idle_seconds:
                idle["colocated"] = idle_cores({"engine": proc}, 3.0, args.idle_seconds)
        finally:
            ve.stop_group(proc, grace=10)

    def run_kvpush() -> None:
        nonlocal hops, writes
        placement = {k: v for k, v in (("aux_cpus", args.aux_cpus), ("router_cpus", args.router_cpus)) if v}
        stack = PDStack(model, work / f"kvpush-{rnd}", **placement)
        stack.start()
        try:
            if "prefill" in modes:
                measure("prefill", stack.p_url)
            if "kvpush" in modes:
                res = measure("kvpush", stack.router_url)
                time.sleep(0.5)  # the last TraceReports reach the daemons
                per_len = {}
                for L, rows in res["sequential"].items():
                    done = [r for r in rows if r.get("ttft_ms") is not None and r.get("transfer_id")]
                    if not done:
                        continue
                    med = sorted(done, key=lambda r: r["ttft_ms"])[len(done) // 2]
                    tl = timelines(stack, stack.router_url, [med["transfer_id"]])[med["transfer_id"]]
                    per_len[str(L)] = {"ttft_ms": round(med["ttft_ms"], 2), "transfer_id": med["transfer_id"],
                                       "hops_ms": breakdown(tl)}
                hops = per_len
                for L, rows in res["sequential"].items():  # every request's hops, not only the median one
                    ttft = {r["transfer_id"]: r["ttft_ms"] for r in rows
                            if r.get("ttft_ms") is not None and r.get("transfer_id")}
                    tids = list(ttft)
                    tids_by_len[str(L)] = tids_by_len.get(str(L), 0) + len(tids)
                    segs = segs_by_len.setdefault(str(L), {})
                    for tid, tl in timelines(stack, stack.router_url, tids).items():
                        for seg, v in breakdown(tl).items():
                            segs.setdefault(seg, []).append(v)
                        out = [tl[h] for h in ("router.prefill_first_token", "router.decode_first_byte") if h in tl]
                        if "router.request_in" in tl and out:  # the first token: the prefill leg's, or the decode's
                            inside = (min(out) - tl["router.request_in"]) / 1e6
                            segs.setdefault("router.request_in -> first token out", []).append(inside)
                            segs.setdefault("client (TTFT outside the router)", []).append(ttft[tid] - inside)
                raw["kvpush"]["decode_prompt_tokens_by_source"] = prompt_tokens_by_source(stack.d_url)
                writes = write_latencies(stack)
            if args.idle_seconds:
                idle["kvpush"] = idle_cores(dict(stack.procs), 3.0, args.idle_seconds)
        finally:
            stack.stop()

    # colocated and kvpush, round by round, in reverse order every other round (A B B A): each
    # round starts fresh engines, and one engine's luck moves TTFT at 2,000 tokens by ~5 ms
    pair = [f for m, f in (("colocated", run_colocated), ("kvpush", run_kvpush))
            if m in modes or (m == "kvpush" and "prefill" in modes)]
    for rnd in range(args.rounds):
        for run in (pair if rnd % 2 == 0 else pair[::-1]):
            run()
    seg_p50 = {L: {seg: round(pct(v, 50), 3) for seg, v in segs.items() if len(v) * 2 >= tids_by_len[L]}
               for L, segs in segs_by_len.items()}
    if "kvpush_shared" in modes:  # the placement before daemons_beside_engines: every daemon on D's core
        stack = PDStack(model, work / "kvpush_shared", daemons_beside_engines=False)
        stack.start()
        try:
            measure("kvpush_shared", stack.router_url)
        finally:
            stack.stop()
    if "kvpush_insecure" in modes:  # the same stack with insecure_peers = true: what auth costs
        stack = PDStack(model, work / "kvpush_insecure", insecure_peers=True)
        stack.start()
        try:
            measure("kvpush_insecure", stack.router_url)
        finally:
            stack.stop()
    if "kvpush_serial" in modes:  # kvpush behind the serial proxy the pull baseline uses
        stack = PDStack(model, work / "kvpush_serial", with_router=False)
        stack.start()
        px_port = free_port()
        with open(work / "kvpush_serial" / "proxy.log", "ab") as plog:
            proxy = subprocess.Popen(
                [ve.vllm_python(), "-m", "kvpush_dev.baseline_proxy", "--mode", "pull", "--port", str(px_port),
                 "--prefill", stack.p_url, "--decode", stack.d_url],
                stdout=plog, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            ve.wait_healthy(f"http://127.0.0.1:{px_port}/health", 120, proxy)
            measure("kvpush_serial", f"http://127.0.0.1:{px_port}")
            raw["kvpush_serial"]["decode_prompt_tokens_by_source"] = prompt_tokens_by_source(stack.d_url)
        finally:
            ve.stop_group(proxy, grace=5)
            stack.stop()
    if "pull" in modes:
        logs = work / "pull"
        logs.mkdir(exist_ok=True)
        ms = start_nixl("pull", model, logs, 600, 120)
        try:
            measure("pull", ms.front_url)
        finally:
            ms.stop()

    summary = {m: summarize(r) for m, r in raw.items()}
    ref = texts.get("colocated") or texts.get("prefill") or {}
    for m, t in texts.items():
        summary[m]["tokens_equal_reference"] = sum(t[k] == ref.get(k.split("#")[0]) for k in t) if ref else None
        summary[m]["requests"] = len(t)
    verdict: dict[str, Any] = {}
    if "colocated" in summary and "kvpush" in summary:
        c, k = summary["colocated"], summary["kvpush"]
        for L in map(str, lengths):
            cs, ks = c["sequential"].get(L), k["sequential"].get(L)
            if not cs or not ks:
                continue
            rows = raw["kvpush"]["sequential"][int(L)]
            worst = max(r["ttft_ms"] for r in rows if r.get("ttft_ms") is not None)
            verdict[L] = {
                "added_p50_ms": round(ks["p50"] - cs["p50"], 2),
                "added_p90_ms": round(ks["p90"] - cs["p90"], 2),
                "p50_ok": ks["p50"] <= cs["p50"] + 10, "p90_ok": ks["p90"] <= cs["p90"] + 25,
                "worst_over_p50": round(worst / ks["p50"], 2), "no_outlier_ok": worst <= 3 * ks["p50"],
            }
        if c["concurrent"] and k["concurrent"]:
            r = k["concurrent"]["p50"] / c["concurrent"]["p50"]
            verdict["concurrent"] = {"p50_ratio": round(r, 3), "ok": r <= 1.5}
    if "colocated" in idle and "kvpush" in idle:
        base = idle["colocated"]["engine"]
        verdict["idle"] = {role: {"cores": idle["kvpush"][role], "over_colocated": round(idle["kvpush"][role] - base, 4),
                                  "ok": idle["kvpush"][role] <= base + 0.02} for role in ("prefill", "decode")}
    if "kvpush_insecure" in summary and "kvpush" in summary:
        k, i = summary["kvpush"], summary["kvpush_insecure"]
        verdict["auth_cost_p50_ms"] = {L: round(v["p50"] - i["sequential"][L]["p50"], 2)
                                       for L, v in k["sequential"].items() if v and i["sequential"].get(L)}
        if k["concurrent"] and i["concurrent"]:
            verdict["auth_cost_concurrent_p50_ratio"] = round(k["concurrent"]["p50"] / i["concurrent"]["p50"], 3)
    if "pull" in summary and "kvpush_serial" in summary:  # the same serial proxy in front of both
        ks, pl = summary["kvpush_serial"], summary["pull"]
        verdict["serial_vs_pull_p50"] = {L: round(ks["sequential"][L]["p50"] / v["p50"], 3)
                                         for L, v in pl["sequential"].items() if v and ks["sequential"].get(L)}
        if ks["concurrent"] and pl["concurrent"]:
            verdict["serial_vs_pull_concurrent_p50"] = round(ks["concurrent"]["p50"] / pl["concurrent"]["p50"], 3)
        verdict["serial_decode_prompt_tokens_by_source"] = raw["kvpush_serial"].get("decode_prompt_tokens_by_source")
    if "pull" in summary and "kvpush" in summary:
        verdict["vs_pull_p50"] = {L: round(summary["kvpush"]["sequential"][L]["p50"] / v["p50"], 3)
                                  for L, v in summary["pull"]["sequential"].items()
                                  if v and summary["kvpush"]["sequential"].get(L)}
    result = {"config": {"lengths": lengths, "requests": args.requests, "output_len": args.output_len,
                         "concurrency": args.concurrency, "modes": modes, "pause_ms": args.pause_ms,
                         "aux_cpus": args.aux_cpus, "router_cpus": args.router_cpus},
              "summary": summary, "verdict": verdict, "kvpush_median_breakdown": hops,
              "kvpush_segment_p50": seg_p50, "idle_cores": idle,
              "kvpush_write_latency": writes,
              "decode_prompt_tokens_by_source": raw.get("kvpush", {}).get("decode_prompt_tokens_by_source")}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    if args.table:
        Path(args.table).write_text(table_md(result, argv if argv is not None else sys.argv[1:]))
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"\nTTFT ms (sequential, {args.requests} per length; concurrency {args.concurrency} last column)")
    print(f"{'mode':<16}" + "".join(f"{L:>22}" for L in lengths) + f"{'conc p50/p90':>18}")
    for m, s in summary.items():
        cells = "".join(f"{s['sequential'][str(L)]['p50']:>8.1f}/{s['sequential'][str(L)]['p90']:.1f}/"
                        f"{s['sequential'][str(L)]['p99']:.1f}".rjust(22) if s["sequential"].get(str(L)) else " " * 22
                        for L in lengths)
        cc = s["concurrent"]
        print(f"{m:<16}{cells}{(str(cc.get('p50')) + '/' + str(cc.get('p90'))):>18}  errors={s['errors']}")
    print("\nverdict:", json.dumps(verdict, indent=1))
    for L, h in hops.items():
        print(f"\nkvpush median request at {L} tokens ({h['ttft_ms']} ms, {h['transfer_id']}):")
        for seg, ms_ in h["hops_ms"].items():
            print(f"  {ms_:>9.3f} ms  {seg}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
