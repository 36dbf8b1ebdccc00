#!/usr/bin/env bash
# A Docker-API engine for the docker sandbox provider, on a machine without Docker:
# Podman's Docker-compatible service. Used by `make test` (as root) and by hand.
#
#   deploy/docker-engine.sh start SOCKET PIDFILE   install podman+runc if missing (root, apt),
#                                                  start `podman system service` on SOCKET,
#                                                  write its PID to PIDFILE, build the images
#   deploy/docker-engine.sh stop PIDFILE           stop the service by its PID
#   deploy/docker-engine.sh images                 build the images only (arena/agent-base, arena/quickstart)
#
# Exits 3 with a reason on stderr when the engine cannot be had here (not root, no apt, ...).
set -euo pipefail
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

images() {
  "$here/images/build.sh"
}

case "${1:-}" in
  start)
    sock="$2"; pidfile="$3"
    need_root; install; configure
    if [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then  # one service per pidfile
      kill "$(cat "$pidfile")"; sleep 1
    fi
    rm -f "$sock"
    podman system service --time=0 "unix://$sock" >"$sock.log" 2>&1 &
    echo $! > "$pidfile"
    for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
    [ -S "$sock" ] || { echo "docker engine: podman service did not start: $(tail -5 "$sock.log")" >&2; exit 3; }
    images
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
  *) echo "usage: $0 start SOCKET PIDFILE | stop PIDFILE | images" >&2; exit 2 ;;
esac
