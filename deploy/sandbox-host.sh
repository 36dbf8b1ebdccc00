#!/usr/bin/env bash
# Host settings for a machine that starts many short-lived sandboxes (local or docker provider).
#
#   deploy/sandbox-host.sh tune     as root; idempotent; lasts until the next boot
#   deploy/sandbox-host.sh show     what is set
#
# tune: the cgroup v2 hierarchy (on a cgroup v1 "hybrid" host, /sys/fs/cgroup/unified) is
# remounted with `favordynmods` (Linux 6.0+), its other options kept. Without it every move of a
# process into a cgroup (a write to cgroup.procs) waits for an RCU grace period on the kernel's
# global cgroup lock: 6-25 ms each, measured here, and a sandbox's start makes one per v1
# hierarchy (bubblewrap's gate; runc/crun for a container and conmon). With it a move takes
# ~0.2 ms, at the price of slightly dearer forks and exits (the lock's read side takes its slow
# path). Measured in docs/sandbox.md ("Performance").
#
# Exits 3 with a reason on stderr when it cannot be done here (not root, a kernel without it).
set -euo pipefail

v2_mount() {
  if [ -f /sys/fs/cgroup/cgroup.controllers ]; then echo /sys/fs/cgroup
  elif [ -f /sys/fs/cgroup/unified/cgroup.controllers ]; then echo /sys/fs/cgroup/unified
  fi
}

options_of() {  # the superblock options of the mount at $1 (the last field of mountinfo)
  awk -v m="$1" '$5 == m { o = $NF } END { print o }' /proc/self/mountinfo
}

case "${1:-}" in
  tune)
    [ "$(id -u)" = "0" ] || { echo "sandbox host: not root; cannot remount cgroups" >&2; exit 3; }
    mnt="$(v2_mount)"
    [ -n "$mnt" ] || { echo "sandbox host: no cgroup v2 hierarchy mounted; nothing to tune" >&2; exit 0; }
    opts="$(options_of "$mnt")"
    case ",$opts," in *,favordynmods,*) exit 0 ;; esac
    # keep what is set (nsdelegate, memory_recursiveprot, ...): a remount replaces the options
    if ! mount -o "remount,${opts:-rw},favordynmods" "$mnt" 2>/dev/null; then
      echo "sandbox host: cannot remount $mnt with favordynmods (Linux 6.0+ needed): cgroup moves stay slow" >&2
      exit 3
    fi
    echo "sandbox host: $mnt remounted with favordynmods (cgroup moves without an RCU grace period)" >&2
    ;;
  show)
    mnt="$(v2_mount)"
    echo "cgroup v2 at ${mnt:-(none)}: $( [ -n "$mnt" ] && options_of "$mnt" )"
    ;;
  *) echo "usage: $0 tune | show" >&2; exit 2 ;;
esac
