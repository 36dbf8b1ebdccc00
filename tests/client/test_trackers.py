"""Arena's figures in W&B, MLflow and TensorBoard (``arena.trackers``), each sink in its offline
mode writing real files that the library's own reader reads back: W&B's offline run (its ``.wandb``
transaction log, records decoded with wandb's ``Record`` protobuf; the table as the run's media
file), MLflow's ``MlflowClient`` on a local store, TensorBoard's ``EventAccumulator``. A missing
library is one line naming the extra; the RL trainer logs its step metrics to a tracker; and on a
real stack the quickstart group's rewards are what the tracker followed from the trainer stream."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from arena import trackers
from arena.trackers import GroupLogger, TrackerUnavailable, group_metrics, open_tracker, track_groups
from arena_core.grpo import group_advantages
from arena_core.schemas import GroupCompleted, RolloutState, Step, Trajectory, Usage, VerificationResult

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart"

# ---------------------------------------------------------------- readers, each the library's own


def wandb_records(run_dir: Path) -> list:
    """The records of a W&B offline run's ``.wandb`` file, decoded with wandb's ``Record`` protobuf.
    wandb >= 0.2x ships no Python reader of the file (wandb-core, in Go, reads it), so its LevelDB-log
    framing is undone here: a 7-byte header (``:W&B``, magic, version), then 32 KiB blocks of
    chunks, each ``crc32 u32 | length u16 | type u8`` (1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def wandb_history(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for record in wandb_records(run_dir):
        if record.WhichOneof("record_type") != "history":
            continue
        items = {i.key or "/".join(i.nested_key): i.value_json for i in record.history.item}
        step = int(json.loads(items.pop("_step")))
        for key, value in items.items():
            if not key.startswith("_"):
                decoded = json.loads(value)
                if isinstance(decoded, (int, float)):
                    out.setdefault(key, []).append((step, float(decoded)))
    return out


def wandb_summary(run_dir: Path) -> dict[str, object]:
    out: dict[str, object] = {}
    for record in wandb_records(run_dir):
        if record.WhichOneof("record_type") == "summary":
            for item in record.summary.update:
                out[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return out


def mlflow_run(uri: Path):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri.resolve().as_uri())
    (experiment,) = [e for e in client.search_experiments() if e.name == "arena"]
    (run,) = client.search_runs([experiment.experiment_id])
    return client, run


def tensorboard_events(logdir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def logged_scalars(kind: str, where: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series the run at ``where`` holds, as ``{name: [(step, value), ...]}``."""
    if kind == "wandb":
        (run_dir,) = (where / "wandb").glob("offline-run-*")
        # wandb's service process writes the run's file on its own: its last records (the history
        # among them) can land just after ``finish`` returned; the exit record comes last
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not any(
                r.WhichOneof("record_type") == "exit" for r in wandb_records(run_dir)):
            time.sleep(0.2)
        return wandb_history(run_dir)
    if kind == "mlflow":
        client, run = mlflow_run(where)
        return {k: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, k)]
                for k in run.data.metrics}
    acc = tensorboard_events(where)
    return {k: [(e.step, e.value) for e in acc.Scalars(k)] for k in acc.Tags()["scalars"]}


# ---------------------------------------------------------------- groups


def make_group(gid: str, task_id: str, rewards: list[float | None]) -> GroupCompleted:
    trajectories = [
        Trajectory(rollout_id=f"{gid}-{i}", task_id=task_id, group_id=gid, group_index=i, group_size=len(rewards),
                   final_state=RolloutState.COMPLETED if r is not None else RolloutState.FAILED, reward=r,
                   infrastructure=r is None,
                   verification=None if r is None else VerificationResult(
                       rollout_id=f"{gid}-{i}", verifier="exact", reward=r, passed=r >= 1.0, started_at=0.0,
                       finished_at=0.0),
                   steps=[Step(rollout_id=f"{gid}-{i}", step_index=0, model="m", backend="b",
                               usage=Usage(prompt_tokens=10, completion_tokens=5, total_tokens=15))])
        for i, r in enumerate(rewards)]
    present = [r for r in rewards if r is not None]
    return GroupCompleted(group_id=gid, task_id=task_id, size=len(rewards), trajectories=trajectories,
                          rewards=rewards, advantages=group_advantages(present), completed_at=0.0,
                          excluded_indexes=[i for i, r in enumerate(rewards) if r is None])


def test_group_metrics_count_infrastructure_outcomes_apart_from_rewards():
    figures = group_metrics(make_group("g1", "t", [1.0, 0.0, None, 1.0]))
    assert figures["members"] == 4 and figures["infrastructure"] == 1
    assert figures["reward_mean"] == pytest.approx(2 / 3) and figures["pass_rate"] == pytest.approx(2 / 3)
    assert figures["reward_std"] == pytest.approx((2 / 9) ** 0.5) and figures["tokens"] == 60
    unrewarded = group_metrics(make_group("g2", "t", [None, None]))
    assert "reward_mean" not in unrewarded and unrewarded["infrastructure"] == 2


@pytest.mark.parametrize("kind", trackers.KINDS)
def test_each_sink_writes_groups_table_and_summary_that_its_own_reader_reads_back(kind, tmp_path):
    pytest.importorskip({"wandb": "wandb", "mlflow": "mlflow", "tensorboard": "tensorboardX"}[kind])
    where = tmp_path / kind
    tracker = open_tracker(kind, dir=where, run_name="r1", wandb_mode="offline")
    logger = GroupLogger(tracker, group_by="task")
    logger.log(make_group("g1", "task-a", [1.0, 0.0, 1.0, 1.0]))
    logger.log(make_group("g2", "task-a", [0.0, 0.0, None, 0.0]))
    logger.close()
    tracker.close()

    scalars = logged_scalars(kind, where / "r1" if kind == "tensorboard" else where)  # a run per directory
    assert scalars["task-a/reward_mean"] == [(0, 0.75), (1, 0.0)]
    assert scalars["task-a/infrastructure"] == [(0, 0.0), (1, 1.0)]
    assert scalars["task-a/tokens"] == [(0, 60.0), (1, 60.0)]
    rows = [["g1", "task-a", 0.75, 0.75, 0.0], ["g2", "task-a", 0.0, 0.0, 1.0]]
    if kind == "wandb":
        (run_dir,) = (where / "wandb").glob("offline-run-*")
        assert wandb_summary(run_dir)["groups"] == 2 and wandb_summary(run_dir)["reward_mean"] == 0.375
        (table,) = (run_dir / "files" / "media" / "table").glob("groups_*.table.json")
        written = json.loads(table.read_text())
        assert written["columns"][0] == "group_id" and written["data"] == rows
    elif kind == "mlflow":
        client, run = mlflow_run(where)
        assert run.info.status == "FINISHED" and run.data.metrics["reward_mean"] == 0.375
        table = json.loads(Path(client.download_artifacts(run.info.run_id, "groups.json", str(tmp_path))).read_text())
        assert table["columns"][0] == "group_id" and table["data"] == rows
    else:
        assert scalars["summary/groups"] == [(1, 2.0)] and scalars["summary/reward_mean"] == [(1, 0.375)]
        (text,) = tensorboard_events(where / "r1").Tensors("groups/text_summary")
        assert "| g2 | task-a | 0.0 | 0.0 | 1.0 |" in text.tensor_proto.string_val[0].decode()


def test_importing_arena_trackers_loads_none_of_the_tracker_libraries():
    probe = ("import sys, arena.trackers; print(','.join(sorted({m.split('.')[0] for m in sys.modules}"
             " & {'wandb', 'mlflow', 'tensorboardX', 'tensorboard', 'torch'})))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "", done.stdout + done.stderr


@pytest.mark.parametrize("kind,module", [("wandb", "wandb"), ("mlflow", "mlflow"), ("tensorboard", "tensorboardX")])
def test_a_missing_library_is_one_line_naming_the_extra(kind, module, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, module, None)  # what Python does with a package that is not installed
    with pytest.raises(TrackerUnavailable) as err:
        open_tracker(kind, dir=tmp_path)
    message = str(err.value)
    assert "\n" not in message and "pip install 'arena[trackers]'" in message and module in message


def test_an_mlflow_database_uri_without_the_full_mlflow_is_one_line(tmp_path):
    pytest.importorskip("mlflow")
    if importlib.util.find_spec("sqlalchemy") is not None:
        pytest.skip("SQLAlchemy is installed here (the full mlflow package)")
    with pytest.raises(TrackerUnavailable) as err:
        open_tracker("mlflow", dir=f"sqlite:///{tmp_path}/mlflow.db")
    assert str(err.value) == ("MLflow's database store (sqlite:) needs the full mlflow package (mlflow-skinny has "
                              "no SQLAlchemy): pip install mlflow")
    assert not (tmp_path / "mlflow.db").exists()


async def test_the_rl_trainer_logs_each_steps_metrics_to_a_tracker(bus, nats_server, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("tensorboardX")
    from arena.stream import TrajectoryStream
    from arena_core import subjects
    from arena_rl.generate import GenRequest, generate
    from arena_rl.model import new_policy
    from arena_rl.tokenizer import CharTokenizer
    from arena_rl.trainer import GRPOTrainer, TrainerConfig

    tok = CharTokenizer(alphabet="01")
    model = new_policy(tok, seed=0, d_model=32, n_layers=1, max_len=16).eval()
    prompt = tok.render_chat([{"role": "user", "content": "101"}])
    for gid, rewards in (("g-a", [1.0, 0.0, 1.0, 1.0]), ("g-b", [0.0, 0.0, 0.0, 0.0])):
        results = generate(model, [GenRequest(prompt_ids=prompt, max_tokens=1, seed=i) for i in range(4)])
        members = [Trajectory(rollout_id=f"{gid}-{i}", task_id="t", group_id=gid, group_index=i, group_size=4,
                              final_state=RolloutState.COMPLETED, reward=r, policy_versions=["0"],
                              steps=[Step(rollout_id=f"{gid}-{i}", step_index=0, model="m", backend="b",
                                          policy_version="0", prompt_token_ids=prompt,
                                          completion_token_ids=res.token_ids, logprobs=res.logprobs)])
                   for i, (r, res) in enumerate(zip(rewards, results, strict=True))]
        group = GroupCompleted(group_id=gid, task_id="t", size=4, trajectories=members, rewards=rewards,
                               advantages=group_advantages(rewards), completed_at=0.0)
        await bus.publish(subjects.group(gid), group, msg_id=subjects.msg_id(gid, "group"))
    trainer = GRPOTrainer(model, tok, TrainerConfig(batch_groups=1, epochs=1))
    tracker = open_tracker("tensorboard", dir=tmp_path)
    async with TrajectoryStream(nats_server.url, name="tracked") as stream:
        history = await asyncio.wait_for(trainer.run(stream, steps=2, tracker=tracker), 60)
    tracker.close()
    scalars = logged_scalars("tensorboard", tmp_path)
    assert scalars["mean_reward"] == [(1, 0.75), (2, 0.0)]
    assert scalars["policy_version"] == [(m.step, float(m.policy_version)) for m in history]
    # the second group has no signal: its step has no optimiser figures, rather than zeros
    assert scalars["loss"] == [(1, pytest.approx(history[0].loss))] and "step" not in scalars


# ---------------------------------------------------------------- a real stack


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
@pytest.mark.timeout(600)
def test_the_quickstart_groups_rewards_on_a_real_stack_are_what_the_tracker_logged(tmp_path):
    pytest.importorskip("mlflow")
    from arena.sdk import ArenaClient
    from arena.tasks import load_task
    from arena_core.settings import Settings
    from arena_stack.natsserver import free_port
    from arena_stack.stack import Stack

    rp = free_port()
    settings = Settings(nats_url=f"nats://127.0.0.1:{free_port()}", data_dir=str(tmp_path / "arena"),
                        rollout_port=rp, trajectory_port=free_port(), dashboard_port=free_port(),
                        public_url=f"http://127.0.0.1:{rp}", backend_url=f"http://127.0.0.1:{free_port()}/v1",
                        backend_policy_version="0", sandbox_concurrency=2, verify_concurrency=1)
    stack = Stack(settings, llm_script=QUICKSTART / "llm_script.json", nats_sync="1s", log=lambda m: None)
    asyncio.run(stack.start())
    try:
        assert stack.api_key  # keys on, as `arena up` runs it
        with ArenaClient(settings.rollout_url, settings.trajectory_url, api_key=stack.api_key) as client:
            submitted = client.submit_group(load_task(QUICKSTART), n=4, seed=0)
            tracker = open_tracker("mlflow", dir=tmp_path / "mlruns", run_name="quickstart")
            trainer_nats = stack.nats_url_for("trainer")  # the NATS user a trainer connects as
            logged = asyncio.run(track_groups(trainer_nats, tracker, name="mlflow-test", group_by="task", limit=1,
                                              idle_s=300))
            tracker.close()
            stored = client.group(submitted.group_id)
        # `arena track` as a process: the NATS URL without a user, the trainer's from the data directory
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("ARENA_")},
               "ARENA_NATS_URL": stack.services_nats_url, "ARENA_DATA_DIR": str(stack.data_dir)}
        cli = subprocess.run([sys.executable, "-m", "arena.cli", "track", "--to", "tensorboard", "--dir",
                              str(tmp_path / "tb"), "--group-by", "task", "--name", "cli", "--limit", "1",
                              "--idle", "120"], env=env, capture_output=True, text=True, timeout=300)
    finally:
        stack.stop()
    assert cli.returncode == 0 and cli.stdout.strip() == "1 group(s) logged to tensorboard", cli.stderr
    assert logged == 1
    rewards = [r for r in stored["rewards"] if r is not None]
    client, run = mlflow_run(tmp_path / "mlruns")
    task = load_task(QUICKSTART).id
    mean = client.get_metric_history(run.info.run_id, f"{task}/reward_mean")
    assert [(m.step, m.value) for m in mean] == [(0, pytest.approx(sum(rewards) / len(rewards)))]
    assert run.data.metrics[f"{task}/members"] == 4
    assert run.data.metrics[f"{task}/infrastructure"] == 4 - len(rewards)
    assert run.data.metrics[f"{task}/tokens"] > 0
    assert logged_scalars("tensorboard", tmp_path / "tb")[f"{task}/reward_mean"] == [(0, pytest.approx(mean[0].value))]
