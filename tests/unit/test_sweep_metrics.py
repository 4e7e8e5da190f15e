"""The sweep's Prometheus maths on real exposition text (prometheus_client's own registry).

Every snapshot here is ``generate_latest`` of a real registry parsed by kvpush_dev.prom,
so the tests cover the format the engines and daemons write, not a hand-made imitation.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvpush.daemon.metrics import DaemonMetrics
from kvpush_dev import prom
from kvpush_dev.sweep import scrape_deltas as sm

BUCKETS = (0.01, 0.1, 1.0)
ITL = "vllm:inter_token_latency_seconds"


def snap(reg: CollectorRegistry) -> prom.Snapshot:
    return prom.parse(generate_latest(reg).decode())


def itl_registry() -> tuple[CollectorRegistry, Histogram]:
    reg = CollectorRegistry()
    h = Histogram(ITL, "inter-token latency", ["model_name", "engine"], buckets=BUCKETS, registry=reg)
    return reg, h


# ---------------------------------------------------------------------------- histograms

def test_histogram_delta_counts_only_the_interval_and_interpolates() -> None:
    reg, h = itl_registry()
    for v in (0.5, 0.5, 0.5):  # before the point: must not count
        h.labels("tiny", "0").observe(v)
    before = snap(reg)
    for v in (0.005,) * 3:
        h.labels("tiny", "0").observe(v)
    for v in (0.005,) * 2:
        h.labels("tiny", "1").observe(v)  # a second label set: summed with the first
    for v in (0.2, 0.3, 0.4, 0.6, 0.9):
        h.labels("tiny", "1").observe(v)
    d = sm.histogram_delta(before, snap(reg), ITL)
    assert d is not None
    assert d["count"] == 10
    assert d["sum"] == pytest.approx(5 * 0.005 + 2.4)
    assert d["mean"] == pytest.approx((5 * 0.005 + 2.4) / 10)
    # rank 5 of 10 is the last observation of the first bucket (0, 0.01]: its upper edge
    assert d["p50"] == pytest.approx(0.01)
    # rank 9.9 falls in (0.1, 1.0] holding observations 6..10: 0.1 + 0.9 * (9.9 - 5) / 5
    assert d["p99"] == pytest.approx(0.1 + 0.9 * 4.9 / 5)


def test_histogram_without_observations_in_the_interval_is_none() -> None:
    reg, h = itl_registry()
    h.labels("tiny", "0").observe(0.05)
    s = snap(reg)
    assert sm.histogram_delta(s, s, ITL) is None
    assert sm.histogram_delta({}, s, "vllm:no_such_histogram") is None
    assert ITL not in sm.metric_summary(s, s, (ITL,), ())


def test_observations_above_the_last_bound_report_the_last_finite_bound() -> None:
    reg, h = itl_registry()
    before = snap(reg)
    for _ in range(4):
        h.labels("tiny", "0").observe(7.0)
    d = sm.histogram_delta(before, snap(reg), ITL)
    assert d is not None and d["p50"] == 1.0 and d["p99"] == 1.0


def test_hist_quantile_edge_cases() -> None:
    assert sm.hist_quantile([], 0.5) is None
    assert sm.hist_quantile([(1.0, 0.0), (math.inf, 0.0)], 0.5) is None
    assert sm.hist_quantile([(1.0, 2.0), (2.0, 4.0), (math.inf, 4.0)], 0.5) == pytest.approx(1.0)
    assert sm.hist_quantile([(1.0, 2.0), (2.0, 4.0), (math.inf, 4.0)], 0.75) == pytest.approx(1.5)


bounds_st = st.lists(st.floats(0.001, 100.0, allow_nan=False), min_size=1, max_size=6, unique=True).map(
    lambda b: tuple(sorted(b)))
values_st = st.lists(st.floats(0.0, 150.0, allow_nan=False), min_size=1, max_size=60)


def bucket_bounds(bounds: tuple[float, ...], x: float) -> tuple[float, float] | None:
    """(lower, upper] of the bucket holding ``x``; None above every finite bound."""
    lo = 0.0
    for b in bounds:
        if x <= b:
            return lo, b
        lo = b
    return None


@settings(max_examples=60, deadline=None)
@given(bounds=bounds_st, old=st.lists(st.floats(0.0, 150.0, allow_nan=False), max_size=20),
       new=values_st, split=st.integers(0, 60))
def test_quantiles_lie_in_the_bucket_of_the_ranked_observation(bounds, old, new, split) -> None:
    """Against the observations themselves: p50/p99 lie inside the bucket holding the
    ceil(q*n)-th smallest observation of the interval (the last finite bound when that one is
    above them all); observations before the interval and label sets change nothing."""
    def run(label_of) -> dict:
        reg = CollectorRegistry()
        h = Histogram("kvpush_write_latency_seconds", "w", ["device"], buckets=bounds, registry=reg)
        for v in old:
            h.labels("cpu0").observe(v)
        before = snap(reg)
        for i, v in enumerate(new):
            h.labels(label_of(i)).observe(v)
        d = sm.histogram_delta(before, snap(reg), "kvpush_write_latency_seconds")
        assert d is not None
        return d

    one = run(lambda i: "cpu0")
    many = run(lambda i: "cpu0" if i < split else "cpu1")
    for key in ("count", "p50", "p99"):
        assert one[key] == pytest.approx(many[key]), key
    assert one["count"] == len(new)
    assert one["sum"] == pytest.approx(sum(new), abs=1e-6)
    for q, key in ((0.5, "p50"), (0.99, "p99")):
        x = sorted(new)[max(math.ceil(q * len(new)), 1) - 1]
        where = bucket_bounds(bounds, x)
        if where is None:
            assert one[key] == bounds[-1]
        else:
            assert where[0] - 1e-9 <= one[key] <= where[1] + 1e-9, (key, x, where)


@settings(max_examples=40, deadline=None)
@given(bounds=bounds_st, values=values_st)
def test_quantile_is_monotone_in_q(bounds, values) -> None:
    reg = CollectorRegistry()
    h = Histogram("h", "h", buckets=bounds, registry=reg)
    for v in values:
        h.observe(v)
    s = snap(reg)
    cum = sorted((sm._le(k.label("le")), v) for k, v in s.items() if k.name == "h_bucket")
    qs = [sm.hist_quantile(cum, q) for q in (0.01, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)]
    assert all(a <= b + 1e-12 for a, b in zip(qs, qs[1:], strict=False))


# ---------------------------------------------------------------------------- counters

def test_counter_deltas_per_series_keyed_as_printed() -> None:
    reg = CollectorRegistry()
    c = Counter("vllm:prompt_tokens_by_source", "prompt tokens", ["engine", "source"], registry=reg)
    c.labels("0", "local_compute").inc(100)
    c.labels("0", "local cache hit").inc(5)  # a space in a label value
    before = snap(reg)
    c.labels("0", "local_compute").inc(3)
    c.labels("0", "external_kv_transfer").inc(256)  # a series new in the interval counts from 0
    after = snap(reg)
    got = sm.counter_deltas(before, after, ("vllm:prompt_tokens_by_source_total",))
    assert got == {
        'vllm:prompt_tokens_by_source_total{engine="0",source="local_compute"}': 3.0,
        'vllm:prompt_tokens_by_source_total{engine="0",source="external_kv_transfer"}': 256.0,
    }  # the unchanged series and the *_created samples are left out
    assert sm.counter_deltas(before, after, ("vllm:other_total",)) == {}
    assert prom.by_label(after, "vllm:prompt_tokens_by_source_total", "source") == {
        "local_compute": 103.0, "local cache hit": 5.0, "external_kv_transfer": 256.0}


def test_daemon_families_the_sweep_keeps_are_the_daemons_own() -> None:
    """The daemon's real DaemonMetrics exposition: the sweep's DAEMON_* names must match it."""
    m = DaemonMetrics("cpu0")
    before = prom.parse(m.render())
    m.write_done(1 << 20, 0.004)
    m.write_done(1 << 20, 0.006)
    m.transfer_finished("prefill", "ok")
    m.failure("nixl")
    out = sm.metric_summary(before, prom.parse(m.render()), sm.DAEMON_HISTOGRAMS, sm.DAEMON_COUNTERS)
    w = out["kvpush_write_latency_seconds"]
    assert w["count"] == 2 and w["sum"] == pytest.approx(0.010)
    assert 0.0 < w["p50"] <= w["p99"]
    names = {k.split("{", 1)[0] for k in out["counters"]}
    assert names == {"kvpush_written_bytes_total", "kvpush_transfers_total", "kvpush_failures_total"}
    assert sum(v for k, v in out["counters"].items() if k.startswith("kvpush_written_bytes_total")) == 2 << 20


# ---------------------------------------------------------------------------- the parser

label_value = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)


@settings(max_examples=60, deadline=None)
@given(values=st.lists(label_value, min_size=1, max_size=4, unique=True))
def test_series_render_as_the_exposition_prints_them(values) -> None:
    """Quotes, backslashes, newlines, spaces in label values: every parsed series renders back
    to exactly the text before its value."""
    reg = CollectorRegistry()
    g = Gauge("vllm:num_requests_running", "running", ["model_name", "engine"], registry=reg)
    for i, v in enumerate(values):
        g.labels(v, str(i)).set(i + 1)
    text = generate_latest(reg).decode()
    s = prom.parse(text)
    printed = {line.rsplit(" ", 1)[0] for line in text.split("\n") if line and not line.startswith("#")}
    assert {k.render() for k in s} == printed
    assert prom.total(s, "vllm:num_requests_running") == sum(range(1, len(values) + 1))
    assert prom.total(s, "vllm:num_requests_running", engine="0") == 1
    assert prom.total(s, "vllm:num_requests_waiting") is None


def test_malformed_text_keeps_the_complete_families() -> None:
    reg = CollectorRegistry()
    Gauge("a_gauge", "a", registry=reg).set(2)
    good = generate_latest(reg).decode()
    s = prom.parse(good + "# TYPE b gauge\nb 1\nthis is not a sample\n")
    assert prom.total(s, "a_gauge") == 2.0
    assert prom.parse("") == {}
    assert prom.scrape(None) == {}
    assert prom.scrape("http://127.0.0.1:9/metrics", timeout=0.5) == {}  # nothing listens on 9
