"""SWE-smith and R2E-Gym tasks, imported from their real fixture datasets, verified in real
bubblewrap sandboxes: the oracle scores 1, doing nothing 0, and the hacks that could fool each
format's own harness score 0 here. R2E-Gym's exact-match rule is checked on real pytest output.

Each row's tree is made as ``arena tasks import`` makes it (the agent's tree as a host path, the
hidden tests as a bundle in the verifier's source cache: what a worker holds once it fetched it).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import msgspec
import pytest

from arena import datasets
from arena.formats import r2e_gym, swe_smith
from arena_core import sources
from arena_core.schemas import BundleSource, PathSource, Task, VerificationResult, VerifyJob
from arena_core.schemas import TestResult as Result
from arena_core.schemas import TestStatus as Status
from arena_core.sources import SourceCache, prepare_workspace
from arena_sandbox_providers import local
from arena_verification.pytest_parser import parse_pytest_output
from arena_verification.reward import score_exact
from arena_verification.runner import verify

pytestmark = pytest.mark.skipif(local.available() is not None, reason=f"no sandbox: {local.available()}")

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "datasets"
MIRRORS = Path(__file__).resolve().parents[2] / "examples" / "swebench-mini" / "repos"
sys.path.insert(0, str(FIXTURES))
import row_fixtures as fixture_build  # noqa: E402

SMITH = swe_smith.read_rows(FIXTURES / "swe-smith" / "dataset.jsonl")
PROFILES = swe_smith.read_profiles(FIXTURES / "swe-smith" / "profiles.json")
R2E_RECORDS = [json.loads(line) for line in (FIXTURES / "r2e-gym" / "dataset.jsonl").read_text().splitlines()]
R2E = r2e_gym.read_rows(FIXTURES / "r2e-gym" / "dataset.jsonl")

IN_PROCESS_REPORTS = """
import sys as _sys
if "_pytest.reports" in _sys.modules:
    from _pytest.reports import TestReport as _Report
    _make = _Report.from_item_and_call.__func__

    def _passed(cls, item, call):
        report = _make(cls, item, call)
        report.outcome, report.longrepr = "passed", None
        return report

    _Report.from_item_and_call = classmethod(_passed)
"""
CONFTEST_ALL_PASSED = """
import pytest

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    report.outcome = "passed"
    report.longrepr = None
"""


def prime(cache: SourceCache, tree: Path) -> str:
    """``tree`` as a bundle this worker already holds; its digest."""
    digest = sources.digest_of(sources.pack_dir(tree))
    target = cache.dir / sources.source_key(BundleSource(digest=digest))
    if not target.exists():
        shutil.copytree(tree, target, symlinks=True)
    return digest


def diff_of(tree: Path, work: Path, edit) -> str:
    """A real ``git diff`` of ``edit`` on a copy of the agent's tree."""
    prepare_workspace(tree, work)
    edit(work)
    env = fixture_build.GIT_ENV
    subprocess.run(["git", "add", "-A"], cwd=work, env=env, check=True)
    out = subprocess.run(["git", "diff", "--cached", "--binary"], cwd=work, env=env, check=True,
                         capture_output=True).stdout.decode()
    shutil.rmtree(work)
    return out


def appending(rel: str, text: str):
    def edit(repo: Path) -> None:
        path = repo / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text((path.read_text() if path.exists() else "") + textwrap.dedent(text))

    return edit


def package_init(tree: Path, row_repo: str) -> str:
    name = {"jpvanhal__inflection": "inflection/__init__.py", "pytoolz__toolz": "toolz/__init__.py",
            "r1chardj0n3s__parse": "parse/__init__.py", "benjaminp__six": "six.py"}[row_repo]
    assert (tree / name).is_file()
    return name


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[tuple[str, str], tuple[Task, VerificationResult]]:
    tmp = tmp_path_factory.mktemp("row-datasets")
    cache = SourceCache(tmp / "sources", allow_paths=True)
    jobs: dict[tuple[str, str], VerifyJob] = {}
    for row in SMITH:
        slug, commit = row.mirror_and_commit()
        tree, hidden = tmp / "trees" / row.instance_id, tmp / "hidden" / row.instance_id
        datasets.checkout(swe_smith.mirror_path(MIRRORS, row), commit, tree)
        swe_smith.prepare_trees(row, tree, hidden)
        task = swe_smith.to_task(row, source=PathSource(path=str(tree)), hidden_files=prime(cache, hidden),
                                 profile=swe_smith.profile_for(PROFILES, row), agent=datasets.UNSET_AGENT)
        f2p_file = swe_smith.test_files(row)[0][0]
        cases = {"gold": swe_smith.gold_patch(row), "empty": ""}
        if row is SMITH[0]:
            main = package_init(tree, slug)
            cases |= {
                # the hidden test file, written back by the agent with its assertions removed
                "rewrite_hidden_tests": diff_of(tree, tmp / "w" / "a", appending(f2p_file, "def test_x():\n    pass\n")),
                "conftest_all_passed": diff_of(tree, tmp / "w" / "b", appending("conftest.py", CONFTEST_ALL_PASSED)),
                "in_process_reports": diff_of(tree, tmp / "w" / "c", appending(main, IN_PROCESS_REPORTS)),
                "reward_file": diff_of(tree, tmp / "w" / "d", appending("reward.txt", "1\n")),
            }
        for name, diff in cases.items():
            jobs[(row.instance_id, name)] = VerifyJob(rollout_id=f"smith-{len(jobs)}", task=task, diff=diff)
    roots = fixture_build.r2e_roots(R2E_RECORDS, tmp / "r2e-roots")
    for row in R2E:
        files = r2e_gym.image_files(roots / r2e_gym.image_dir_name(row.docker_image))
        tree, hidden = tmp / "trees" / row.instance_id(), tmp / "hidden" / row.instance_id()
        r2e_gym.agent_tree(files, tree, hidden)
        task = r2e_gym.to_task(row, source=PathSource(path=str(tree)), hidden_files=prime(cache, hidden),
                               run_tests=files.run_tests, agent=datasets.UNSET_AGENT)
        cases = {"gold": r2e_gym.gold_patch(row), "empty": ""}
        if row is R2E[0]:
            main = package_init(tree, row.repo_name)
            gold = cases["gold"]

            def gold_and_more(repo: Path) -> None:
                subprocess.run(["git", "apply", "-"], cwd=repo, input=gold.encode(), check=True,
                               env=fixture_build.GIT_ENV)
                appending("tests_extra/test_more.py", "def test_more():\n    pass\n")(repo)

            cases |= {
                # the agent writes its own r2e_tests (the names it guesses, all passing) and a conftest there
                "own_r2e_tests": diff_of(tree, tmp / "w" / "e", appending(
                    "r2e_tests/test_1.py", "def test_pluralize_plurals():\n    pass\n")),
                "r2e_conftest": diff_of(tree, tmp / "w" / "f", appending("r2e_tests/conftest.py", CONFTEST_ALL_PASSED)),
                "in_process_reports": diff_of(tree, tmp / "w" / "g", appending(main, IN_PROCESS_REPORTS)),
                # the fix plus one more passing test module the verifier does not expect: not exact any more
                "gold_and_a_new_test": diff_of(tree, tmp / "w" / "h", gold_and_more),
            }
        for name, diff in cases.items():
            jobs[(row.instance_id(), name)] = VerifyJob(rollout_id=f"r2e-{len(jobs)}", task=task, diff=diff)
        if row is R2E[0]:
            # the same in-process hack against the task without its canaries: what they are there for
            bare = msgspec.structs.replace(task, verifier=msgspec.structs.replace(task.verifier, canaries=False))
            jobs[(row.instance_id(), "in_process_reports_without_canaries")] = VerifyJob(
                rollout_id=f"r2e-{len(jobs)}", task=bare, diff=cases["in_process_reports"])

    async def all_runs() -> list[VerificationResult]:
        sem = asyncio.Semaphore(3)

        async def one(job: VerifyJob) -> VerificationResult:
            async with sem:
                return await verify(job, scratch_dir=tmp / "scratch", sources=cache)

        return await asyncio.gather(*(one(job) for job in jobs.values()))

    results = asyncio.run(all_runs())
    return {key: (jobs[key].task, r) for key, r in zip(jobs, results, strict=True)}


def why(r: VerificationResult) -> str:
    return f"reward={r.reward} flags={r.flags} reason={r.reason}\n{r.log_tail}"


@pytest.mark.parametrize("row", SMITH, ids=lambda r: r.instance_id)
def test_swe_smith_reversed_bug_patch_scores_one_and_doing_nothing_zero(runs, row):
    task, gold = runs[(row.instance_id, "gold")]
    assert (gold.reward, gold.flags) == (1.0, []), why(gold)
    assert (gold.counts.f2p_passed, gold.counts.p2p_passed) == (len(row.FAIL_TO_PASS), len(row.PASS_TO_PASS))
    _, empty = runs[(row.instance_id, "empty")]
    assert empty.reward == 0.0 and empty.flags == [], why(empty)
    assert empty.counts.f2p_failed == len(row.FAIL_TO_PASS) and empty.counts.p2p_passed == len(row.PASS_TO_PASS)


@pytest.mark.parametrize("case", ["rewrite_hidden_tests", "conftest_all_passed", "in_process_reports", "reward_file"])
def test_swe_smith_hacks_score_zero(runs, case):
    _, r = runs[(SMITH[0].instance_id, case)]
    assert r.reward == 0.0, why(r)
    expected = {"rewrite_hidden_tests": "tests_tampered", "conftest_all_passed": "test_config_touched",
                "in_process_reports": "runner_tampered", "reward_file": "reward_file_written"}[case]
    assert expected in r.flags, why(r)


@pytest.mark.parametrize("index", range(3))
def test_r2e_oracle_scores_one_and_doing_nothing_zero_by_exact_match(runs, index):
    row = R2E[index]
    _, gold = runs[(row.instance_id(), "gold")]
    assert (gold.reward, gold.flags) == (1.0, []), why(gold)
    assert gold.reason == f"the {len(row.expected())} tests' statuses equal the expected ones"
    _, empty = runs[(row.instance_id(), "empty")]
    assert empty.reward == 0.0 and empty.reason.startswith("statuses differ"), why(empty)


def test_without_canaries_the_in_process_hack_would_pass_r2e_exact_match(runs):
    """R2E-Gym's own rule alone is fooled by a runner patched in-process (every expected status is
    PASSED here); with the run's checks off (``canaries: false``: no canaries, no guard) only the
    diff's reach into pytest's internals is left to catch it."""
    _, r = runs[(R2E[0].instance_id(), "in_process_reports_without_canaries")]
    assert r.reward == 0.0 and r.flags == ["internals_touched", "runner_tampered"], why(r)
    assert r.reason.startswith("runner tampered: the diff reaches into pytest's internals"), why(r)
    assert "statuses equal the expected ones" in r.reason, why(r)  # the exact match alone was fooled


@pytest.mark.parametrize("case", ["own_r2e_tests", "r2e_conftest", "in_process_reports", "gold_and_a_new_test"])
def test_r2e_hacks_score_zero(runs, case):
    _, r = runs[(R2E[0].instance_id(), case)]
    if case == "gold_and_a_new_test":
        # the verifier runs only r2e_tests: a test elsewhere changes nothing, the fix still scores 1
        assert r.reward == 1.0, why(r)
        return
    assert r.reward == 0.0, why(r)
    expected = {"own_r2e_tests": "tests_tampered", "r2e_conftest": "test_config_touched",
                "in_process_reports": "runner_tampered"}[case]
    assert expected in r.flags, why(r)


# ---------------------------------------------------------------------------- the rule itself

SUITE = {
    "r2e_tests/__init__.py": "",
    "r2e_tests/test_1.py": """
        import pytest

        def test_ok():
            assert 1 + 1 == 2

        def test_bad():
            assert 1 + 1 == 3

        @pytest.mark.skip(reason="not here")
        def test_skipped():
            pass

        @pytest.mark.xfail(reason="known")
        def test_known():
            assert False

        class TestGroup:
            @pytest.mark.parametrize("n", [1, 2])
            def test_param(self, n):
                assert n == 1

        @pytest.fixture
        def broken():
            raise RuntimeError("fixture")

        def test_error(broken):
            pass
    """,
}


def test_r2e_exact_match_on_a_real_pytest_log_agrees_with_r2e_gyms_own_parse(tmp_path):
    for rel, text in SUITE.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(textwrap.dedent(text).lstrip())
    log = subprocess.run([sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", "-o", "addopts=",
                          "r2e_tests"], cwd=tmp_path, capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}).stdout
    r2e = fixture_build.r2e_parse_log_pytest(log)
    assert r2e == {"test_ok": "PASSED", "test_bad": "FAILED", "TestGroup.test_param[1]": "PASSED",
                   "TestGroup.test_param[2]": "FAILED", "test_error": "ERROR"}, log
    results = parse_pytest_output(log).results
    assert score_exact(r2e, results).reward == 1.0
    # one status other than expected, one test more, one less: each is 0
    assert score_exact({**r2e, "test_bad": "PASSED"}, results).reward == 0.0
    assert score_exact({k: v for k, v in r2e.items() if k != "test_ok"}, results).reward == 0.0
    less = score_exact({**r2e, "test_new": "PASSED"}, results)
    assert (less.reward, less.missing, less.flags) == (0.0, ["test_new"], ["tests_missing"])
    # skipped and xfailed tests are not in R2E-Gym's map, so they are not in ours
    assert score_exact(r2e, [*results, Result(test_id="r2e_tests/test_1.py::test_z", status=Status.SKIPPED)]
                       ).reward == 1.0
