"""Logs of every ``translator`` command: JSON lines on stderr through python-json-logger.

Each line holds ``ts``, ``level``, ``logger``, ``message``, the ``request_id`` of the HTTP request
being served (``-`` outside one), ``exc_info`` when an exception is logged, and every field
passed as ``extra=`` (nothing is dropped). ``TRANSLATOR_LOG_FORMAT=text`` gives classic
one-line text instead, for reading a training run in a terminal.
"""

from __future__ import annotations

import logging
import os
from contextvars import ContextVar

from pythonjsonlogger.json import JsonFormatter

request_id_var: ContextVar[str] = ContextVar("request_id", default="-")

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"


class RequestIdFilter(logging.Filter):
    """Stamp each record with the request id of the context it was logged in."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id_var.get()
        return True


def formatter(kind: str) -> logging.Formatter:
    if kind == "text":
        return logging.Formatter(TEXT_FORMAT)
    return JsonFormatter(
        "%(asctime)s %(levelname)s %(name)s %(request_id)s %(message)s",
        rename_fields={"asctime": "ts", "levelname": "level", "name": "logger"},
        json_ensure_ascii=False,
    )


def configure_logging(level: str = "info", kind: str | None = None) -> None:
    """Route every logger (uvicorn's included) to one stderr handler in ``kind`` format
    (default: ``TRANSLATOR_LOG_FORMAT``, else json)."""
    kind = kind or os.environ.get("TRANSLATOR_LOG_FORMAT", "json")
    handler = logging.StreamHandler()
    handler.setFormatter(formatter(kind))
    handler.addFilter(RequestIdFilter())
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error"):
        logging.getLogger(name).handlers = []
        logging.getLogger(name).propagate = True
    logging.getLogger("uvicorn.access").disabled = True  # app.access logs with request ids instead
