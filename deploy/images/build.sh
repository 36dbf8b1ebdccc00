#!/usr/bin/env bash
# Builds Arena's sandbox images locally with podman (no registry is needed or used):
#   arena/agent-base:latest  imported from a rootfs tarball (agent-base/build-rootfs.sh)
#   arena/quickstart:latest  FROM arena/agent-base, + the examples/quickstart test tools
# Skips an image that already exists unless ARENA_REBUILD_IMAGES=1.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
exists() { podman image exists "$1" && [ "${ARENA_REBUILD_IMAGES:-0}" != "1" ]; }

if ! exists arena/agent-base:latest; then
  tarball="$(mktemp /tmp/arena-agent-base.XXXXXX.tar)"
  "$here/agent-base/build-rootfs.sh" "$tarball"
  podman import --change 'USER 1000:1000' --change 'WORKDIR /sandbox/workspace' \
    --change 'ENV PATH=/usr/local/bin:/usr/bin:/bin HOME=/tmp LANG=C.UTF-8' \
    --change 'LABEL arena.image=agent-base' \
    "$tarball" arena/agent-base:latest >/dev/null
  rm -f "$tarball"
  echo "built arena/agent-base:latest" >&2
fi

if ! exists arena/quickstart:latest; then
  ctx="$(mktemp -d /tmp/arena-quickstart.XXXXXX)"
  site="$("$repo/.venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  mkdir -p "$ctx/site"
  for pkg in pytest _pytest pluggy iniconfig packaging pygments py.py; do
    [ -e "$site/$pkg" ] && cp -a "$site/$pkg" "$ctx/site/"
  done
  cp "$here/quickstart/Containerfile" "$ctx/"
  podman build -q -t arena/quickstart:latest -f "$ctx/Containerfile" "$ctx" >/dev/null
  rm -rf "$ctx"
  echo "built arena/quickstart:latest" >&2
fi
