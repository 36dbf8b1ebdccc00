#!/usr/bin/env bash
# Builds the root filesystem of arena/agent-base as a tarball (no registry needed):
# the host's Debian Python 3.11 (standard library only), git, a POSIX shell and the
# coreutils an agent needs, each with the shared libraries it links, plus the
# sandbox user (uid/gid 1000) and an empty /sandbox it owns.
#   build-rootfs.sh OUT.tar
set -euo pipefail
out="$1"
root="$(mktemp -d /tmp/arena-rootfs.XXXXXX)"
trap 'rm -rf "$root"' EXIT

bins=(sh dash bash env sleep cat ls mkdir rm cp mv ln true false echo printf test id touch chmod
      head tail wc sort uniq tr cut sed grep find xargs tar gzip diff patch timeout basename dirname
      readlink realpath stat git python3.11)
# usr-merged layout, as on the host: /bin, /lib, ... are links into /usr
mkdir -p "$root/usr/bin" "$root/usr/sbin" "$root/usr/lib" "$root/usr/lib64"
for d in bin sbin lib lib64; do ln -s "usr/$d" "$root/$d"; done
copy() {  # copy a file (and, for a link, what it points to) to the same place under $root
  local src="$1" dest
  case "$src" in /bin/*|/sbin/*|/lib/*|/lib64/*) dest="/usr$src" ;; *) dest="$src" ;; esac
  mkdir -p "$root$(dirname "$dest")"
  cp -a "$src" "$root$dest" 2>/dev/null || true
  if [ -L "$src" ]; then copy "$(readlink -f "$src")"; fi
}
libs_of() { ldd "$1" 2>/dev/null | awk '/=>/ {print $3} /^\s*\/lib/ {print $1}' | grep '^/' || true; }

declare -A seen=()
for b in "${bins[@]}"; do
  p="$(command -v "$b" 2>/dev/null || true)"
  case "$p" in /usr/bin/*|/bin/*) ;; *) p="/usr/bin/$b" ;; esac
  [ -e "$p" ] || { echo "build-rootfs: missing $b" >&2; continue; }
  copy "$p"
done
# git's helpers and templates, Python's standard library (no tests, no site packages)
mkdir -p "$root/usr/lib" "$root/usr/share"
tar -C /usr/lib -cf - git-core | tar -C "$root/usr/lib" -xf -
[ -d /usr/share/git-core ] && tar -C /usr/share -cf - git-core | tar -C "$root/usr/share" -xf -
tar -C /usr/lib --exclude='python3.11/test' --exclude='python3.11/idlelib' --exclude='python3.11/tkinter' \
    --exclude='__pycache__' --exclude='python3.11/site-packages' -cf - python3.11 | tar -C "$root/usr/lib" -xf -
# Bytecode for the standard library: the root is read-only at run time, so without it
# every Python start (the sandbox's command server, the relay, agents) recompiles what
# it imports (~50 ms for a few modules). unchecked-hash: the image never changes.
/usr/bin/python3.11 -m compileall -q -j 0 --invalidation-mode unchecked-hash -s "$root" -p / \
  -x '/(lib2to3|ensurepip)/' "$root/usr/lib/python3.11" >/dev/null
ln -sf python3.11 "$root/usr/bin/python3"
ln -sf python3 "$root/usr/bin/python"
mkdir -p "$root/usr/local/lib/python3.11/dist-packages"
# shared libraries of everything copied so far
find "$root/usr" -type f \( -perm -u+x -o -name '*.so*' \) -print | while read -r f; do
  libs_of "${f#$root}"
done | sort -u | while read -r lib; do
  copy "$lib"
done
copy /lib64/ld-linux-x86-64.so.2
# mount points of the sandbox (so the runtime creates nothing in the read-only root)
mkdir -p "$root/etc" "$root/tmp" "$root/var/tmp" "$root/proc" "$root/dev" "$root/sys" "$root/run/arena" \
  "$root/sandbox/workspace" "$root/sandbox/.arena" "$root/sandbox/agent"
chmod 1777 "$root/tmp"
printf 'root:x:0:0:root:/root:/bin/sh\nsandbox:x:1000:1000:sandbox:/tmp:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n' > "$root/etc/passwd"
printf 'root:x:0:\nsandbox:x:1000:\nnogroup:x:65534:\n' > "$root/etc/group"
printf '127.0.0.1 localhost sandbox\n::1 localhost\n' > "$root/etc/hosts"
printf 'passwd: files\ngroup: files\nhosts: files\n' > "$root/etc/nsswitch.conf"
chmod 1777 "$root/var/tmp"
chown 1000:1000 "$root/sandbox" "$root/sandbox/workspace" "$root/sandbox/.arena"
tar -C "$root" --numeric-owner -cf "$out" .
