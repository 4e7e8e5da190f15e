"""Log line formats of kvpushd and the router: human text, or one JSON object per line.

Text is for a person reading journald; JSON is for a log pipeline (Loki, Elasticsearch,
Cloud Logging) that would otherwise have to parse the text back. Both processes configure
logging through :func:`configure` (flag ``--log-format``, config key ``log_format``), so
their lines share one shape.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)-7s %(processName)s[%(process)d] %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``ts`` (RFC 3339, UTC), ``level``, ``logger``, ``pid``,
    ``process``, ``msg``, and ``exc`` when an exception is attached. Newlines in a message
    stay inside the string, so one record is always one line."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="microseconds"),
            "level": record.levelname,
            "logger": record.name,
            "pid": record.process,
            "process": record.processName,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def formatter(fmt: str, text_format: str = TEXT_FORMAT) -> logging.Formatter:
    if fmt == "json":
        return JsonFormatter()
    if fmt == "text":
        return logging.Formatter(text_format)
    raise ValueError(f"log format must be one of {', '.join(FORMATS)}, got {fmt!r}")


def configure(level: str | int, fmt: str = "text", text_format: str = TEXT_FORMAT) -> None:
    """The root logger writes ``fmt`` lines at ``level`` to stderr (journald adds its own
    metadata); replaces any handler configured before."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter(fmt, text_format))
    logging.basicConfig(level=level, handlers=[handler], force=True)
