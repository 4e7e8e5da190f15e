"""Layer-wise push and a hybrid model across the capped link: ``scripts/bench_lab.py layerwise
--model-preset swa-deep`` (docs/results/layerwise-hybrid.md).

Why: a layer frame names no KV cache group, so kvpush pushes a hybrid model's requests whole
(engine_plugin.scheduler.half). Two ways to stream them instead: frames that name their group
(not built), or vLLM's hybrid allocator off (``--disable-hybrid-kv-cache-manager`` on both
engines: one group, every layer holds the whole prompt, so a sliding-window layer moves all of
it too, but it streams). This measures, on one hybrid model, same prompts, one run, what each
choice costs the first token across the lab's capped link (kvpush_dev.bench.layerwise has the
lab, the calibration and the cap; the cap is set from the model's dense KV, what the hybrid
allocator off moves, as the deep model's is):

- ``colocated``: one engine, no connector (hybrid allocator on).
- ``colocated-dense``: the same with the hybrid allocator off: what turning it off costs the
  prefill itself (every layer keeps, and attends over, the whole prompt's cache).
- ``auto``: kvpush as shipped, hybrid allocator on: whole-request push of the groups' blocks
  (a sliding-window group moves only the blocks its window still reads).
- ``whole-dense``: hybrid allocator off, ``layerwise: off`` (and the connector's
  ``windowed_as_full``: without it kvpush refuses the windowed full-attention spec).
- ``layerwise-dense``: hybrid allocator off, ``layerwise: on``.
- ``layerwise-hybrid``: hybrid allocator on, ``layerwise: on`` forced: the plugin logs that it
  pushes whole and does (the transfer rows must say so).
- ``pull``: vLLM's NixlConnector, hybrid allocator on.

Per length and mode: TTFT p50 / p90 (the decode engine's first token: the router's
``--first-token decode``), the KV bytes moved per request (kvpush: the prefill daemon's
``kvpush_written_bytes_total``; pull: the decode engine's ``vllm:nixl_bytes_transferred``
sum), that many bytes' time at the cap, and the prefill daemon's WRITE (post to completion).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

from kvpush_dev.bench import layerwise as lw

HYBRID_OFF = ("--disable-hybrid-kv-cache-manager",)
# kvpush refuses a windowed full-attention spec unless the connector says to move it as dense
DENSE_KEYS = {"windowed_as_full": True}
# mode -> (what the table calls it, the connector's layerwise key, hybrid allocator on, what
# the prefill daemon's transfer rows must say: the mode fails loudly otherwise)
MODES: dict[str, tuple[str, str | None, bool, str | None]] = {
    "colocated-dense": ("colocated, hybrid off", None, False, None),
    "auto": ("kvpush auto (as shipped), hybrid on: whole", "auto", True, "whole"),
    "layerwise-hybrid": ("kvpush layerwise=on forced, hybrid on", "on", True, "whole"),
    "whole-dense": ("kvpush whole, hybrid off", "off", False, "whole"),
    "layerwise-dense": ("kvpush layer-wise, hybrid off", "on", False, "layerwise"),
    "pull": ("vLLM pull (NixlConnector), hybrid on", None, True, None),
}
DEFAULT_MODES = ("colocated-dense", "auto", "whole-dense", "layerwise-dense", "pull")
RESULT = "layerwise-hybrid.md"


def parse_modes(text: str | None) -> list[str]:
    """``--modes`` for a hybrid preset: names from MODES (colocated always runs)."""
    if not text:
        return list(DEFAULT_MODES)
    modes = [m for m in text.split(",") if m and m != "colocated"]
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"unknown modes for a hybrid preset: {bad}; from {', '.join(MODES)}")
    return modes


# --------------------------------------------------------------------------- counters

def daemon_written_bytes(ops_socket: str) -> float:
    """The daemon's ``kvpush_written_bytes_total`` (every WRITE it finished, groups included)."""
    from kvpush import proto
    from kvpush.daemon.ops.ctl import Target, ask
    from kvpush_dev import prom

    t = Target(ops_socket, "cpu0")
    ask([t], proto.OpsRequest("metrics"), 5.0)
    return prom.total(prom.parse(str((t.data or {}).get("text") or "")), "kvpush_written_bytes_total") or 0.0


def nixl_bytes(url: str) -> float:
    """The decode engine's ``vllm:nixl_bytes_transferred`` sum (what NixlConnector pulled)."""
    from kvpush_dev import prom

    return prom.total(prom.scrape(url, timeout=10.0), "vllm:nixl_bytes_transferred_sum") or 0.0


def _bytes_probe(front: lw.Front) -> Any:
    """A function giving the mode's KV bytes counter now, run where it can be read; None: none."""
    stack = front.extra.get("stack")
    if stack is not None:
        from kvpush.proto import naming

        sock = naming.ops_socket(str(stack.rt("p0")), 0)
        return lambda: front.client(daemon_written_bytes, sock, timeout=30)
    url = front.extra.get("decode_metrics")
    if url:
        return lambda: front.client(nixl_bytes, url, timeout=30)
    return None


# --------------------------------------------------------------------------- one mode

def run_mode(name: str, start: Any, lengths: list[int], n: int, seed: int, out_len: int,
             want_mode: str | None) -> dict[str, Any]:
    """Start a mode; warm every length; then per length ``n`` requests between two reads of its
    bytes counter; read the prefill daemon's rows (kvpush); stop it."""
    lw.log(f"[{name}] starting")
    front = start()
    try:
        front.client(asyncio.run, lw._ttfts(front.url, lengths, 0, seed, out_len), timeout=1800)
        probe = _bytes_probe(front)
        raw: dict[int, list[dict[str, Any]]] = {}
        moved: dict[int, float | None] = {}
        for L in lengths:
            b0 = probe() if probe else None
            raw.update(front.client(asyncio.run, lw._ttfts(front.url, [L], n, seed, out_len, warm=False), timeout=1800))
            if probe:
                time.sleep(1.0)  # a pulled request's counter lands after its first token
                moved[L] = (probe() - b0) / n
        res: dict[str, Any] = {"ttft": {L: lw.ttft_stats(rs) for L, rs in raw.items()},
                               "ttft_ms": {L: [r.get("ttft_ms") for r in rs] for L, rs in raw.items()},
                               "texts": {f"{L}:{i}": r.get("text") for L, rs in raw.items() for i, r in enumerate(rs)},
                               "bytes": moved}
        stack = front.extra.get("stack")
        if stack is not None:
            time.sleep(0.5)
            rows = lw.prefill_daemon_transfers(stack)
            per = lw.final_rows(rows, lengths, n)
            res["write_ms"] = {L: lw.median1([r.get("latency_ms") for r in rs]) for L, rs in per.items()}
            res["stream"] = lw.stream_stats(rows, lengths, n)
            if want_mode is not None and (why := lw.check_modes(rows, want_mode)):
                res["error"] = why
    finally:
        front.stop()
    lw.log(f"[{name}] " + json.dumps({"ttft": res["ttft"], "bytes": res["bytes"]}))
    return res


def bench(model: Path, preset_args: tuple[str, ...], lengths: list[int], n: int, seed: int, out_len: int,
          modes: list[str], cap: str | None, work: Path, layer_group: int | None = None,
          rounds: int = 1) -> dict[str, Any]:
    """Calibrate (colocated, hybrid on), the cap from the dense KV, every mode across it;
    ``rounds`` > 1: colocated and the modes again, in reverse order every other round (A B B A),
    fresh engines each, the requests pooled (kvpush_dev.bench.layerwise's ``--rounds``)."""
    from kvpush_dev.netlab import Lab, sweep_stale

    per_tok = lw.kv_bytes_per_token(model)
    out: dict[str, Any] = {"model": {"dir": model.name, "layers": lw.num_layers(model), "kv_bytes_per_token": per_tok,
                                     "config": _shape(model)},
                           "lengths": lengths, "requests": n, "seed": seed, "output_len": out_len,
                           "layer_group": layer_group, "rounds": rounds, "modes": {}}
    pre: dict[str, Any] = {}
    runs: dict[str, list[dict[str, Any]]] = {"colocated": [
        lw._colocated(model, work / "colocated", lengths, n, seed, out_len, pre, preset_args)]}
    out["calibration"] = {"layers": lw.num_layers(model), "kv_bytes_per_token": per_tok,
                          "lengths": {L: {"prefill_ms_p50": lw.ttft_stats(rs).get("p50"), "kv_bytes": per_tok * L,
                                          "kv_mib": round(per_tok * L / 2**20, 2)} for L, rs in pre.items()}}
    c = lw.cap_for(out["calibration"])
    if cap:
        c["rate"], c["mbit_per_s"] = cap, float(cap.removesuffix("mbit"))
    out["cap"] = c
    lw.log(f"cap {c['rate']} on p0 -> d0")
    sweep_stale()
    lab = Lab(("p0", "d0", "rt"), name=f"t{os.getpid()}h").up()
    try:
        lab.cap("p0", c["rate"], burst="1mb", latency="200ms")
        for r, m in lw.round_order(["colocated", *modes], rounds):
            if m == "colocated":
                if r:  # round 0's ran with the calibration
                    runs[m].append(lw._colocated(model, work / f"colocated-{r}", lengths, n, seed, out_len,
                                                 None, preset_args))
                continue
            _, key, hybrid, want = MODES[m]
            wd = work / (m if r == 0 else f"{m}-{r}")
            args = tuple(preset_args) + (() if hybrid else HYBRID_OFF)

            def start(m: str = m, key: str | None = key, args: tuple[str, ...] = args, wd: Path = wd) -> lw.Front:
                if m == "pull":
                    return lw.start_pull(lab, model, wd, args)
                return lw.start_kvpush(lab, model, wd, key, layer_group, engine_args=args,
                                       plugin_extra=None if MODES[m][2] else DENSE_KEYS)

            if m == "colocated-dense":
                runs.setdefault(m, []).append(lw._colocated(model, wd, lengths, n, seed, out_len, None, args))
                continue
            try:
                runs.setdefault(m, []).append(run_mode(m if rounds == 1 else f"{m}, round {r}", start, lengths, n,
                                                       seed, out_len, want))
            except Exception as exc:  # one mode failing must not lose the others' figures
                runs.setdefault(m, []).append({"error": f"{type(exc).__name__}: {exc}"})
                lw.log(f"[{m}] FAILED: {exc}")
    finally:
        lab.down()
    out["modes"] = {m: pool(rs) for m, rs in runs.items()}
    out["verdict"] = verdict(out)
    return out


def pool(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One mode's rounds as one result (kvpush_dev.bench.layerwise._pool: TTFT over every
    round's requests, each round's p50 kept), with the bytes and WRITE times the median of the
    rounds'."""
    out = lw._pool(runs)
    if len(runs) > 1 and not out.get("error"):
        for k in ("bytes", "write_ms"):
            if all(k in r for r in runs):
                out[k] = {L: lw.median1([r[k].get(L) for r in runs]) for L in runs[0][k]}
    return out


def _shape(model: Path) -> dict[str, Any]:
    c = json.loads((model / "config.json").read_text())
    kinds = c.get("layer_types") or []
    return {"sliding_window": c.get("sliding_window"), "sliding_layers": kinds.count("sliding_attention"),
            "full_layers": kinds.count("full_attention")}


# --------------------------------------------------------------------------- verdict and table

def transfer_ms(nbytes: float | None, mbit: float) -> float | None:
    """``nbytes`` across a ``mbit`` Mbit/s link, ms."""
    return None if nbytes is None else round(nbytes * 8 / (mbit * 1e6) * 1e3, 1)


def _p50(out: dict[str, Any], m: str, L: int) -> float | None:
    return out["modes"].get(m, {}).get("ttft", {}).get(L, {}).get("p50")


def verdict(out: dict[str, Any]) -> dict[str, Any]:
    """Per length: hybrid-on whole (``auto``) against the best hybrid-off layer-wise, the bytes
    each moves, the hidden fraction of the dense transfer, and what per-group frames would give:
    ``auto``'s TTFT less that fraction of its own transfer (the hybrid bytes streamed as well as
    the dense ones are). ``auto_fastest_everywhere``: whether ``auto`` was at least as fast at
    every length (a fact for the decision, which docs/models.md states with the bytes and memory)."""
    m, v = out["modes"], {}
    lengths = out["lengths"]
    if not all(k in m and "ttft" in m[k] for k in ("auto", "layerwise-dense")):
        return {}
    rows = {}
    for L in lengths:
        a, ld, wd = _p50(out, "auto", L), _p50(out, "layerwise-dense", L), _p50(out, "whole-dense", L)
        ab, db = m["auto"].get("bytes", {}).get(L), m["layerwise-dense"].get("bytes", {}).get(L)
        if a is None or ld is None:
            continue
        r: dict[str, Any] = {"auto_minus_layerwise_dense_ms": round(a - ld, 1)}
        if ab and db:
            r["hybrid_over_dense_bytes"] = round(ab / db, 3)
        cd, co = _p50(out, "colocated-dense", L), _p50(out, "colocated", L)
        if cd and co:  # what the allocator off costs the prefill itself
            r["colocated_dense_over_hybrid"] = round(cd / co, 3)
        wms = m.get("whole-dense", {}).get("write_ms", {}).get(L)
        if wd is not None and wms:
            hf = (wd - ld) / wms
            r["hidden_fraction_dense"] = round(hf, 3)
            aw = m["auto"].get("write_ms", {}).get(L)
            if aw:
                r["per_group_frames_gain_ms"] = round(max(0.0, hf) * aw, 1)
                r["per_group_frames_ttft_ms"] = round(a - max(0.0, hf) * aw, 1)
        rows[L] = r
    v["per_length"] = rows
    v["auto_fastest_everywhere"] = bool(rows) and all(r["auto_minus_layerwise_dense_ms"] <= 0 for r in rows.values())
    ref = m.get("auto", {}).get("texts")
    for name in m:
        if name != "auto" and ref and m[name].get("texts"):
            t = m[name]["texts"]
            v[f"{name}_tokens_equal_auto"] = f"{sum(t[k] == ref.get(k) for k in t)}/{len(t)}"
    return v


def table(out: dict[str, Any], command: str) -> str:
    lengths, m, c, cal = out["lengths"], out["modes"], out["cap"], out["calibration"]
    sh, mbit = out["model"]["config"], float(c["mbit_per_s"])
    lines = [f"# Layer-wise push and a hybrid model across a capped link ({out['model']['dir']} model, netns lab)", "",
             f"Written by `{command}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. "
             f"{out['requests']} sequential streaming requests a length and mode after one warm-up a length"
             + (f", in each of {out['rounds']} rounds (colocated and the modes in order, then reversed; fresh "
                "engines each round; the cells pool every round's requests; bytes and WRITE ms: the rounds' median)"
                if out.get("rounds", 1) > 1 else "") + ", "
             f"{out['output_len']} output tokens, same prompts (token IDs, seed {out['seed']}) for every mode. "
             f"Model: {out['model']['layers']} layers, {sh['sliding_layers']} sliding-window (window "
             f"{sh['sliding_window']}) and {sh['full_layers']} full attention, {out['model']['kv_bytes_per_token']} B "
             "of float32 KV a token over every layer. P on lab host p0 (core 0), D on d0 (core 1), front end on rt; "
             f"`tbf rate {c['rate']}` on p0's link (the rate at which the dense KV crosses in about the prefill's "
             "time). TTFT: the decode engine's first token (router `--first-token decode`), ms, p50 / p90.", "",
             "| tokens | prefill ms (1 core) | mode | TTFT p50 / p90 | KV MiB / request | transfer ms at cap "
             "(computed) | WRITE ms (daemon) | streamed parts | tail ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    for L in lengths:
        pre = cal["lengths"].get(L, {}).get("prefill_ms_p50")
        for k, r in m.items():
            if r.get("error"):
                continue
            b = (r.get("bytes") or {}).get(L)
            st = (r.get("stream") or {}).get(L, {})
            label = "colocated" if k == "colocated" else MODES[k][0]
            lines.append("| " + " | ".join([
                str(L), str(pre), label, lw._cell(r.get("ttft", {}).get(L)),
                "—" if b is None else f"{b / 2**20:.2f}", str(transfer_ms(b, mbit) or "—"),
                str((r.get("write_ms") or {}).get(L) or "—"), str(st.get("groups", "—")),
                str(st.get("tail_ms", "—"))]) + " |")
    v = out.get("verdict") or {}
    lines += ["", "Notes:", "",
              "- hybrid on: vLLM's hybrid KV cache allocator (the default): one KV cache group per kind of "
              "layer, a sliding-window group keeps (and kvpush moves) only the blocks its window reads. "
              "hybrid off: `--disable-hybrid-kv-cache-manager` on every engine of the mode: one group, every "
              "layer keeps the whole prompt, so the push moves the dense KV, and can stream it per layer.",
              "- KV MiB / request: kvpush, the prefill daemon's `kvpush_written_bytes_total` over the length's "
              "requests; pull, the decode engine's `vllm:nixl_bytes_transferred` sum. Transfer ms at cap: "
              "those bytes x 8 / the cap. WRITE ms: the prefill daemon's final WRITE, post to completion, median "
              "(layer-wise: what was left after the streamed parts). Streamed parts and tail: as in "
              "layerwise.md (the tail: last frame, or the seal, to the final WRITE's end).",
              "- per-group frames (not built) estimate: hybrid-on TTFT less the dense run's hidden fraction "
              "((TTFT whole, hybrid off - TTFT layer-wise, hybrid off) / its WRITE ms) of the hybrid WRITE.",
              "- One run on a shared 2-core machine: absolute figures are noisy, compare modes side by side."]
    if out.get("rounds", 1) > 1:
        lines.insert(-1, lw.rounds_note(m, lengths))
    for k, r in m.items():
        if r.get("error"):
            lines.append(f"- **{k}: not measured: {r['error']}**")
    if v:
        lines += ["", "```", json.dumps(v, indent=1), "```"]
    return "\n".join(lines) + "\n"
