"""One log setup for every role: one line per event, `key=value` (logfmt) or JSON.

Every `servefleet` subcommand that runs a process calls `setup_logging`, so the engine, the
gateway, the operator, the autoscaler and `servefleet up` write the same fields in the same
shape, and one log pipeline (Loki's logfmt or json parser) reads them all. uvicorn and kopf
log through the root handler installed here (callers pass `log_config=None` to uvicorn).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Any, Literal

LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")
LogFormat = Literal["text", "json"]

# Attributes every LogRecord has; anything else came in through `extra=` and is a field.
_RECORD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "color_message",  # uvicorn's coloured duplicate of the message
    "taskName",
}
# kopf says "Handler ... succeeded" for every event at info; its warnings and errors stay.
_NOISY_LOGGERS = ("httpx", "httpcore", "uvicorn.access", "asyncio", "kopf.objects")
# kopf puts its whole settings object and a skip flag on every record: not fields for a reader.
_DROPPED_EXTRAS = frozenset({"settings", "k8s_skip"})


def add_logging_arguments(parser: argparse.ArgumentParser) -> None:
    """`--log-level` and `--log-format`, spelled the same in every subcommand."""
    parser.add_argument(
        "--log-level",
        type=str.lower,
        choices=LOG_LEVELS,
        default="info",
        help="lowest level logged",
    )
    parser.add_argument(
        "--log-format",
        type=str.lower,
        choices=LOG_FORMATS,
        default="text",
        help="text: key=value fields (logfmt); json: one JSON object per line",
    )


def _time(record: logging.LogRecord) -> str:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
    return f"{stamp}.{int(record.msecs):03d}Z"


def record_fields(record: logging.LogRecord) -> dict[str, Any]:
    """time, level, logger, msg, then the record's `extra=` fields, then exc (if any)."""
    fields: dict[str, Any] = {
        "time": _time(record),
        "level": record.levelname.lower(),
        "logger": record.name,
        "msg": record.getMessage(),
    }
    for key, value in vars(record).items():
        if key == "k8s_ref" and isinstance(value, dict):
            fields["object"] = _object_ref(value)
        elif key not in _RECORD_ATTRS and key not in _DROPPED_EXTRAS and not key.startswith("_"):
            fields[key] = value
    return fields


def _object_ref(ref: dict[str, Any]) -> str:
    """kopf's object reference as `Kind namespace/name`, what kubectl users read."""
    where = "/".join(str(ref[k]) for k in ("namespace", "name") if ref.get(k))
    return f"{ref.get('kind', '')} {where}".strip()


def _logfmt_value(value: object) -> str:
    text = str(value)
    if text and not any(c in text for c in ' ="\\\n\t'):
        return text
    return json.dumps(text, ensure_ascii=False)


class LogfmtFormatter(logging.Formatter):
    """`time=… level=info logger=… msg="…" key=value…`; tracebacks follow on their own lines
    (they are for unexpected failures only: expected ones are one line)."""

    def format(self, record: logging.LogRecord) -> str:
        line = " ".join(f"{k}={_logfmt_value(v)}" for k, v in record_fields(record).items())
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line; a traceback is the `exc` field, so a line is a record."""

    def format(self, record: logging.LogRecord) -> str:
        fields = record_fields(record)
        if record.exc_info:
            fields["exc"] = self.formatException(record.exc_info)
        return json.dumps(fields, ensure_ascii=False, default=str)


def setup_logging(level: str = "info", log_format: str = "text") -> None:
    """Replace the root handler with ours; quiet the chatty libraries to warnings."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else LogfmtFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in _NOISY_LOGGERS:
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # uvicorn's loggers keep their own handlers when it configured them; ours is the one.
    for name in ("uvicorn", "uvicorn.error"):
        uvicorn_logger = logging.getLogger(name)
        uvicorn_logger.handlers[:] = []
        uvicorn_logger.propagate = True
