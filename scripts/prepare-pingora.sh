#!/usr/bin/env bash
# Prepares the patched pingora-proxy that Cargo.toml's [patch.crates-io] points at:
# the published 0.9.1 crate (checksum-verified) plus patches/pingora-proxy-0.9.1.diff,
# which lets a body read whole in request_filter reach the replica (see
# docs/body-forwarding.md). Idempotent and fast when already prepared.
#   scripts/prepare-pingora.sh
set -euo pipefail
cd "$(dirname "$0")/.."

crate=pingora-proxy-0.9.1
sha=8e3d5670490740405ecc8c6f75c3fcbce4d24f7adaffb355ca44550e7918e358
diff=patches/$crate.diff
dest=.pingora-patched/$crate
stamp=$dest/.prefix-router-patch
want=$(sha256sum "$diff" | cut -d' ' -f1)

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cached=$(ls "${CARGO_HOME:-$HOME/.cargo}"/registry/cache/*/"$crate".crate 2>/dev/null | head -n1 || true)
if [ -n "$cached" ]; then
  cp "$cached" "$tmp/$crate.crate"
else
  curl -sSfL --retry 3 -o "$tmp/$crate.crate" "https://static.crates.io/crates/pingora-proxy/$crate.crate"
fi
echo "$sha  $tmp/$crate.crate" | sha256sum -c --quiet -
tar xzf "$tmp/$crate.crate" -C "$tmp"
patch -s -d "$tmp/$crate" -p1 < "$diff"
echo "$want" > "$tmp/$crate/.prefix-router-patch"
rm -rf "$dest"
mkdir -p "$(dirname "$dest")"
mv "$tmp/$crate" "$dest"
echo "prepared $dest with $diff"
