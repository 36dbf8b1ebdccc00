"""Fenced code blocks of README.md and docs/*.md, and the docs' quick starts run as written: the
machinery of tests/e2e/test_readme_runs_as_written.py, which runs both against one stack."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
#: The line before a docs block's fence that marks it as run (an HTML comment: not rendered).
MARK = "<!-- run"
#: The pages whose quick starts are run; each must keep at least one marked block.
QUICK_START_PAGES = ("tasks.md", "openenv.md", "verification.md", "deploy.md")


def code_blocks(text: str) -> list[tuple[str, str, int]]:
    """(language, body, line number of the opening fence) of each fenced block."""
    out, lang, body, start = [], None, [], 0
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            if lang is None:
                lang, body, start = line[3:].strip(), [], number
            else:
                out.append((lang, "\n".join(body), start))
                lang = None
        elif lang is not None:
            body.append(line)
    return out


def marked_blocks(path: Path) -> list[tuple[str, int]]:
    """(body, line of the opening fence) of each block of ``path`` marked ``<!-- run ... -->``; a
    marked block must be a shell block (``sh``)."""
    lines = path.read_text().splitlines()
    out = []
    for lang, body, start in code_blocks("\n".join(lines)):
        if start >= 2 and lines[start - 2].strip().startswith(MARK):
            assert lang == "sh", f"docs/{path.name} line {start}: a block marked to run is a ```sh block"
            out.append((body, start))
    return out


def run_docs_quick_starts(cwd: Path, env: dict[str, str], *, rollout_port: int, trajectory_port: int) -> list[str]:
    """Run every marked block of docs/*.md (file order) in ``cwd``, each as one bash script
    (``set -euo pipefail``: variables and here-documents span its lines), with the literal
    ``127.0.0.1:9090`` / ``:9092`` moved to the stack's ports; fail on a non-zero exit, a traceback
    or an empty output. What ran, with its time."""
    ran = []
    for page in sorted(DOCS.glob("*.md")):
        for body, line in marked_blocks(page):
            where = f"docs/{page.name} line {line}"
            script = body.replace("127.0.0.1:9090", f"127.0.0.1:{rollout_port}").replace(
                "127.0.0.1:9092", f"127.0.0.1:{trajectory_port}")
            started = time.monotonic()
            done = subprocess.run(["bash", "-c", "set -euo pipefail\n" + script], cwd=cwd, env=env,
                                  stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)
            said = done.stdout + done.stderr
            assert done.returncode == 0, f"{where} exited {done.returncode}:\n{script}\n---\n{said[-3000:]}"
            assert "Traceback" not in said, f"{where}:\n{said[-3000:]}"
            assert done.stdout.strip(), f"{where} printed nothing\n{done.stderr[-3000:]}"
            ran.append(f"{where} ({time.monotonic() - started:.1f} s)")
    return ran
