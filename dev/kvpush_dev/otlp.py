"""A local OTLP/HTTP traces receiver: what a collector would get, decoded with opentelemetry-proto.

Accepts the exporter's protobuf POSTs on /v1/traces and keeps every span (bounded), so tests
check the real wire export instead of the SDK's in-memory copy.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MAX_SPANS = 10_000


class OtlpReceiver:
    def __init__(self, host: str = "127.0.0.1") -> None:
        self._spans: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self.posts: list[tuple[str, str | None]] = []  # (path, content-type) of each POST
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
                    ExportTraceServiceRequest,
                )

                req = ExportTraceServiceRequest()
                req.ParseFromString(self.rfile.read(int(self.headers["content-length"])))
                receiver._add(self.path, self.headers.get("content-type"), req)
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *_a: Any) -> None:
                pass

        self._server = ThreadingHTTPServer((host, 0), Handler)
        self.endpoint = f"http://{host}:{self._server.server_address[1]}/v1/traces"
        threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True).start()

    def _add(self, path: str, ctype: str | None, req: Any) -> None:
        out = []
        for rs in req.resource_spans:
            resource = {a.key: a.value.string_value for a in rs.resource.attributes}
            service = resource.get("service.name", "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    attrs = {a.key: a.value.string_value for a in s.attributes}
                    out.append({"service": service, "resource": resource, "name": s.name, "trace_id": int.from_bytes(s.trace_id, "big"),
                                "span_id": int.from_bytes(s.span_id, "big"),
                                "parent_span_id": int.from_bytes(s.parent_span_id, "big") if s.parent_span_id else None,
                                "transfer_id": attrs.get("kvpush.transfer_id"),
                                "events": [e.name for e in s.events], "status": s.status.code})
        with self._lock:
            self.posts.append((path, ctype))
            self._spans.extend(out[: MAX_SPANS - len(self._spans)])

    def spans(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._spans)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
