#!/usr/bin/env bash
# Builds Arena's sandbox images locally with podman (no registry is needed or used):
#   arena/agent-base:latest  imported from a rootfs tarball (agent-base/build-rootfs.sh)
#   arena/quickstart:latest  FROM arena/agent-base, + the examples/quickstart test tools
# Each image carries the label arena.build = a hash of what defines it (these scripts,
# the Containerfile); an image that exists with the same hash is kept (so a change to
# the definitions rebuilds it), ARENA_REBUILD_IMAGES=1 rebuilds anyway.
# Global podman options (another store: --root/--runroot/...) come from $ARENA_PODMAN_OPTS.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
read -r -a opts <<< "${ARENA_PODMAN_OPTS:-}"
pm() { podman "${opts[@]}" "$@"; }
base_hash="$(cat "$here/build.sh" "$here/agent-base/build-rootfs.sh" | sha256sum | cut -c1-16)"
quickstart_hash="$(cat "$here/quickstart/Containerfile" <(echo "$base_hash") | sha256sum | cut -c1-16)"
current() {  # image is present with build hash $2
  [ "${ARENA_REBUILD_IMAGES:-0}" != "1" ] && pm image exists "$1" &&
    [ "$(pm image inspect --format '{{ index .Labels "arena.build" }}' "$1")" = "$2" ]
}

rebuilt=0
if ! current arena/agent-base:latest "$base_hash"; then
  rebuilt=1
  tarball="$(mktemp /tmp/arena-agent-base.XXXXXX.tar)"
  "$here/agent-base/build-rootfs.sh" "$tarball"
  # one variable per ENV: `podman import` reads `ENV A=1 B=2` as A="1 B=2"
  pm import -q --change 'USER 1000:1000' --change 'WORKDIR /sandbox/workspace' \
    --change 'ENV PATH=/usr/local/bin:/usr/bin:/bin' --change 'ENV HOME=/tmp' --change 'ENV LANG=C.UTF-8' \
    --change 'LABEL arena.image=agent-base' --change "LABEL arena.build=$base_hash" \
    "$tarball" arena/agent-base:latest >/dev/null
  rm -f "$tarball"
  echo "built arena/agent-base:latest" >&2
fi

if ! current arena/quickstart:latest "$quickstart_hash"; then
  rebuilt=1
  ctx="$(mktemp -d /tmp/arena-quickstart.XXXXXX)"
  site="$("$repo/.venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  mkdir -p "$ctx/site"
  for pkg in pytest _pytest pluggy iniconfig packaging pygments py.py; do
    [ -e "$site/$pkg" ] && cp -a "$site/$pkg" "$ctx/site/"
    # the distribution metadata too: pytest and pluggy read their own versions from it
    for meta in "$site/$pkg"-*.dist-info; do [ -e "$meta" ] && cp -a "$meta" "$ctx/site/"; done
  done
  # bytecode, as for the base image's standard library (the root is read-only)
  /usr/bin/python3.11 -m compileall -q -j 0 --invalidation-mode unchecked-hash -s "$ctx/site" \
    -p /usr/local/lib/python3.11/dist-packages "$ctx/site" >/dev/null
  cp "$here/quickstart/Containerfile" "$ctx/"
  pm build -q --label "arena.build=$quickstart_hash" -t arena/quickstart:latest -f "$ctx/Containerfile" "$ctx" >/dev/null
  rm -rf "$ctx"
  echo "built arena/quickstart:latest" >&2
fi

# the images these replaced (untagged now), unless a container still uses them
if [ "$rebuilt" = 1 ]; then pm image prune -f >/dev/null 2>&1 || true; fi
