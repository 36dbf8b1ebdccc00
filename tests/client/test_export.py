"""Exports end to end: from the trajectory API (a real uvicorn server on 127.0.0.1) to
Parquet loaded by ``datasets``, and with ``arena export --store`` from the chDB directory."""

from __future__ import annotations

import asyncio
import json
import os

import pytest
import uvicorn

from arena import cli
from arena.export_io import ExportFilter, HttpSource, Progress, run_export
from arena_stack.natsserver import free_port
from arena_core.schemas import RolloutState, RolloutStateChanged, Step, Usage, VerificationResult
from arena_trajectory import assembler
from arena_trajectory.app import create_app
from arena_trajectory.clickhouse import ChdbBackend
from arena_trajectory.store import TrajectoryStore

T0 = 1_763_769_600.0  # 2025-11-22 00:00 UTC
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def trajectory(g: int, i: int, task: str, day: int) -> object:
    rid = f"r{g}-{i}"
    event = RolloutStateChanged(rollout_id=rid, task_id=task, from_state=RolloutState.VERIFYING,
                                to_state=RolloutState.COMPLETED, at=T0 + day * 86400 + g, steps=2,
                                group_id=f"g{g:02d}", group_index=i, group_size=2)
    steps = [Step(rollout_id=rid, step_index=s, model="m", backend="b", policy_version="1",
                  request_messages=[{"role": "user", "content": f"task {task}"}], prompt_token_ids=[1, 2],
                  completion_token_ids=[3, 4, 5], logprobs=[-0.1, -0.2, -0.3], completion_text=f"{rid}/{s}",
                  usage=Usage(prompt_tokens=2, completion_tokens=3), started_at=T0 + day * 86400)
             for s in range(2)]
    verification = VerificationResult(rollout_id=rid, verifier="tests", reward=float(i == g % 2),
                                      passed=i == g % 2, started_at=1.0, finished_at=2.0)
    return assembler.assemble(event, steps, None, verification)


@pytest.fixture
async def served(tmp_path):
    """A chDB store with 12 groups of 2 over two tasks and two days, served over HTTP."""
    store = TrajectoryStore(ChdbBackend(tmp_path / "data" / "clickhouse"))
    await store.init()
    await store.insert_trajectories([trajectory(g, i, "calc.add" if g % 3 else "calc.sub", g % 2)
                                     for g in range(12) for i in range(2)])
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(store), host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", store, tmp_path
    finally:
        server.should_exit = True
        await task
        await store.close()


async def test_grpo_parquet_from_the_api_loads_with_datasets(served):
    url, _, tmp_path = served
    out = tmp_path / "grpo"
    progress_lines = []

    class Sink:
        def write(self, s):
            progress_lines.append(s)

        def flush(self):
            pass

    source = HttpSource(url, ExportFilter(), page=5)  # pages cut groups in two: they must be rejoined
    stats, files = await run_export(source, view="grpo", fmt="parquet", out=out,
                                    progress=Progress(None, enabled=True, stream=Sink()))
    assert stats.rows == 24 and stats.groups == 12 and stats.skipped == {}
    assert sorted(str(p.relative_to(out).parent) for p in files) == [
        "date=2025-11-22/task=calc.add", "date=2025-11-22/task=calc.sub",
        "date=2025-11-23/task=calc.add", "date=2025-11-23/task=calc.sub"]
    assert "24 trajectories" in "".join(progress_lines) and "[####" in "".join(progress_lines)

    import datasets

    ds = await asyncio.to_thread(datasets.load_dataset, "parquet", data_files=str(out / "**" / "*.parquet"),
                                 split="train", cache_dir=str(tmp_path / "hf-cache"))
    assert ds.num_rows == 24
    assert {"group_id", "advantage", "reward", "completions", "date", "task_id"} <= set(ds.column_names)
    by_group: dict[str, list[float]] = {}
    for row in ds:
        by_group.setdefault(row["group_id"], []).append(row["advantage"])
    assert len(by_group) == 12 and all(sorted(a) == pytest.approx([-1.0, 1.0], abs=1e-5) for a in by_group.values())

    filtered, _ = await run_export(HttpSource(url, ExportFilter(task_id="calc.sub")), view="sft", fmt="jsonl",
                                   out=tmp_path / "sft.jsonl")
    lines = [json.loads(x) for x in (tmp_path / "sft.jsonl").read_text().splitlines()]
    assert filtered.rows == 4 and {x["task_id"] for x in lines} == {"calc.sub"}
    assert lines[0]["messages"][-1]["role"] == "assistant"


async def test_cli_exports_tokens_from_the_store_directory_when_the_service_is_stopped(served, capsys):
    url, store, tmp_path = served
    code = await asyncio.to_thread(cli.main, ["--trajectory-url", url, "export", "--view", "dpo", "--format",
                                              "jsonl", "--out", str(tmp_path / "dpo.jsonl"), "--quiet"])
    assert code == 0 and "12 dpo rows from 24 trajectories in 12 groups" in capsys.readouterr().out
    await store.close()  # the service stops: chDB allows one process per directory
    code = await asyncio.to_thread(cli.main, ["export", "--view", "tokens", "--format", "parquet", "--out",
                                              str(tmp_path / "tokens"), "--store", str(tmp_path / "data"),
                                              "--quiet"])
    assert code == 0 and "48 tokens rows" in capsys.readouterr().out
    import pyarrow.dataset as pads

    table = pads.dataset(str(tmp_path / "tokens"), format="parquet").to_table()
    row = table.slice(0, 1).to_pylist()[0]
    assert row["input_ids"] == [1, 2, 3, 4, 5] and row["loss_mask"] == [0, 0, 1, 1, 1]
    assert (row["sequence_index"], row["num_sequences"]) == (0, 2)  # both calls send the same prompt
    assert row["logprobs"] == pytest.approx([0.0, 0.0, -0.1, -0.2, -0.3]) and row["num_loss_tokens"] == 3
    bad = await asyncio.to_thread(cli.main, ["export", "--view", "tokens", "--out", str(tmp_path / "x"),
                                             "--store", str(tmp_path / "nowhere")])
    assert bad == 2 and "is not a chDB store" in capsys.readouterr().err


def tool_use(i: int, reward: float) -> object:
    """Three calls: the agent calls a tool, gives up on its second call (abandoned) and sends it
    again with the tool's output (20, 21) and template tokens (5) after its first answer."""
    rid = f"tool-{i}"
    event = RolloutStateChanged(rollout_id=rid, task_id="chat.tools", from_state=RolloutState.VERIFYING,
                                to_state=RolloutState.COMPLETED, at=T0 + 50, steps=3, group_id="tools",
                                group_index=i, group_size=2)
    steps = [Step(rollout_id=rid, step_index=0, model="m", backend="b", policy_version="1",
                  prompt_token_ids=[1, 2, 3], completion_token_ids=[10, 11 + i], logprobs=[-0.5, -0.25]),
             Step(rollout_id=rid, step_index=1, model="m", backend="b", policy_version="1", abandoned=True,
                  prompt_token_ids=[1, 2, 3, 10, 11 + i, 20, 21, 5], completion_token_ids=[99], logprobs=[-9.0]),
             Step(rollout_id=rid, step_index=2, model="m", backend="b", policy_version="2",
                  prompt_token_ids=[1, 2, 3, 10, 11 + i, 20, 21, 5], completion_token_ids=[12, 2],
                  logprobs=[-0.125, -1.0])]
    verification = VerificationResult(rollout_id=rid, verifier="tests", reward=reward, passed=reward == 1.0,
                                      started_at=1.0, finished_at=2.0)
    return assembler.assemble(event, steps, None, verification)


async def test_a_multi_turn_rollout_exports_as_its_merged_training_sequence(served):
    url, store, tmp_path = served
    members = [tool_use(0, 1.0), tool_use(1, 0.0)]
    await store.insert_trajectories(members)
    only = ExportFilter(task_id="chat.tools")

    got = [t async for t in HttpSource(url, only).trajectories()]  # the API's export carries them
    assert [t.sequences for t in got] == [t.sequences for t in members]
    assert [(b.step_index, b.kind) for b in got[0].sequence_breaks] == [(1, "abandoned")]

    stats, _ = await run_export(HttpSource(url, only), view="tokens", fmt="jsonl", out=tmp_path / "tools.jsonl")
    rows = [json.loads(x) for x in (tmp_path / "tools.jsonl").read_text().splitlines()]
    assert stats.rows == 2 and stats.skipped == {"step the agent never received (abandoned)": 2}
    first = rows[0]
    assert first["rollout_id"] == "tool-0" and first["steps"] == [0, 2] and first["policy_versions"] == ["1", "2"]
    assert first["input_ids"] == [1, 2, 3, 10, 11, 20, 21, 5, 12, 2]
    assert first["loss_mask"] == [0, 0, 0, 1, 1, 0, 0, 0, 1, 1] and first["num_loss_tokens"] == 4
    assert first["logprobs"] == [0.0, 0.0, 0.0, -0.5, -0.25, 0.0, 0.0, 0.0, -0.125, -1.0]
    assert (first["sequence_index"], first["num_sequences"]) == (0, 1)
    assert [r["advantage"] for r in rows] == pytest.approx([1.0, -1.0], abs=1e-5)
    assert rows[1]["input_ids"] == [1, 2, 3, 10, 12, 20, 21, 5, 12, 2]
