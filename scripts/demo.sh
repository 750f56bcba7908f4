#!/usr/bin/env bash
# Runs the router on its embedded default in front of two simulated replicas
# (gpu0 on 127.0.0.1:8001, gpu1 on :8002). Ctrl-C stops all three.
#   make run        (or: scripts/demo.sh after a release build)
set -euo pipefail
cd "$(dirname "$0")/.."
bin=target/release
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT INT TERM
for i in 0 1; do
  "$bin/replica-sim" --listen "127.0.0.1:800$((i + 1))" --name "gpu$i" >/dev/null &
  pids+=($!)
done
cat <<'MSG'
prefix-router on http://127.0.0.1:8080 (metrics: http://127.0.0.1:9091/metrics), replicas gpu0 and gpu1 (replica-sim).
Try:
  curl -si localhost:8080/v1/chat/completions -d '{"model":"sim","messages":[{"role":"user","content":"hi"}]}' | grep x-prefix
  curl -si localhost:8080/v1/chat/completions -d '{"model":"sim","messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"tok tok"},{"role":"user","content":"more"}]}' | grep x-prefix
MSG
"$bin/prefix-router" &
pids+=($!)
wait "${pids[-1]}"
