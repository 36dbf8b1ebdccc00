"""Print stored trajectories as JSON lines, read from the store itself (what arena export --store runs).

The store is a chDB directory (with the service stopped) or a ClickHouse server URL. The first
line is ``{"total": N}``, then one trajectory per line, a group's members adjacent; an error is
one ``{"error": {...}}`` line and exit status 1. See docs/trajectory.md (Exports).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
from pathlib import Path

import msgspec

from arena_core.errors import ArenaError, InvalidRequest, Unavailable
from arena_trajectory.clickhouse import ChdbBackend, ClickHouseConnectBackend
from arena_trajectory.listing import TrajectoryFilter
from arena_trajectory.store import TrajectoryStore

PAGE = 500


def open_store(location: str) -> TrajectoryStore:
    if re.match(r"^(https?|clickhouse)://", location):
        return TrajectoryStore(ClickHouseConnectBackend.from_url(location))
    path = Path(location)
    if not (path / "metadata").is_dir() and (path / "clickhouse" / "metadata").is_dir():
        path = path / "clickhouse"  # an Arena data directory was given
    if not (path / "metadata").is_dir():
        raise InvalidRequest(f"{location} is not a chDB store (no metadata/ directory)")
    try:
        return TrajectoryStore(ChdbBackend(path))
    except Exception as exc:  # noqa: BLE001 - chDB raises plain RuntimeErrors
        raise Unavailable(f"cannot open the chDB store at {path} (is the trajectory service running "
                          f"on it? stop it or export through --from-url): {exc}") from exc


async def dump(location: str, f: TrajectoryFilter, out, *, page: int = PAGE) -> None:
    store = open_store(location)
    encoder = msgspec.json.Encoder()
    try:
        out.write(encoder.encode({"total": await store.count_filtered(f)}) + b"\n")
        after = None
        while True:
            batch = await store.export_page(f, after=after, limit=page)
            for t in batch:
                out.write(encoder.encode(t) + b"\n")
            if len(batch) < page:
                break
            after = (batch[-1].group_id or "", batch[-1].rollout_id)
        out.flush()
    finally:
        await store.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m arena_trajectory.dump", description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True, help="a chDB directory or a ClickHouse server URL")
    parser.add_argument("--filter", default="{}", help="a JSON object of TrajectoryFilter fields")
    args = parser.parse_args(argv)
    out = sys.stdout.buffer
    try:
        f = msgspec.json.decode(args.filter.encode(), type=TrajectoryFilter)
    except msgspec.ValidationError as exc:
        out.write(msgspec.json.encode({"error": {"code": "invalid_request", "message": f"filter: {exc}"}}) + b"\n")
        return 1
    try:
        asyncio.run(dump(args.store, f, out))
    except ArenaError as exc:
        out.write(msgspec.json.encode({"error": {"code": exc.code, "message": str(exc)}}) + b"\n")
        out.flush()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
