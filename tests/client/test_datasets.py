"""SWE-bench-format rows as tasks: JSONL, JSON and Parquet rows, the test files of a patch,
per-repository specs, the public and private parts of the task made from a row."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from arena import datasets
from arena_core.errors import InvalidRequest
from arena_core.schemas import BundleSource, Task

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


# --------------------------------------------------------------------------- SWE-bench's spec tables

#: An excerpt of SWE-bench's own ``MAP_REPO_VERSION_TO_SPECS`` (swebench 4.1.0), as it keeps it.
SWEBENCH_SPECS = Path(__file__).resolve().parents[1] / "fixtures" / "swebench_specs" / "map_repo_version_to_specs.json"


def swebench_row(repo: str, version: str, *test_files: str) -> datasets.SwebenchRow:
    patch = "".join(f"diff --git a/{f} b/{f}\n--- a/{f}\n+++ b/{f}\n@@ -1 +1 @@\n-a\n+b\n" for f in test_files)
    return datasets.SwebenchRow(instance_id=f"{repo.replace('/', '__')}-1", repo=repo, base_commit="a" * 40,
                                version=version, test_patch=patch, FAIL_TO_PASS=["t::a"])


def test_swebench_spec_table_runs_test_cmd_as_swebench_does_and_keeps_its_environment_fields():
    specs = datasets.read_specs(SWEBENCH_SPECS)
    table = json.loads(SWEBENCH_SPECS.read_text())
    # pytest repositories: the test patch's test files appended, its data files not
    row = swebench_row("astropy/astropy", "5.0", "astropy/io/fits/tests/test_header.py",
                       "astropy/io/fits/tests/data/header.txt")
    spec = datasets.spec_for(specs, row)
    task = datasets.to_task(row, source=SOURCE, command=spec.test_cmd, extra_test_files=spec.test_files, spec=spec)
    assert task.verifier.command == "pytest -rA astropy/io/fits/tests/test_header.py"
    assert task.verifier.test_files == ["astropy/io/fits/tests/test_header.py", "astropy/io/fits/tests/data/header.txt"]
    kept = json.loads(task.metadata["swebench_spec"])
    assert kept == {k: v for k, v in table["astropy/astropy"]["5.0"].items() if k != "test_cmd"}
    assert {"python", "pip_packages", "install", "pre_install"} <= kept.keys()
    assert task.metadata["python"] == "3.9" and task.public().metadata["python"] == "3.9"
    # Django: runtests.py takes module labels; eval_commands run before the tests
    row = swebench_row("django/django", "1.7", "tests/model_fields/tests.py")
    spec = datasets.spec_for(specs, row)
    assert spec.test_cmd.splitlines() == [
        "export LANG=en_US.UTF-8", "export LC_ALL=en_US.UTF-8", "export PYTHONIOENCODING=utf8",
        "export LANGUAGE=en_US:en",
        "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1 model_fields.tests"]
    assert spec.kept["packages"] == "requirements.txt" and spec.python == "3.5"
    assert datasets.spec_for(specs, swebench_row("django/django", "4.0", "tests/a/b.py")).test_cmd.endswith(" a.b")
    # every field of the excerpt accepted (no_use_env, packages, build, docker_specs, list test_cmd, ...)
    for repo, versions in table.items():
        for version, entry in versions.items():
            spec = datasets.spec_for(specs, swebench_row(repo, version, "t/test_x.py"))
            assert spec.kept == {k: v for k, v in entry.items() if k not in ("test_cmd", "eval_commands")}
    # a list test_cmd (SWE-bench's other languages) runs line by line as given
    assert datasets.spec_for(specs, swebench_row("redis/redis", "13115", "tests/x.tcl")).test_cmd == \
        "\n".join(table["redis/redis"]["13115"]["test_cmd"])


def test_spec_fields_swebench_forks_add_are_kept_and_only_used_fields_are_type_checked():
    row = swebench_row("o/n", "0.3", "tests/test_a.py")
    entry = {"python": "3.10", "packages": "environment.yml", "env_patches": ["sed -i '/- pip:/,/^ *-/d' environment.yml"],
             "reqs_path": ["requirements/dev.txt"], "env_yml_path": ["ci/env.yml"], "no_use_env": True,
             "test_cmd": "pytest -rA --tb=short"}
    spec = datasets.spec_for({"o/n": {"0.3": entry}}, row)
    assert spec.test_cmd == "pytest -rA --tb=short tests/test_a.py"
    assert spec.kept == {k: v for k, v in entry.items() if k != "test_cmd"}
    # one spec for every version (no version keys) works the same
    assert datasets.spec_for({"o/n": entry}, row).test_cmd == spec.test_cmd
    with pytest.raises(InvalidRequest, match=r"spec of o/n 0.3: Expected `str \| array"):
        datasets.spec_for({"o/n": {"0.3": {**entry, "test_cmd": 3}}}, row)


def test_a_spec_table_without_the_rows_version_is_refused_not_replaced_by_the_default():
    specs = datasets.read_specs(SWEBENCH_SPECS)
    with pytest.raises(InvalidRequest, match=r"versions \['1.7', '4.0'\] of django/django, not '9.9'"):
        datasets.spec_for(specs, swebench_row("django/django", "9.9", "tests/a/b.py"))
    # a repository the table does not name: the import's command
    assert datasets.spec_for(specs, swebench_row("o/n", "1.0")).test_cmd == datasets.DEFAULT_COMMAND


def test_import_cli_takes_swebench_spec_table_as_swebench_keeps_it(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join(json.dumps({
        "instance_id": r.instance_id, "repo": r.repo, "base_commit": r.base_commit, "version": r.version,
        "patch": "", "test_patch": r.test_patch, "FAIL_TO_PASS": json.dumps(["t::a"]), "PASS_TO_PASS": "[]"})
        for r in (swebench_row("astropy/astropy", "5.0", "astropy/tests/test_a.py"),
                  swebench_row("sphinx-doc/sphinx", "7.1", "tests/test_build.py"))) + "\n")
    for fmt in ("swebench", "swe-gym"):
        out = tmp_path / fmt
        done = subprocess.run([sys.executable, "-m", "arena.cli", "tasks", "import", fmt, str(rows), "--image",
                               "example/testbed:1", "--specs", str(SWEBENCH_SPECS), "--out", str(out)],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        sphinx = msgspec.json.decode((out / "sphinx-doc__sphinx-1.json").read_bytes(), type=Task)
        assert sphinx.verifier.command == "tox --current-env -epy39 -v -- tests/test_build.py"
        assert json.loads(sphinx.metadata["swebench_spec"])["pre_install"] == ["sed -i 's/pytest/pytest -rA/' tox.ini"]
        astropy = msgspec.json.decode((out / "astropy__astropy-1.json").read_bytes(), type=Task)
        assert astropy.verifier.command == "pytest -rA astropy/tests/test_a.py"
