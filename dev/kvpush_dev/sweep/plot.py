"""Figures and a summary table from a bench_sweep.py results directory.

    python scripts/plot_sweep.py --results-dir DIR --metric ttft|tpot|all [--out PNG]

Figure: the metric's median (solid) and p99 (dashed, same colour) against input length,
one panel per QPS, one line per mode; points with nothing completed are left out (their
failed/timed-out counts are in the table). Several iterations of a point are averaged.
``summary.md`` (always rewritten in DIR): per point and mode the TTFT p50/p99, TPOT p50,
completed/failed/timed-out and correctness, then the ratios kvpush/pull and
kvpush/vllm-push (TTFT p50, TTFT p99, TPOT p50) at every point, then CPU per mode.
Needs matplotlib (Agg) and nothing from vLLM.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MODES_ORDER = ("kvpush", "pull", "vllm-push")
POINT_RE = re.compile(r"^(?P<mode>[a-z][a-z0-9-]*)_qps(?P<qps>[0-9.]+)_in(?P<inp>\d+)_out(?P<out>\d+)"
                      r"_iter(?P<it>\d+)\.json$")
METRICS = ("ttft", "tpot")
STYLE = {"kvpush": "tab:green", "pull": "tab:red", "vllm-push": "tab:blue"}


@dataclass(frozen=True)
class Key:
    """A load point, all iterations together."""

    qps: float
    input_len: int
    output_len: int


@dataclass
class Agg:
    """One mode at one point: latency stats averaged over iterations, counts summed."""

    mode: str
    key: Key
    iterations: int = 0
    stats: dict[str, dict[str, float | None]] = field(default_factory=dict)  # metric -> median/p99/mean
    completed: int = 0
    failed: int = 0
    timed_out: int = 0
    num_prompts: int = 0
    checked: int = 0
    matched: int = 0


def load_points(results: Path) -> list[dict[str, Any]]:
    """Every per-point JSON in ``results`` (file names as bench_sweep.py writes them)."""
    out = []
    for f in sorted(results.glob("*.json")):
        m = POINT_RE.match(f.name)
        if not m:
            continue
        d = json.loads(f.read_text())
        d.setdefault("mode", m["mode"])
        d.setdefault("qps", float(m["qps"]))
        d.setdefault("input_len", int(m["inp"]))
        d.setdefault("output_len", int(m["out"]))
        d.setdefault("iteration", int(m["it"]))
        out.append(d)
    return out


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def aggregate(points: list[dict[str, Any]]) -> dict[tuple[str, Key], Agg]:
    groups: dict[tuple[str, Key], list[dict[str, Any]]] = {}
    for d in points:
        key = Key(float(d["qps"]), int(d["input_len"]), int(d["output_len"]))
        groups.setdefault((d["mode"], key), []).append(d)
    out = {}
    for (mode, key), ds in groups.items():
        a = Agg(mode, key, iterations=len(ds))
        for d in ds:
            a.completed += int(d.get("completed") or 0)
            a.failed += int(d.get("failed") or 0)
            a.timed_out += int(d.get("timed_out") or 0)
            a.num_prompts += int(d.get("num_prompts") or 0)
            c = d.get("correctness") or {}
            a.checked += int(c.get("checked") or 0)
            a.matched += int(c.get("matched") or 0)
        for m in ("ttft", "tpot", "itl", "e2el"):
            a.stats[m] = {s: _mean([float(d[m][s]) for d in ds if d.get(m) and d[m].get(s) is not None])
                          for s in ("median", "p99", "mean")}
        out[(mode, key)] = a
    return out


def modes_in(aggs: dict[tuple[str, Key], Agg]) -> list[str]:
    present = {m for m, _ in aggs}
    return [m for m in MODES_ORDER if m in present] + sorted(present - set(MODES_ORDER))


def keys_in(aggs: dict[tuple[str, Key], Agg]) -> list[Key]:
    return sorted({k for _, k in aggs}, key=lambda k: (k.qps, k.input_len, k.output_len))


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0 or math.isnan(a) or math.isnan(b):
        return None
    return a / b


def _f(x: float | None, nd: int = 1) -> str:
    return "n/a" if x is None else f"{x:.{nd}f}"


def _stat(a: Agg | None, metric: str, s: str) -> float | None:
    return None if a is None else a.stats.get(metric, {}).get(s)


def summary_markdown(aggs: dict[tuple[str, Key], Agg], mode_info: dict[str, dict[str, Any]] | None = None) -> str:
    modes = modes_in(aggs)
    lines = ["# Push vs pull, side by side", "",
             "Latencies in ms (vLLM's benchmark client; medians and p99 averaged over iterations). "
             "done/failed/timed-out are request counts; correct = greedy texts equal to the prefill "
             "engine alone.", "",
             "| QPS | in | out | mode | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | done/failed/timed-out | correct |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for k in keys_in(aggs):
        for m in modes:
            a = aggs.get((m, k))
            if a is None:
                continue
            lines.append(f"| {k.qps:g} | {k.input_len} | {k.output_len} | {m} | {_f(_stat(a, 'ttft', 'median'))} "
                         f"| {_f(_stat(a, 'ttft', 'p99'))} | {_f(_stat(a, 'tpot', 'median'), 2)} "
                         f"| {_f(_stat(a, 'tpot', 'p99'), 2)} "
                         f"| {a.completed}/{a.failed}/{a.timed_out} | {a.matched}/{a.checked} |")
    lines += ["", "## Ratios (kvpush / baseline; below 1 = kvpush faster; n/a = nothing completed)", "",
              "| QPS | in | out | TTFT p50 /pull | TTFT p99 /pull | TPOT p50 /pull "
              "| TTFT p50 /vllm-push | TTFT p99 /vllm-push | TPOT p50 /vllm-push |",
              "|---|---|---|---|---|---|---|---|---|"]
    for k in keys_in(aggs):
        kv = aggs.get(("kvpush", k))
        cells = []
        for base in ("pull", "vllm-push"):
            b = aggs.get((base, k))
            for metric, s in (("ttft", "median"), ("ttft", "p99"), ("tpot", "median")):
                cells.append(_f(ratio(_stat(kv, metric, s), _stat(b, metric, s)), 3))
        lines.append(f"| {k.qps:g} | {k.input_len} | {k.output_len} | " + " | ".join(cells) + " |")
    if "colocated" in modes and "kvpush" in modes:
        lines += _vs_colocated(aggs)
    if mode_info:
        lines += ["", "## CPU per mode (process groups)", "",
                  "| mode | status | start-up s | idle cores | CPU s over the load |", "|---|---|---|---|---|"]
        for m in modes:
            info = mode_info.get(m)
            if not info:
                continue
            idle = ", ".join(f"{g} {v:.2f}" for g, v in (info.get("idle_cpu_cores") or {}).items())
            load = ", ".join(f"{g} {v:.1f}" for g, v in (info.get("load_cpu_seconds") or {}).items())
            lines.append(f"| {m} | {info.get('status', '?')} | {info.get('startup_s', 'n/a')} | {idle or 'n/a'} "
                         f"| {load or 'n/a'} |")
    return "\n".join(lines) + "\n"


def _vs_colocated(aggs: dict[tuple[str, Key], Agg]) -> list[str]:
    """What disaggregation buys: kvpush 1P1D against one colocated engine given the same two
    cores, with GOALS' "worth disaggregating" bar (TPOT p99 <= 0.7x, TTFT p50 <= 1.2x)."""
    out = ["", "## kvpush 1P1D / one colocated engine on both cores (below 1 = kvpush better)", "",
           "| QPS | in | out | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | TPOT p99 <= 0.7x | TTFT p50 <= 1.2x |",
           "|---|---|---|---|---|---|---|---|---|"]
    for k in keys_in(aggs):
        kv, co = aggs.get(("kvpush", k)), aggs.get(("colocated", k))
        r = {(m, s): ratio(_stat(kv, m, s), _stat(co, m, s))
             for m in ("ttft", "tpot") for s in ("median", "p99")}

        def ok(x: float | None, bar: float) -> str:
            return "n/a" if x is None else ("yes" if x <= bar else "no")

        out.append(f"| {k.qps:g} | {k.input_len} | {k.output_len} | " + " | ".join(
            _f(r[key], 3) for key in (("ttft", "median"), ("ttft", "p99"), ("tpot", "median"), ("tpot", "p99")))
            + f" | {ok(r[('tpot', 'p99')], 0.7)} | {ok(r[('ttft', 'median')], 1.2)} |")
    return out


def load_mode_info(results: Path) -> dict[str, dict[str, Any]]:
    out = {}
    for f in results.glob("mode_*.json"):
        d = json.loads(f.read_text())
        out[str(d.get("mode", f.stem[5:]))] = d
    return out


def plot_metric(aggs: dict[tuple[str, Key], Agg], metric: str, out: Path) -> Path:
    """Median (solid) and p99 (dashed) of ``metric`` vs input length; one panel per QPS."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = keys_in(aggs)
    qpss = sorted({k.qps for k in keys})
    modes = modes_in(aggs)
    fig, axes = plt.subplots(1, max(len(qpss), 1), figsize=(4.2 * max(len(qpss), 1), 3.8), squeeze=False,
                             sharey=True)
    for ax, q in zip(axes[0], qpss, strict=False):
        for mi, m in enumerate(modes):
            # a small per-mode nudge along x so that modes at one point do not hide each other
            nudge = 1.0 + 0.012 * (mi - (len(modes) - 1) / 2)
            pts = sorted(((k.input_len * nudge, aggs[(m, k)]) for k in keys if k.qps == q and (m, k) in aggs),
                         key=lambda t: t[0])
            color = STYLE.get(m)
            med = [(x, a.stats[metric]["median"]) for x, a in pts if a.stats[metric]["median"] is not None]
            p99 = [(x, a.stats[metric]["p99"]) for x, a in pts if a.stats[metric]["p99"] is not None]
            if med:
                ax.plot(*zip(*med, strict=True), marker="o", color=color, label=f"{m} p50")
            if p99:
                ax.plot(*zip(*p99, strict=True), linestyle="--", marker=".", color=color, alpha=0.7,
                        label=f"{m} p99")
            lost = [(x, a) for x, a in pts if a.timed_out + a.failed > 0]
            for x, a in lost:
                ax.annotate(f"{a.failed + a.timed_out}✗", (x, 1), xycoords=("data", "axes fraction"),
                            textcoords="offset points", xytext=(0, -12 - 10 * modes.index(m)),
                            ha="center", fontsize=7, color=color)
        xs = sorted({k.input_len for k in keys if k.qps == q})
        ax.set_xticks(xs)
        if len(xs) == 1:  # one input length: keep the per-mode nudge small on screen
            ax.set_xlim(xs[0] * 0.85, xs[0] * 1.15)
        ax.set_title(f"QPS {q:g}")
        ax.set_xlabel("input length (tokens)")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel(f"{metric.upper()} (ms)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    for ax in axes[0][1:]:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 6), fontsize=8)
    fig.suptitle(f"{metric.upper()}: median (solid), p99 (dashed); ✗ = failed or timed-out requests")
    fig.tight_layout(rect=(0, 0.1, 1, 0.95))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results-dir", required=True)
    ap.add_argument("--metric", choices=(*METRICS, "all"), default="all")
    ap.add_argument("--out", default=None, help="PNG path (one metric only; default DIR/<metric>.png)")
    args = ap.parse_args(argv)
    results = Path(args.results_dir)
    aggs = aggregate(load_points(results))
    if not aggs:
        print(f"no point results in {results}")
        return 1
    metrics = METRICS if args.metric == "all" else (args.metric,)
    if args.out and len(metrics) > 1:
        ap.error("--out needs a single --metric")
    for m in metrics:
        out = plot_metric(aggs, m, Path(args.out) if args.out else results / f"{m}.png")
        print(f"wrote {out}")
    (results / "summary.md").write_text(summary_markdown(aggs, load_mode_info(results)))
    print(f"wrote {results / 'summary.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
