"""A diff of up to ``ARENA_MAX_DIFF_BYTES`` is read for the paths it touches without a list of
all its lines (that list was about twice the diff again), line boundaries exactly as before."""

from __future__ import annotations

import random
import tracemalloc

from arena_verification import patch

BREAKS = ["\n", "\r", "\r\n", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"]


def test_lines_are_the_lines_of_splitlines():
    rng = random.Random(7)
    pieces = ["a", "diff --git a/x b/x", "", " ", "é", "\t", *BREAKS]
    cases = ["", "a", "\n", "\n\n", "a\n", "a\r\n\rb", "\r\n\n", *BREAKS]
    cases += ["".join(rng.choice(pieces) for _ in range(rng.randrange(60))) for _ in range(2000)]
    for text in cases:
        assert list(patch.lines(text)) == text.splitlines(), repr(text)


def test_the_paths_of_an_8_mib_diff_take_no_copy_of_it():
    body = "".join(f"+line {i} of a large generated file, {'x' * 40}\n" for i in range(120_000))
    diff = (f"diff --git a/big.txt b/big.txt\nnew file mode 100644\n--- /dev/null\n+++ b/big.txt\n"
            f"@@ -0,0 +1,120000 @@\n{body}"
            "diff --git a/tests/test_x.py b/tests/test_x.py\n--- a/tests/test_x.py\n+++ b/tests/test_x.py\n"
            "@@ -1 +1 @@\n-old\n+new\n")
    assert len(diff) > 8 * 1024 * 1024
    tracemalloc.start()
    try:
        paths = patch.touched_paths(diff)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert paths == {"big.txt", "tests/test_x.py"}
    assert peak < 256 * 1024, peak  # a line at a time (splitlines: ~16 MiB)
