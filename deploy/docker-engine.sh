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
# The OCI runtime is runc (Debian's crun 1.8 refuses this kind of host: cgroup v1
# hybrid). Events stay in a file under --tmpdir, the container log driver is k8s-file
# (the provider reads a container's log only when its start fails).
#
# Exits 3 with a reason on stderr when the engine cannot be had here (not root, no apt, ...).
set -euo pipefail
shopt -s inherit_errexit  # a failing $(store_opts) stops the script
here="$(cd "$(dirname "$0")" && pwd)"

need_root() { [ "$(id -u)" = "0" ] || { echo "docker engine: not root; cannot install/run podman here" >&2; exit 3; }; }

install() {
  if command -v podman >/dev/null 2>&1 && command -v runc >/dev/null 2>&1; then return; fi
  need_root
  command -v apt-get >/dev/null 2>&1 || { echo "docker engine: podman missing and no apt-get" >&2; exit 3; }
  echo "installing podman and runc with apt-get" >&2
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc >/dev/null
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
    (cd "$(dirname "$sock")" && exec podman "${opts[@]}" system service --time=0 "unix://$sock" >"$sock.log" 2>&1) &
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
