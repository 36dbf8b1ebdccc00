"""The topology step: create (or bring to this release's configuration) every JetStream stream,
KV bucket and object store Arena uses, with the administrator's NATS credentials. The services'
own users may not create, update, delete or purge streams (``arena_core.access``, rendered by
``natsauth``): they only bind to what this step made, and stop at start with a clear error when
something is missing.

Who runs it: the embedded stack (``arena up``, ``arena_stack.stack.Stack``) before its services;
compose's ``topology`` service; Kubernetes' ``arena-topology`` Job. By hand:
``ARENA_NATS_URL=nats://admin:<password>@host:4222 python -m arena_stack.topology``.
"""

from __future__ import annotations

import asyncio
import os
import sys

from arena_core.bus import Bus, TopologyError, redact
from arena_core.errors import Unavailable


async def create(url: str, replicas: int | None = None, *, connect_timeout: float = 10.0) -> None:
    """Connect to ``url`` (the administrator's credentials in it) and create the topology."""
    bus = await Bus.connect(url, "topology", connect_timeout=connect_timeout)
    try:
        await bus.ensure_topology(replicas)
    finally:
        await bus.close()


def main(argv: list[str]) -> int:
    if argv:
        print("usage: ARENA_NATS_URL=nats://admin:<password>@host:4222 python -m arena_stack.topology "
              "(ARENA_NATS_REPLICAS: copies of each stream)", file=sys.stderr)
        return 2
    url = os.environ.get("ARENA_NATS_URL", "nats://127.0.0.1:4222")
    try:
        asyncio.run(create(url, connect_timeout=float(os.environ.get("ARENA_TOPOLOGY_CONNECT_TIMEOUT_S", "60"))))
    except (TopologyError, Unavailable) as exc:
        print(f"arena topology: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - e.g. the user may not create streams: one line, no traceback
        print(f"arena topology: cannot create the topology on {redact(url)} (the administrator's credentials "
              f"are needed): {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(f"arena topology: streams, KV buckets and object stores ready on {redact(url)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
