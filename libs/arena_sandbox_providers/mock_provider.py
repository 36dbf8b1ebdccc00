"""The ``mock`` provider: NO PROCESS RUNS. For API demos and wiring tests only.

Files put in a mock sandbox are kept in memory; ``exec`` runs nothing: it prints a
banner saying so, writes ``/sandbox/.arena/done`` and a ``result.json`` of
``{"mock": true}``, and exits 0; the diff is empty. Every ``SandboxDone`` from it
has ``provider="mock"`` and a reason starting with ``mock provider``.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Mapping
from pathlib import Path

from arena_sandbox_providers.local import ProxyForward
from arena_sandbox_providers.provider import CreateSpec, ExecResult, OutputCallback

BANNER = b"[arena mock sandbox: no process was run; this result is not real]\n"


class MockSandbox:
    provider = "mock"

    def __init__(self, sandbox_id: str):
        self.id = sandbox_id
        self.files: dict[str, bytes] = {}
        self.destroyed = False

    async def put_dir(self, src: Path, dest: str, *, src_stable: bool = False) -> None:
        for path in Path(src).rglob("*"):
            if path.is_file() and not path.is_symlink():
                self.files[f"{dest.rstrip('/')}/{path.relative_to(src)}"] = path.read_bytes()

    async def put_files(self, files: Mapping[str, bytes]) -> None:
        self.files.update(files)

    async def exec(self, command: list[str], *, env: Mapping[str, str], workdir: str = "/sandbox/workspace",
                   timeout_s: float = 600.0, proxy: ProxyForward | None = None,
                   cancel: asyncio.Event | None = None, on_output: OutputCallback | None = None) -> ExecResult:
        if on_output is not None:
            on_output(BANNER)
        self.files["/sandbox/.arena/result.json"] = b'{"mock": true}'
        self.files["/sandbox/.arena/done"] = b""
        return ExecResult(exit_code=0)

    async def read_file(self, path: str, *, max_bytes: int) -> bytes | None:
        data = self.files.get(path)
        return None if data is None else data[: max_bytes + 1]

    async def exists(self, path: str) -> bool:
        return path in self.files

    async def diff(self, base: str, *, timeout_s: float = 120.0, put_at_base: bool = False,
                   max_bytes: int | None = None) -> str:
        return ""

    async def destroy(self) -> None:
        self.destroyed = True
        self.files.clear()


class MockProvider:
    name = "mock"
    uses_host_memory = False

    async def health(self) -> str | None:
        return None

    def pool_key(self, spec: CreateSpec) -> CreateSpec:
        return CreateSpec(limits=spec.limits)

    async def create(self, spec: CreateSpec) -> MockSandbox:
        return MockSandbox(f"mock-{uuid.uuid4().hex[:12]}")

    async def reap_orphans(self) -> int:
        return 0

    async def close(self) -> None:
        return None
