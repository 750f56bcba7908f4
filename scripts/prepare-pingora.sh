#!/usr/bin/env bash
# Prepares the patched Pingora crates that Cargo.toml's [patch.crates-io] points at:
# each published 0.9.1 crate (checksum-verified) plus patches/<crate>.diff.
# - pingora-proxy: a body read whole in request_filter reaches the replica
#   (docs/body-forwarding.md); a total deadline for a replica's response head.
# - pingora-core: a total deadline for a client's request head (slowloris);
#   a request body read straight into the caller's buffer (one copy, not two).
# Idempotent and fast when already prepared.
#   scripts/prepare-pingora.sh
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

prepare() {
  local name=$1 sha=$2
  local crate=$name-0.9.1
  local diff=patches/$crate.diff
  local dest=.pingora-patched/$crate
  local stamp=$dest/.prefix-router-patch
  local want
  want=$(sha256sum "$diff" | cut -d' ' -f1)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return 0
  fi
  rm -rf "${tmp:?}"/*
  local cached
  cached=$(ls "${CARGO_HOME:-$HOME/.cargo}"/registry/cache/*/"$crate".crate 2>/dev/null | head -n1 || true)
  if [ -n "$cached" ]; then
    cp "$cached" "$tmp/$crate.crate"
  else
    curl -sSfL --retry 3 -o "$tmp/$crate.crate" "https://static.crates.io/crates/$name/$crate.crate"
  fi
  echo "$sha  $tmp/$crate.crate" | sha256sum -c --quiet -
  tar xzf "$tmp/$crate.crate" -C "$tmp"
  patch -s -d "$tmp/$crate" -p1 < "$diff"
  echo "$want" > "$tmp/$crate/.prefix-router-patch"
  rm -rf "$dest"
  mkdir -p "$(dirname "$dest")"
  mv "$tmp/$crate" "$dest"
  echo "prepared $dest with $diff"
}

prepare pingora-proxy 8e3d5670490740405ecc8c6f75c3fcbce4d24f7adaffb355ca44550e7918e358
prepare pingora-core a535f47f65fdcb003f9e1df04cd18e614c128dfe9388acce3f211ae38ac14d68
