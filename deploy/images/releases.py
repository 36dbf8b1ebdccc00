"""The scaffolds' pinned versions (what `make images` installs) beside the newest release published on
their registries (`npm view <package> version`, `pip index versions <package>`).

    python deploy/images/releases.py            # JSON: {name: {"package", "registry", "pinned", "newest"}}
    python deploy/images/releases.py --build    # build arena/<name>:newest for every scaffold whose newest
                                                # release is not the pinned one (build.sh with ARENA_IMAGE_TAG=
                                                # newest and the version variables); as root through the docker
                                                # engine's store (deploy/docker-engine.sh images); the JSON is
                                                # kept in .arena/scaffold-releases.json for the test

Pinned versions come from build.sh's defaults (the npm scaffolds, mini-swe-agent) and from the presets'
REQUIREMENTS (OpenHands, Terminus-2: their images are built by the local provider's installer).
tests/e2e/test_agent_newest_releases.py runs each newest release that differs from the pinned one.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
#: What the last `--build` resolved (tests/e2e/test_agent_newest_releases.py reads it: the test itself
#: never asks a registry, so `make test` stays offline).
RESOLVED = REPO / ".arena" / "scaffold-releases.json"

#: name -> (registry, package, build.sh's version variable, where the pin is)
SCAFFOLDS = {
    "claude-code": ("npm", "@anthropic-ai/claude-code", "ARENA_CLAUDE_CODE_VERSION", "build.sh"),
    "opencode": ("npm", "opencode-ai", "ARENA_OPENCODE_VERSION", "build.sh"),
    "mini-swe-agent": ("pypi", "mini-swe-agent", "ARENA_MINI_SWE_AGENT_VERSION", "build.sh"),
    "openhands": ("pypi", "openhands", "ARENA_OPENHANDS_VERSION", "preset"),
    "terminus-2": ("pypi", "harbor", "ARENA_TERMINUS_2_VERSION", "preset"),
}


def pinned(name: str) -> str:
    registry, package, variable, where = SCAFFOLDS[name]
    if where == "build.sh":
        text = (HERE / "build.sh").read_text()
        match = re.search(r'\$\{' + variable + r':-([^}]+)\}', text)
        if not match:
            raise SystemExit(f"releases: no default for {variable} in build.sh")
        return match[1]
    sys.path.insert(0, str(REPO / "libs"))
    from arena_core.scaffolds import install
    saved = os.environ.pop(variable, None)  # the pin, not an override
    try:
        (requirement,) = install.requirements(name)
    finally:
        if saved is not None:
            os.environ[variable] = saved
    return requirement.split("==", 1)[1]


def newest(name: str) -> str:
    registry, package, _, _ = SCAFFOLDS[name]
    if registry == "npm":
        out = subprocess.run(["npm", "view", package, "version"], capture_output=True, text=True, check=True,
                             timeout=120)
        return out.stdout.strip()
    sys.path.insert(0, str(REPO / "libs"))
    from arena_core.scaffolds import install
    python = install.python_version(name) if name in ("openhands", "terminus-2") else "3.11"
    out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", package, "--python-version", python,
                          "--disable-pip-version-check"], capture_output=True, text=True, check=True, timeout=120)
    match = re.match(rf"{re.escape(package)} \(([^)]+)\)", out.stdout.strip())
    if not match:
        raise SystemExit(f"releases: cannot read pip's answer for {package}: {out.stdout[:200]!r}")
    return match[1]


def releases() -> dict[str, dict[str, str]]:
    return {name: {"registry": SCAFFOLDS[name][0], "package": SCAFFOLDS[name][1], "pinned": pinned(name),
                   "newest": newest(name)} for name in SCAFFOLDS}


def build(found: dict[str, dict[str, str]]) -> None:
    names = [n for n, r in found.items() if r["newest"] != r["pinned"]]
    for name, r in found.items():
        state = "differs: building arena/%s:newest" % name if name in names else "the pinned one"
        print(f"{name}: pinned {r['pinned']}, newest {r['newest']} ({state})", file=sys.stderr)
    if not names:
        return
    env = {**os.environ, "ARENA_IMAGE_TAG": "newest", "ARENA_IMAGES": " ".join(names)}
    env.update({SCAFFOLDS[n][2]: found[n]["newest"] for n in names})
    if os.geteuid() == 0:
        subprocess.run(["bash", str(REPO / "deploy" / "docker-engine.sh"), "images"], env=env, check=True)
    else:
        subprocess.run(["bash", str(HERE / "build.sh"), *names], env=env, check=True)


if __name__ == "__main__":
    found = releases()
    if "--build" in sys.argv[1:]:
        build(found)
        RESOLVED.parent.mkdir(parents=True, exist_ok=True)
        RESOLVED.write_text(json.dumps(found, indent=1))
    print(json.dumps(found, indent=1))
