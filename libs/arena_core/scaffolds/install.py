"""Install a scaffold into its own virtualenv for the local sandbox provider:
``python -m arena_core.scaffolds.install mini-swe-agent [--dir .arena/scaffolds]``.

The virtualenv is ``<dir>/<name>``, built on this interpreter's base Python (which the local
provider binds into every sandbox), from the scaffold module's ``REQUIREMENTS``; a finished
install is marked by a stamp naming them, so a second run is a no-op. See docs/agents.md.
"""

from __future__ import annotations

import argparse
import fcntl
import importlib
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

from arena_core.scaffolds import SCAFFOLDS

STAMP = ".arena-installed"


def requirements(name: str) -> tuple[str, ...]:
    if name not in SCAFFOLDS:
        raise ValueError(f"unknown scaffold {name!r} (known: {', '.join(SCAFFOLDS)})")
    module = importlib.import_module(f"arena_core.scaffolds.{SCAFFOLDS[name]}")
    reqs = getattr(module, "REQUIREMENTS", ())
    if not reqs:
        raise ValueError(f"scaffold {name!r} has no pip requirements to install (it ships in its image)")
    return tuple(reqs)


def installed(name: str, base: Path) -> bool:
    stamp = Path(base) / name / STAMP
    return stamp.is_file() and stamp.read_text() == "\n".join(requirements(name))


def ensure(name: str, base: str | Path, *, quiet: bool = True) -> Path:
    """``<base>/<name>``, a virtualenv with the scaffold installed (built now if missing)."""
    base = Path(base).resolve()
    base.mkdir(parents=True, exist_ok=True)
    target = base / name
    with open(base / f".{name}.lock", "w") as lock:  # one builder at a time
        fcntl.flock(lock, fcntl.LOCK_EX)
        if installed(name, base):
            return target
        shutil.rmtree(target, ignore_errors=True)  # a half-built one
        venv.EnvBuilder(with_pip=True, symlinks=True).create(target)
        pip = [str(target / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check",
               *(["--quiet"] if quiet else []), *requirements(name)]
        subprocess.run(pip, check=True, env={**os.environ, "PIP_NO_INPUT": "1"})
        (target / STAMP).write_text("\n".join(requirements(name)))
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m arena_core.scaffolds.install", description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="+", metavar="SCAFFOLD")
    parser.add_argument("--dir", default=os.environ.get("ARENA_SCAFFOLDS_DIR") or ".arena/scaffolds",
                        help="where the virtualenvs go (default: $ARENA_SCAFFOLDS_DIR or .arena/scaffolds)")
    args = parser.parse_args(argv)
    for name in args.names:
        try:
            print(f"{name}: {ensure(name, args.dir, quiet=False)}")
        except (ValueError, subprocess.CalledProcessError) as exc:
            sys.exit(f"{name}: {exc}")


if __name__ == "__main__":
    main()
