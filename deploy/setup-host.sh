#!/usr/bin/env bash
# Host prerequisites for the embedded stack: bubblewrap (the local sandbox provider) and git.
# Installs them with apt-get when running as root and they are missing; otherwise says what is needed.
set -euo pipefail
missing=()
command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
command -v git >/dev/null 2>&1 || missing+=(git)
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing ${missing[*]} with apt-get"
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
else
  echo "warning: missing ${missing[*]}; install them (e.g. sudo apt-get install ${missing[*]})" >&2
fi
