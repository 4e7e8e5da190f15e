"""Prometheus exposition text (an engine's or kvpushd's /metrics) as series -> value.

Parsing is prometheus_client's own (``text_string_to_metric_families``), not a hand-written
line splitter: label values with spaces, escapes, ``+Inf``/``NaN`` and comments are handled
the way the exporters write them. The demo, the e2e tests and the benchmarks all read
metrics through this module.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Series:
    """One sample's identity: its name (``x_total``, ``x_bucket``, ...) and labels, in exposition order."""

    name: str
    labels: tuple[tuple[str, str], ...] = ()

    def label(self, key: str) -> str | None:
        return dict(self.labels).get(key)

    def matches(self, want: Mapping[str, str]) -> bool:
        mine = dict(self.labels)
        return all(mine.get(k) == v for k, v in want.items())

    def render(self) -> str:
        """As the exposition prints it: ``name{a="x",b="y"}`` (the sweep's JSON keys)."""
        if not self.labels:
            return self.name
        esc = (v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"') for _, v in self.labels)
        return self.name + "{" + ",".join(f'{k}="{v}"' for (k, _), v in zip(self.labels, esc, strict=True)) + "}"


Snapshot = dict[Series, float]


def parse(text: str) -> Snapshot:
    """Every sample of the text. Malformed text yields the families complete before the
    first bad line (a scrape cut short must not fail a benchmark point)."""
    out: Snapshot = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[Series(s.name, tuple(s.labels.items()))] = float(s.value)
    except ValueError:
        pass
    return out


def fetch_text(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return str(r.read().decode(errors="replace"))


def scrape(url: str | None, timeout: float = 5.0) -> Snapshot:
    """``url``'s samples; empty when there is no URL or it does not answer."""
    if not url:
        return {}
    try:
        return parse(fetch_text(url, timeout))
    except (urllib.error.URLError, OSError, TimeoutError):
        return {}


def total(snap: Snapshot, name: str, **labels: str) -> float | None:
    """Sum of the samples named ``name`` whose labels include ``labels``; None if there are none."""
    vals = [v for s, v in snap.items() if s.name == name and s.matches(labels)]
    return sum(vals) if vals else None


def by_label(snap: Snapshot, name: str, label: str) -> dict[str, float]:
    """Samples named ``name`` summed per value of ``label`` (e.g. prompt tokens per source)."""
    out: dict[str, float] = {}
    for s, v in snap.items():
        if s.name == name and (key := s.label(label)) is not None:
            out[key] = out.get(key, 0.0) + v
    return out
