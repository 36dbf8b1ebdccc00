#!/usr/bin/env bash
# A Docker-API engine for the docker sandbox provider, on a machine without Docker:
# Podman's Docker-compatible service. Used by `make test` (as root) and by hand.
#
#   deploy/docker-engine.sh start SOCKET PIDFILE   install podman+runc if missing (root, apt),
#                                                  start `podman system service` on SOCKET,
#                                                  write its PID to PIDFILE, build the images
#   deploy/docker-engine.sh stop PIDFILE           stop the service by its PID
#   deploy/docker-engine.sh images                 build the images only (arena/agent-base, arena/quickstart;
#                                                  others named in $ARENA_IMAGES, e.g. ARENA_IMAGES=openenv-echo)
#   deploy/docker-engine.sh podman ARGS...         podman on the engine's store (e.g. `podman ps -a`)
#
# Configuration for a host that runs ephemeral sandboxes (measured in docs/sandbox.md):
# the engine has its own store in memory, $ARENA_ENGINE_DIR (default
# /dev/shm/arena-engine, a tmpfs): image and container storage (--root), run state
# (--runroot) and temporary files (--tmpdir). Creating and removing a container then
# writes Podman's state (its database, the storage's container and layer lists, the
# container's run files) without going to disk. Nothing in it has to outlive a reboot:
# sandbox containers are never reused, and the images are rebuilt from deploy/images
# (a few seconds) when missing. Where /dev/shm has less than 1 GiB free at `start`
# (a container's small /dev/shm), /var/lib/arena-engine is used, and said; later
# calls (images, podman) use the store that exists, so they find the service's. The
# store is a directory of the caller's, mode 0700: one that another user made first in
# /dev/shm (writable by all), or a symlink, is refused (exit 3).
# The OCI runtime is crun where it can run containers here (it starts one sooner than
# runc), else runc; $ARENA_ENGINE_RUNTIME=runc|crun decides instead. On a cgroup v1
# "hybrid" host crun refuses to run while the v2 tree offers a controller: `start` then
# binds each such controller that no v1 hierarchy has (here only hugetlb, which nothing
# uses) to a v1 hierarchy of its own at /sys/fs/cgroup/<name>, as a v1 host mounts it
# anyway; where that cannot be done, runc. Events stay in a file under --tmpdir, the
# container log driver is k8s-file (the provider reads a container's log only when its
# start fails).
#
# Exits 3 with a reason on stderr when the engine cannot be had here (not root, no apt, ...).
set -euo pipefail
shopt -s inherit_errexit  # a failing $(store_opts) stops the script
here="$(cd "$(dirname "$0")" && pwd)"

need_root() { [ "$(id -u)" = "0" ] || { echo "docker engine: not root; cannot install/run podman here" >&2; exit 3; }; }

install() {
  if command -v podman >/dev/null 2>&1 && command -v runc >/dev/null 2>&1 && command -v crun >/dev/null 2>&1; then
    return
  fi
  need_root
  command -v apt-get >/dev/null 2>&1 || { echo "docker engine: podman missing and no apt-get" >&2; exit 3; }
  echo "installing podman, runc and crun with apt-get" >&2
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc >/dev/null
  # crun is optional: runc serves where it cannot be had
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq crun >/dev/null 2>&1 || echo "docker engine: no crun; runc it is" >&2
}

crun_usable() {  # crun runs containers on this host's cgroups (binding v2-only controllers to v1 on a hybrid host)
  command -v crun >/dev/null 2>&1 || return 1
  local unified=/sys/fs/cgroup/unified/cgroup.controllers c
  [ -f /sys/fs/cgroup/cgroup.controllers ] && return 0   # cgroup v2 only
  [ -f "$unified" ] || return 0                          # cgroup v1 only
  for c in $(cat "$unified"); do                         # hybrid: crun wants the v2 tree without controllers
    [ -e "/sys/fs/cgroup/$c" ] && return 1               # already a v1 path of that name: leave the host alone
    mkdir "/sys/fs/cgroup/$c" 2>/dev/null && mount -t cgroup -o "$c" cgroup "/sys/fs/cgroup/$c" 2>/dev/null || {
      rmdir "/sys/fs/cgroup/$c" 2>/dev/null || true; return 1; }
    echo "docker engine: cgroup controller $c bound to v1 at /sys/fs/cgroup/$c (crun refuses a hybrid host's v2 controllers)" >&2
  done
  [ -z "$(cat "$unified")" ]
}

runtime() {  # the OCI runtime of the engine's containers
  case "${ARENA_ENGINE_RUNTIME:-}" in
    runc|crun) echo "$ARENA_ENGINE_RUNTIME" ;;
    "") if crun_usable; then echo crun; else echo runc; fi ;;
    *) echo "docker engine: ARENA_ENGINE_RUNTIME must be runc or crun" >&2; exit 2 ;;
  esac
}

configure() {
  mkdir -p /etc/containers
  if ! grep -qs '^runtime *= *"runc"' /etc/containers/containers.conf; then
    printf '[engine]\nruntime = "runc"\n' >> /etc/containers/containers.conf
  fi
}

store_dir() {  # the engine's store; $1 = "decide" (start): in memory unless there is too little of it
  local dir="${ARENA_ENGINE_DIR:-}" mem=/dev/shm/arena-engine disk=/var/lib/arena-engine avail
  if [ -z "$dir" ]; then
    if [ -d "$mem" ] || { [ "${1:-}" != decide ] && [ ! -d "$disk" ]; }; then
      dir="$mem"  # the store that exists: all later calls (images, podman) must find the service's
    elif [ "${1:-}" != decide ]; then
      dir="$disk"
    else
      avail="$(df --output=avail -B1 /dev/shm 2>/dev/null | tail -1 || echo 0)"
      dir="$mem"
      if [ "${avail:-0}" -lt $((1 << 30)) ]; then
        echo "docker engine: less than 1 GiB free in /dev/shm; the engine's store is $disk (disk)" >&2
        dir="$disk"
      fi
    fi
  fi
  # /dev/shm is writable by every user: a directory someone else made first (or a
  # symlink) would hand them the store of a root engine. Ours, 0700, or nothing.
  mkdir -p -m 0700 "$dir" 2>/dev/null || true
  if [ -L "$dir" ] || [ ! -d "$dir" ] || [ "$(stat -c %u "$dir")" != "$(id -u)" ]; then
    echo "docker engine: $dir is not a directory of $(id -un) (a symlink, or made by another user); not using it as the engine's store" >&2
    exit 3
  fi
  chmod 0700 "$dir"
  echo "$dir"
}

store_opts() {
  local dir; dir="$(store_dir "${1:-}")"
  echo "--root $dir/root --runroot $dir/run --tmpdir $dir/tmp --events-backend file"
}

images() {
  local store="${1:-}"
  [ -n "$store" ] || store="$(store_opts)"
  ARENA_PODMAN_OPTS="$store" "$here/images/build.sh"
}

case "${1:-}" in
  start)
    sock="$2"; pidfile="$3"
    need_root; install; configure
    if [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then  # one service per pidfile
      kill "$(cat "$pidfile")"; sleep 1
    fi
    rm -f "$sock"
    store="$(store_opts decide)"
    read -r -a opts <<< "$store"
    # run from the socket's directory: conmon writes an `oom` marker file into its working
    # directory when a container is OOM-killed, which must not land in the caller's checkout
    rt="$(runtime)"
    echo "docker engine: OCI runtime $rt" >&2
    (cd "$(dirname "$sock")" && exec podman --runtime "$rt" "${opts[@]}" system service --time=0 "unix://$sock" >"$sock.log" 2>&1) &
    echo $! > "$pidfile"
    for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
    [ -S "$sock" ] || { echo "docker engine: podman service did not start: $(tail -5 "$sock.log")" >&2; exit 3; }
    images "$store"
    ;;
  stop)
    pidfile="$2"
    if [ -f "$pidfile" ]; then
      pid="$(cat "$pidfile")"
      kill "$pid" 2>/dev/null || true
      for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      rm -f "$pidfile"
    fi
    ;;
  images) need_root; install; configure; images ;;
  podman) need_root; shift; store="$(store_opts)"; read -r -a opts <<< "$store"; exec podman "${opts[@]}" "$@" ;;
  *) echo "usage: $0 start SOCKET PIDFILE | stop PIDFILE | images | podman ARGS..." >&2; exit 2 ;;
esac
