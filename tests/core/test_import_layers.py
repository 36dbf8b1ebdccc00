"""The package layers hold: import-linter's contracts (pyproject.toml), the client installs
without the server's or the trainer's dependencies, and no module imports a library's private names."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OURS = {"arena", "arena_core", "arena_rl", "arena_stack", "arena_sandbox_providers", "arena_rollout",
        "arena_sandbox", "arena_verification", "arena_trajectory", "tests"}


def test_import_linter_contracts_are_kept():
    lint = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run([str(lint), "--config", str(ROOT / "pyproject.toml")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


def test_the_client_loads_without_server_or_trainer_dependencies():
    probe = ("import sys, arena.sdk, arena.cli, arena.stream, arena.export_io, arena.export, arena.datasets;"
             "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'chdb', 'docker', 'fastapi',"
             " 'uvicorn', 'clickhouse_connect', 'arena_rollout', 'arena_sandbox', 'arena_verification',"
             " 'arena_trajectory', 'arena_rl'}); print(','.join(heavy))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""


#: Private names a module may import, and why. The proxy relay starts once per command in a
#: sandbox (docker; local without CAP_SYS_ADMIN), stdlib only: CPython's C modules behind
#: ``socket``/``threading``/``signal`` start in ~1 ms where those cost ~10 (docs/sandbox.md, Performance).
ALLOWED = {"libs/arena_sandbox_providers/shim.py": {"_socket", "_thread", "_signal"},
           # the docker sandbox's init: every cold sandbox waits for its start
           "libs/arena_sandbox_providers/cmdserver.py": {"_socket", "_signal"}}


def private_imports(path: Path) -> list[str]:
    found = []
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules = [(node.module, a.name) for a in node.names]
        else:
            continue
        for module, name in modules:
            if module.split(".")[0] in OURS or module == "__future__":
                continue
            if module in ALLOWED.get(str(path.relative_to(ROOT)), ()):
                continue
            parts = module.split(".") + ([name] if name else [])
            if any(p.startswith("_") and not p.startswith("__") for p in parts):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {module}{'.' + name if name else ''}")
    return found


def test_no_module_imports_a_librarys_private_names():
    sources = [p for d in ("libs", "services", "tests", "benchmarks", "examples") for p in (ROOT / d).rglob("*.py")
               if "fixtures" not in p.parts]
    found = [hit for p in sources for hit in private_imports(p)]
    assert found == []
