"""ClickHouse connections for the trajectory store: embedded chDB or a server through
clickhouse-connect, behind one small ``Backend`` protocol. Both run the same SQL.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol
from urllib.parse import urlparse

from arena_core.errors import Unavailable


Param = str | int | float | list[str]


class Backend(Protocol):
    """The three things the store needs from ClickHouse. Calls block; the store runs
    them in a thread."""

    def execute(self, sql: str) -> None: ...

    def insert(self, table: str, rows: bytes, *, fmt: str = "JSONEachRow", columns: Sequence[str] = ()) -> None:
        """Insert ``rows`` (in format ``fmt``) into ``table`` (``database.table``);
        ``columns``: the columns the rows hold, in order (required by ``RowBinary``)."""

    def select(self, sql: str, params: Mapping[str, Param]) -> bytes:
        """Run ``sql`` with ``{name:Type}`` parameters bound (a list binds an
        ``Array(String)``); JSONEachRow result."""

    def close(self) -> None: ...


def array_literal(values: list[str]) -> str:
    """A ClickHouse ``Array(String)`` literal of ``values``, quoted and escaped."""
    quoted = (
        "'" + v.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n").replace("\t", "\\t")
        .replace("\r", "\\r").replace("\0", "\\0") + "'"
        for v in values
    )
    return "[" + ",".join(quoted) + "]"


def escape_param(value: str) -> str:
    """Escape a query-parameter value the way ClickHouse parses it (TSV "escaped" format).

    The server reads a bound ``String`` parameter as escaped text, so a raw backslash,
    tab or newline would be misread; this makes the round trip exact.
    """
    return (
        value.replace("\\", "\\\\")
        .replace("\t", "\\t")
        .replace("\n", "\\n")
        .replace("\r", "\\r")
        .replace("\0", "\\0")
        .replace("\b", "\\b")
        .replace("\f", "\\f")
    )


class ChdbBackend:
    """Embedded ClickHouse (chDB): one session per process, serialized by a lock."""

    def __init__(self, path: str | Path):
        from chdb import session  # imported here: the server backend does not need it

        Path(path).mkdir(parents=True, exist_ok=True)
        self.path = str(path)
        self._lock = threading.Lock()
        self._session = session.Session(self.path)

    def execute(self, sql: str) -> None:
        with self._lock:
            self._session.query(sql)

    def insert(self, table: str, rows: bytes, *, fmt: str = "JSONEachRow", columns: Sequence[str] = ()) -> None:
        target = f"{table} ({', '.join(columns)})" if columns else table
        with self._lock:
            # a streaming insert takes the bytes as they are (binary formats too), no str round trip
            with self._session.send_insert(f"INSERT INTO {target}", fmt) as inserter:
                inserter.append(rows)
                inserter.finish()

    def select(self, sql: str, params: Mapping[str, Param]) -> bytes:
        bound = {k: _bind(v) for k, v in params.items()}
        with self._lock:
            return self._session.query(sql, "JSONEachRow", params=bound).bytes()

    def close(self) -> None:
        with self._lock:
            if self._session is not None:  # idempotent
                self._session.close()
                self._session = None


def _bind(value: Param) -> str:
    if isinstance(value, list):
        return array_literal(value)
    return escape_param(value) if isinstance(value, str) else str(value)


class ClickHouseConnectBackend:
    """A ClickHouse server through clickhouse-connect (HTTP). Parameters are bound by the
    server; inserts use ``async_insert`` and wait for it, so a return means stored."""

    def __init__(self, client, *, async_insert: bool = True):
        self.client = client
        self._insert_settings = {"async_insert": 1, "wait_for_async_insert": 1} if async_insert else {}

    @classmethod
    def from_url(cls, url: str) -> ClickHouseConnectBackend:
        import clickhouse_connect

        dsn = "http" + url[len("clickhouse"):] if url.startswith("clickhouse://") else url
        try:
            # no session id: requests are stateless, so concurrent calls from threads are safe
            client = clickhouse_connect.get_client(dsn=dsn, autogenerate_session_id=False)
        except Exception as exc:  # noqa: BLE001 - the driver raises several types
            parsed = urlparse(dsn)
            host = f"{parsed.hostname}:{parsed.port}" if parsed.port else str(parsed.hostname)
            where = parsed._replace(netloc=host).geturl()  # no credentials in logs
            raise Unavailable(f"cannot connect to ClickHouse at {where}: {type(exc).__name__}") from exc
        return cls(client)

    def execute(self, sql: str) -> None:
        self.client.command(sql)

    def insert(self, table: str, rows: bytes, *, fmt: str = "JSONEachRow", columns: Sequence[str] = ()) -> None:
        self.client.raw_insert(table, column_names=list(columns) or None, insert_block=rows, fmt=fmt,
                               settings=self._insert_settings)

    def select(self, sql: str, params: Mapping[str, Param]) -> bytes:
        return self.client.raw_query(sql, parameters=dict(params), fmt="JSONEachRow")

    def close(self) -> None:
        self.client.close()
