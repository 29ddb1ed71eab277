"""One logging configuration for every command: cotserve's loggers and uvicorn's together.

`configure(level, fmt)` is called by the CLI before a command runs. The level comes from
`--log-level`, else `$COTSERVE_LOG_LEVEL`, else `info`; the format from `--log-format`, else
`$COTSERVE_LOG_FORMAT`, else `text`:

* text: `2026-11-30T18:00:00.123Z INFO cotserve.worker: message`
* json: one object a line, `{"time", "level", "logger", "message", ...}` plus the record's own
  fields (what a caller passed as `extra=`), and `exc_info` as text.

Uvicorn is then run with `log_config=None`, so its records go through the same handler.
"""

from __future__ import annotations

import json
import logging
import os
import time
from functools import lru_cache
from typing import Any

LEVELS = ("debug", "info", "warning", "error", "critical")
FORMATS = ("text", "json")
LOGGERS = ("cotserve", "uvicorn", "uvicorn.error", "uvicorn.access")
# Set on records after they are made, never by a caller's `extra=`; uvicorn's `color_message` repeats
# the message with terminal colours.
_NOT_EXTRA = frozenset({"message", "asctime", "taskName", "color_message"})


def _utc(record: logging.LogRecord) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = f"{_utc(record)} {record.levelname} {record.name}: {record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


@lru_cache(maxsize=1)
def _every_records_attributes(factory: Any) -> frozenset[str]:
    """What the installed record factory puts on every record: LogRecord's own attributes, and what a
    library's factory adds (vLLM's, installed when an engine starts in the process, as in the embedded
    vLLM worker, tags each record with its process name). Everything else came from `extra=`."""
    return frozenset(vars(factory("", logging.INFO, "", 0, "", (), None))) | _NOT_EXTRA


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {"time": _utc(record), "level": record.levelname, "logger": record.name,
                               "message": record.getMessage()}
        standard = _every_records_attributes(logging.getLogRecordFactory())
        for key, value in vars(record).items():
            # the fields a caller passed in `extra` (plain values; libraries that tag every record
            # with their own objects, such as litellm's redaction marker, are left out)
            if key not in standard and not key.startswith("_") and isinstance(
                    value, (str, int, float, bool, type(None), list, dict)):
                out[key] = value
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


_current: list[str] = []  # [level, format] once configure() ran


def current() -> tuple[str, str]:
    """The configured (level, format), or what configure() would pick now."""
    return (_current[0], _current[1]) if _current else resolve()


def resolve(level: str | None = None, fmt: str | None = None) -> tuple[str, str]:
    """The effective (level, format), checked; a bad value raises ValueError naming the choices."""
    level = (level or os.environ.get("COTSERVE_LOG_LEVEL") or "info").strip().lower()
    fmt = (fmt or os.environ.get("COTSERVE_LOG_FORMAT") or "text").strip().lower()
    if level not in LEVELS:
        raise ValueError(f"log level {level!r}: use one of {', '.join(LEVELS)}")
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r}: use one of {', '.join(FORMATS)}")
    return level, fmt


def configure(level: str | None = None, fmt: str | None = None, stream: Any = None) -> tuple[str, str]:
    """Install one stderr handler for cotserve's and uvicorn's loggers; returns (level, format)."""
    level, fmt = resolve(level, fmt)
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.set_name("cotserve")
    numeric = getattr(logging, level.upper())
    for name in LOGGERS:
        logger = logging.getLogger(name)
        for old in [h for h in logger.handlers if h.get_name() == "cotserve" or name.startswith("uvicorn")]:
            logger.removeHandler(old)
        logger.setLevel(numeric)
        logger.propagate = False
        logger.addHandler(handler)
    _current[:] = [level, fmt]
    return level, fmt
