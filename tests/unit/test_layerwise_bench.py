"""The layer-wise benchmark's arithmetic (kvpush_dev.bench.layerwise) and the deep model's
shape: the cap, the ratios, the hidden fraction and the loud refusal to measure whole-request
under a layer-wise name are plain functions, checked here without engines."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from kvpush_dev.bench import layerwise as lw
from kvpush_dev.tiny_model import PRESETS


def cal(prefill_ms: dict[int, float], per_tok: int = 24576) -> dict:
    return {"kv_bytes_per_token": per_tok,
            "lengths": {L: {"prefill_ms_p50": ms, "kv_bytes": per_tok * L} for L, ms in prefill_ms.items()}}


def test_deep_preset_kv_per_token_matches_its_config(tmp_path):
    spec = PRESETS["deep"]
    assert spec.layers >= 16 and spec.kv_bytes_per_token() == 24 * 2 * 2 * 64 * 4
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": spec.layers, "hidden_size": spec.hidden, "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads, "head_dim": spec.head_dim}))
    assert lw.kv_bytes_per_token(tmp_path) == spec.kv_bytes_per_token()
    assert PRESETS["tiny"].layers == 2  # the default model every other test uses is unchanged


def test_cap_makes_transfer_equal_prefill_where_one_length():
    c = lw.cap_for(cal({2000: 1000.0}))
    # 2000 tokens x 24576 B x 8 / 1 s = 393 Mbit/s, rounded to 10
    assert c["rate"] == "390mbit" and abs(c["transfer_over_prefill"][2000] - 1.0) < 0.02


@given(st.dictionaries(st.sampled_from([256, 512, 1024, 2000, 4000]), st.floats(20.0, 5000.0), min_size=1))
def test_cap_is_between_the_equal_time_rates(prefill_ms):
    c = lw.cap_for(cal(prefill_ms))
    rates = c["equal_rate_mbit"].values()
    assert min(rates) - 10 <= c["mbit_per_s"] <= max(rates) + 10 or c["mbit_per_s"] == 10
    # the ratio under the cap is the equal-time rate over the cap, per length
    for L, r in c["transfer_over_prefill"].items():
        assert abs(r - c["equal_rate_mbit"][L] / c["mbit_per_s"]) < 0.01 + 0.01 * r


def test_deployment_ratio_arithmetic():
    d = lw.deployment_ratio()
    assert d["kv_bytes_per_token"] == 327680
    assert 0.5 <= d["transfer_over_prefill"] <= 2.0  # the regime the lab's cap stands for
    assert abs(d["transfer_us_per_token"] - 327680 * 8 / 25e9 * 1e6) < 0.1


def test_hidden_fraction():
    whole = {"ttft": {2000: {"p50": 2500.0}}, "transfer_ms": {2000: 1200.0}}
    lay = {"ttft": {2000: {"p50": 1300.0}}}
    assert lw.hidden(whole, lay, 2000) == 1.0
    assert lw.hidden({"ttft": {2000: {"p50": 2500.0}}}, lay, 2000) is None  # no transfer time: no figure


def test_ttft_bound_of_goals():
    out = {"model": {"layers": 24}, "layer_group": 4,
           "calibration": {"lengths": {2000: {"prefill_ms_p50": 1000.0}}},
           "modes": {"whole": {"transfer_ms": {2000: 1200.0}}, "layerwise": {"ttft": {2000: {"p50": 1410.0}}}}}
    # bound = max(1000, 1200) + 1200 * 4 / 24 + 10 = 1410
    assert lw.over_bound(out, 2000) == 1.0
    assert lw.over_ideal_ms(out, 2000) == 10.0  # 1410 - (1200 + 200)
    out["layer_group"] = None  # the run set none: the connector's default
    from kvpush.engine_plugin.config import LAYER_GROUP

    assert lw.over_bound(out, 2000) == round(1410 / (1200 + 1200 * LAYER_GROUP / 24 + 10), 3)


def test_transfer_rows_matched_to_lengths_by_bytes():
    per = 24576
    rows = [{"side": "prefill", "result": "ok", "bytes": 512 * per, "latency_ms": 300.0},
            {"side": "prefill", "result": "ok", "bytes": 512 * per, "latency_ms": 320.0},
            {"side": "prefill", "result": "failed", "bytes": 512 * per, "latency_ms": 9000.0},
            {"side": "decode", "result": "ok", "bytes": 2048 * per, "latency_ms": 1.0},
            {"side": "prefill", "result": "ok", "bytes": 2048 * per, "latency_ms": 1100.0}]
    assert lw._transfer_ms_by_length(rows, [512, 2000, 4000], per) == {512: 310.0, 2000: 1100.0, 4000: None}


def test_check_modes_refuses_whole_request_under_a_layerwise_name():
    rows = [{"side": "prefill", "mode": "whole"}, {"side": "prefill", "mode": "layerwise"}]
    assert "whole" in lw.check_modes(rows, "layerwise")
    assert lw.check_modes([{"side": "prefill"}], "layerwise")  # no mode reported: a failure, not a pass
    assert lw.check_modes([], "layerwise")
    assert lw.check_modes([{"side": "prefill", "mode": "layerwise"}], "layerwise") == ""
    assert lw.check_modes([{"side": "prefill", "mode": "layer_groups"}, {"side": "decode"}], "layerwise") == ""
    assert lw.check_modes([{"side": "prefill", "mode": "whole_request"}], "whole") == ""
    assert lw.check_modes([{"side": "prefill", "mode": "whole_request"}], "layerwise")


def test_streaming_missing_follows_the_connector_schema(monkeypatch):
    from kvpush.engine_plugin import config as connector_config

    if "layerwise" not in connector_config.KEYS:
        assert "layerwise" in lw.streaming_missing()
    monkeypatch.setattr(connector_config, "KEYS", ())
    assert "layerwise" in lw.streaming_missing()
    monkeypatch.undo()
    assert lw.streaming_missing() == ""


def test_tables_render_with_a_mode_not_measured():
    out = {"lengths": [512], "requests": 2, "output_len": 8, "seed": 7,
           "model": {"dir": "deep", "layers": 24, "kv_bytes_per_token": 24576},
           "calibration": {"layers": 24, "kv_bytes_per_token": 24576,
                           "lengths": {512: {"prefill_ms_p50": 200.0, "kv_bytes": 512 * 24576, "kv_mib": 12.0}}},
           "cap": lw.cap_for(cal({512: 200.0})), "deployment": lw.deployment_ratio(),
           "modes": {"colocated": {"ttft": {512: {"p50": 210.0, "p90": 220.0, "errors": 0}}},
                     "layerwise": {"error": "no layerwise key"}}, "verdict": {}}
    md = lw.table_capped(out, "scripts/bench_lab.py layerwise")
    assert "| 512 | 12.0 | 200.0 |" in md and "210 / 220" in md
    assert "**layerwise: not measured: no layerwise key**" in md
    assert "| 512 | 200.0 | 12.0 |" in lw.table_model(out["calibration"], "x")


def test_the_as_shipped_mode_shows_its_first_and_second_token_and_its_cost_over_colocated():
    st = lambda p50: {"p50": p50, "p90": p50 + 10, "errors": 0}  # noqa: E731
    out = {"lengths": [512], "requests": 2, "output_len": 8, "seed": 7,
           "model": {"dir": "deep", "layers": 24, "kv_bytes_per_token": 24576},
           "calibration": {"layers": 24, "kv_bytes_per_token": 24576,
                           "lengths": {512: {"prefill_ms_p50": 200.0, "kv_bytes": 512 * 24576, "kv_mib": 12.0}}},
           "cap": lw.cap_for(cal({512: 200.0})), "deployment": lw.deployment_ratio(),
           "modes": {"colocated": {"ttft": {512: st(210.0)}},
                     "whole": {"ttft": {512: st(500.0)}, "texts": {"512:0": "a"}},
                     "default": {"ttft": {512: st(216.0)}, "second": {512: st(340.0)}, "texts": {"512:0": "a"},
                                 "first_tokens": {"prefill": 14.0, "decode": 1.0}},
                     "pull": {"ttft": {512: st(1200.0)}}}}
    lw._verdict(out, [512])
    assert out["verdict"]["default_minus_colocated_p50_ms"] == {512: 6.0}
    assert out["verdict"]["default_tokens_equal_whole"] == "1/1"
    md = lw.table_capped(out, "scripts/bench_lab.py layerwise")
    head, sep, row = (ln for ln in md.splitlines() if ln.startswith("| tokens") or ln.startswith("|---")
                      or ln.startswith("| 512"))
    assert head.count("|") == sep.count("|") == row.count("|")  # every column has its cell
    assert "216 / 226 | 340 / 350 | 1200 / 1210 |" in row
    assert "from the prefill leg in 14 of 15 requests" in md


def test_stream_stats_map_final_rows_to_lengths_in_request_order() -> None:
    """Newest-first rows: warm-ups (one a length) are skipped, group rows ignored, medians per length."""
    def row(tail, groups=6, lag=2.0, **kw):
        return {"side": "prefill", "result": "ok", "group": 0, "tail_ms": tail, "groups": groups,
                "first_group_lag_ms": lag, **kw}
    oldest_first = [row(999), row(999), row(10), row(12), row(11, group=3), row(50), row(70)]
    got = lw.stream_stats(list(reversed(oldest_first)), [512, 2000], 2)
    assert got == {512: {"groups": 6.0, "lag_ms": 2.0, "tail_ms": 11.0},
                   2000: {"groups": 6.0, "lag_ms": 2.0, "tail_ms": 60.0}}
    assert lw.stream_stats(list(reversed(oldest_first[:-1])), [512, 2000], 2) == {}  # a row missing: no guess


def test_rounds_pool_every_requests_ttft_and_keep_each_rounds_p50() -> None:
    def run(xs: list[float], frames: float) -> dict:
        return {"ttft": {16: lw.ttft_stats([{"ttft_ms": x} for x in xs])}, "ttft_ms": {16: xs},
                "progress_frames": frames}

    pooled = lw._pool([run([10, 11, 12], 0.0), run([20, 21, 22], 5.0)])
    assert pooled["ttft"][16]["n"] == 6 and pooled["round_p50"][16] == [11, 21]
    assert pooled["progress_frames"] == [0.0, 5.0]
    out = {"lengths": [16], "requests": 3, "output_len": 8, "rounds": 2, "model": {"dir": "deep"},
           "modes": {"whole": pooled, "auto": lw._pool([{"error": "boom"}, run([1], 0)])}}
    text = lw.table_loopback(out, "cmd")
    assert "whole: 16: 11 / 21" in text and "auto: not measured: boom" in text


def test_round_order_runs_every_mode_each_round_reversed_every_other() -> None:
    assert lw.round_order(["colocated", "whole", "default"], 2) == [
        (0, "colocated"), (0, "whole"), (0, "default"), (1, "default"), (1, "whole"), (1, "colocated")]
    assert lw.round_order(["a"], 1) == [(0, "a")]


def test_pooled_rounds_keep_second_tokens_writes_texts_and_first_token_sources() -> None:
    def run(first: list[float], second: list[float], write: float, text: str, prefill: float) -> dict:
        return {"ttft": {512: lw.ttft_stats([{"ttft_ms": x} for x in first])}, "ttft_ms": {512: first},
                "second_ms": {512: second}, "transfer_ms": {512: write}, "texts": {"512:0": text},
                "first_tokens": {"prefill": prefill, "decode": 1.0}}

    got = lw._pool([run([100, 110], [130, 140], 300.0, "a", 3), run([200, 210], [230, 240], 320.0, "b", 4),
                    run([300, 310], [330, 340], 400.0, "c", 5)])
    assert got["ttft"][512]["n"] == 6 and got["second"][512]["n"] == 6
    assert got["transfer_ms"] == {512: 320.0}  # the rounds' median, not the last round's
    assert got["texts"] == {"0:512:0": "a", "1:512:0": "b", "2:512:0": "c"}
    assert got["first_tokens"] == {"prefill": 12.0, "decode": 3.0}
    assert lw.decode_step_ms(got, 512) == 30.0


def test_verdict_judges_the_as_shipped_ttft_and_names_the_decode_step_in_the_excess() -> None:
    st = lambda p50: {"p50": p50, "p90": p50 + 10, "errors": 0}  # noqa: E731
    out = {"model": {"layers": 24}, "layer_group": 2, "lengths": [2000],
           "calibration": {"lengths": {2000: {"prefill_ms_p50": 1000.0}}},
           "modes": {"whole": {"ttft": {2000: st(2300.0)}, "transfer_ms": {2000: 1200.0}},
                     # the decode engine's first token lands 30 ms after the ideal; one step is 25 ms
                     "layerwise": {"ttft": {2000: st(1330.0)}, "ttft_ms": {2000: [1330.0, 1331.0]},
                                   "second_ms": {2000: [1355.0, 1356.0]}},
                     "default": {"ttft": {2000: st(1020.0)}}}}
    lw._verdict(out, [2000])
    v = out["verdict"]
    ideal = 1200 + 1200 * 2 / 24  # 1300
    assert v["layerwise_ttft_over_bound"] == {2000: round(1330 / (ideal + 10), 3)} and v["layerwise_ttft_over_bound"][2000] > 1
    assert v["decode_step_ms"] == {2000: 25.0}
    assert v["layerwise_ttft_over_bound_plus_one_decode_step"] == {2000: round(1330 / (ideal + 35), 3)}
    assert v["default_ttft_over_bound"] == {2000: round(1020 / (ideal + 10), 3)}
