# The two commands of the README, plus the benchmarks.
.PHONY: run test bench prepare

prepare:
	scripts/prepare.sh

# The router on its embedded default, in front of two simulated replicas.
run: prepare
	cargo build --release --bins
	scripts/demo.sh

# The whole test suite (unit, property, integration with real processes), then
# the TLS test, which needs the `tls` build (OpenSSL compiled from source).
test: prepare
	cargo test
	cargo test --features tls --test tls

# Criterion benches of the decision path; rewrites docs/performance.md.
bench: prepare
	cargo bench --bench decision | tee target/bench-decision.txt
	scripts/perf-report.py
