#!/usr/bin/env bash
# The unit tests of the patched vendor crates whose patches they cover:
# pingora-pool's (patches/pingora-pool-0.9.1.diff), pingora-timeout's
# (patches/pingora-timeout-0.9.1.diff) and, of pingora-core's, those of its
# patch (chunk size lines; the crate's own tests need the internet). Vendor
# crates are not workspace members, so `cargo test --workspace` does not run
# them; this tests a copy of each as a workspace of its own, starting from
# this checkout's Cargo.lock (dev-dependencies it lacks, such as
# pingora-core's reqwest and jemalloc, come from the registry).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=target/vendor-test
for spec in pingora-pool-0.9.1 pingora-timeout-0.9.1 pingora-core-0.9.1:chunk_size_line; do
  crate=${spec%%:*}
  filter=()
  [ "$crate" = "$spec" ] || filter=(--lib -- "${spec#*:}")
  rm -rf "${dir:?}/$crate"
  mkdir -p "$dir"
  cp -r "vendor/$crate" "$dir/"
  cp Cargo.lock "$dir/$crate/"
  printf '\n[workspace]\n' >> "$dir/$crate/Cargo.toml"
  CARGO_TARGET_DIR="$dir/target" cargo test -q --manifest-path "$dir/$crate/Cargo.toml" ${filter[@]+"${filter[@]}"}
done
