"""SWE-bench-format rows as tasks: JSONL, JSON and Parquet rows, the test files of a patch,
per-repository specs, the public and private parts of the task made from a row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from arena import datasets
from arena_core.errors import InvalidRequest
from arena_core.schemas import BundleSource

DATASET = Path(__file__).resolve().parents[2] / "examples" / "swebench-mini"
SOURCE = BundleSource(digest="sha256:" + "0" * 64)


def test_rows_read_the_same_from_jsonl_json_and_parquet(tmp_path):
    rows = datasets.read_rows(DATASET / "dataset.jsonl")
    assert len(rows) == 5
    records = [json.loads(line) for line in (DATASET / "dataset.jsonl").read_text().splitlines()]
    (tmp_path / "rows.json").write_text(json.dumps(records))
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist(records), tmp_path / "rows.parquet")
    for other in ("rows.json", "rows.parquet"):
        again = datasets.read_rows(tmp_path / other)
        assert [(r.instance_id, r.tests("FAIL_TO_PASS")) for r in again] == [
            (r.instance_id, r.tests("FAIL_TO_PASS")) for r in rows]


def test_lists_come_as_json_strings_or_lists_and_bad_ones_are_clear_errors():
    row = datasets.SwebenchRow(instance_id="o__n-1", repo="o/n", base_commit="a" * 40,
                               FAIL_TO_PASS='["t.py::a[x y]"]', PASS_TO_PASS=["t.py::b"])
    assert row.tests("FAIL_TO_PASS") == ["t.py::a[x y]"] and row.tests("PASS_TO_PASS") == ["t.py::b"]
    with pytest.raises(InvalidRequest, match="not a JSON list"):
        datasets.SwebenchRow(instance_id="x", repo="o/n", base_commit="a", FAIL_TO_PASS="[oops").tests("FAIL_TO_PASS")
    with pytest.raises(InvalidRequest, match="not found"):
        datasets.read_rows("/nonexistent.jsonl")


def test_the_test_files_of_a_patch_are_its_new_names():
    diff = ("diff --git a/tests/test_a.py b/tests/test_a.py\n--- a/tests/test_a.py\n+++ b/tests/test_a.py\n"
            "diff --git a/old.py b/tests/new_name.py\nsimilarity index 90%\n"
            'diff --git "a/tests/sp ace.py" "b/tests/sp ace.py"\n')
    assert datasets.patch_files(diff) == ["tests/test_a.py", "tests/new_name.py", "tests/sp ace.py"]


def test_a_row_becomes_a_task_with_its_tests_private_and_its_statement_public():
    specs = datasets.read_specs(DATASET / "specs.json")
    for row in datasets.read_rows(DATASET / "dataset.jsonl"):
        spec = datasets.spec_for(specs, row)
        task = datasets.to_task(row, source=SOURCE, command=spec.test_cmd, extra_test_files=spec.test_files)
        public = task.public()
        assert public.verifier is None and public.instructions == row.problem_statement
        assert task.verifier.test_patch == row.test_patch and task.verifier.canaries
        assert task.verifier.fail_to_pass == row.tests("FAIL_TO_PASS")
        assert set(datasets.patch_files(row.test_patch)) <= set(task.verifier.test_files)
        assert "{test_files}" not in task.verifier.command
        if row.repo == "r1chardj0n3s/parse":
            assert "-o addopts=" in task.verifier.command and "tests/test_search.py" in task.verifier.test_files
    with pytest.raises(InvalidRequest, match="no local mirror"):
        datasets.mirror_of(DATASET / "repos", "nobody/nothing")


def test_specs_may_be_keyed_by_version():
    row = datasets.SwebenchRow(instance_id="o__n-1", repo="o/n", base_commit="a", version="1.2")
    specs = {"o/n": {"1.2": {"test_cmd": "pytest -x {test_files}"}, "*": {"test_cmd": "other"}}}
    assert datasets.spec_for(specs, row).test_cmd == "pytest -x {test_files}"
    assert datasets.spec_for({"o/n": {"*": {"test_cmd": "other"}}}, row).test_cmd == "other"
    assert datasets.spec_for({}, row).test_cmd == datasets.DEFAULT_COMMAND
