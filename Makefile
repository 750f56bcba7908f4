# The two commands of the README, plus the benchmarks.
.PHONY: run test bench prepare

prepare:
	scripts/prepare.sh

# The router on its embedded default, in front of two simulated replicas.
run: prepare
	cargo build --release --bins
	scripts/demo.sh

# The whole test suite (unit, property, integration with real processes).
test: prepare
	cargo test

# Criterion benches of the decision path (see docs/performance.md).
bench: prepare
	cargo bench --bench decision
