"""Optional OpenTelemetry export of the per-request timeline (``pip install kvpush[otel]``).

Every kvpush process already stamps each request's hops in a bounded ring
(:mod:`kvpush.proto.trace`). With ``otlp_traces_endpoint`` set, a process also exports each
finished timeline as one span (``kvpush router``, ``kvpushd cpu0``, ...) whose span events
are the hops, converted from CLOCK_MONOTONIC to wall time with the process's clock pair.
The span is built after the fact from the stamps (they are the record), so tracing adds no
work on the transfer path beyond a queue append; the SDK's batch processor sends in its
own thread.

One trace per request: a W3C ``traceparent`` the client sends the router (or the router's
own new trace) is forwarded to both engines as the ``traceparent`` header, which vLLM
attaches its own request spans to (``--otlp-traces-endpoint``); and the router writes that
trace context into the ``transfer_id`` it hands both legs (``kvp-<trace id>-<span id>``),
the one field that reaches both daemons untouched. A daemon whose transfer ID carries no
context (a serial proxy such as Ray Serve's or llm-d's named the transfer) exports under a
trace ID derived from the transfer ID, so the prefill and decode daemons' spans of one
transfer still share a trace.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import re
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvpush.proto.trace import ClockPair

log = logging.getLogger(__name__)

_TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
_IN_TID = re.compile(r"^kvp-([0-9a-f]{32})-([0-9a-f]{16})$")


@dataclass(frozen=True, slots=True)
class TraceContext:
    """A W3C trace context: which trace, which span is the parent, sampled or not."""

    trace_id: int
    span_id: int
    sampled: bool = True

    @property
    def traceparent(self) -> str:
        return f"00-{self.trace_id:032x}-{self.span_id:016x}-{'01' if self.sampled else '00'}"

    def child(self) -> TraceContext:
        """A new span of the same trace (its parent is this one)."""
        return TraceContext(self.trace_id, _nonzero(64), self.sampled)

    @classmethod
    def new(cls) -> TraceContext:
        return cls(_nonzero(128), _nonzero(64))


def _nonzero(bits: int) -> int:
    while True:
        v = secrets.randbits(bits)
        if v:
            return v


def parse_traceparent(value: str | None) -> TraceContext | None:
    """The context of a ``traceparent`` header (version 00), or None if absent or malformed
    (all-zero IDs are invalid by the spec)."""
    m = _TRACEPARENT.match(value or "")
    if m is None:
        return None
    trace_id, span_id = int(m.group(1), 16), int(m.group(2), 16)
    if not trace_id or not span_id:
        return None
    return TraceContext(trace_id, span_id, bool(int(m.group(3), 16) & 1))


def transfer_id_for(ctx: TraceContext) -> str:
    """A transfer ID that carries ``ctx`` to both daemons (unique: the span ID is fresh)."""
    return f"kvp-{ctx.trace_id:032x}-{ctx.span_id:016x}"


def context_of(transfer_id: str) -> TraceContext | None:
    """The trace context a router wrote into ``transfer_id``, or None."""
    m = _IN_TID.match(transfer_id)
    if m is None:
        return None
    return TraceContext(int(m.group(1), 16), int(m.group(2), 16))


def derived_trace_id(transfer_id: str) -> int:
    """The trace ID every process derives for a transfer that carries no context."""
    return int.from_bytes(hashlib.sha256(transfer_id.encode()).digest()[:16], "big") or 1


class SpanSink:
    """Exports finished timelines as spans: OTLP/HTTP to ``endpoint``, or to ``exporter`` (tests)."""

    def __init__(self, service: str, endpoint: str | None = None, exporter: Any = None) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=endpoint)
        self.service = service
        self._resource = Resource.create({"service.name": service})
        self._scope = InstrumentationScope("kvpush")
        self._processor = BatchSpanProcessor(exporter)
        self._warned = False  # one warning, not one per transfer
        atexit.register(self.shutdown)

    def export(self, name: str, transfer_id: str, events: Sequence[tuple[str, int]],
               clock: ClockPair | None = None, ctx: TraceContext | None = None,
               parent: TraceContext | None = None, failed: bool = False) -> TraceContext | None:
        """One span named ``name`` from the first to the last stamp of ``events`` (monotonic
        ns), a span event per hop. Its context is ``ctx`` if given (the router's own span),
        else a child of ``parent``, of the transfer ID's context, or of the derived trace.
        Returns the span's context (None: nothing to export)."""
        from opentelemetry.sdk.trace import Event, ReadableSpan
        from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

        if not events:
            return None
        clock = clock or ClockPair.read()
        off = clock.wall_ns - clock.monotonic_ns
        if ctx is None:
            parent = parent or context_of(transfer_id)
            ctx = parent.child() if parent else TraceContext(derived_trace_id(transfer_id), _nonzero(64))
        if not ctx.sampled:
            return ctx
        flags = TraceFlags(TraceFlags.SAMPLED)
        span = ReadableSpan(
            name=name,
            context=SpanContext(ctx.trace_id, ctx.span_id, is_remote=False, trace_flags=flags),
            parent=SpanContext(parent.trace_id, parent.span_id, is_remote=True, trace_flags=flags)
            if parent else None,
            resource=self._resource,
            attributes={"kvpush.transfer_id": transfer_id, "kvpush.process": self.service},
            events=[Event(hop, {}, t + off) for hop, t in events],
            kind=SpanKind.INTERNAL,
            status=Status(StatusCode.ERROR if failed else StatusCode.UNSET),
            start_time=min(t for _, t in events) + off,
            end_time=max(t for _, t in events) + off,
            instrumentation_scope=self._scope,
        )
        self._processor.on_end(span)
        return ctx

    def on_end(self, name: str) -> Callable[[str, list[tuple[str, int]]], None]:
        """A :class:`~kvpush.proto.trace.TraceRing` sink exporting each ended timeline."""
        def sink(transfer_id: str, events: list[tuple[str, int]]) -> None:
            try:
                self.export(name, transfer_id, events, failed=any(h.endswith("_failed") for h, _ in events))
            except Exception as e:  # tracing must never break a transfer
                if not self._warned:
                    self._warned = True
                    log.warning("OpenTelemetry export of %s failed (further failures are not logged): %s",
                                transfer_id, e)
        return sink

    def flush(self, timeout_s: float = 5.0) -> bool:
        return bool(self._processor.force_flush(int(timeout_s * 1000)))

    def shutdown(self) -> None:
        self._processor.shutdown()
