#!/usr/bin/env bash
# Everything a fresh machine needs before cargo can build prefix-router:
# - cmake (Pingora's zlib-ng compression builds with it): Debian's package when
#   apt is usable, else the PyPI wheel;
# - the patched pingora-proxy crate (scripts/prepare-pingora.sh).
# Idempotent and fast when already done.
#   scripts/prepare.sh
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v cmake >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    (apt-get install -y -qq cmake >/dev/null 2>&1) || (apt-get update -qq && apt-get install -y -qq cmake >/dev/null)
  else
    python3 -m pip install --quiet cmake
  fi
fi
scripts/prepare-pingora.sh
