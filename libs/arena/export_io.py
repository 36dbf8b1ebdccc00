"""Reading trajectories for export (``HttpSource``, ``StoreSource``) and writing the views
(``ParquetWriter``, ``JsonlWriter``). pyarrow is the optional extra ``arena[export]``.

See docs/trajectory.md ("Exports: training data").
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Protocol

import httpx
import msgspec

from arena import endpoints
from arena_core.apikeys import auth_headers
from arena_core.errors import BY_CODE, ArenaError, InvalidRequest, Unavailable
from arena.export import ExportOptions, ExportStats, View, export_rows
from arena_core.schemas import Trajectory

PAGE = 500


class ExportFilter(msgspec.Struct, frozen=True, kw_only=True):
    task_id: str | None = None
    since: float | None = None
    until: float | None = None
    min_reward: float | None = None
    policy_version: str | None = None

    def params(self) -> dict[str, str]:
        return {k: str(v) for k, v in msgspec.structs.asdict(self).items() if v is not None}


class _Page(msgspec.Struct):
    trajectories: list[Trajectory]
    next: list[str] | None = None
    total: int | None = None


# --------------------------------------------------------------------------- sources


class Source(Protocol):
    total: int | None

    def trajectories(self) -> AsyncIterator[Trajectory]: ...


class HttpSource:
    """Pages through ``GET {url}/v1/export/trajectories``. ``url`` and ``api_key`` unset: as
    ``arena.endpoints.resolve`` finds them (``ARENA_TRAJECTORY_URL``, ``ARENA_API_KEY``, else the
    local stack and ``$ARENA_DATA_DIR/api-key``)."""

    def __init__(self, url: str | None, f: ExportFilter, *, page: int = PAGE, timeout: float = 60.0,
                 api_key: str | None = None):
        found = endpoints.resolve(trajectory_url=url, api_key=api_key)
        self.url = found.trajectory_url
        self.api_key = found.api_key
        self.filter = f
        self.page = page
        self.timeout = timeout
        self.total: int | None = None

    async def trajectories(self) -> AsyncIterator[Trajectory]:
        params: dict[str, str] = {**self.filter.params(), "limit": str(self.page)}
        decoder = msgspec.json.Decoder(_Page)
        async with httpx.AsyncClient(timeout=self.timeout, headers=auth_headers(self.api_key or "")) as client:
            while True:
                try:
                    r = await client.get(f"{self.url}/v1/export/trajectories", params=params)
                except httpx.ConnectError as exc:
                    raise Unavailable(endpoints.not_running(self.url, exc)) from exc
                except httpx.TransportError as exc:
                    raise Unavailable(f"trajectory service at {self.url} is not reachable: {exc}") from exc
                if r.status_code != 200:
                    try:
                        err = r.json()["error"]
                        code, message = err["code"], err["message"]
                    except (ValueError, KeyError, TypeError):
                        raise Unavailable(f"{self.url} answered {r.status_code}: {r.text[:200]}") from None
                    raise BY_CODE.get(code, ArenaError)(message)
                page = decoder.decode(r.content)
                if page.total is not None:
                    self.total = page.total
                for t in page.trajectories:
                    yield t
                if page.next is None:
                    return
                params.update(after_group=page.next[0], after_rollout=page.next[1])


    async def task_ids(self, *, most: int = 5000) -> list[str]:
        """The task ids the trajectory API holds trajectories of (``GET /v1/stats/tasks``), A-Z,
        at most ``most``: where a ``--task-id`` that matched nothing finds its near matches."""
        ids: list[str] = []
        async with httpx.AsyncClient(timeout=self.timeout, headers=auth_headers(self.api_key or "")) as client:
            while len(ids) < most:
                try:
                    r = await client.get(f"{self.url}/v1/stats/tasks",
                                         params={"order": "task_id", "limit": "1000", "offset": str(len(ids))})
                except httpx.TransportError as exc:
                    raise Unavailable(f"trajectory service at {self.url} is not reachable: {exc}") from exc
                if r.status_code != 200:
                    raise Unavailable(f"{self.url}/v1/stats/tasks answered {r.status_code}: {r.text[:200]}")
                rows = r.json()["rows"]
                ids.extend(row["task_id"] for row in rows)
                if len(rows) < 1000:
                    break
        return ids


class StoreSource:
    """Reads the ClickHouse store itself (a chDB directory or a ClickHouse server URL) through the
    trajectory plane's ``python -m arena_trajectory.dump``, run as a process: the client never
    imports a service, and the store's dependencies (chDB) stay with the ``server`` extra."""

    def __init__(self, location: str, f: ExportFilter, *, python: str = sys.executable):
        self.location = location
        self.filter = f
        self.python = python
        self.total: int | None = None

    async def trajectories(self) -> AsyncIterator[Trajectory]:
        proc = await asyncio.create_subprocess_exec(
            self.python, "-m", "arena_trajectory.dump", "--store", self.location,
            "--filter", msgspec.json.encode(self.filter).decode(),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, limit=256 * 1024 * 1024)
        assert proc.stdout is not None and proc.stderr is not None
        stderr = asyncio.ensure_future(proc.stderr.read())
        decoder = msgspec.json.Decoder(Trajectory)
        try:
            while line := await proc.stdout.readline():
                if line.startswith((b'{"total"', b'{"error"')):  # a trajectory starts {"rollout_id"
                    head = msgspec.json.decode(line)
                    if "error" in head:
                        err = head["error"]
                        raise BY_CODE.get(err.get("code"), ArenaError)(err.get("message", "export failed"))
                    self.total = head["total"]
                    continue
                yield decoder.decode(line)
            if await proc.wait() != 0:
                detail = (await stderr).decode(errors="replace").strip().splitlines()
                hint = detail[-1] if detail else f"exit status {proc.returncode}"
                if "No module named" in hint:
                    hint += " (reading a store needs the trajectory service installed: pip install 'arena[server]')"
                raise Unavailable(f"cannot read the store at {self.location}: {hint}")
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            stderr.cancel()


# --------------------------------------------------------------------------- writers


def _schemas():
    import pyarrow as pa

    msg = pa.struct([("role", pa.string()), ("content", pa.string())])
    common = [("date", pa.string()), ("task_id", pa.string()), ("group_id", pa.string())]
    return {
        "grpo": pa.schema(common + [
            ("group_size", pa.int32()), ("group_index", pa.int32()), ("rollout_id", pa.string()),
            ("reward", pa.float64()), ("advantage", pa.float64()), ("final_state", pa.string()),
            ("policy_versions", pa.list_(pa.string())), ("num_steps", pa.int32()),
            ("prompt_messages", pa.string()), ("completions", pa.list_(pa.string()))]),
        "dpo": pa.schema(common + [
            ("prompt_messages", pa.string()), ("chosen", pa.list_(pa.string())), ("rejected", pa.list_(pa.string())),
            ("chosen_messages", pa.list_(msg)), ("rejected_messages", pa.list_(msg)),
            ("chosen_reward", pa.float64()), ("rejected_reward", pa.float64()),
            ("chosen_rollout_id", pa.string()), ("rejected_rollout_id", pa.string())]),
        "sft": pa.schema(common + [
            ("rollout_id", pa.string()), ("reward", pa.float64()), ("messages", pa.list_(msg))]),
        "tokens": pa.schema(common + [
            ("rollout_id", pa.string()), ("sequence_index", pa.int32()), ("num_sequences", pa.int32()),
            ("steps", pa.list_(pa.int32())), ("policy_versions", pa.list_(pa.string())),
            ("input_ids", pa.list_(pa.int64())), ("loss_mask", pa.list_(pa.int8())),
            ("logprobs", pa.list_(pa.float32())), ("num_loss_tokens", pa.int32()),
            ("advantage", pa.float64()), ("reward", pa.float64())]),
    }


def partition_name(value: str) -> str:
    """A task id as a safe directory name (``/`` and other specials become ``_``)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", value) or "_"


class ParquetWriter:
    def __init__(self, out: Path, view: View, *, rows_per_file: int = 50_000):
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise InvalidRequest("Parquet export needs pyarrow: pip install 'arena[export]'") from None
        self.out = out
        self.schema = _schemas()[view]
        self.rows_per_file = rows_per_file
        self._buffers: dict[tuple[str, str], list[dict]] = {}
        self._parts: dict[tuple[str, str], int] = {}
        self.files: list[Path] = []

    def write(self, row: dict) -> None:
        key = (row["date"], row["task_id"])
        buf = self._buffers.setdefault(key, [])
        buf.append(row)
        if len(buf) >= self.rows_per_file:
            self._flush(key)

    def _flush(self, key: tuple[str, str]) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        rows = self._buffers.pop(key, [])
        if not rows:
            return
        n = self._parts.get(key, 0)
        self._parts[key] = n + 1
        directory = self.out / f"date={key[0]}" / f"task={partition_name(key[1])}"
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"part-{n:05d}.parquet"
        pq.write_table(pa.Table.from_pylist(rows, schema=self.schema), path)
        self.files.append(path)

    def close(self) -> None:
        for key in list(self._buffers):
            self._flush(key)


class JsonlWriter:
    def __init__(self, out: Path):
        out.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(out, "w", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self.files = [out]

    def write(self, row: dict) -> None:
        self._file.write(json.dumps(row, ensure_ascii=False) + "\n")

    def close(self) -> None:
        self._file.close()


# --------------------------------------------------------------------------- progress


class Progress:
    """Progress on stderr: on a terminal a one-line bar redrawn in place; elsewhere (a log, a pipe,
    CI: ``enabled=None`` and no terminal) a plain line every ``log_every_s`` and at the end, so logs
    stay readable; ``enabled=False``: nothing."""

    def __init__(self, total: int | None, *, enabled: bool | None = None, stream=None, log_every_s: float = 5.0):
        self.stream = stream or sys.stderr
        tty = getattr(self.stream, "isatty", lambda: False)()
        self.enabled = True if enabled is None else enabled
        #: a bar redrawn in place (a terminal, or forced), else lines
        self.redraw = tty or enabled is True
        self.interval = 0.1 if self.redraw else log_every_s
        self.total = total
        self.done = 0
        self.rows = 0
        self._last = 0.0 if self.redraw else time.monotonic()
        self._printed = False
        self._start = time.monotonic()

    def update(self, done: int, rows: int, total: int | None = None, *, force: bool = False) -> None:
        self.done, self.rows = done, rows
        if total is not None:
            self.total = total
        now = time.monotonic()
        if not self.enabled or (now - self._last < self.interval and not force):
            return
        self._last = now
        rate = done / max(now - self._start, 1e-9)
        if self.total:
            frac = min(done / self.total, 1.0)
            bar = "#" * int(frac * 30)
            eta = f"  ETA {(self.total - done) / rate:,.0f}s" if rate > 0 and done < self.total else ""
            line = f"[{bar:<30}] {done}/{self.total} trajectories {frac:4.0%}  {rows} rows  {rate:,.0f}/s{eta}"
        else:
            line = f"{done} trajectories  {rows} rows  {rate:,.0f}/s"
        self.stream.write("\r" + line if self.redraw else "export: " + line + "\n")
        self.stream.flush()
        self._printed = True

    def finish(self) -> None:
        if not self.redraw and not self._printed:
            return  # a short export in a log: its summary line says it all
        self.update(self.done, self.rows, force=True)
        if self.enabled and self.redraw:
            self.stream.write("\n")
            self.stream.flush()


# --------------------------------------------------------------------------- the export


async def _pages(source: Source) -> AsyncIterator[list[Trajectory]]:
    batch: list[Trajectory] = []
    async for t in source.trajectories():
        batch.append(t)
        if len(batch) >= PAGE:
            yield batch
            batch = []
    if batch:
        yield batch


async def run_export(source: Source, *, view: View, fmt: str, out: Path, options: ExportOptions | None = None,
                     progress: Progress | None = None) -> tuple[ExportStats, list[Path]]:
    """Export ``view`` from ``source`` to ``out`` (a directory for Parquet, a file for JSONL)."""
    if fmt == "parquet":
        writer: Any = ParquetWriter(out, view)
    elif fmt == "jsonl":
        writer = JsonlWriter(out)
    else:
        raise InvalidRequest(f"unknown format {fmt!r}: parquet or jsonl")
    stats = ExportStats()
    progress = progress or Progress(None, enabled=False)
    pending: list[Trajectory] = []
    done = 0
    try:
        async for page in _pages(source):
            pending.extend(page)
            # hold back the last group: its members may continue on the next page
            cut = len(pending)
            last_gid = pending[-1].group_id
            if last_gid is not None:
                while cut > 0 and pending[cut - 1].group_id == last_gid:
                    cut -= 1
            for row in export_rows(pending[:cut], view, options, stats):
                writer.write(row)
            done += cut
            del pending[:cut]
            progress.update(done, stats.rows, source.total)
        for row in export_rows(pending, view, options, stats):
            writer.write(row)
        done += len(pending)
        progress.update(done, stats.rows, source.total)
    finally:
        writer.close()
        progress.finish()
    return stats, writer.files


def export(source: Source, **kwargs) -> tuple[ExportStats, list[Path]]:
    return asyncio.run(run_export(source, **kwargs))
