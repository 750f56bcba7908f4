# The two commands of the README, plus the benchmarks.
.PHONY: run test bench bench-proxy bench-sse bench-memory results soak prepare

prepare:
	scripts/prepare.sh

# The router on its embedded default, in front of two simulated replicas.
run: prepare
	cargo build --release --bins
	scripts/demo.sh

# The whole test suite (unit, property, integration with real processes, a real
# llama.cpp engine), then the TLS test, which needs the `tls` build.
test: prepare
	scripts/real-engine.sh prepare
	cargo test
	cargo test --features tls --test tls

# Criterion benches of the decision path; rewrites docs/performance.md.
bench: prepare
	cargo bench --bench decision | tee target/bench-decision.txt
	scripts/perf-report.py

# The router against direct, nginx, HAProxy, a plain Pingora proxy and SMG on
# 127.0.0.1, each pinned to one CPU (~20 min); installs Debian's nginx-light,
# haproxy and wrk, and SMG into bench-out/venv. Rewrites the proxy section of
# docs/performance.md.
bench-proxy: prepare
	cargo build --release --bins --examples
	scripts/bench-proxy.py --doc docs/performance.md

# How much later an SSE event reaches the client through the router (and plain
# Pingora) than straight from the replica (~1 min). Rewrites the SSE section of
# docs/performance.md.
bench-sse: prepare
	cargo build --release --bins --examples
	scripts/bench-sse.py --doc docs/performance.md

# Router RSS with 1,000 routed 400 KiB requests held at once (~1 min). Rewrites
# the memory section of docs/performance.md.
bench-memory: prepare
	cargo build --release --bins
	scripts/bench-memory.py --doc docs/performance.md

# The policies, `shape` before kv_room (`shape+kv_room=off`) and the peer SMG
# side by side, on simulated cards (3 salts, ~13 min) and on two real llama.cpp
# replicas (~12 min); rewrites docs/results.md and its plots. SMG is installed
# from PyPI into bench-out/venv on first use.
results: prepare
	cargo build --release --bins
	target/release/routebench compare --time-scale 10 --salts 3 --peer smg \
	  --policies shape,shape+kv_room=off,roundrobin,affinity \
	  --out bench-out/sim --results bench-out/results-sim.md
	scripts/real-engine.sh compare
	cat docs/results-preface.md bench-out/results-sim.md bench-out/results-real.md > docs/results.md
	cp bench-out/results-sim.svg bench-out/results-real.svg docs/

# A bounded soak (~4 min): 256 concurrent clients, a replica killed and
# restarted, a reload; every request accounted for, duplicates counted, RSS
# and fds sampled. Rewrites the figures in docs/reliability.md.
soak: prepare
	cargo build --release --bins
	scripts/soak.py --doc docs/reliability.md
