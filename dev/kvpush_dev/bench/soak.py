"""Soak benchmarks: does anything grow with the number of transfers? (issue 25, item 5)

Each subcommand drives many transfers through real components and prints the size of
every collection they keep, and the process RSS, at the start, the middle and the end; it
also writes the table to ``docs/results/soak_<name>.md``.

``daemons``: real transfers (one block each, 32 in flight) through a real prefill and decode
daemon pair with engine stand-ins (:mod:`kvpush_dev.daemon_harness`), 1 in 10 aborted by
the decode engine before its prefill (Released). The daemons' collections are their ops
``status`` view (records per core state, peers, writes in flight) and the ``pending`` rows;
their RSS is theirs (``status.rss_bytes``). The cores keep a tombstone 60 s, and the
allocator keeps what the purged ones used for reuse, so a warm-up of as many transfers runs
first (the same tombstone high-water mark) and the measurements around the run wait for the
tombstones to go: growth is measured from after the warm-up (target: at most 1 MiB).

``router``: requests through the real router (:mod:`kvpush.router.app`) in front of a
prefill and a decode engine stand-in (aiohttp on loopback: a JSON answer, an SSE stream),
64 in flight; 1 in 10 prefill legs fail (500), 1 in 10 clients go away mid-stream. The
router's collections are walked like the plugin's; the asyncio tasks and the session's
open connections are counted too. The router, the stand-ins and the client share the
process, so the RSS is theirs together.

``plugin``: both halves of the engine plugin (KVPushScheduler + KVPushWorker) of a prefill
engine and of a decode engine, in one process, called the way vLLM's scheduler and worker
call them, with vLLM's own ``Request`` objects; each worker talks to a daemon stand-in over
its real engine socket (:class:`kvpush_dev.engine_peer.FakeDaemon`), which the driver
answers as a daemon does. The mix, per 10 transfers: 7 succeed, 1 is aborted by the client
while its KV is loading (Abort, then Released), 1 is preempted (the decode request after its
load, the prefill request in the middle of a chunked prefill), 1 fails (ReceiveFailed on the
decode side, SendFailed on the prefill side). Collections are found by walking the halves'
attributes (any dict, set, list or deque, and the lifecycle cores' own), so a collection
nobody declared is found too. ``bounded`` ones (LRU caches and capped "said once" sets) may
sit at their cap; every other must be back at its baseline (the value before any transfer).

    python scripts/bench_soak.py plugin --transfers 100000
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil

RESULTS = Path(__file__).resolve().parents[3] / "docs" / "results"
BLOCK = 16
PROMPT = 64  # tokens: 4 blocks
WAVE = 64  # transfers in flight together (GOALS: the hook cost is judged at 64 in flight)
#: collections that are caches with a cap of their own: they may end at (never above) it
BOUNDED = {"trace._t": 1024, "_said._seen": 64, "_warned._seen": 32,
           "lifecycle.deadline_heap": 64}  # stale heap entries: rebuilt past 2 x live + 64


def rss_mib() -> float:
    return psutil.Process().memory_info().rss / 2**20


def collections_of(obj: Any, prefix: str = "", seen: set[int] | None = None) -> dict[str, int]:
    """Every container ``obj`` keeps (recursively through kvpush objects): name -> size."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return {}
    seen.add(id(obj))
    out: dict[str, int] = {}
    sizes = getattr(obj, "sizes", None)
    if callable(sizes) and type(obj).__module__.endswith("lifecycle"):
        return {f"{prefix}{k}": v for k, v in sizes().items()}
    attrs = vars(obj) if hasattr(obj, "__dict__") else {
        n: getattr(obj, n) for n in getattr(type(obj), "__slots__", ()) if hasattr(obj, n)}
    for name, v in attrs.items():
        if isinstance(v, (dict, set, frozenset, list, deque)):
            out[f"{prefix}{name}"] = len(v)
            if isinstance(v, dict) and name == "data":  # TransferSamples: lists per key
                out[f"{prefix}{name}[*]"] = sum(len(x) for x in v.values() if isinstance(x, list))
        elif type(v).__module__.startswith("kvpush") and not isinstance(v, (str, int, float, bool)):
            out.update(collections_of(v, f"{prefix}{name}.", seen))
    return out


# ------------------------------------------------------------------ the plugin soak


@dataclass
class Engine:
    """One engine's two plugin halves and the daemon stand-in its worker talks to."""

    role: str
    sched: Any
    worker: Any
    daemon: Any
    freed: set[str] = field(default_factory=set)  # finished_sending seen, this wave
    loaded: set[str] = field(default_factory=set)  # finished_recving seen, this wave

    def step(self, out: Any, forward: bool = True) -> None:
        """One engine step: the scheduler's metadata to the worker, the forward, the
        worker's finished sets back to the scheduler (as vLLM's connector calls do)."""
        meta = self.sched.build_connector_meta(out)
        self.worker.idle_step = meta.idle
        if meta.stamps:
            self.worker.take_stamps(meta.stamps)
        if meta:
            self.worker.publish(meta)
        if forward:
            self.worker.after_forward()
        fs, fr = self.worker.collect()
        self.freed |= fs
        self.loaded |= fr
        self.sched.update_connector_output(SimpleNamespace(finished_sending=fs, finished_recving=fr))
        self.worker.samples.take()  # what vLLM's stats hook drains every step
        self.worker.take_load_errors()


def sched_out(new: list[tuple[Any, int, int]] = (), cached: dict[str, int] | None = None) -> Any:
    """A SchedulerOutput with what the plugin reads: new requests (request, computed,
    scheduled tokens) and tokens per scheduled request."""
    scheduled = {r.request_id: n for r, _, n in new}
    scheduled.update(cached or {})
    return SimpleNamespace(
        total_num_scheduled_tokens=sum(scheduled.values()),
        num_scheduled_tokens=scheduled,
        scheduled_new_reqs=[SimpleNamespace(req_id=r.request_id, prompt_token_ids=r.prompt_token_ids,
                                            num_computed_tokens=c, block_ids=(blocks(r),)) for r, c, _ in new])


def blocks(r: Any) -> list[int]:
    base = (hash(r.request_id) % 1000) * 4
    return [base, base + 1, base + 2, base + 3]


def kv_blocks(r: Any) -> Any:
    return SimpleNamespace(get_block_ids=lambda: (blocks(r),))


class PluginSoak:
    def __init__(self, tmp: str) -> None:
        from kvpush.engine_plugin.config import PluginConfig
        from kvpush.engine_plugin.scheduler.half import KVPushScheduler
        from kvpush.engine_plugin.worker.half import KVPushWorker
        from kvpush_dev.engine_peer import FakeDaemon

        self.engines: dict[str, Engine] = {}
        for role in ("prefill", "decode"):
            ep = f"ipc://{tmp}/{role}.sock"
            daemon = FakeDaemon(ep, f"d-{role}")
            daemon.answer_aborts = role == "decode"  # Released, as the decode daemon's counter does
            cfg = PluginConfig(daemon=ep)
            w = KVPushWorker(cfg, engine_id=role, role=role, rank=0, tp_size=1, model="m", total_kv_heads=1)
            self.engines[role] = Engine(role, KVPushScheduler(cfg, block_size=BLOCK), w, daemon)
        end = time.monotonic() + 10
        for e in self.engines.values():
            while not e.worker.client.available:
                e.worker.client.poll()
                e.daemon.serve()
                if time.monotonic() > end:
                    raise RuntimeError("the plugin never saw its daemon stand-in")
                time.sleep(0.002)
        self.n = 0

    def close(self) -> None:
        for e in self.engines.values():
            e.worker.shutdown()
            e.daemon.close()

    def collections(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for role, e in self.engines.items():
            out.update(collections_of(e.sched, f"{role}.scheduler."))
            out.update(collections_of(e.worker, f"{role}.worker."))
        return out

    # ---------------------------------------------------------------- the daemons

    def answer(self, e: Engine, fail: set[str]) -> None:
        """What a daemon answers: Sent/SendFailed for a PrefillDone, SendFailed for a prefill
        Abort, Received/ReceiveFailed for a Register (Released for a decode Abort: FakeDaemon)."""
        from kvpush import proto

        for m in e.daemon.serve():
            if isinstance(m, proto.PrefillDone):
                e.daemon.send(proto.SendFailed(m.transfer_id, 0, "write failed") if m.transfer_id in fail
                              else proto.Sent(m.transfer_id, 0))
            elif isinstance(m, proto.Abort) and e.role == "prefill":
                e.daemon.send(proto.SendFailed(m.transfer_id, m.attempt, "aborted"))
            elif isinstance(m, proto.Register) and m.transfer_id not in self.held_back:
                e.daemon.send(proto.ReceiveFailed(m.transfer_id, m.attempt, "producer failed")
                              if m.transfer_id in fail else proto.Received(m.transfer_id, m.attempt))
        e.daemon.got.clear()

    def settle(self, e: Engine, until: Callable[[], bool], fail: set[str], cached: dict[str, int] | None = None,
               what: str = "") -> None:
        end = time.monotonic() + 10
        while not until():
            self.answer(e, fail)
            e.step(sched_out(cached=cached) if cached else sched_out(), forward=bool(cached))
            if time.monotonic() > end:
                raise RuntimeError(f"{e.role}: {what} never settled")

    # ---------------------------------------------------------------- one wave

    def wave(self, size: int) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request, RequestStatus

        first = self.n
        self.n += size
        kinds = {f"t{i}": ("ok", "ok", "ok", "ok", "ok", "ok", "ok", "abort", "preempt", "fail")[i % 10]
                 for i in range(first, self.n)}
        fail = {t for t, k in kinds.items() if k == "fail"}
        self.held_back = {t for t, k in kinds.items() if k == "abort"}

        def req(rid: str, params: dict[str, Any], max_tokens: int) -> Any:
            return Request(rid, list(range(PROMPT)), SamplingParams(
                max_tokens=max_tokens, extra_args={"kv_transfer_params": params}), None)

        # --- prefill engine: the early path for max_tokens 1, chunked + preempted for "preempt"
        p = self.engines["prefill"]
        preqs = {t: req(f"p-{t}", {"do_remote_decode": True, "transfer_id": t}, 1 if i % 2 else 2)
                 for i, t in enumerate(kinds)}
        for r in preqs.values():
            p.sched.get_num_new_matched_tokens(r, 0)
            p.sched.update_state_after_alloc(r, kv_blocks(r), 0)
        chunked = {t for t, k in kinds.items() if k == "preempt"}
        p.step(sched_out(new=[(r, 0, PROMPT // 2 if t in chunked else PROMPT) for t, r in preqs.items()]))
        for t in chunked:  # preempted after half its prompt; matched and allocated again, resumed
            r = preqs[t]
            p.sched.get_num_new_matched_tokens(r, 0)
            p.sched.update_state_after_alloc(r, kv_blocks(r), 0)
        p.step(sched_out(cached={preqs[t].request_id: PROMPT for t in chunked}))
        held: set[str] = set()
        for t, r in preqs.items():
            r.status = RequestStatus.FINISHED_ABORTED if kinds[t] == "abort" else RequestStatus.FINISHED_LENGTH_CAPPED
            hold, _ = p.sched.request_finished(r, blocks(r))
            if hold:
                held.add(r.request_id)
        self.settle(p, lambda: held <= p.freed, fail, what="held prefill blocks")
        p.freed.clear()

        # --- decode engine: claim, register, load (or fail, or abort while loading), decode
        d = self.engines["decode"]
        dparams = {t: {"do_remote_prefill": True, "transfer_id": t, "prefill_endpoints": ["tcp://10.0.0.1:17500"],
                       "prefill_tp_size": 1} for t in kinds}
        dreqs = {t: req(f"d-{t}", dparams[t], 4) for t in kinds}
        for r in dreqs.values():
            n, load = d.sched.get_num_new_matched_tokens(r, 0)
            assert load and n == PROMPT, (n, load)
            d.sched.update_state_after_alloc(r, kv_blocks(r), n)
        d.step(sched_out())  # Registers go out; this step schedules none of them
        loading = {r.request_id for t, r in dreqs.items() if kinds[t] != "abort"}
        self.settle(d, lambda: loading <= d.loaded, fail, what="loads")
        d.loaded.clear()
        aborted = set()
        for t in self.held_back:  # the client went away while the KV was loading
            r = dreqs[t]
            r.status = RequestStatus.FINISHED_ABORTED
            assert d.sched.request_finished(r, blocks(r))[0]
            aborted.add(r.request_id)
        running = {r.request_id: 1 for t, r in dreqs.items() if kinds[t] != "abort"}
        for r in dreqs.values():
            if r.request_id in running:  # back in the waiting queue: matched again, never claimed again
                assert d.sched.get_num_new_matched_tokens(r, PROMPT) == (0, False)
                d.sched.update_state_after_alloc(r, kv_blocks(r), 0)
        d.step(sched_out(cached=running))  # the first decode step
        for t in chunked:  # preempted while decoding: recomputed, not loaded again
            r = dreqs[t]
            assert d.sched.get_num_new_matched_tokens(r, 0) == (0, False)
            d.sched.update_state_after_alloc(r, kv_blocks(r), 0)
        self.settle(d, lambda: aborted <= d.freed, fail, cached=running, what="aborted loads")
        d.freed.clear()
        for r in dreqs.values():
            if r.request_id in running:
                r.status = RequestStatus.FINISHED_LENGTH_CAPPED
                assert d.sched.request_finished(r, blocks(r)) == (False, None)
        d.step(sched_out())
        self.held_back = set()


def run_plugin(transfers: int, report: bool = True) -> dict[str, Any]:
    """Drive ``transfers`` through both halves; the collections and RSS at start, middle, end."""
    tmp = tempfile.mkdtemp(prefix="kvsoak-", dir="/tmp")
    soak = PluginSoak(tmp)
    try:
        gc.collect()
        snaps = {"start": (soak.collections(), rss_mib())}
        t0 = time.monotonic()
        while soak.n < transfers:
            soak.wave(min(WAVE, transfers - soak.n))
            if "middle" not in snaps and soak.n >= transfers // 2:
                gc.collect()
                snaps["middle"] = (soak.collections(), rss_mib())
                if report:
                    print(f"[soak plugin] {soak.n} transfers in {time.monotonic() - t0:.1f} s", file=sys.stderr)
        gc.collect()
        snaps["end_before_purge"] = (soak.collections(), rss_mib())
        purge(soak)
        gc.collect()
        snaps["end"] = (soak.collections(), rss_mib())
        return {"transfers": soak.n, "seconds": time.monotonic() - t0, "snaps": snaps}
    finally:
        soak.close()
        shutil.rmtree(tmp, ignore_errors=True)


def purge(soak: PluginSoak) -> None:
    """Let every tombstone's time pass: the scheduler cores hear a no-op event from the future."""
    from kvpush.engine_plugin.scheduler import lifecycle as sl

    for e in soak.engines.values():
        lc = getattr(e.sched, "lifecycle", None)
        if lc is not None:
            lc.handle(sl.SendingDone("", time.monotonic() + lc.tombstone_s + 1))


def grown(snaps: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """Collections not back at their baseline at the end (bounded caches: above their cap)."""
    start, end = snaps["start"][0], snaps["end"][0]
    bad = {}
    for name, n in end.items():
        cap = next((c for suffix, c in BOUNDED.items() if name.endswith(suffix)), None)
        if (n > cap) if cap is not None else (n != start.get(name, 0)):
            bad[name] = (start.get(name, 0), n)
    return bad


def table(snaps: dict[str, Any], cols: list[str]) -> str:
    names = sorted(set().union(*(snaps[c][0] for c in cols)))
    lines = ["| collection | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    lines += [f"| {n} | " + " | ".join(str(snaps[c][0].get(n, "")) for c in cols) + " |" for n in names]
    lines.append("| **RSS MiB** | " + " | ".join(f"{snaps[c][1]:.1f}" for c in cols) + " |")
    return "\n".join(lines)


def write_result(name: str, header: str, body: str) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"soak_{name}.md"
    path.write_text(f"{header}\n\n{body}\n")
    return path


def main_plugin(args: argparse.Namespace) -> int:
    res = run_plugin(args.transfers)
    snaps = res["snaps"]
    cols = ["start", "middle", "end_before_purge", "end"]
    body = table(snaps, cols)
    bad = grown(snaps)
    verdict = "every collection back at its baseline" if not bad else f"GREW: {bad}"
    print(body)
    print(f"{res['transfers']} transfers in {res['seconds']:.1f} s: {verdict}")
    header = (f"# Soak: the plugin halves, {res['transfers']} transfers\n\n"
              f"`python scripts/bench_soak.py plugin --transfers {args.transfers}` on "
              f"{time.strftime('%Y-%m-%d')} ({os.cpu_count()} CPUs, shared machine): prefill and decode "
              f"scheduler + worker halves, vLLM Request objects, daemon stand-ins on real engine sockets; "
              f"7/10 succeed, 1/10 aborted while loading, 1/10 preempted, 1/10 fail. "
              f"{res['seconds']:.1f} s. `end_before_purge`: scheduler tombstones not yet {120:.0f} s old; "
              f"`end`: after. Bounded caches ({', '.join(BOUNDED)}) may sit at their cap.\n\nResult: {verdict}.")
    print(f"wrote {write_result('plugin', header, body)}", file=sys.stderr)
    return 0 if not bad else 1


# ------------------------------------------------------------------ the daemon pair soak

TOMBSTONE_WAIT_S = 62.0  # the daemon cores' tombstone_s (60) and a tick


def daemon_collections(d: Any) -> dict[str, int]:
    st = d.ops("status")
    out = {f"{k}.{s}": n for k, per in st["pending"].items() for s, n in per.items()}
    out.update({f"peers.{k}": n for k, n in st["peers"].items()})
    out["in_flight"] = st["in_flight"]
    out["pending_rows"] = len(d.ops("pending")["pending"])
    return out


def run_daemons(transfers: int, warmup: int, window: int = 32, wait_s: float = TOMBSTONE_WAIT_S) -> dict[str, Any]:
    from kvpush import proto
    from kvpush_dev.bench.transfer import daemon_pair

    snaps: dict[str, Any] = {}

    def snap(label: str, p: Any, d: Any) -> None:
        cols = {f"prefill.{k}": v for k, v in daemon_collections(p).items()}
        cols.update({f"decode.{k}": v for k, v in daemon_collections(d).items()})
        rss = {"prefill": p.ops("status")["rss_bytes"] / 2**20, "decode": d.ops("status")["rss_bytes"] / 2**20}
        snaps[label] = (cols, rss)
        print(f"[soak daemons] {label}: rss {rss}", file=sys.stderr)

    def push(p: Any, d: Any, pe: Any, de: Any, first: int, n: int) -> None:
        for base in range(first, first + n, window):
            batch = [(f"soak-{i}", i % window) for i in range(base, min(base + window, first + n))]
            for tid, b in batch:
                de.client.send(proto.Register(tid, 0, (b,), 16, (p.peer_endpoint,), 1, 10_000))
            aborted = {tid for tid, _ in batch if int(tid.split("-")[1]) % 10 == 9}
            for tid in aborted:
                de.client.send(proto.Abort(tid, 0, "client went away"))
            for tid, b in batch:
                if tid not in aborted:
                    pe.client.send(proto.PrefillDone(tid, (b,), 16, 10_000))
            for tid, _ in batch:
                if tid in aborted:
                    de.wait_for(lambda m, t=tid: isinstance(m, proto.Released) and m.transfer_id == t, 20)
                else:
                    assert isinstance(de.result(tid), proto.Received)
                    assert isinstance(pe.result(tid), proto.Sent)
            de.inbox.clear()
            pe.inbox.clear()

    t0 = time.monotonic()
    with daemon_pair("peer", 64) as (p, d, pe, de):
        snap("start", p, d)
        # Warm-up: the same load for longer than the tombstones last, so the same high-water mark.
        push(p, d, pe, de, 0, warmup)
        time.sleep(wait_s)
        snap("after_warmup", p, d)
        push(p, d, pe, de, warmup, transfers // 2)
        snap("middle", p, d)
        push(p, d, pe, de, warmup + transfers // 2, transfers - transfers // 2)
        snap("end_before_purge", p, d)
        time.sleep(wait_s)
        snap("end", p, d)
    return {"transfers": transfers, "warmup": warmup, "seconds": time.monotonic() - t0, "snaps": snaps}


def main_daemons(args: argparse.Namespace) -> int:
    res = run_daemons(args.transfers, args.warmup, wait_s=args.wait_s)
    snaps = res["snaps"]
    cols = ["start", "after_warmup", "middle", "end_before_purge", "end"]
    names = sorted(set().union(*(snaps[c][0] for c in cols)))
    lines = ["| collection | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    lines += [f"| {n} | " + " | ".join(str(snaps[c][0].get(n, "")) for c in cols) + " |" for n in names]
    for side in ("prefill", "decode"):
        lines.append(f"| **{side} RSS MiB** | " + " | ".join(f"{snaps[c][1][side]:.1f}" for c in cols) + " |")
    growth = {s: snaps["end"][1][s] - snaps["after_warmup"][1][s] for s in ("prefill", "decode")}
    ok = all(g <= 1.0 for g in growth.values())
    body = "\n".join(lines)
    verdict = ", ".join(f"{s} RSS {g:+.2f} MiB after warm-up" for s, g in growth.items())
    verdict += " (target <= 1 MiB: " + ("met" if ok else "NOT met") + ")"
    print(body)
    print(f"{res['transfers']} transfers after a warm-up of {res['warmup']}, {res['seconds']:.0f} s: {verdict}")
    header = (f"# Soak: a real daemon pair, {res['transfers']} transfers after a warm-up of {res['warmup']}\n\n"
              f"`python scripts/bench_soak.py daemons --transfers {args.transfers} --warmup {args.warmup}` on {time.strftime('%Y-%m-%d')} "
              f"({os.cpu_count()} CPUs, shared machine, noisy): one 64 KiB block per transfer, 32 in flight, "
              f"1 in 10 aborted by the decode engine before its prefill. Collections: the daemons' ops `status` "
              f"(records per core state; tombstones included) and `pending` rows. Every snapshot but `middle` and "
              f"`end_before_purge` waits {args.wait_s:.0f} s for the cores' tombstones to go. "
              f"{res['seconds']:.0f} s.\n\nResult: {verdict}.")
    print(f"wrote {write_result('daemons', header, body)}", file=sys.stderr)
    return 0 if ok else 1


# ------------------------------------------------------------------ the router soak


async def _router_soak(requests: int, concurrency: int) -> dict[str, Any]:
    import asyncio
    import json

    import aiohttp
    from aiohttp import web

    from kvpush.router.app import Backend, RouterConfig, build_app
    from kvpush_dev.aioserve import serve


    async def prefill(req: web.Request) -> web.Response:
        body = await req.json()
        if body.get("prompt") == "fail":
            return web.json_response({"error": {"message": "boom"}}, status=500)
        return web.json_response({"choices": [{"text": "x", "index": 0}], "kv_transfer_params": None})

    async def decode(req: web.Request) -> web.StreamResponse:
        await req.json()
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(req)
        try:
            for i in range(4):
                await resp.write(f"data: {json.dumps({'choices': [{'text': str(i), 'index': 0}]})}\n\n".encode())
                await asyncio.sleep(0.001)
            await resp.write(b"data: [DONE]\n\n")
        except ConnectionError:  # the router closed the leg (its client left, or the prefill failed)
            pass
        return resp

    papp, dapp = web.Application(), web.Application()
    papp.router.add_post("/v1/completions", prefill)
    dapp.router.add_post("/v1/completions", decode)
    (pr, p_url), (dr, d_url) = await serve(papp), await serve(dapp)
    app = build_app(RouterConfig(prefill=[Backend(p_url, ["tcp://127.0.0.1:1"])], decode=[Backend(d_url, [])]))
    rr, url = await serve(app)
    router = app["router"]
    snaps: dict[str, Any] = {}
    outcome = {"ok": 0, "failed": 0, "gone": 0}

    def snap(label: str) -> None:
        gc.collect()
        cols = collections_of(router, "router.")
        cols["asyncio.tasks"] = len(asyncio.all_tasks())
        conn = router.session.connector if router.session is not None else None
        cols["session.connections"] = sum(len(v) for v in getattr(conn, "_conns", {}).values())
        cols["session.acquired"] = len(getattr(conn, "_acquired", ()))
        snaps[label] = (cols, rss_mib())

    async def one(s: aiohttp.ClientSession, i: int) -> None:
        body = {"model": "tiny", "prompt": "fail" if i % 10 == 9 else "hi", "max_tokens": 4, "stream": True}
        try:
            async with s.post(f"{url}/v1/completions", json=body) as r:
                if r.status != 200:
                    outcome["failed"] += 1
                    await r.read()
                    return
                async for line in r.content:
                    if i % 10 == 8:  # the client goes away mid-stream
                        outcome["gone"] += 1
                        return
                    if b'"error"' in line:  # a leg failed after the 200: the stream's last event
                        outcome["failed"] += 1
                        return
                outcome["ok"] += 1
        except aiohttp.ClientError:
            outcome["failed"] += 1

    t0 = time.monotonic()
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as s:
            await one(s, 0)
            snap("start")
            sem = asyncio.Semaphore(concurrency)

            async def bounded(i: int) -> None:
                async with sem:
                    await one(s, i)

            half = requests // 2
            await asyncio.gather(*(bounded(i) for i in range(1, half)))
            await asyncio.sleep(2.0)  # legs the router cancelled finish closing
            snap("middle")
            await asyncio.gather(*(bounded(i) for i in range(half, requests)))
            await asyncio.sleep(2.0)
            snap("end")
    finally:
        for runner in (rr, pr, dr):
            await runner.cleanup()
    return {"requests": requests, "seconds": time.monotonic() - t0, "snaps": snaps, "outcome": outcome}


def run_router(requests: int, concurrency: int = 64) -> dict[str, Any]:
    import asyncio

    return asyncio.run(_router_soak(requests, concurrency))


#: the router's bounded caches: its trace ring and the request-id map it trims to the ring's size
ROUTER_BOUNDED = {"router.trace._t": 4096, "router.request_ids": 4096}


def main_router(args: argparse.Namespace) -> int:
    res = run_router(args.requests)
    snaps = res["snaps"]
    cols = ["start", "middle", "end"]
    # Baseline: the middle (half the requests in): pooled keep-alive connections, and the
    # server tasks that serve them, are there from the first burst on and bounded by it.
    mid, end = snaps["middle"][0], snaps["end"][0]
    bad = {n: (mid.get(n, 0), v) for n, v in end.items() if v > ROUTER_BOUNDED.get(n, mid.get(n, 0))}
    verdict = "nothing above its size at the middle, or its cap" if not bad else f"GREW: {bad}"
    body = table(snaps, cols)
    print(body)
    print(f"{res['requests']} requests in {res['seconds']:.1f} s ({res['outcome']}): {verdict}")
    header = (f"# Soak: the router, {res['requests']} requests\n\n"
              f"`python scripts/bench_soak.py router --requests {args.requests}` on {time.strftime('%Y-%m-%d')} "
              f"({os.cpu_count()} CPUs, shared machine): the router in front of aiohttp engine stand-ins, 64 in "
              f"flight, 1 in 10 prefill legs failing, 1 in 10 clients leaving mid-stream ({res['outcome']}). "
              f"Bounded: {', '.join(f'{k} <= {v}' for k, v in ROUTER_BOUNDED.items())}. RSS: router, stand-ins "
              f"and client in one process. {res['seconds']:.1f} s.\n\nResult: {verdict}.")
    print(f"wrote {write_result('router', header, body)}", file=sys.stderr)
    return 0 if not bad else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    pl = sub.add_parser("plugin", help="transfers through both plugin halves in memory")
    pl.add_argument("--transfers", type=int, default=100_000)
    dm = sub.add_parser("daemons", help="real transfers through a real daemon pair")
    dm.add_argument("--transfers", type=int, default=20_000)
    dm.add_argument("--warmup", type=int, default=20_000, help="transfers first, not measured (as many as the run)")
    dm.add_argument("--wait-s", type=float, default=TOMBSTONE_WAIT_S, help="for the cores' tombstones to go")
    ro = sub.add_parser("router", help="requests through the router in front of engine stand-ins")
    ro.add_argument("--requests", type=int, default=10_000)
    args = ap.parse_args(argv)
    return {"plugin": main_plugin, "daemons": main_daemons, "router": main_router}[args.cmd](args)
