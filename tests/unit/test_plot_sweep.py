"""kvpush_dev.sweep.plot (scripts/plot_sweep.py) on a tiny synthetic results directory (no vLLM, no engines)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvpush_dev.sweep import plot as ps

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _point(mode: str, qps: float, inp: int, ttft: float | None, tpot: float | None, *, it: int = 0,
           completed: int = 8, failed: int = 0, timed_out: int = 0, matched: int = 4) -> dict[str, Any]:
    def stat(v: float | None) -> dict[str, float] | None:
        return None if v is None else {"mean": v, "median": v, "p99": 3 * v}

    return {"mode": mode, "qps": qps, "input_len": inp, "output_len": 32, "iteration": it,
            "completed": completed, "failed": failed, "timed_out": timed_out, "num_prompts": 8,
            "ttft": stat(ttft), "tpot": stat(tpot), "itl": stat(tpot), "e2el": stat(ttft),
            "correctness": {"checked": 4, "matched": matched}}


def _write(d: Path, p: dict[str, Any]) -> None:
    q = ps.Key(p["qps"], p["input_len"], 32)
    name = f"{p['mode']}_qps{q.qps:g}_in{q.input_len}_out32_iter{p['iteration']}.json"
    (d / name).write_text(json.dumps(p))


@pytest.fixture()
def results(tmp_path: Path) -> Path:
    for qps in (2.0, 4.0):
        for inp in (256, 1024):
            _write(tmp_path, _point("kvpush", qps, inp, 10.0 * inp / 256, 2.0))
            _write(tmp_path, _point("pull", qps, inp, 100.0 * inp / 256, 8.0))
            if inp == 1024 and qps == 4.0:  # every request hung: no latency at all
                _write(tmp_path, _point("vllm-push", qps, inp, None, None, completed=0, timed_out=8,
                                        matched=0))
            else:
                _write(tmp_path, _point("vllm-push", qps, inp, 40.0, 4.0, completed=5, timed_out=3))
    # a second iteration of one point: medians are averaged, counts summed
    _write(tmp_path, _point("kvpush", 2.0, 256, 30.0, 4.0, it=1, failed=1))
    (tmp_path / "mode_kvpush.json").write_text(json.dumps(
        {"mode": "kvpush", "status": "ok", "startup_s": 40.0, "idle_cpu_cores": {"kvpushd": 0.01},
         "load_cpu_seconds": {"prefill": 3.5}}))
    (tmp_path / "sweep.json").write_text("{}")  # not a point: ignored
    (tmp_path / "kvpush_qps2_in256_out32_iter0.prompts.json").write_text("[]")  # not a point either
    return tmp_path


def test_aggregate_averages_iterations_and_sums_counts(results: Path) -> None:
    aggs = ps.aggregate(ps.load_points(results))
    assert len(aggs) == 12
    a = aggs[("kvpush", ps.Key(2.0, 256, 32))]
    assert a.iterations == 2
    assert a.stats["ttft"]["median"] == pytest.approx(20.0)  # (10 + 30) / 2
    assert a.stats["ttft"]["p99"] == pytest.approx(60.0)
    assert (a.completed, a.failed, a.timed_out, a.checked, a.matched) == (16, 1, 0, 8, 8)
    hung = aggs[("vllm-push", ps.Key(4.0, 1024, 32))]
    assert hung.stats["ttft"]["median"] is None and hung.timed_out == 8


def test_summary_ratios_and_counts(results: Path) -> None:
    aggs = ps.aggregate(ps.load_points(results))
    md = ps.summary_markdown(aggs, ps.load_mode_info(results))
    rows = {line.split("|")[1].strip() + "x" + line.split("|")[2].strip(): line
            for line in md.split("## Ratios")[1].splitlines() if line.startswith("| ") and "QPS" not in line}
    # QPS 4, in 1024: kvpush TTFT 40 vs pull 400 -> 0.1; p99 120/1200; TPOT 2/8; vllm-push all hung
    cells = [c.strip() for c in rows["4x1024"].split("|")[4:-1]]
    assert cells == ["0.100", "0.100", "0.250", "n/a", "n/a", "n/a"]
    cells = [c.strip() for c in rows["2x1024"].split("|")[4:-1]]
    assert cells == ["0.100", "0.100", "0.250", "1.000", "1.000", "0.500"]
    assert "| 4 | 1024 | 32 | vllm-push | n/a | n/a | n/a | n/a | 0/0/8 | 0/4 |" in md
    assert "| 2 | 256 | 32 | kvpush | 20.0 | 60.0 | 3.00 | 9.00 | 16/1/0 | 8/8 |" in md
    assert "| kvpush | ok | 40.0 | kvpushd 0.01 | prefill 3.5 |" in md


def test_main_writes_figures_and_summary(results: Path) -> None:
    assert ps.main(["--results-dir", str(results), "--metric", "ttft"]) == 0
    png = results / "ttft.png"
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 5000
    assert (results / "summary.md").read_text().startswith("# Push vs pull")
    out = results / "fig" / "tpot-custom.png"
    assert ps.main(["--results-dir", str(results), "--metric", "tpot", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert ps.main(["--results-dir", str(results)]) == 0  # both metrics
    assert (results / "tpot.png").exists()


def test_empty_dir_is_an_error(tmp_path: Path) -> None:
    assert ps.main(["--results-dir", str(tmp_path)]) == 1


def test_ratio_guards() -> None:
    assert ps.ratio(1.0, 4.0) == 0.25
    assert ps.ratio(None, 4.0) is None
    assert ps.ratio(1.0, 0.0) is None
    assert ps.ratio(float("nan"), 1.0) is None


def test_summary_against_colocated_judges_worth_disaggregating(tmp_path: Path) -> None:
    """kvpush 1P1D / one colocated engine, with GOALS' bar (TPOT p99 <= 0.7x, TTFT p50 <= 1.2x)."""
    _write(tmp_path, _point("kvpush", 1.0, 512, 300.0, 4.0))
    _write(tmp_path, _point("colocated", 1.0, 512, 200.0, 8.0))
    _write(tmp_path, _point("kvpush", 3.0, 512, 230.0, 6.0))
    _write(tmp_path, _point("colocated", 3.0, 512, 200.0, 6.0))
    md = ps.summary_markdown(ps.aggregate(ps.load_points(tmp_path)))
    part = md.split("## kvpush 1P1D / one colocated engine")[1]
    assert "| 1 | 512 | 32 | 1.500 | 1.500 | 0.500 | 0.500 | yes | no |" in part
    assert "| 3 | 512 | 32 | 1.150 | 1.150 | 1.000 | 1.000 | no | yes |" in part
