"""Structured logs: one JSON object per line on stderr, with the rollout and trace ids.

Whatever a line says, secrets are taken out of it (``redact``): API keys' and sign-in tokens'
secrets (their ids stay: they name the key), the key of an OpenEnv base URL
(``/openenv/k/{key}/``), and a URL's password (``nats://user:password@host``)."""

from __future__ import annotations

import json
import logging
import re
import sys
import time

_CONTEXT_FIELDS = ("rollout_id", "group_id", "subject", "trace_id", "consumer", "sandbox_id", "error")


#: ``ak_<id>_<secret>`` (API keys) and ``st_<id>_<secret>`` (sign-in tokens): the secret goes
_KEY = re.compile(r"\b((?:ak|st)_[0-9a-f]{6,32}_)[A-Za-z0-9_-]{8,}")
_OPENENV_KEY = re.compile(r"(/openenv/k/)[^/\s?#\"']+")
_URL_PASSWORD = re.compile(r"([a-z][a-z0-9+.-]*://[^:/@\s\"']*:)[^@/\s\"']+@", re.IGNORECASE)
REDACTED = "***"


def redact(text: str) -> str:
    """``text`` without API keys' or sign-in tokens' secrets, OpenEnv URL keys and URL passwords."""
    if "_" not in text and "@" not in text and "/openenv/k/" not in text:
        return text
    text = _KEY.sub(rf"\g<1>{REDACTED}", text)
    text = _OPENENV_KEY.sub(rf"\g<1>{REDACTED}", text)
    return _URL_PASSWORD.sub(rf"\g<1>{REDACTED}@", text)


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
            "msg": redact(record.getMessage()),
        }
        for key in _CONTEXT_FIELDS:
            value = getattr(record, key, None)
            if value is not None:
                line[key] = redact(value) if isinstance(value, str) else value
        if record.exc_info:
            line["exc"] = redact(self.formatException(record.exc_info))
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
