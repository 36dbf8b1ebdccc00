"""Arena's figures in the experiment trackers users already have: Weights & Biases, MLflow and
TensorBoard, each through its own library (``pip install 'arena[trackers]'``).

A :class:`Tracker` logs scalars at a step, a table, a run summary, and is closed. ``open_tracker``
makes one; :func:`group_metrics` turns a completed group into its figures (reward mean/std, pass
rate, tokens, infrastructure outcomes) and :func:`track_groups` follows the trainer stream and logs
them per group. The RL trainer logs each step's metrics to a tracker it is given
(``GRPOTrainer.run(tracker=...)``). See docs/rl.md ("Trackers").
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

from arena_core.schemas import GroupCompleted

TrackerKind = Literal["wandb", "mlflow", "tensorboard"]
KINDS: tuple[TrackerKind, ...] = ("wandb", "mlflow", "tensorboard")
INSTALL_HINT = "pip install 'arena[trackers]'"


class TrackerUnavailable(RuntimeError):
    """The tracker's library is not installed (one line, naming the extra that installs it)."""


def _require(module: str, kind: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise TrackerUnavailable(f"the {kind} tracker needs the {module} package: {INSTALL_HINT}") from None


class Tracker(Protocol):
    def log(self, values: Mapping[str, float], step: int) -> None:
        """Scalars at ``step`` (steps only grow)."""

    def table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        """A table (e.g. evaluation results), one row per item."""

    def summary(self, values: Mapping[str, float]) -> None:
        """The run's final figures."""

    def close(self) -> None: ...


class WandbTracker:
    """A W&B run. ``mode="offline"`` writes it under ``dir`` with no login (``wandb sync`` uploads
    it later); ``None`` follows ``WANDB_MODE``."""

    def __init__(self, *, project: str = "arena", run_name: str | None = None, dir: str | Path | None = None,
                 mode: str | None = None, config: Mapping[str, Any] | None = None):
        self._wandb = _require("wandb", "wandb")
        if dir is not None:
            Path(dir).mkdir(parents=True, exist_ok=True)
        settings = self._wandb.Settings(silent=True, console="off")
        self.run = self._wandb.init(project=project, name=run_name, dir=str(dir) if dir else None, mode=mode,
                                    config=dict(config or {}), settings=settings, reinit="create_new")

    def log(self, values: Mapping[str, float], step: int) -> None:
        self.run.log(dict(values), step=step)

    def table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        self.run.log({name: self._wandb.Table(columns=list(columns), data=[list(r) for r in rows])})

    def summary(self, values: Mapping[str, float]) -> None:
        self.run.summary.update(dict(values))

    def close(self) -> None:
        self.run.finish()


#: Tracking URIs of MLflow's SQLAlchemy store: the full ``mlflow`` package, not ``mlflow-skinny``.
MLFLOW_DB_SCHEMES = frozenset({"sqlite", "postgresql", "mysql", "mssql"})


class MlflowTracker:
    """An MLflow run through ``MlflowClient`` (``mlflow-skinny``). ``tracking_uri`` is a server or a
    local directory (``file:...`` or a path; MLflow keeps such stores in maintenance mode, which
    ``MLFLOW_ALLOW_FILE_STORE`` acknowledges); ``None`` follows ``MLFLOW_TRACKING_URI``."""

    def __init__(self, *, tracking_uri: str | Path | None = None, experiment: str = "arena",
                 run_name: str | None = None, config: Mapping[str, Any] | None = None):
        _require("mlflow", "mlflow")
        from mlflow import MlflowClient
        from mlflow.entities import Metric, Param

        self._metric = Metric
        uri = str(tracking_uri) if tracking_uri is not None else os.environ.get("MLFLOW_TRACKING_URI")
        if uri is not None and "://" not in uri and not uri.startswith("file:"):
            uri = Path(uri).resolve().as_uri()
        if uri is not None and uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        scheme = (uri or "").split(":", 1)[0].split("+", 1)[0].lower()
        if scheme in MLFLOW_DB_SCHEMES and importlib.util.find_spec("sqlalchemy") is None:
            raise TrackerUnavailable(f"MLflow's database store ({scheme}:) needs the full mlflow package "
                                     "(mlflow-skinny has no SQLAlchemy): pip install mlflow")
        self.client = MlflowClient(tracking_uri=uri)
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        self.run_id: str = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        self._step = 0
        if config:
            self.client.log_batch(self.run_id, params=[Param(k, str(v)) for k, v in config.items()])

    def log(self, values: Mapping[str, float], step: int) -> None:
        self._step = max(self._step, step)
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[self._metric(_mlflow_key(k), float(v), now, step)
                                                    for k, v in values.items()])

    def table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        data = {c: [r[i] for r in rows] for i, c in enumerate(columns)}
        self.client.log_table(self.run_id, data, f"{name}.json")

    def summary(self, values: Mapping[str, float]) -> None:
        self.log(values, self._step)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _mlflow_key(key: str) -> str:
    """MLflow's metric names allow letters, digits and ``_-. /``; anything else becomes ``_``."""
    return "".join(c if c.isalnum() or c in "_-. /" else "_" for c in key)


class TensorBoardTracker:
    """Event files under ``logdir`` through tensorboardX's ``SummaryWriter``; a table is a text
    summary (a Markdown table), the summary scalars under ``summary/``."""

    def __init__(self, *, logdir: str | Path = "runs", run_name: str | None = None):
        tensorboardx = _require("tensorboardX", "tensorboard")
        path = Path(logdir) / run_name if run_name else Path(logdir)
        self.writer = tensorboardx.SummaryWriter(logdir=str(path))
        self._step = 0

    def log(self, values: Mapping[str, float], step: int) -> None:
        self._step = max(self._step, step)
        for key, value in values.items():
            self.writer.add_scalar(key, float(value), global_step=step)

    def table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(str(v) for v in row) + " |" for row in rows]
        self.writer.add_text(name, "\n".join(lines), global_step=self._step)

    def summary(self, values: Mapping[str, float]) -> None:
        self.log({f"summary/{k}": v for k, v in values.items()}, self._step)

    def close(self) -> None:
        self.writer.close()


def open_tracker(kind: str, *, dir: str | Path | None = None, project: str = "arena", run_name: str | None = None,
                 config: Mapping[str, Any] | None = None, wandb_mode: str | None = None) -> Tracker:
    """A tracker of ``kind``: ``wandb`` (runs under ``dir``), ``mlflow`` (``dir`` is the tracking
    URI or directory, ``project`` the experiment), ``tensorboard`` (event files under ``dir``)."""
    if kind == "wandb":
        return WandbTracker(project=project, run_name=run_name, dir=dir, mode=wandb_mode, config=config)
    if kind == "mlflow":
        return MlflowTracker(tracking_uri=dir, experiment=project, run_name=run_name, config=config)
    if kind == "tensorboard":
        return TensorBoardTracker(logdir=dir or "runs", run_name=run_name)
    raise ValueError(f"unknown tracker {kind!r}: one of {', '.join(KINDS)}")


def group_metrics(group: GroupCompleted) -> dict[str, float]:
    """A completed group's figures: ``reward_mean`` / ``reward_std`` (population) / ``pass_rate``
    over the members with a reward, the members' ``tokens`` (prompt + completion, every LLM call),
    ``infrastructure`` (members without a reward: Arena could not run or verify them; never a 0)
    and ``members``. A group whose members all lack a reward has no reward figures."""
    rewards = [r for r in group.rewards if r is not None]
    out: dict[str, float] = {"members": float(len(group.rewards)),
                             "infrastructure": float(len(group.rewards) - len(rewards))}
    if rewards:
        mean = sum(rewards) / len(rewards)
        out["reward_mean"] = mean
        out["reward_std"] = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
        rewarded = [t for t in group.trajectories if t.reward is not None]
        passed = [t for t in rewarded if t.verification is not None and t.verification.passed]
        if rewarded:
            out["pass_rate"] = len(passed) / len(rewarded)
    if group.trajectories:
        out["tokens"] = float(sum(s.usage.prompt_tokens + s.usage.completion_tokens
                                  for t in group.trajectories for s in t.steps))
    return out


class GroupLogger:
    """Logs each group's figures to ``tracker`` at a growing step (the groups logged so far), under
    ``{task_id}/`` with ``group_by="task"``; ``close()`` logs a summary (mean of every group's
    reward mean, groups logged) and a table of the groups."""

    def __init__(self, tracker: Tracker, *, group_by: Literal["task"] | None = None):
        self.tracker = tracker
        self.group_by = group_by
        self.step = 0
        self.rows: list[list[Any]] = []

    def log(self, group: GroupCompleted) -> dict[str, float]:
        figures = group_metrics(group)
        prefix = f"{group.task_id}/" if self.group_by == "task" else ""
        self.tracker.log({prefix + k: v for k, v in figures.items()}, self.step)
        self.step += 1
        self.rows.append([group.group_id, group.task_id, figures.get("reward_mean"), figures.get("pass_rate"),
                          figures["infrastructure"]])
        return figures

    def close(self) -> None:
        means = [row[2] for row in self.rows if row[2] is not None]
        if self.rows:
            self.tracker.table("groups", ["group_id", "task_id", "reward_mean", "pass_rate", "infrastructure"],
                               self.rows)
        self.tracker.summary({"groups": float(len(self.rows)),
                              **({"reward_mean": sum(means) / len(means)} if means else {})})


async def track_groups(nats_url: str, tracker: Tracker, *, name: str = "tracker",
                       group_by: Literal["task"] | None = None, limit: int | None = None,
                       idle_s: float | None = None, project: str | None = None) -> int:
    """Follow the trainer stream (its own durable consumer ``trainer-{name}``: what it logged is
    committed, so a restart goes on where it stopped) and log every completed group to
    ``tracker``; stops after ``limit`` groups or ``idle_s`` seconds without one. Returns the groups
    logged. The tracker is left open; ``GroupLogger.close``'s table and summary are logged before
    returning."""
    from arena.stream import TrajectoryStream

    logger = GroupLogger(tracker, group_by=group_by)
    try:
        async with TrajectoryStream(nats_url, name=name, partial_groups="yield", project=project) as stream:
            batches = stream.groups(batch_size=1).__aiter__()
            while limit is None or logger.step < limit:
                try:
                    batch = await (asyncio.wait_for(batches.__anext__(), idle_s) if idle_s else batches.__anext__())
                except (asyncio.TimeoutError, StopAsyncIteration):
                    break
                for group in batch:
                    await asyncio.to_thread(logger.log, group)
                await batch.commit()
            await batches.aclose()
    finally:  # stopped (Ctrl-C) too: what was logged gets its table and summary
        if logger.step:
            logger.close()
    return logger.step
