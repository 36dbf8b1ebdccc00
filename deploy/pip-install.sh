#!/usr/bin/env bash
# Install packages into a virtualenv with uv (https://docs.astral.sh/uv/), pip's indexes kept.
#   deploy/pip-install.sh VENV_PYTHON [pip install arguments...]
#
# Why: `pip install -e '.[test,rl]'` (about 190 packages, torch among them) takes 4-5 minutes on a
# 2-core host; uv installs the same versions in under 30 s (measured: same resolution, package for
# package). pip's configuration (pip.conf files and PIP_* variables: index-url, extra-index-url,
# find-links, constraint, cert) is read with `pip config list` and handed to uv, so a host whose
# packages come from a mirror or a wheel directory resolves exactly as pip would; all indexes are
# weighed together, as pip does (--index-strategy unsafe-best-match).
# Falls back to pip when uv cannot be installed (ARENA_PIP=pip forces pip).
set -euo pipefail
py=$1; shift

if [ "${ARENA_PIP:-}" != pip ] && { [ -x "$(dirname "$py")/uv" ] || \
    "$py" -m pip install --quiet --disable-pip-version-check 'uv>=0.4' >/dev/null 2>&1; }; then
  flags=(--python "$py" --index-strategy unsafe-best-match)
  while IFS= read -r line; do
    key=${line%%=*}; key=${key##*.}
    value=${line#*=}; value=${value#\'}; value=${value%\'}
    case $key in
      index-url)       flags+=(--index-url "$value") ;;
      extra-index-url) for v in $value; do flags+=(--extra-index-url "$v"); done ;;
      find-links)      for v in $value; do flags+=(--find-links "$v"); done ;;
      constraint)      for v in $value; do [ -f "$v" ] && flags+=(--constraint "$v"); done ;;
      cert)            export SSL_CERT_FILE="$value" ;;
    esac
  done < <("$py" -m pip config list 2>/dev/null || true)
  exec "$(dirname "$py")/uv" pip install "${flags[@]}" "$@"
fi
exec "$py" -m pip install --disable-pip-version-check "$@"
