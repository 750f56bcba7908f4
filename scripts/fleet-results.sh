#!/usr/bin/env bash
# Several router instances in front of the same simulated replicas (1, 2 and 3;
# each request sent to one of them at random): `local`, `rendezvous` (with
# singles by the counter and by their root) and `redis` (a redis-server on a
# free port, started and stopped here), 3 salts each (~20 min). Rewrites
# docs/fleet.md from docs/fleet-preface.md and the runs.
#   scripts/fleet-results.sh
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --bins
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no > /dev/null &
redis=$!
trap 'kill $redis 2>/dev/null || true' EXIT
for n in 1 2 3; do
  target/release/routebench compare --time-scale 10 --salts 3 --instances "$n" \
    --scenario agent-loop --scenario burst --scenario mixed \
    --policies "shape,shape+fleet.mode=rendezvous,shape+fleet.mode=rendezvous+fleet.singles=root,shape+fleet.mode=redis+fleet.redis_url=\"redis://127.0.0.1:$port/0\"" \
    --label "simulated replicas, $n router instance(s), each request to one at random (replica-sim)" \
    --out "bench-out/fleet-$n" --results "bench-out/results-fleet-$n.md"
done
cat docs/fleet-preface.md bench-out/results-fleet-1.md bench-out/results-fleet-2.md \
  bench-out/results-fleet-3.md > docs/fleet.md
cp bench-out/results-fleet-1.svg bench-out/results-fleet-2.svg bench-out/results-fleet-3.svg docs/
