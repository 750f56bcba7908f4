# The two commands of the README, plus the benchmarks.
.PHONY: run test bench results prepare

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

# The three policies side by side on simulated cards; rewrites docs/results.md (+ .svg).
results: prepare
	cargo build --release --bins
	target/release/routebench compare --time-scale 10 --out bench-out \
		--results docs/results.md --preface docs/results-preface.md
