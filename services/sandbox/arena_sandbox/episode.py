"""An OpenEnv episode in a sandbox (a task whose agent is ``external``): each exchange the
environment endpoint sends runs here, as one of Arena's tools in the task's sandbox
(:class:`ToolSession`) or relayed to the task's own OpenEnv server (``arena_sandbox.hosted``).
Pure: exchanges arrive through an :class:`Exchanges` source (the worker's NATS wiring).
docs/openenv.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import posixpath
import time
import uuid
from typing import Any, Protocol

import msgspec

from arena_core import envtools
from arena_core.schemas import EnvError, EnvReply, EnvRequest, EnvStep
from arena_sandbox_providers import local
from arena_sandbox_providers.local import ProxyForward
from arena_sandbox_providers.provider import Sandbox, SandboxError

log = logging.getLogger("arena.sandbox.episode")

#: Longest string kept in a recorded observation or action; longer ones are cut (``truncated``).
RECORD_STRING_MAX = 16 * 1024


class Exchange(Protocol):
    request: EnvRequest

    async def reply(self, answer: EnvReply) -> None: ...


class Exchanges(Protocol):
    async def next(self, timeout_s: float) -> Exchange | None:
        """The next exchange, or ``None`` when none came within ``timeout_s``."""


class EpisodeEnd(msgspec.Struct, frozen=True, kw_only=True):
    """How an episode ended. ``done``: the client submitted, or the environment said done."""

    done: bool
    closed: bool = False  # the client closed the episode before it was done (still verified)
    timed_out: bool = False
    cancelled: bool = False
    failed: bool = False
    reason: str
    steps: list[EnvStep] = []
    answer: str | None = None
    log: bytes = b""
    duration_s: float = 0.0


class Session(Protocol):
    async def start(self) -> None: ...

    async def reset(self, data: dict[str, Any]) -> EnvReply: ...

    async def step(self, data: dict[str, Any]) -> EnvReply: ...

    async def state(self) -> dict[str, Any]: ...

    async def close(self) -> None: ...

    def log(self) -> bytes: ...

    def interrupt(self) -> None:
        """The exchange in flight is being abandoned (a cancel, the wall clock)."""


class EnvironmentBroken(Exception):
    """The hosted environment cannot go on (it exited, closed its socket, or did not answer)."""


# --------------------------------------------------------------------------- recording


def capped(value: Any, limit: int = RECORD_STRING_MAX) -> tuple[Any, bool]:
    """``value`` with every string longer than ``limit`` cut; and whether any was."""
    if isinstance(value, str):
        return (value[:limit], True) if len(value) > limit else (value, False)
    if isinstance(value, dict):
        out, cut = {}, False
        for key, item in value.items():
            out[key], c = capped(item, limit)
            cut = cut or c
        return out, cut
    if isinstance(value, list):
        items = [capped(item, limit) for item in value]
        return [i for i, _ in items], any(c for _, c in items)
    return value, False


def record(index: int, kind: str, action: dict[str, Any], reply: EnvReply, started: float) -> EnvStep:
    action, cut_a = capped(action)
    observation, cut_o = capped(reply.observation)
    error = f"{reply.error.code}: {reply.error.message}" if reply.error is not None else ""
    return EnvStep(index=index, kind=kind, action=action, observation=observation, reward=reply.reward,
                   done=reply.done, error=error, truncated=cut_a or cut_o, started_at=started,
                   duration_ms=(time.time() - started) * 1000)


# --------------------------------------------------------------------------- the loop


async def play(session: Session, exchanges: Exchanges, *, wall_clock_s: float, idle_s: float,
               cancel: asyncio.Event | None = None) -> EpisodeEnd:
    """Serve exchanges until the episode is done, the wall clock runs out (a step in flight
    included), the client is gone for ``idle_s``, or ``cancel``. Each ``seq`` runs once: a
    repeated one gets its reply again. An episode whose first exchange is not its reset (this
    sandbox took over an episode another one had begun) ends at once as a failure of Arena's,
    as does anything unexpected: never an exception out of here, which would run the job again."""
    cancel = cancel or asyncio.Event()
    started = time.monotonic()
    replies: dict[int, EnvReply] = {}
    steps: list[EnvStep] = []
    answer: list[str] = []
    reset_done = False

    def end(reason: str, **fields: Any) -> EpisodeEnd:
        return EpisodeEnd(reason=reason, steps=steps, answer=answer[0] if answer else None, log=session.log(),
                          duration_s=time.monotonic() - started, **{"done": False, **fields})

    async def send(exchange: Exchange, reply: EnvReply) -> None:
        try:
            await exchange.reply(reply)
        except Exception as exc:  # noqa: BLE001 - too big for a message, the connection gone
            log.warning("cannot answer exchange %d: %s", reply.seq, exc)
            with contextlib.suppress(Exception):
                await exchange.reply(EnvReply(seq=reply.seq, error=EnvError(
                    code="EXECUTION_ERROR", message=f"the answer could not be sent: {type(exc).__name__}: {exc}")))

    try:
        await session.start()
    except EnvironmentBroken as exc:
        return end(f"the environment did not start: {exc}", failed=True)
    while True:
        left = wall_clock_s - (time.monotonic() - started)
        if left <= 0:
            return end(f"wall clock of {wall_clock_s:g}s exceeded", timed_out=True)
        nxt = asyncio.ensure_future(exchanges.next(min(left, idle_s)))
        stop = asyncio.ensure_future(cancel.wait())
        await asyncio.wait({nxt, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if cancel.is_set():
            nxt.cancel()
            return end("rollout cancelled during the episode", cancelled=True)
        exchange = nxt.result()
        if exchange is None:
            if wall_clock_s - (time.monotonic() - started) <= 0:
                return end(f"wall clock of {wall_clock_s:g}s exceeded", timed_out=True)
            return end(f"no action for {idle_s:g}s: the client is gone", timed_out=True)
        req = exchange.request
        if req.seq in replies:
            await send(exchange, replies[req.seq])
            continue
        if not reset_done and req.kind in ("step", "close") and req.seq > 0:
            await send(exchange, EnvReply(seq=req.seq, error=EnvError(
                code="SESSION_ERROR", message="the episode's sandbox was restarted: reset to start another")))
            return end("the episode's sandbox was restarted after the episode had begun (its state is gone)",
                       failed=True)
        at = time.time()
        if req.kind == "close":
            reply = EnvReply(seq=req.seq, done=True)
            replies[req.seq] = reply
            await send(exchange, reply)
            return end("the client closed the episode", done=True, closed=True)
        # an exchange in flight is cut short by a cancel or the wall clock: a command of Arena's
        # tools gets the same cancel and is killed by its sandbox; a hosted environment's answer
        # still awaited after a moment is abandoned (its connection is never reused)
        left = wall_clock_s - (time.monotonic() - started)
        work = asyncio.ensure_future(_answer(session, req, reset_done))
        stop = asyncio.ensure_future(cancel.wait())
        await asyncio.wait({work, stop}, timeout=max(left, 0.0), return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if not work.done():
            over = not cancel.is_set()
            session.interrupt()
            await asyncio.wait({work}, timeout=5.0)
            work.cancel()
            with contextlib.suppress(BaseException):
                await work
            if over:
                return end(f"wall clock of {wall_clock_s:g}s exceeded (during a step)", timed_out=True)
            return end("rollout cancelled during the episode", cancelled=True)
        try:
            reply = work.result()
        except Exception as exc:  # noqa: BLE001 - EnvironmentBroken, or anything unexpected
            what = f"environment failed: {exc}" if isinstance(exc, EnvironmentBroken) else \
                f"Arena could not run it: {type(exc).__name__}: {exc}"
            log.warning("episode exchange %d failed: %s", req.seq, what)
            reply = EnvReply(seq=req.seq, error=EnvError(code="EXECUTION_ERROR", message=what))
            if req.kind != "state":
                steps.append(record(len(steps), req.kind, req.data, reply, at))
            await send(exchange, reply)
            return end(what, failed=True)
        if req.kind == "reset" and reply.error is None:
            reset_done = True
        if req.kind != "state":  # a state is read afresh each time; an action runs once
            replies[req.seq] = reply
            for old in [q for q in replies if q < req.seq - 2]:  # only the latest are ever asked again
                del replies[old]
        if req.kind != "state" and reset_done and (reply.error is None or req.kind == "step"):
            steps.append(record(len(steps), req.kind, req.data, reply, at))
        if isinstance(session, ToolSession) and session.answer is not None and not answer:
            answer.append(session.answer)
        await send(exchange, reply)
        if reply.done:
            return end("the client submitted" if isinstance(session, ToolSession) else "the environment said done",
                       done=True)


async def _answer(session: Session, req: EnvRequest, reset_done: bool) -> EnvReply:
    """One exchange's answer from ``session`` (reset once, then steps); raises EnvironmentBroken."""
    if req.kind == "state":
        return EnvReply(seq=req.seq, state=await session.state())
    if req.kind == "reset":
        if reset_done:
            return EnvReply(seq=req.seq, error=EnvError(
                code="SESSION_ERROR", message="this episode was reset already; a new reset starts a new rollout"))
        return _with_seq(await session.reset(req.data), req.seq)
    if not reset_done:
        return EnvReply(seq=req.seq, error=EnvError(code="SESSION_ERROR", message="reset before step"))
    return _with_seq(await session.step(req.data), req.seq)


def _with_seq(reply: EnvReply, seq: int) -> EnvReply:
    return msgspec.structs.replace(reply, seq=seq)


# --------------------------------------------------------------------------- Arena's tools


class _Output:
    """Output of one command, its first ``limit`` bytes kept."""

    def __init__(self, limit: int):
        self.limit, self.chunks, self.size, self.cut = limit, [], 0, False

    def __call__(self, chunk: bytes) -> None:
        room = self.limit - self.size
        if room <= 0:
            self.cut = True
            return
        if len(chunk) > room:
            chunk, self.cut = chunk[:room], True
        self.chunks.append(chunk)
        self.size += len(chunk)

    def data(self) -> bytes:
        return b"".join(self.chunks)


class ToolSession:
    """Arena's own task as an environment: the tools of :mod:`arena_core.envtools`, each call
    a command in the task's sandbox (never a host-side file operation on agent-made paths)."""

    def __init__(self, sandbox: Sandbox, *, workdir: str, env: dict[str, str], proxy: ProxyForward | None,
                 instructions: str, rollout_id: str, cancel: asyncio.Event | None = None):
        self.sandbox, self.workdir, self.env, self.proxy = sandbox, workdir, env, proxy
        self.cancel = cancel  # kills a running command when the rollout ends
        self.instructions, self.rollout_id = instructions, rollout_id
        self.answer: str | None = None
        self.calls = 0

    async def start(self) -> None:
        return None

    def log(self) -> bytes:
        return b""

    async def close(self) -> None:
        return None

    def interrupt(self) -> None:
        if self.cancel is not None:
            self.cancel.set()  # its sandbox kills the command in flight

    async def state(self) -> dict[str, Any]:
        return {"episode_id": self.rollout_id, "step_count": self.calls, "workdir": self.workdir}

    async def reset(self, data: dict[str, Any]) -> EnvReply:
        observation = {"prompt": self.instructions, "workdir": self.workdir, "rollout_id": self.rollout_id,
                       "tools": envtools.tool_list()}
        return EnvReply(seq=0, observation=observation, reward=None, done=False)

    async def step(self, data: dict[str, Any]) -> EnvReply:
        try:
            action = envtools.parse_action(data)
        except envtools.ActionError as exc:
            return EnvReply(seq=0, error=EnvError(code="VALIDATION_ERROR", message=str(exc), errors=exc.errors))
        self.calls += 1
        if isinstance(action, envtools.ListTools):
            return EnvReply(seq=0, observation={"tools": envtools.tool_list()})
        name = action.tool_name
        if name not in envtools.TOOLS:
            return EnvReply(seq=0, observation=envtools.tool_error(
                "tool_not_found", f"no tool {name!r}; the tools are {', '.join(envtools.TOOLS)}", name))
        try:
            args = envtools.parse_arguments(name, action.arguments)
        except envtools.ActionError as exc:
            return EnvReply(seq=0, observation=envtools.tool_error(
                "invalid_args", "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors), name))
        try:
            result, done = await getattr(self, f"_{name}")(args)
        except _ToolFailed as exc:
            return EnvReply(seq=0, observation=envtools.tool_error(exc.kind, str(exc), name))
        return EnvReply(seq=0, observation={"tool_name": name, "result": result, "error": None}, done=done)

    # -- the tools

    def _path(self, path: str) -> str:
        full = posixpath.normpath(path if path.startswith("/") else posixpath.join(self.workdir, path))
        if full != local.WORKSPACE and not full.startswith(local.WORKSPACE + "/"):
            raise _ToolFailed("invalid_args", f"{path!r} is outside {local.WORKSPACE}")
        return full

    async def _run(self, argv: list[str], *, timeout_s: float = 120.0, limit: int = envtools.MAX_OUTPUT_BYTES):
        out = _Output(limit)
        try:
            ran = await self.sandbox.exec(argv, env=self.env, workdir=self.workdir, timeout_s=timeout_s,
                                          proxy=self.proxy, cancel=self.cancel, on_output=out)
        except SandboxError as exc:
            raise _ToolFailed("execution_error", f"the sandbox could not run it: {exc}") from exc
        return ran, out

    async def _shell(self, args: envtools.Shell):
        ran, out = await self._run(["/bin/sh", "-c", args.command], timeout_s=args.timeout_s)
        return {"output": out.data().decode("utf-8", errors="replace"), "exit_code": ran.exit_code,
                "timed_out": ran.timed_out, "truncated": out.cut}, False

    async def _read(self, path: str) -> bytes:
        full = self._path(path)
        ran, out = await self._run(["/bin/sh", "-c", 'test -f "$1" || { echo "$1: no such file" >&2; exit 1; }; '
                                    f'head -c {envtools.MAX_FILE_BYTES + 1} -- "$1"', "sh", full],
                                   limit=envtools.MAX_FILE_BYTES + 4096)
        if ran.exit_code != 0:
            raise _ToolFailed("execution_error", out.data().decode("utf-8", errors="replace").strip()
                              or f"cannot read {path}")
        data = out.data()
        if len(data) > envtools.MAX_FILE_BYTES:
            raise _ToolFailed("execution_error", f"{path} is larger than {envtools.MAX_FILE_BYTES} bytes")
        return data

    async def _write(self, path: str, data: bytes) -> None:
        full = self._path(path)
        staged = f"{local.ARENA_DIR}/in-{uuid.uuid4().hex}"
        await self.sandbox.put_files({staged: data})
        script = ('mkdir -p -- "$(dirname -- "$2")" && cat -- "$1" > "$2"; rc=$?; rm -f -- "$1"; exit $rc')
        ran, out = await self._run(["/bin/sh", "-c", script, "sh", staged, full])
        if ran.exit_code != 0:
            raise _ToolFailed("execution_error", out.data().decode("utf-8", errors="replace").strip()
                              or f"cannot write {path}")

    async def _read_file(self, args: envtools.ReadFile):
        text = (await self._read(args.path)).decode("utf-8", errors="replace")
        lines = text.splitlines(keepends=True)
        start = args.offset - 1
        stop = len(lines) if args.limit is None else start + args.limit
        chosen = "".join(lines[start:stop])
        cut = len(chosen.encode()) > envtools.MAX_OUTPUT_BYTES
        return {"content": chosen.encode()[: envtools.MAX_OUTPUT_BYTES].decode("utf-8", errors="ignore"),
                "lines": len(lines), "truncated": cut or stop < len(lines)}, False

    async def _write_file(self, args: envtools.WriteFile):
        data = args.content.encode()
        await self._write(args.path, data)
        return {"bytes_written": len(data)}, False

    async def _edit_file(self, args: envtools.EditFile):
        try:
            text = (await self._read(args.path)).decode("utf-8")
        except UnicodeDecodeError:
            raise _ToolFailed("execution_error", f"{args.path} is not UTF-8 text: edit it with shell") from None
        count = text.count(args.old_str)
        if count == 0:
            raise _ToolFailed("execution_error", f"old_str does not occur in {args.path}")
        if count > 1 and not args.replace_all:
            raise _ToolFailed("execution_error", f"old_str occurs {count} times in {args.path}; "
                              "make it unique or set replace_all")
        await self._write(args.path, text.replace(args.old_str, args.new_str).encode())
        return {"replacements": count}, False

    async def _submit(self, args: envtools.Submit):
        self.answer = args.answer
        return {"submitted": True}, True


class _ToolFailed(Exception):
    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind
