#!/usr/bin/env python3
"""Rebuild the swebench-mini dataset: ``dataset.jsonl`` and ``repos/*.bundle``.

What it downloads
    Five source distributions from PyPI, nothing else (``pip download --no-binary :all:
    --no-deps NAME==VERSION``; their SHA-256 are pinned below and checked):
    inflection 0.5.1, toolz 1.2.0, parse 1.22.4, tabulate 0.10.0, six 1.17.0.

What it does, per instance
    1. unpacks the sdist, drops what the tests do not need (docs, egg-info, benchmarks, CI
       files) and commits the rest as ``upstream <version>`` (commit 1);
    2. applies a hand-made bug (literal text replacements below) and commits it: that is
       ``base_commit`` (= ``environment_setup_commit``);
    3. ``patch`` = the gold fix (the bug's edits reversed; source files only) and
       ``test_patch`` = the hidden tests (test files only), both ``git diff`` against base;
    4. writes ``repos/<owner>__<name>.bundle`` (``git bundle create --all``: the two
       commits only -- neither the fix nor the hidden tests are in the bundle);
    5. checks it in a fresh clone of the bundle: base + test_patch (= the empty agent
       patch) and base + test_patch + patch are each run with ``python -m pytest -rA``;
       FAIL_TO_PASS = the tests failing in the first run and passing in the second (they
       must all be new tests, absent at base), PASS_TO_PASS = up to 20 existing tests,
       spread over the test file, that pass in both runs. Every run must stay under 5 s.

Git history is deterministic (fixed author, committer, dates, no user config), so the
commit ids in dataset.jsonl are the same on every run.

How to re-run (Python 3.11, a venv holding only pytest, network to PyPI for the sdists)::

    python3.11 -m venv /tmp/swb-venv && /tmp/swb-venv/bin/pip install pytest
    /tmp/swb-venv/bin/python examples/swebench-mini/build.py

Options: ``--python`` the interpreter that runs the tests (default: the one running this
script; it must have pytest and must NOT have the five libraries installed), ``--sdists``
a directory for the downloaded sdists (default /tmp/swebench-mini-sdists; reused when the
hashes match), ``--keep`` keeps the scratch directory.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TEST_TIME_LIMIT_S = 5.0
MAX_P2P = 20
IDENT = {"name": "Arena Dataset", "email": "swebench-mini@arena.invalid"}
PYTEST_BASE = ["-m", "pytest", "-rA", "-p", "no:cacheprovider"]

# ---------------------------------------------------------------------------------------
# The instances. ``bug``: (path, correct text, buggy text) -- each correct text must occur
# exactly once; the gold patch puts the correct text back. ``tests``: (path, old, new) --
# the (unique) ``old`` text is replaced by ``new``, or ``new`` is appended when old is None.
# ---------------------------------------------------------------------------------------

INFLECTION_TESTS = '''

@pytest.mark.parametrize(
    ("underscore", "human"),
    [
        ("employee_id", "Employee"),
        ("user_identity", "User identity"),
        ("valid_id_card", "Valid id card"),
        ("grid_idx", "Grid idx"),
        ("caf\u00e9_id", "Caf\u00e9"),
        ("stra\u00dfe_identifier", "Stra\u00dfe identifier"),
    ],
)
def test_humanize_strips_only_a_trailing_id(underscore, human):
    assert human == inflection.humanize(underscore)


def test_titleize_keeps_id_inside_words():
    assert inflection.titleize("product_identifier") == "Product Identifier"
    assert inflection.titleize("ValidIdCard") == "Valid Id Card"
'''

TOOLZ_TESTS = '''

@pytest.mark.parametrize("n", [2, 3, 4, 5])
@pytest.mark.parametrize("length", [1, 5, 6, 7, 10])
def test_partition_all_iterator_matches_sequence(length, n):
    expected = [tuple(range(i, min(i + n, length)))
                for i in range(0, length, n)]
    assert list(partition_all(n, list(range(length)))) == expected
    assert list(partition_all(n, iter(range(length)))) == expected


def test_partition_all_generator_keeps_last_items():
    gen = (c for c in "abcde")
    assert list(partition_all(2, gen)) == [("a", "b"), ("c", "d"), ("e",)]
    gen = (c for c in "abcdef")
    assert list(partition_all(4, gen)) == [("a", "b", "c", "d"), ("e", "f")]
'''

PARSE_TESTS = '''


@pytest.mark.parametrize(
    ("fmt", "string", "pos", "endpos", "expected"),
    [
        ("<{}>", "<a> <b> <c>", 0, 7, ["a", "b"]),
        ("<{}>", "<a> <b> <c>", 2, 9, ["b"]),
        ("<{}>", "<a> <b> <c>", 4, None, ["b", "c"]),
        ('"{}"', 'say "hi" and "bye"', 0, 10, ["hi"]),
        ("\\u00ab{}\\u00bb", "\\u00ab\\u00e9t\\u00e9\\u00bb \\u00abhiver\\u00bb", 0, 6, ["\\u00e9t\\u00e9"]),
    ],
)
def test_findall_pos_and_endpos(fmt, string, pos, endpos, expected):
    found = [r.fixed[0] for r in parse.findall(fmt, string, pos, endpos)]
    assert found == expected


def test_findall_endpos_keyword_matches_slice():
    string = "1 22 333 4444"
    found = [r.fixed[0] for r in parse.findall("{:d}", string, endpos=4)]
    assert found == [r.fixed[0] for r in parse.findall("{:d}", string[:4])]
    assert found == [1, 22]


def test_compiled_findall_endpos():
    p = parse.compile("{:d}")
    assert [r.fixed[0] for r in p.findall("1 22 333", endpos=4)] == [1, 22]
'''

TABULATE_TESTS = '''

INTFMT_PER_COLUMN_EXPECTED = {
    "plain": "\\n".join(
        [
            "fruit      sold    revenue",
            "apples   12,000    3500000",
            "kiwis         7      41000",
        ]
    ),
    "simple": "\\n".join(
        [
            "fruit      sold    revenue",
            "-------  ------  ---------",
            "apples   12,000    3500000",
            "kiwis         7      41000",
        ]
    ),
    "grid": "\\n".join(
        [
            "+---------+--------+-----------+",
            "| fruit   |   sold |   revenue |",
            "+=========+========+===========+",
            "| apples  | 12,000 |   3500000 |",
            "+---------+--------+-----------+",
            "| kiwis   |      7 |     41000 |",
            "+---------+--------+-----------+",
        ]
    ),
    "pipe": "\\n".join(
        [
            "| fruit   |   sold |   revenue |",
            "|:--------|-------:|----------:|",
            "| apples  | 12,000 |   3500000 |",
            "| kiwis   |      7 |     41000 |",
        ]
    ),
}


@mark.parametrize("tablefmt", ["plain", "simple", "grid", "pipe"])
def test_intfmt_list_shorter_than_row(tablefmt):
    "Output: a per-column intfmt shorter than the rows keeps every column"
    table = [["apples", 12000, 3500000], ["kiwis", 7, 41000]]
    result = tabulate(
        table,
        headers=["fruit", "sold", "revenue"],
        intfmt=["", ","],
        tablefmt=tablefmt,
    )
    assert_equal(INTFMT_PER_COLUMN_EXPECTED[tablefmt], result)


def test_intfmt_tuple_applies_to_leading_columns():
    "Output: intfmt tuple covering only the first column"
    result = tabulate([[10000, 20000, "x"], [10, 2000000, "y"]], intfmt=(",",), tablefmt="plain")
    expected = "10,000    20000  x\\n    10  2000000  y"
    assert_equal(expected, result)
'''

SIX_TESTS = '''


@pytest.mark.parametrize(
    ("raw", "errors", "expected"),
    [
        (b"caf\\xe9 au lait", "replace", u"caf\\ufffd au lait"),
        (b"na\\xefve 'quoted'", "ignore", u"nave 'quoted'"),
        (b"\\xff\\xfe", "backslashreplace", u"\\\\xff\\\\xfe"),
        (b"plain ascii", "strict", u"plain ascii"),
    ],
)
def test_ensure_str_honours_errors(raw, errors, expected):
    assert six.ensure_str(raw, encoding="utf-8", errors=errors) == expected


def test_ensure_str_and_ensure_text_agree_on_errors():
    raw = b"\\xc3\\xa9t\\xe9"
    assert six.ensure_str(raw, errors="replace") == six.ensure_text(raw, errors="replace")
    with pytest.raises(UnicodeDecodeError):
        six.ensure_str(raw)
'''

TABULATE_ANCHOR = (
    '    result = tabulate([[82642], ["1500"], [2463]], intfmt=",", tablefmt="plain")\n'
    '    expected = "82,642\\n  1500\\n 2,463"\n'
    "    assert_equal(expected, result)\n"
)

INSTANCES = [
    {
        "instance_id": "jpvanhal__inflection-1",
        "repo": "jpvanhal/inflection",
        "dist": "inflection",
        "version": "0.5.1",
        "sdist": "inflection-0.5.1.tar.gz",
        "drop": ["docs"],
        "dates": ("2020-08-22T20:08:00+00:00", "2024-03-04T09:12:00+00:00"),
        "base_message": "Tidy up humanize()",
        "created_at": "2024-03-11T14:27:53Z",
        "bug": [
            ("inflection/__init__.py",
             '    word = re.sub(r"_id$", "", word)\n',
             '    word = re.sub(r"_id", "", word)\n'),
        ],
        "test_files": ["test_inflection.py"],
        "pytest_args": [],
        "tests": [("test_inflection.py", None, INFLECTION_TESTS)],
        "problem_statement": """\
humanize() eats "_id" in the middle of words

I use `inflection.humanize` to build form labels from column names. Since upgrading, column
names that merely *contain* `_id` come out mangled:

```python
>>> import inflection
>>> inflection.humanize("user_identity")
'Userentity'
>>> inflection.humanize("valid_id_card")
'Valid card'
>>> inflection.humanize("author_id")      # this one is fine
'Author'
```

The docstring says humanize strips a *trailing* `"_id"` (the Rails foreign-key convention),
so I would expect `'User identity'` and `'Valid id card'`. `titleize()` goes through
`humanize()` and shows the same problem: `titleize("product_identifier")` gives
`'Productentifier'`.

Python 3.11, inflection 0.5.1.
""",
    },
    {
        "instance_id": "pytoolz__toolz-1",
        "repo": "pytoolz/toolz",
        "dist": "toolz",
        "version": "1.2.0",
        "sdist": "toolz-1.2.0.tar.gz",
        "drop": [],
        "dates": ("2025-09-01T10:00:00+00:00", "2025-10-06T16:40:00+00:00"),
        "base_message": "itertoolz: simplify the no_pad search in partition_all",
        "created_at": "2025-10-14T08:03:12Z",
        "bug": [
            ("toolz/itertoolz.py",
             "                if prev[mid] is no_pad:\n                    hi = mid\n",
             "                if prev[mid] is no_pad:\n                    hi = mid - 1\n"),
        ],
        "test_files": ["toolz/tests/test_itertoolz.py"],
        "pytest_args": [],
        "tests": [
            ("toolz/tests/test_itertoolz.py", "import itertools\n",
             "import itertools\nimport pytest\n"),
            ("toolz/tests/test_itertoolz.py",
             "    assert raises(LookupError, lambda: list(partition_all(5, too_short_list)))\n",
             "    assert raises(LookupError, lambda: list(partition_all(5, too_short_list)))\n"
             + TOOLZ_TESTS),
        ],
        "problem_statement": """\
partition_all loses elements when given an iterator

`partition_all` gives different results for a list and for an iterator over the same
items. With a list everything is fine, but with a generator or `iter(...)` the last,
partial chunk is truncated or comes back empty:

```python
>>> from toolz import partition_all
>>> list(partition_all(2, [1, 2, 3]))
[(1, 2), (3,)]
>>> list(partition_all(2, iter([1, 2, 3])))
[(1, 2), ()]
>>> list(partition_all(4, iter(range(6))))
[(0, 1, 2, 3), (4,)]
```

The last one should be `[(0, 1, 2, 3), (4, 5)]`: element 5 silently disappears. Not every
length is affected (e.g. `partition_all(4, iter(range(7)))` is right), which made this
hard to track down in a streaming pipeline that reads records in batches from a file.

toolz 1.2.0, Python 3.11.
""",
    },
    {
        "instance_id": "r1chardj0n3s__parse-1",
        "repo": "r1chardj0n3s/parse",
        "dist": "parse",
        "version": "1.22.4",
        "sdist": "parse-1.22.4.tar.gz",
        "drop": [],
        "dates": ("2025-01-15T12:00:00+00:00", "2025-02-03T18:20:00+00:00"),
        "base_message": "Pass findall() options through to the parser",
        "created_at": "2025-02-10T11:45:30Z",
        "bug": [
            ("parse/__init__.py",
             "    return p.findall(string, pos, endpos, evaluate_result=evaluate_result)\n",
             "    return p.findall(string, pos, evaluate_result=evaluate_result)\n"),
        ],
        "test_files": ["tests/test_findall.py", "tests/test_search.py", "tests/test_result.py"],
        # pyproject.toml's addopts asks for pytest-cov (--cov ...): switched off here.
        "pytest_args": ["-o", "addopts="],
        "tests": [
            ("tests/test_findall.py", "import parse\n", "import pytest\n\nimport parse\n"),
            ("tests/test_findall.py", None, PARSE_TESTS),
        ],
        "problem_statement": """\
parse.findall() ignores endpos

The docs for `findall` say: *Optionally start the search at "pos" character index and limit
the search to a maximum index of endpos - equivalent to search(string[:endpos]).*
`pos` works, but `endpos` has no effect with the module-level function:

```python
>>> import parse
>>> [r[0] for r in parse.findall("{:d}", "1 22 333 4444", endpos=4)]
[1, 22, 333, 4444]
>>> [r[0] for r in parse.findall("{:d}", "1 22 333 4444"[:4])]
[1, 22]
```

`parse.search(..., endpos=4)` does respect it, so `findall` is the odd one out. I rely on
this to scan only the header part of a large log buffer without copying it.

parse 1.22.4, Python 3.11.
""",
    },
    {
        "instance_id": "astanin__python-tabulate-1",
        "repo": "astanin/python-tabulate",
        "dist": "tabulate",
        "version": "0.10.0",
        "sdist": "tabulate-0.10.0.tar.gz",
        "drop": ["benchmark", ".github", ".pre-commit-config.yaml", "HOWTOPUBLISH"],
        "dates": ("2025-05-20T08:00:00+00:00", "2025-06-09T13:05:00+00:00"),
        "base_message": "Per-column format lists: share the set-up code",
        "created_at": "2025-06-17T07:58:41Z",
        "bug": [
            ("tabulate/__init__.py",
             "        int_formats = list(intfmt)\n"
             "        if len(int_formats) < len(cols):\n"
             "            int_formats.extend((len(cols) - len(int_formats)) * [_DEFAULT_INTFMT])\n",
             "        int_formats = list(intfmt)\n"),
        ],
        "test_files": ["test/test_output.py"],
        "pytest_args": [],
        "tests": [
            ("test/test_output.py", TABULATE_ANCHOR, TABULATE_ANCHOR + TABULATE_TESTS),
        ],
        "problem_statement": """\
Columns disappear when intfmt is a list shorter than the table

`floatfmt`, `intfmt` and `missingval` accept one value per column. With `floatfmt` and
`missingval` a list that is shorter than the number of columns is padded with the defaults,
but with `intfmt` the extra columns are silently dropped from the output:

```python
>>> from tabulate import tabulate
>>> print(tabulate([["apples", 12000, 3500000]], headers=["fruit", "sold", "revenue"],
...                intfmt=["", ","]))
fruit      sold
-------  ------
apples   12,000
```

I expected the `revenue` column to be printed with the default integer format. No error or
warning is raised, so this went unnoticed in a report for a while. Passing a full list
(`["", ",", ""]`) works around it.

tabulate 0.10.0, Python 3.11.
""",
    },
    {
        "instance_id": "benjaminp__six-1",
        "repo": "benjaminp/six",
        "dist": "six",
        "version": "1.17.0",
        "sdist": "six-1.17.0.tar.gz",
        "drop": ["documentation"],
        "dates": ("2024-12-04T17:00:00+00:00", "2025-01-20T10:30:00+00:00"),
        "base_message": "ensure_str: streamline the Python 3 branch",
        "created_at": "2025-01-28T16:12:09Z",
        "bug": [
            ("six.py",
             "    elif PY3 and isinstance(s, binary_type):\n        return s.decode(encoding, errors)\n",
             "    elif PY3 and isinstance(s, binary_type):\n        return s.decode(encoding)\n"),
        ],
        "test_files": ["test_six.py"],
        "pytest_args": [],
        "tests": [("test_six.py", None, SIX_TESTS)],
        "problem_statement": """\
six.ensure_str() ignores the errors argument on Python 3

`six.ensure_str(b, encoding, errors)` is documented to decode bytes on Python 3, and it
takes an `errors` argument, but the argument does not seem to be used for bytes input:

```python
>>> import six
>>> six.ensure_text(b"caf\\xe9", errors="replace")
'caf\ufffd'
>>> six.ensure_str(b"caf\\xe9", errors="replace")
Traceback (most recent call last):
  ...
UnicodeDecodeError: 'utf-8' codec can't decode byte 0xe9 in position 3: unexpected end of data
```

We decode latin-1-ish HTTP headers with `errors="replace"` / `"ignore"` and this blows up
in production. `ensure_text` with the same arguments behaves as expected, so I'd expect
`ensure_str` to agree with it on Python 3.

six 1.17.0, Python 3.11.
""",
    },
]

#: sdist SHA-256, checked after download (the pip index used when this was built).
SDIST_SHA256 = {
    "inflection-0.5.1.tar.gz": "1a29730d366e996aaacffb2f1f1cb9593dc38e2ddd30c91250c6dde09ea9b417",
    "toolz-1.2.0.tar.gz": "9667a038e9d6ecba37995e26cb2f59ec6420b6ad8dd9677de59db9b956b08490",
    "parse-1.22.4.tar.gz": "706d458feed5a81b02768d3156e8070baf6cee7d150a3a3c0cd43101a875c3b5",
    "tabulate-0.10.0.tar.gz": "e2cfde8f79420f6deeffdeda9aaec3b6bc5abce947655d17ac662b126e48a60d",
    "six-1.17.0.tar.gz": "ff70335d468e7eb6ec65b95b99d3a2836546063f63acc5171de367e834932a81",
}


# ---------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------

def git_env(date: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update({
        "GIT_AUTHOR_NAME": IDENT["name"], "GIT_AUTHOR_EMAIL": IDENT["email"],
        "GIT_COMMITTER_NAME": IDENT["name"], "GIT_COMMITTER_EMAIL": IDENT["email"],
        "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1",
        "LC_ALL": "C", "TZ": "UTC",
    })
    if date:
        env["GIT_AUTHOR_DATE"] = date
        env["GIT_COMMITTER_DATE"] = date
    return env


def git(cwd: Path, *args: str, date: str | None = None, input: str | None = None) -> str:
    cmd = ["git", "-c", "core.autocrlf=false", "-c", "commit.gpgsign=false",
           "-c", "init.defaultBranch=main", "-c", "advice.detachedHead=false", *args]
    res = subprocess.run(cmd, cwd=cwd, env=git_env(date), input=input, text=True,
                         capture_output=True)
    if res.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed in {cwd}:\n{res.stdout}{res.stderr}")
    return res.stdout


def git_diff(cwd: Path) -> str:
    return git(cwd, "diff", "--no-color", "--no-ext-diff", "--src-prefix=a/", "--dst-prefix=b/",
               "HEAD")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def fetch_sdist(inst: dict, sdists: Path, python: str) -> Path:
    path = sdists / inst["sdist"]
    if not path.exists():
        sdists.mkdir(parents=True, exist_ok=True)
        subprocess.run([python, "-m", "pip", "download", "--quiet", "--no-binary", ":all:",
                        "--no-deps", "--dest", str(sdists), f"{inst['dist']}=={inst['version']}"],
                       check=True)
    want = SDIST_SHA256[inst["sdist"]]
    got = sha256(path)
    if got != want:
        raise SystemExit(f"{path}: sha256 {got}, expected {want}")
    return path


def unpack(sdist: Path, dest: Path, drop: list[str]) -> None:
    with tarfile.open(sdist) as tar:
        tar.extractall(dest.parent / "unpack", filter="data")
    (top,) = list((dest.parent / "unpack").iterdir())
    shutil.move(str(top), dest)
    shutil.rmtree(dest.parent / "unpack")
    for pattern in ["*.egg-info", "**/__pycache__", "**/*.pyc"] + drop:
        for p in sorted(dest.glob(pattern), reverse=True):
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()


def replace_once(path: Path, old: str, new: str) -> None:
    text = path.read_text(encoding="utf-8")
    if text.count(old) != 1:
        raise SystemExit(f"{path}: expected exactly one occurrence of {old!r}, found {text.count(old)}")
    path.write_text(text.replace(old, new), encoding="utf-8")


def add_tests(root: Path, tests: list) -> None:
    for rel, old, new in tests:
        path = root / rel
        if old is None:
            with path.open("a", encoding="utf-8") as fh:
                fh.write(new)
        else:
            replace_once(path, old, new)


def diff_paths(diff: str) -> list[str]:
    return re.findall(r"^diff --git a/(\S+) b/", diff, flags=re.M)


SUMMARY_RE = re.compile(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS) (.+)$")


def run_pytest(root: Path, python: str, inst: dict) -> tuple[dict[str, str], float, str]:
    """Run the instance's test command; return {test id: status}, seconds, the output."""
    cmd = [python, *PYTEST_BASE, *inst["pytest_args"], *inst["test_files"]]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PYTEST"))}
    env.update({"PYTHONDONTWRITEBYTECODE": "1", "NO_COLOR": "1", "COLUMNS": "120"})
    t0 = time.monotonic()
    res = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    took = time.monotonic() - t0
    out = res.stdout + res.stderr
    ids = collect(root, python, inst)
    statuses: dict[str, str] = {}
    in_summary = False
    for line in out.splitlines():
        if "short test summary info" in line:
            in_summary = True
            continue
        if not in_summary:
            continue
        m = SUMMARY_RE.match(line)
        if not m:
            continue
        status, rest = m.groups()
        if rest in ids:
            statuses[rest] = status
            continue
        hits = [i for i in ids if rest.startswith(i + " - ")]
        if len(hits) != 1:
            raise SystemExit(f"cannot tell the test id in {line!r}")
        statuses[hits[0]] = status
    missing = set(ids) - set(statuses)
    skipped_ok = re.search(r"(\d+) skipped", out)
    if missing and not skipped_ok:
        raise SystemExit(f"{inst['instance_id']}: no result for {sorted(missing)[:5]}\n{out[-3000:]}")
    return statuses, took, out


def collect(root: Path, python: str, inst: dict) -> list[str]:
    cmd = [python, *PYTEST_BASE, *inst["pytest_args"], "--collect-only", "-q", *inst["test_files"]]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PYTEST"))}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    res = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    ids = [line for line in res.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if not ids:
        raise SystemExit(f"nothing collected in {root}:\n{res.stdout}{res.stderr}")
    return ids


def spread(items: list[str], k: int) -> list[str]:
    if len(items) <= k:
        return list(items)
    picked = [items[round(i * (len(items) - 1) / (k - 1))] for i in range(k)]
    return list(dict.fromkeys(picked))


# ---------------------------------------------------------------------------------------
# build one instance
# ---------------------------------------------------------------------------------------

def build(inst: dict, sdist: Path, work: Path, python: str) -> dict:
    iid = inst["instance_id"]
    repo_dir = work / iid / "repo"
    repo_dir.parent.mkdir(parents=True)
    unpack(sdist, repo_dir, inst["drop"])
    upstream_date, base_date = inst["dates"]

    git(repo_dir, "init", "-q", "-b", "main")
    git(repo_dir, "add", "-A", "-f")
    git(repo_dir, "commit", "-q", "-m", f"upstream {inst['version']}", date=upstream_date)
    for rel, good, bad in inst["bug"]:
        replace_once(repo_dir / rel, good, bad)
    git(repo_dir, "add", "-A")
    git(repo_dir, "commit", "-q", "-m", inst["base_message"], date=base_date)
    base = git(repo_dir, "rev-parse", "HEAD").strip()

    # gold patch: the correct text back
    for rel, good, bad in inst["bug"]:
        replace_once(repo_dir / rel, bad, good)
    patch = git_diff(repo_dir)
    git(repo_dir, "checkout", "-q", "--", ".")
    # hidden tests
    add_tests(repo_dir, inst["tests"])
    test_patch = git_diff(repo_dir)
    git(repo_dir, "checkout", "-q", "--", ".")

    test_files = set(inst["test_files"])
    assert patch and set(diff_paths(patch)).isdisjoint(test_files), iid
    assert not any("test" in p.split("/")[-1] for p in diff_paths(patch)), iid
    assert test_patch and set(diff_paths(test_patch)) <= test_files, iid

    owner_name = inst["repo"].replace("/", "__")
    bundle = HERE / "repos" / f"{owner_name}.bundle"
    bundle.parent.mkdir(exist_ok=True)
    if bundle.exists():
        bundle.unlink()
    git(repo_dir, "-c", "pack.threads=1", "bundle", "create", "-q", str(bundle), "--all")

    # ---- check in a fresh clone of the bundle
    check = work / iid / "check"
    git(work, "clone", "-q", str(bundle), str(check))
    git(check, "checkout", "-q", base)
    at_base = set(collect(check, python, inst))
    (work / iid / "test.patch").write_text(test_patch)
    (work / iid / "gold.patch").write_text(patch)
    git(check, "apply", str(work / iid / "test.patch"))
    before, t1, out1 = run_pytest(check, python, inst)     # = base + test_patch + empty patch
    git(check, "apply", str(work / iid / "gold.patch"))
    after, t2, out2 = run_pytest(check, python, inst)

    f2p = [t for t, s in before.items() if s != "PASSED" and after.get(t) == "PASSED"]
    still_bad = [t for t, s in after.items() if s not in ("PASSED", "XFAIL")]
    if still_bad:
        raise SystemExit(f"{iid}: failing with the gold patch: {still_bad}\n{out2[-3000:]}")
    if not f2p:
        raise SystemExit(f"{iid}: no FAIL_TO_PASS test\n{out1[-3000:]}")
    leaked = [t for t in f2p if t in at_base]
    if leaked:
        raise SystemExit(f"{iid}: FAIL_TO_PASS tests already exist at base: {leaked}")
    broken = [t for t, s in before.items() if s != "PASSED" and t in at_base]
    if broken:
        raise SystemExit(f"{iid}: existing tests fail at base: {broken}")
    for took in (t1, t2):
        if took > TEST_TIME_LIMIT_S:
            raise SystemExit(f"{iid}: the test run took {took:.1f} s")
    p2p_pool = [t for t, s in before.items()
                if t in at_base and s == "PASSED" and after.get(t) == "PASSED"]
    p2p = spread(p2p_pool, MAX_P2P)

    print(f"{iid}: base {base[:12]}  F2P {len(f2p)}  P2P {len(p2p)}  "
          f"runs {t1:.2f}s / {t2:.2f}s  bundle {bundle.stat().st_size} B")
    return {
        "instance_id": iid,
        "repo": inst["repo"],
        "base_commit": base,
        "patch": patch,
        "test_patch": test_patch,
        "FAIL_TO_PASS": json.dumps(f2p, ensure_ascii=False),
        "PASS_TO_PASS": json.dumps(p2p, ensure_ascii=False),
        "version": inst["version"],
        "environment_setup_commit": base,
        "created_at": inst["created_at"],
        "problem_statement": inst["problem_statement"],
        "hints_text": "",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--sdists", default="/tmp/swebench-mini-sdists", type=Path)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()

    probe = subprocess.run([args.python, "-c", "import pytest, sys; print(pytest.__version__)"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        raise SystemExit(f"{args.python} has no pytest")
    for inst in INSTANCES:
        clash = subprocess.run([args.python, "-c", f"import {inst['dist']}"], cwd="/",
                               capture_output=True)
        if clash.returncode == 0:
            raise SystemExit(f"{args.python} has {inst['dist']} installed: use a venv with pytest only")

    work = Path(tempfile.mkdtemp(prefix="swebench-mini-"))
    rows = []
    try:
        for inst in INSTANCES:
            sdist = fetch_sdist(inst, args.sdists, args.python)
            rows.append(build(inst, sdist, work, args.python))
    finally:
        if args.keep:
            print(f"scratch kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    with (HERE / "dataset.jsonl").open("w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"wrote {len(rows)} instances to {HERE / 'dataset.jsonl'} (pytest {probe.stdout.strip()})")


if __name__ == "__main__":
    main()
