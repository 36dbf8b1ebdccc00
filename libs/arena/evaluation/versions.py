"""The versions of a job's grading (docs/evaluation.md, Re-grading). Version 1 is the verdicts the
job's rollouts got as they ran (``attempts.jsonl``; report ``report.*``). Each ``arena eval regrade``
adds one: every graded attempt verified again by another verifier, its verdicts in
``grades.vN.jsonl`` (the attempt log's ``finished`` records, re-graded) and its report in
``report.vN.*``; ``versions.json`` lists them. Nothing of an earlier version is ever rewritten.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from arena.evaluation.records import AttemptFinished, AttemptKey, final_results, read_log
from arena_core.errors import InvalidRequest

VERSIONS_FILE = "versions.json"


class GradingVersion(msgspec.Struct, frozen=True, kw_only=True):
    """One grading of the job. ``verifier``: the name its results are stored under in the
    trajectory plane (version 1: the tasks' own verifiers, ``original``); ``source``: what the
    user gave (``--verifier FILE`` or ``--task-dir DIR``); ``grades``: the re-graded verdicts' file."""

    version: int
    created_at: float
    verifier: str
    source: str
    grades: str | None = None  # None: version 1, the attempt log itself
    regraded: int = 0  # attempts verified again
    infrastructure: int = 0  # of those, the ones the new verifier could not grade (left out)


_ORIGINAL = GradingVersion(version=1, created_at=0.0, verifier="original", source="the tasks' own verifiers")


def read_versions(directory: Path) -> list[GradingVersion]:
    """Every version, oldest first; version 1 always."""
    path = directory / VERSIONS_FILE
    if not path.is_file():
        return [_ORIGINAL]
    return msgspec.json.decode(path.read_bytes(), type=list[GradingVersion])


def grades_file(version: int) -> str:
    return f"grades.v{version}.jsonl"


def report_stem(version: int) -> str:
    """``report`` for version 1 (the first report, kept as it was), ``report.vN`` after."""
    return "report" if version == 1 else f"report.v{version}"


def add_version(directory: Path, version: GradingVersion, grades: list[AttemptFinished]) -> None:
    """Write the version's grades, then list it (each file replaced whole: a kill leaves the
    version either listed with its grades or not listed)."""
    versions = read_versions(directory)
    if version.version != versions[-1].version + 1:
        raise InvalidRequest(f"version {version.version} follows {versions[-1].version}: another regrade ran")
    encoder = msgspec.json.Encoder()
    _replace(directory / grades_file(version.version), b"".join(encoder.encode(g) + b"\n" for g in grades))
    if versions[0].created_at == 0.0:
        versions[0] = msgspec.structs.replace(versions[0], created_at=(directory / "job.json").stat().st_mtime)
    _replace(directory / VERSIONS_FILE, msgspec.json.format(encoder.encode([*versions, version]), indent=2) + b"\n")


def _replace(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def graded(directory: Path, version: int) -> tuple[dict[AttemptKey, AttemptFinished], list[AttemptFinished]]:
    """The job as version ``version`` grades it: each attempt's result, and every try (for cost),
    a re-graded try in place of the one it re-grades."""
    versions = read_versions(directory)
    if not 1 <= version <= versions[-1].version:
        raise InvalidRequest(f"the job has grading versions 1 to {versions[-1].version}, not {version}")
    records = read_log(directory)
    final = final_results(records)
    tries = [r for r in records if isinstance(r, AttemptFinished)]
    if version == 1:
        return final, tries
    decoder = msgspec.json.Decoder(AttemptFinished)
    lines = (directory / grades_file(version)).read_bytes().splitlines()
    again = {g.rollout_id: g for g in (decoder.decode(line) for line in lines if line.strip())}
    final = {key: again.get(r.rollout_id, r) for key, r in final.items()}
    return final, [again.get(t.rollout_id, t) for t in tries]
