"""Logging setup: human-readable lines by default, one JSON object per line with `log_format=json`
(`COALESCE_LOG_FORMAT=json`). Events (request start/finish, dedup decisions, preemptions, worker loss) go to
the `coalesce.events` logger with their fields in `extra={"fields": {...}}`, so both formats carry them.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any

EVENTS = logging.getLogger("coalesce.events")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One line of JSON: time, level, logger, message, the event's fields, and the exception if any."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        line.update(getattr(record, "fields", {}))
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class TextFormatter(logging.Formatter):
    """The usual line, with an event's fields appended as key=value."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = getattr(record, "fields", None)
        return text + "".join(f" {k}={v}" for k, v in fields.items()) if fields else text


def configure_logging(log_format: str = "text", level: int = logging.INFO) -> None:
    """Replace the root handlers with one stderr handler in the chosen format."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def event(name: str, message: str, level: int = logging.INFO, **fields: Any) -> None:
    """Log one event; empty fields (no trace id when untraced) are left out."""
    if EVENTS.isEnabledFor(level):
        kept = {k: v for k, v in fields.items() if v not in ("", None)}
        EVENTS.log(level, message, extra={"fields": {"event": name, **kept}})
