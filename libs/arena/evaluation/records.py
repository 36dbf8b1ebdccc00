"""An evaluation job on disk: its spec (``job.json``) and the append-only log of its attempts
(``attempts.jsonl``, one record a line, flushed and synced as written). docs/evaluation.md.

The log is the job's whole state: a killed client loses at most a line being written (a cut last
line is ignored), and ``arena eval resume`` rebuilds what is done, in flight and left from it.
"""

from __future__ import annotations

import os
import re
import secrets
import threading
import time
from pathlib import Path
from typing import Literal

import msgspec

from arena_core.errors import InvalidRequest

SPEC_FILE = "job.json"
LOG_FILE = "attempts.jsonl"
JOB_ID = re.compile(r"^ev-[0-9]{8}-[0-9]{6}-[0-9a-f]{6}$")

Outcome = Literal["completed", "failed", "infrastructure"]


class EvalTask(msgspec.Struct, frozen=True, kw_only=True):
    """A task of the job: its id and the file it was read from (``dataset.toml`` tasks: the manifest)."""

    task_id: str
    path: str


class EvalSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What ``arena eval run`` was asked: every task × model × attempt (``k`` per pair) is one attempt."""

    job_id: str
    created_at: float
    dataset: str  # the directory, task file or dataset.toml, resolved
    tasks: list[EvalTask]
    agent: str  # a scaffold preset, or "task": each task's own agent
    models: list[str]
    k: int
    concurrency: int
    provider: str | None = None  # None: docker for a task with its own image, else local
    max_infra_retries: int = 2  # tries after an infrastructure outcome, per attempt
    timeout_s: float = 1800.0  # the longest wait for one rollout
    seed: int = 0  # attempt i of task t is sampled with seed_of(seed, t, i), the same for every model
    success_threshold: float = 1.0  # a reward at or above it is a success (pass@k, pass^k)


class AttemptCost(msgspec.Struct, frozen=True, kw_only=True):
    """What one try spent, from its trajectory. The agent's LLM calls (the policy's steps), the
    judge's calls (an ``llm_judge`` verifier; by judge model) and the verifier's sandbox time stay
    apart. Seconds: ``queue_s`` waiting for a sandbox, ``agent_s`` the agent's sandbox, ``verify_s``
    the verifier's run, ``wall_s`` submission to the final state."""

    llm_calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, those the backend served from its prefix cache
    judge_calls: int = 0
    judge_prompt_tokens: dict[str, int] = {}
    judge_completion_tokens: dict[str, int] = {}
    judge_cached_tokens: dict[str, int] = {}
    queue_s: float = 0.0
    agent_s: float = 0.0
    verify_s: float = 0.0
    wall_s: float = 0.0
    #: No trajectory could be read (the trajectory plane did not answer in time): the figures are 0.
    missing: bool = False


class AttemptSubmitted(msgspec.Struct, frozen=True, kw_only=True, tag="submitted"):
    """Try ``try_`` of attempt ``attempt`` (0..k-1) of ``task_id`` by ``model`` is rollout ``rollout_id``."""

    task_id: str
    model: str
    attempt: int
    try_: int
    rollout_id: str
    at: float


class AttemptFinished(msgspec.Struct, frozen=True, kw_only=True, tag="finished"):
    """A try ended. ``outcome``: ``completed`` (verified, ``reward`` set), ``failed`` (the agent
    failed, timed out or ran out of budget: a failure, scored 0), ``infrastructure`` (Arena could not
    run or verify it: retried, never a failure)."""

    task_id: str
    model: str
    attempt: int
    try_: int
    rollout_id: str
    outcome: Outcome
    state: str
    reason: str = ""
    reward: float | None = None
    cost: AttemptCost = AttemptCost()
    at: float


Record = AttemptSubmitted | AttemptFinished
_decode_record = msgspec.json.Decoder(Record)
_encode = msgspec.json.Encoder()

AttemptKey = tuple[str, str, int]  # task_id, model, attempt


def new_job_id(now: float | None = None) -> str:
    return time.strftime("ev-%Y%m%d-%H%M%S-", time.localtime(now)) + secrets.token_hex(3)


def evals_dir() -> Path:
    """Where jobs live: ``$ARENA_DATA_DIR/evals`` (``.arena/evals`` by default)."""
    return Path(os.environ.get("ARENA_DATA_DIR") or ".arena") / "evals"


def job_dir(job: str) -> Path:
    """A job's directory from its id (under ``evals_dir()``) or a path to it."""
    path = Path(job)
    if (path / SPEC_FILE).is_file():
        return path
    if not JOB_ID.match(job):
        raise InvalidRequest(f"{job!r} is neither a job id (ev-YYYYMMDD-HHMMSS-xxxxxx) nor a job directory")
    path = evals_dir() / job
    if not (path / SPEC_FILE).is_file():
        raise InvalidRequest(f"no evaluation job {job} under {evals_dir()}")
    return path


def write_spec(directory: Path, spec: EvalSpec) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / (SPEC_FILE + ".tmp")
    tmp.write_bytes(msgspec.json.format(_encode.encode(spec), indent=2) + b"\n")
    os.replace(tmp, directory / SPEC_FILE)


def read_spec(directory: Path) -> EvalSpec:
    return msgspec.json.decode((directory / SPEC_FILE).read_bytes(), type=EvalSpec)


def read_log(directory: Path) -> list[Record]:
    """Every whole record of the log, in order; a cut last line (the client killed mid-write) is skipped."""
    path = directory / LOG_FILE
    if not path.is_file():
        return []
    out = []
    lines = path.read_bytes().split(b"\n")
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(_decode_record.decode(line))
        except msgspec.DecodeError:
            if i == len(lines) - 1:  # the last line, not ended by a newline: cut by a kill
                break
            raise InvalidRequest(f"{path} line {i + 1} is not an attempt record") from None
    return out


class Log:
    """Appends records to ``attempts.jsonl`` from any thread, each line synced before it returns."""

    def __init__(self, directory: Path) -> None:
        path = directory / LOG_FILE
        data = path.read_bytes() if path.is_file() else b""
        if data and not data.endswith(b"\n"):  # a line cut by a kill: dropped, so the next record starts clean
            os.truncate(path, data.rfind(b"\n") + 1)
        self._file = open(path, "ab")
        self._lock = threading.Lock()

    def append(self, record: Record) -> None:
        line = _encode.encode(record) + b"\n"
        with self._lock:
            self._file.write(line)
            self._file.flush()
            os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


def finished_attempts(records: list[Record]) -> dict[AttemptKey, list[AttemptFinished]]:
    """Each attempt's finished tries, in order."""
    out: dict[AttemptKey, list[AttemptFinished]] = {}
    for r in records:
        if isinstance(r, AttemptFinished):
            out.setdefault((r.task_id, r.model, r.attempt), []).append(r)
    return out


def final_results(records: list[Record]) -> dict[AttemptKey, AttemptFinished]:
    """Each attempt's result: its first try that was not an infrastructure outcome, else its last try."""
    out: dict[AttemptKey, AttemptFinished] = {}
    for key, tries in finished_attempts(records).items():
        out[key] = next((t for t in tries if t.outcome != "infrastructure"), tries[-1])
    return out
