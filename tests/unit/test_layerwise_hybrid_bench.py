"""The hybrid layer-wise bench's plain parts (kvpush_dev.bench.layerwise_hybrid and
``bench_lab.py layerwise --model-preset``): the deeper sliding-window preset's shape, the modes'
parsing, the rows mapped to lengths, the verdict's arithmetic and the table, without engines."""

from __future__ import annotations

import json

import pytest
import transformers

from kvpush.engine_plugin.model_kinds import check_model, layer_kinds
from kvpush_dev.bench import lab
from kvpush_dev.bench import layerwise as lw
from kvpush_dev.bench import layerwise_hybrid as lh
from kvpush_dev.tiny_model import FAMILIES, PRESETS


def test_swa_deep_is_gemma3s_pattern_at_the_deep_presets_kv_size(tmp_path) -> None:
    fam = FAMILIES["swa-deep"]
    cfg = getattr(transformers, fam.config_class)(**fam.config)
    assert layer_kinds(cfg) == fam.layer_kinds
    assert fam.layer_kinds.count("sliding_attention") == 20 and fam.layer_kinds.count("full_attention") == 4
    assert fam.layer_kinds[5] == fam.layer_kinds[-1] == "full_attention"  # five sliding to one full
    check_model(cfg, "swa-deep")  # kvpush moves it (KV cache groups)
    (tmp_path / "config.json").write_text(json.dumps(fam.config))
    assert lw.kv_bytes_per_token(tmp_path) == PRESETS["deep"].kv_bytes_per_token()
    assert FAMILIES["swa"].config["num_hidden_layers"] == 4  # the family preset the tests use is unchanged


def test_model_preset_option_defaults_to_deep_and_takes_the_hybrid_presets(monkeypatch) -> None:
    seen = {}
    monkeypatch.setattr(lab, "_layerwise", lambda args, argv: seen.setdefault("a", args) and 0)
    lab.main(["layerwise"])
    assert seen.pop("a").model_preset == "deep"
    lab.main(["layerwise", "--model-preset", "swa-deep"])
    assert seen["a"].model_preset == "swa-deep" and seen["a"].model_dir is None
    with pytest.raises(SystemExit):
        lab.main(["layerwise", "--model-preset", "mamba"])  # its allocator cannot be turned off
    assert lab.layerwise_lengths(None) == [512, 2000, 4000] and lab.layerwise_lengths("16,32") == [16, 32]


def test_modes_parse_and_refuse_unknown_names() -> None:
    assert lh.parse_modes(None) == list(lh.DEFAULT_MODES)
    assert lh.parse_modes("colocated,auto,layerwise-dense") == ["auto", "layerwise-dense"]
    with pytest.raises(ValueError, match="layerwise"):
        lh.parse_modes("auto,layerwise")  # the deep bench's name: here it must say which allocator
    # the modes the decision needs turn the allocator off only where they say so
    assert [m for m, (_, _, hybrid, _) in lh.MODES.items() if not hybrid] == ["colocated-dense", "whole-dense",
                                                                             "layerwise-dense"]
    assert lh.MODES["layerwise-hybrid"][1] == "on" and lh.MODES["layerwise-hybrid"][3] == "whole"


def _row(ms: float, group: int = 0, result: str = "ok") -> dict:
    return {"side": "prefill", "group": group, "result": result, "latency_ms": ms, "mode": "whole"}


def test_final_rows_map_to_lengths_in_request_order_warm_ups_dropped() -> None:
    # newest first, as the daemon lists them: warm-ups (1, 2), then 2 requests at each length
    oldest_first = [_row(1), _row(2), _row(10), _row(11, group=3), _row(12), _row(20), _row(21, result="failed"),
                    _row(22)]
    got = lw.final_rows(list(reversed(oldest_first)), [512, 2000], 2)
    assert {L: [r["latency_ms"] for r in rs] for L, rs in got.items()} == {512: [10, 12], 2000: [20, 22]}
    assert lw.final_rows(list(reversed(oldest_first[:-1])), [512, 2000], 2) == {}  # one missing: no guess


def _out(auto: float, lw_dense: float, whole_dense: float = 3000.0) -> dict:
    def mode(p50: float, nbytes: float, write: float | None = None) -> dict:
        return {"ttft": {2000: {"p50": p50, "p90": p50 + 10, "n": 3, "errors": 0}}, "bytes": {2000: nbytes},
                "write_ms": {2000: write}, "texts": {"2000:0": "a b"}}

    return {"lengths": [2000], "requests": 3, "seed": 7, "output_len": 8,
            "model": {"dir": "swa-deep", "layers": 24, "kv_bytes_per_token": 24576,
                      "config": {"sliding_window": 128, "sliding_layers": 20, "full_layers": 4}},
            "cap": {"rate": "300mbit", "mbit_per_s": 300.0},
            "calibration": {"lengths": {2000: {"prefill_ms_p50": 1400.0}}},
            "modes": {"colocated": {"ttft": {2000: {"p50": 1400.0, "p90": 1410.0}}},
                      "auto": mode(auto, 16 << 20, 450.0), "whole-dense": mode(whole_dense, 48 << 20, 1500.0),
                      "layerwise-dense": mode(lw_dense, 48 << 20, 200.0),
                      "pull": {"error": "RuntimeError: did not start"}}}


def test_verdict_keeps_hybrids_whole_when_fewer_bytes_beat_streaming_more() -> None:
    out = _out(auto=1650.0, lw_dense=1700.0)
    v = lh.verdict(out)
    r = v["per_length"][2000]
    assert v["auto_fastest_everywhere"] is True and r["auto_minus_layerwise_dense_ms"] == -50.0
    assert r["hybrid_over_dense_bytes"] == round(16 / 48, 3)
    assert r["hidden_fraction_dense"] == round((3000 - 1700) / 1500, 3)
    # per-group frames would hide that fraction of the hybrid WRITE
    assert r["per_group_frames_gain_ms"] == round(1300 / 1500 * 450.0, 1)
    assert v["whole-dense_tokens_equal_auto"] == "1/1"
    out["modes"]["colocated-dense"] = {"ttft": {2000: {"p50": 2100.0}}}
    assert lh.verdict(out)["per_length"][2000]["colocated_dense_over_hybrid"] == 1.5


def test_verdict_asks_for_per_group_frames_when_dense_streaming_wins() -> None:
    assert lh.verdict(_out(auto=1800.0, lw_dense=1700.0))["auto_fastest_everywhere"] is False
    assert lh.verdict({"lengths": [2000], "modes": {"auto": {"ttft": {}}}}) == {}  # nothing to judge


def test_table_shows_bytes_transfer_time_and_the_mode_not_measured() -> None:
    out = _out(auto=1650.0, lw_dense=1700.0)
    out["verdict"] = lh.verdict(out)
    t = lh.table(out, "scripts/bench_lab.py layerwise --model-preset swa-deep")
    assert "`scripts/bench_lab.py layerwise --model-preset swa-deep`" in t and "`tbf rate 300mbit`" in t
    row = next(ln for ln in t.splitlines() if "hybrid on: whole" in ln)
    # 16 MiB, and 16 MiB x 8 / 300 Mbit/s at the cap
    assert "| 1650 / 1660 | 16.00 | 447.4 | 450.0 |" in row
    assert "**pull: not measured: RuntimeError: did not start**" in t and '"auto_fastest_everywhere": true' in t
    assert lh.transfer_ms(None, 300.0) is None


def test_rounds_pool_requests_and_take_the_median_bytes_and_write_times() -> None:
    def rnd(ttfts: list[float], nbytes: float, write: float) -> dict:
        return {"ttft_ms": {2000: ttfts}, "ttft": {2000: lw.ttft_stats([{"ttft_ms": x} for x in ttfts])},
                "bytes": {2000: nbytes}, "write_ms": {2000: write}, "texts": {"2000:0": "a"}}

    got = lh.pool([rnd([100.0, 110.0], 10.0, 5.0), rnd([300.0, 310.0], 30.0, 7.0), rnd([200.0], 20.0, 9.0)])
    assert got["ttft"][2000]["n"] == 5 and got["round_p50"][2000] == [100.0, 300.0, 200.0]
    assert got["bytes"][2000] == 20.0 and got["write_ms"][2000] == 7.0
    out = _out(auto=1650.0, lw_dense=1700.0)
    out["rounds"], out["modes"]["auto"]["round_p50"] = 2, {2000: [1600.0, 1700.0]}
    t = lh.table(out, "x")
    assert "in each of 2 rounds" in t and "auto: 2000: 1600.0 / 1700.0" in t
    assert lh.pool([{"error": "E"}, rnd([1.0], 1.0, 1.0)]) == {"error": "E"}
