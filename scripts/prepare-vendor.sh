#!/usr/bin/env bash
# The patched crates that Cargo.toml's [patch.crates-io] points at live in
# vendor/, committed, so `cargo build` works on a fresh clone. Each is the
# published crate (SHA-256 checked) plus patches/<crate>-<version>.diff:
# - pingora-proxy 0.9.1: a body read whole in request_filter reaches the replica
#   (docs/body-forwarding.md), sent with the request head in one write;
#   a total deadline for a replica's response head; after a failed request
#   write, a bounded wait for an early answer (then the write error, retried);
#   the HTTP/2 and custom upstream paths boxed (an HTTP/1 request's future is
#   not sized for them); a request head that does not parse answered 400 in
#   the OpenAI error shape (it had an empty body).
# - pingora-core 0.9.1: a total deadline for a client's request head (slowloris);
#   a request's first read takes up to 8 KiB (a short request in one system
#   call), then moves to a buffer of its size (a held stream keeps its bytes,
#   not 8 KiB); a head parsed from bytes an earlier request read is copied
#   out of them;
#   a request body read straight into the caller's buffer (one copy, not two);
#   an HTTP/1 request head held back to go out with the body's first write;
#   a replica's response head read with room for the headers the router adds;
#   a replica's response head read 1 KiB at a time (was 4 KiB), its body
#   through a buffer of 2 KiB that doubles up to 16 KiB (was 64 KiB);
#   a connection's HTTP/2 path boxed (an HTTP/1 connection's future is not
#   sized for it); an HTTP/2 handshake deadline; a response body chunk's size
#   line written without formatting or an allocation.
# - pingora-pool 0.9.1: a node emptied by taking its last idle connection is
#   kept for the connections released to it, not dropped and built again per request
#   (one idle connection to each of many replicas); empty nodes are swept once
#   there are twice as many as the pool holds connections.
# - pingora-timeout 0.9.1: the clock thread of Pingora's fast timers sleeps
#   until its earliest timer is due (at most 250 ms, for its watchdog), woken
#   by a timer registered due sooner, instead of waking every 10 ms forever
#   (100 wake-ups a second in an idle router); a clock thread the watchdog
#   replaced ends.
# - zeromq 0.7.0: `SocketOptions::max_message_size` (libzmq's ZMQ_MAXMSGSIZE):
#   a peer announcing a larger frame is disconnected before its bytes are
#   buffered (the crate reserved whatever length a frame header announced).
#   scripts/prepare-vendor.sh --check   # vendor/ is exactly crate + diff (CI)
#   scripts/prepare-vendor.sh           # rebuild vendor/ after editing a diff
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-write}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

build() {
  local name=$1 version=$2 sha=$3
  local crate=$name-$version
  local cached
  cached=$(ls "${CARGO_HOME:-$HOME/.cargo}"/registry/cache/*/"$crate".crate 2>/dev/null | head -n1 || true)
  if [ -n "$cached" ]; then
    cp "$cached" "$tmp/$crate.crate"
  else
    curl -sSfL --retry 3 -o "$tmp/$crate.crate" "https://static.crates.io/crates/$name/$crate.crate"
  fi
  echo "$sha  $tmp/$crate.crate" | sha256sum -c --quiet -
  tar xzf "$tmp/$crate.crate" -C "$tmp"
  patch -s -d "$tmp/$crate" -p1 < "patches/$crate.diff"
  if [ "$mode" = --check ]; then
    diff -r "$tmp/$crate" "vendor/$crate" >&2 \
      || { echo "vendor/$crate differs from $crate + patches/$crate.diff: run scripts/prepare-vendor.sh" >&2; exit 1; }
  else
    rm -rf "vendor/$crate"
    mkdir -p vendor
    mv "$tmp/$crate" "vendor/$crate"
    echo "wrote vendor/$crate from $crate + patches/$crate.diff"
  fi
}

build pingora-proxy 0.9.1 8e3d5670490740405ecc8c6f75c3fcbce4d24f7adaffb355ca44550e7918e358
build pingora-core 0.9.1 a535f47f65fdcb003f9e1df04cd18e614c128dfe9388acce3f211ae38ac14d68
build pingora-pool 0.9.1 ecda093a10bad5e887d73286f052dd0fc78ad0d6c7654235e507ed0f85b64af1
build pingora-timeout 0.9.1 d58d029af71f7694815494c681f1bb93aa06d83b6fa6a6b42e7154ee0e8e43e4
build zeromq 0.7.0 55b31ad37d1aad854ddc8c4f16b637259ce95f757f6c32f05447279c68ed9e2a
