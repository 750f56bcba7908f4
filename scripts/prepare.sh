#!/usr/bin/env bash
# Everything a fresh machine needs before cargo can build prefix-router:
# - cmake (Pingora's zlib-ng compression builds with it): Debian's package when
#   apt is usable, else the PyPI wheel;
# - socat and openssl, which the TLS test uses as a TLS terminator (Debian);
# - the patched pingora-proxy crate (for tool in socat openssl; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
      (apt-get install -y -qq "$tool" >/dev/null 2>&1) || (apt-get update -qq && apt-get install -y -qq "$tool" >/dev/null)
    else
      echo "prepare: please install $tool (the TLS test needs it)" >&2
    fi
  fi
done
scripts/prepare-pingora.sh).
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
for tool in socat openssl; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
      (apt-get install -y -qq "$tool" >/dev/null 2>&1) || (apt-get update -qq && apt-get install -y -qq "$tool" >/dev/null)
    else
      echo "prepare: please install $tool (the TLS test needs it)" >&2
    fi
  fi
done
scripts/prepare-pingora.sh
