"""Install a scaffold into its own virtualenv for the local sandbox provider:
``python -m arena_core.scaffolds.install mini-swe-agent [--dir .arena/scaffolds]``.

The virtualenv is ``<dir>/<name>``, built on this interpreter's base Python (which the local
provider binds into every sandbox), from the scaffold module's ``REQUIREMENTS``; a finished
install is marked by a stamp naming them, so a second run is a no-op. A scaffold that needs
another Python (``PYTHON = "3.12"`` in its module) gets a copy of the host's ``python3.12``
installation inside its directory (the sandboxes see only that directory). See docs/agents.md.
"""

from __future__ import annotations

import argparse
import fcntl
import importlib
import os
import re
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
    # ARENA_<NAME>_VERSION (e.g. ARENA_OPENHANDS_VERSION=1.17.0) pins the scaffold's own package at
    # another version: deploy/images/releases.py builds the newest releases beside the pinned ones
    override = os.environ.get(f"ARENA_{name.upper().replace('-', '_')}_VERSION", "").strip()
    if override:
        if not re.fullmatch(r"[0-9A-Za-z.+!-]+", override):
            raise ValueError(f"scaffold {name!r}: version override {override!r} is not a version")
        first = re.split(r"[=<>!~\[ ]", reqs[0], maxsplit=1)[0]
        reqs = (f"{first}=={override}", *reqs[1:])
    return tuple(reqs)


def python_version(name: str) -> str:
    """The Python (``"3.12"``) the scaffold needs: its module's ``PYTHON``, else this one's."""
    module = importlib.import_module(f"arena_core.scaffolds.{SCAFFOLDS[name]}")
    return getattr(module, "PYTHON", "") or "%d.%d" % sys.version_info[:2]


def installed(name: str, base: Path) -> bool:
    stamp = Path(base) / name / STAMP
    return stamp.is_file() and stamp.read_text() == "\n".join(requirements(name))


def launchable(base: str | Path | None) -> list[str]:
    """The scaffold presets a sandbox whose scaffolds directory is ``base`` (``None``: none, so
    nothing installed) can launch: those installed there (``<base>/<name>/bin``, where the runner
    looks), and those with no pip requirements (they ship in the image or on the host's ``PATH``)."""
    out = []
    for name in SCAFFOLDS:
        try:
            requirements(name)
        except ValueError:
            out.append(name)  # nothing to install here
            continue
        except ImportError:
            continue
        if base is not None and (Path(base) / name / "bin").is_dir():
            out.append(name)
    return out


def host_python(version: str) -> str:
    """The base installation (``sys.base_prefix``) of a working ``python<version>`` on this host:
    on ``PATH`` (a pyenv shim of a version not selected fails, and is passed over), else pyenv's."""
    pyenv = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv") / "versions"
    candidates = [Path(d) / f"python{version}" for d in os.environ.get("PATH", "").split(os.pathsep) if d]
    candidates += sorted(pyenv.glob(f"{version}*/bin/python{version}"), reverse=True)
    for exe in candidates:
        if not os.access(exe, os.X_OK):
            continue
        probe = subprocess.run([str(exe), "-c", "import sys; print(sys.base_prefix)"], capture_output=True, text=True)
        if probe.returncode == 0:
            return probe.stdout.strip()
    raise ValueError(f"no working python{version} on PATH or in {pyenv} (the scaffold needs Python {version})")


def interpreter(version: str, target: Path) -> str:
    """A ``python<version>`` the sandboxes can run: this one's base (bound into them), one under
    ``/usr``, or else a copy of the host's installation in ``<target>/python``, whose executable
    finds its ``libpython`` beside it (its RUNPATH, an absolute path, made ``$ORIGIN/../lib``)."""
    if version == "%d.%d" % sys.version_info[:2]:
        return sys.executable
    prefix = host_python(version)
    exe = f"bin/python{version}"
    if prefix == "/usr" or prefix.startswith("/usr/"):
        return f"{prefix}/{exe}"
    copy = target / "python"
    shutil.copytree(prefix, copy, symlinks=True,
                    ignore=shutil.ignore_patterns("test", "idle_test", "site-packages"))
    (copy / f"lib/python{version}/site-packages").mkdir()
    binary = (copy / exe).read_bytes()
    old = f"{prefix}/lib".encode() + b"\0"
    if old in binary:  # same length, so no offset in the file moves
        (copy / exe).write_bytes(binary.replace(old, b"$ORIGIN/../lib".ljust(len(old), b"\0")))
    return str(copy / exe)


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
        target.mkdir()
        python = interpreter(python_version(name), target)
        if python == sys.executable:
            venv.EnvBuilder(with_pip=True, symlinks=True).create(target)
        else:
            subprocess.run([python, "-m", "venv", "--symlinks", str(target)], check=True)
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
