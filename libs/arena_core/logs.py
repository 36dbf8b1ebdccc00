"""Structured logs: one JSON object per line on stderr, with the rollout and trace ids."""

from __future__ import annotations

import json
import logging
import sys
import time

_CONTEXT_FIELDS = ("rollout_id", "group_id", "subject", "trace_id", "consumer", "sandbox_id", "error")


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": round(time.time(), 3),
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key in _CONTEXT_FIELDS:
            value = getattr(record, key, None)
            if value is not None:
                line[key] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def setup(service: str, level: str = "INFO") -> logging.Logger:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("uvicorn.access", "httpx", "nats"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return logging.getLogger(f"arena.{service}")
