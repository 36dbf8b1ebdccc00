"""examples/trl-from-export: TRL's DPOTrainer fed from Arena's dpo Parquet export, offline on CPU.

Trajectories (real ``Trajectory``/``Step`` structs, grouped as the trajectory plane stores
them) go through the real export (``run_export`` → ``ParquetWriter``, hive partitions);
the example loads the files with ``datasets`` and trains with TRL for a few steps.
"""

from __future__ import annotations

import asyncio
import importlib.util
import math
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")
pytest.importorskip("pyarrow")

from arena.export import ExportOptions  # noqa: E402
from arena.export_io import run_export  # noqa: E402
from arena_core.schemas import RolloutState, Step, Trajectory  # noqa: E402

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "trl-from-export" / "train_dpo.py"
T0 = 1_763_769_600.0  # 2025-11-22 00:00 UTC


def _example():
    spec = importlib.util.spec_from_file_location("trl_train_dpo", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module's annotations through it
    spec.loader.exec_module(module)
    return module


def member(task: str, gid: str, i: int, a: int, b: int, answer: int, size: int) -> Trajectory:
    rid = f"{gid}-{i}"
    step = Step(rollout_id=rid, step_index=0, model="policy", backend="http://127.0.0.1:1", policy_version="3",
                request_messages=[{"role": "system", "content": "Answer with the number only."},
                                  {"role": "user", "content": f"{a}+{b}="}],
                prompt_token_ids=[1, 2, 3], completion_token_ids=[4, 5], logprobs=[-0.5, -0.7],
                completion_text=str(answer))
    return Trajectory(rollout_id=rid, task_id=task, group_id=gid, group_index=i, group_size=size,
                      final_state=RolloutState.COMPLETED, reward=1.0 if answer == a + b else 0.0,
                      steps=[step], policy_versions=["3"], completed_at=T0 + 60 * i)


def groups() -> list[Trajectory]:
    """12 groups of 3 members over two tasks: one right answer, two wrong ones per group."""
    out = []
    for g in range(12):
        a, b = g % 5 + 1, g // 5 + 2
        task = "calc/add" if g % 2 == 0 else "calc/add-hard"
        answers = [a + b + 3, a + b, a + b - 1] if g % 3 else [a + b, a * b + 10, a + b + 1]
        out += [member(task, f"g{g:02d}", i, a, b, ans, 3) for i, ans in enumerate(answers)]
    return out


class ListSource:
    """The export's ``Source`` protocol over trajectories already in memory (instead of the
    trajectory service or its store, which the export tests cover)."""

    def __init__(self, trajectories: list[Trajectory]):
        self._trajectories = trajectories
        self.total = len(trajectories)

    async def trajectories(self):
        for t in self._trajectories:
            yield t


def test_dpo_export_trains_with_trl(tmp_path):
    stats, files = asyncio.run(run_export(ListSource(groups()), view="dpo", fmt="parquet", out=tmp_path / "dpo",
                                          options=ExportOptions()))
    assert stats.rows == 12 and stats.skipped == {}
    assert {p.parent.name for p in files} == {"task=calc_add", "task=calc_add-hard"}

    ex = _example()
    pairs = ex.load_pairs(tmp_path / "dpo", cache_dir=str(tmp_path / "hf-cache"))
    assert pairs.num_rows == 12 and set(pairs.column_names) == {"prompt", "chosen", "rejected"}
    first = pairs[0]
    assert first["prompt"][0] == {"role": "system", "content": "Answer with the number only."}
    assert first["chosen"][0]["role"] == first["rejected"][0]["role"] == "assistant"
    assert first["chosen"][0]["content"] != first["rejected"][0]["content"]

    r = ex.train(tmp_path / "dpo", tmp_path / "run", max_steps=24, batch_size=4, learning_rate=2e-2, seed=0,
                 eval_every=6)
    assert r.pairs == 12 and r.steps == 24 and len(r.losses) == len(r.margins) == 24
    assert all(math.isfinite(x) for x in r.losses + r.margins)
    assert r.weights_changed and r.max_weight_delta > 1e-3
    # the policy starts equal to the reference: loss log(2) and margin 0 on the first batch
    assert r.losses[0] == pytest.approx(math.log(2), abs=1e-4) and r.margins[0] == pytest.approx(0.0, abs=1e-6)
    # over all pairs, the implicit reward of the chosen answers pulls ahead of the rejected ones
    steps = [s for s, _, _ in r.evals]
    margins = [m for _, m, _ in r.evals]
    assert steps == [0, 6, 12, 18, 24]
    assert margins[0] == pytest.approx(0.0, abs=1e-3)  # equal up to float noise (padding in batches)
    assert all(b > a for a, b in zip(margins, margins[1:])), margins
    assert margins[-1] > 0.05, margins

def test_cli_says_what_is_wrong_with_a_bad_directory(tmp_path, capsys):
    assert _example().main(["--parquet", str(tmp_path / "nothing"), "--out", str(tmp_path / "run")]) == 2
    assert "no .parquet files" in capsys.readouterr().err
