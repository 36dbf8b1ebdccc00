"""Canaries for tasks whose tests are named without their file (R2E-Gym's exact match): they go
into the hidden test files, and their names are valid Python names whatever the expected keys hold
(a parameter such as ``[Donald E. Knuth-donald_e_knuth]`` has dots and spaces)."""

from __future__ import annotations

import ast
import json
from pathlib import Path, PurePosixPath

from arena_core.schemas import TestsVerifier
from arena_verification.tests_verifier import plan_canaries

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "datasets"


def test_canaries_of_an_exact_match_task_are_valid_tests_in_its_hidden_files(tmp_path):
    rows = [json.loads(line) for line in (FIXTURES / "r2e-gym" / "dataset.jsonl").read_text().splitlines()]
    expected = json.loads(rows[0]["expected_output_json"])
    assert any("." in key.split("[", 1)[-1] for key in expected if "[" in key)  # params with dots
    hidden = {"r2e_tests/__init__.py": b"", "r2e_tests/test_1.py": b"import pytest\n\n" + b"".join(
        f"def {key.split('[')[0].split('.')[-1]}():\n    pass\n\n".encode() for key in expected)}
    spec = TestsVerifier(expected_statuses=expected, hidden_files="sha256:" + "0" * 64)
    for _ in range(200):  # the names are drawn at random: many draws
        canaries = plan_canaries(spec, tmp_path, [PurePosixPath("r2e_tests")], hidden)
        assert canaries is not None and list(canaries.files) == ["r2e_tests/test_1.py"]
        must_fail, must_pass, source = canaries.files["r2e_tests/test_1.py"]
        assert must_fail.isidentifier() and must_pass.isidentifier() and must_fail != must_pass
        ast.parse(hidden["r2e_tests/test_1.py"].decode() + source)
        assert must_fail not in {k.split("[")[0].split(".")[-1] for k in expected}
