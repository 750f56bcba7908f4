# The two commands of the README, plus the benchmarks.
.PHONY: run test bench bench-proxy count-instructions bench-sse bench-memory bench-scale results fleet-results soak fuzz prepare container-check

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
	cargo test --workspace
	cargo test --features tls --test tls
	scripts/test-vendor.sh

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

# The same proxies' user-mode instructions per request under Valgrind's
# callgrind (~5 min; needs valgrind): work counted, not timed, so it does not
# swing with the machine. Prints a table; docs/performance.md quotes it.
count-instructions: prepare
	cargo build --release --bins --examples
	scripts/count-instructions.py --hooks

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

# How the router's cost grows with its fleet (2 to 1,000 replicas: idle CPU,
# CPU and latency per request, RSS, a /metrics scrape; idle CPU under three
# probe schedules), its open SSE streams
# (100 to 10,000: RSS per stream, CPU per event, a new request's latency),
# the conversations it tracks (10K to 1M: CPU per turn, memory each) and its
# prompts' size (4 to 400 KiB, with and without checkpoints), beside SMG's,
# and of Redis fleet mode at 1 to 3 instances, on `routebench stubs` replicas
# (~35 min). Rewrites docs/scale.md and its plots.
bench-scale: prepare
	cargo build --release --bins
	scripts/bench-scale.py --doc docs/scale.md

# The policies, singles by the counter (`shape+singles.by=spread`, the seed's
# rule), `shape` before kv_room (`shape+kv_room=off`) and the peer SMG
# side by side, on simulated cards (3 salts, ~15 min; then steady singles behind
# many tenants' prompts, 2 salts, ~20 min; engine_load and the
# load guard on `unseen-load`, ~6 min, the capacity wall's levers, ~5 min,
# agent loops on the Responses API, ~3 min, 150 tenants overflowing 4
# cards against an oracle, at half the other runs' time scale (this
# machine's wall-clock noise, times 10, hid the arms' differences),
# ~20 min, and a tenant flooding the fleet beside agent loops, with and
# without fair admission, ~5 min)
# and on two real llama.cpp replicas (~15 min, then agent loops amid bursts in
# 3 rounds, each engine on its own CPU, ~19 min, then steady singles behind
# tenants' prompts on engines of 4 slots, ~10 min); rewrites docs/results.md and
# its plots. SMG is installed
# from PyPI into bench-out/venv on first use.
results: prepare
	cargo build --release --bins
	target/release/routebench compare --time-scale 10 --salts 3 --peer smg \
	  --policies shape,shape+singles.by=spread,shape+kv_room=off,roundrobin,affinity \
	  --out bench-out/sim --results bench-out/results-sim.md
	target/release/routebench compare --time-scale 10 --salts 2 --peer smg \
	  --scenario shared-prefix --scenario shared-prefix-card --scenario shared-prefix-over \
	  --scenario shared-prefix-bursts --scenario agent-loop-shared \
	  --policies shape,shape+singles.spread_while_all_fit=false,shape+singles.by=spread,roundrobin,affinity \
	  --label "simulated replicas, steady singles behind many tenants' long system prompts (replica-sim)" \
	  --out bench-out/shared --results bench-out/results-shared.md
	target/release/routebench compare --time-scale 10 --salts 3 --peer smg --scenario unseen-load \
	  --policies 'shape,shape+engine_load={interval_ms: 50},shape+engine_load={interval_ms: 50}+load_guard_in_flight=4,roundrobin' \
	  --label "simulated replicas, load the router does not see (replica-sim)" \
	  --out bench-out/unseen --results bench-out/results-unseen.md
	target/release/routebench compare --time-scale 10 --salts 3 --scenario capacity \
	  --policies shape,shape+kv_room=spread,shape+kv_room=off,roundrobin \
	  --label "simulated replicas, the capacity wall (replica-sim)" \
	  --out bench-out/capacity --results bench-out/results-capacity.md
	target/release/routebench compare --time-scale 10 --salts 3 --scenario capacity \
	  --sim-arg=--max-num-seqs=1 --policies shape,shape+kv_room=off \
	  --label "simulated replicas running one request at a time, the capacity wall (replica-sim --max-num-seqs 1)" \
	  --out bench-out/capacity-one --results bench-out/results-capacity-one.md
	target/release/routebench compare --time-scale 10 --salts 3 --peer smg \
	  --scenario agent-loop --scenario responses-loop --policies shape,roundrobin \
	  --label "simulated replicas, agent loops on chat and on the Responses API (replica-sim)" \
	  --out bench-out/responses --results bench-out/results-responses.md
	target/release/routebench compare --time-scale 5 --sims 4 --salts 3 --peer smg --scenario many-tenants \
	  --policies shape,shape+queued_prefill_step_bytes=0,shape+kv_events,roundrobin,oracle,oracle-soonest \
	  --sim-arg=--tokenizer=$(CURDIR)/.real-engine/tokenizer \
	  --label "4 simulated cards with SmolLM2's tokenizer, 150 tenants of 6k-token prompts, twice what the cards hold (replica-sim)" \
	  --out bench-out/many-tenants --results bench-out/results-many-tenants.md
	target/release/routebench compare --time-scale 10 --salts 3 --scenario noisy-neighbour \
	  --policies 'shape,shape+shed_in_flight=4,shape+shed_in_flight=4+queue.max_waiting=1024,shape+shed_in_flight=4+queue.max_waiting=1024+tenants.header=x-tenant,shape+shed_in_flight=2+queue.max_waiting=1024+tenants.header=x-tenant' \
	  --label "simulated replicas, a tenant flooding the fleet beside agent loops (replica-sim)" \
	  --out bench-out/noisy --results bench-out/results-noisy.md
	ENGINE_CPUS="0 1" \
	  LABEL="real llama.cpp replicas, each engine on its own CPU (xllamacpp, SmolLM2-135M cut to 4 blocks, 1 thread, 1 slot of 4096 tokens)" \
	  scripts/real-engine.sh compare
	ENGINE_CPUS="0 1" POLICIES=shape,shape+replica.prompt_cache=last,roundrobin OUT=bench-out/real-mixed \
	  RESULTS=bench-out/results-real-mixed.md \
	  LABEL="real llama.cpp replicas, agent loops amid bursts, 3 rounds, each engine on its own CPU (xllamacpp, 1 slot of 4096 tokens, --cache-ram 0)" \
	  scripts/real-engine.sh compare --scenario agent-loop --scenario burst --scenario mixed --salts 3
	ENGINE_CPUS="0 1" ENGINE_SLOTS=4 POLICIES=shape,shape+singles.by=spread,roundrobin,affinity \
	  OUT=bench-out/real-shared RESULTS=bench-out/results-real-shared.md \
	  LABEL="real llama.cpp replicas, steady singles behind 8 tenants' system prompts, 2 rounds, each engine on its own CPU (xllamacpp, 4 slots of 4096 tokens, --cache-ram 0)" \
	  scripts/real-engine.sh compare --scenario shared-prefix --salts 2
	cat docs/results-preface.md bench-out/results-sim.md bench-out/results-shared.md \
	  bench-out/results-unseen.md \
	  bench-out/results-capacity.md bench-out/results-capacity-one.md \
	  bench-out/results-responses.md bench-out/results-many-tenants.md bench-out/results-noisy.md \
	  bench-out/results-real.md \
	  bench-out/results-real-mixed.md bench-out/results-real-shared.md > docs/results.md
	cp bench-out/results-sim.svg bench-out/results-responses.svg bench-out/results-real.svg \
	  bench-out/results-real-mixed.svg docs/

# Several router instances in front of the same simulated replicas (1, 2 and
# 3; each request to one of them at random): local, rendezvous and redis, 3
# salts (~20 min); rewrites docs/fleet.md.
fleet-results: prepare
	scripts/fleet-results.sh

# Every parser that reads outside bytes, 100,000 property-test cases each
# (proptest; `cargo fuzz` needs a nightly toolchain): request bodies (chat
# scanner against its serde oracle, checkpoints, Responses API, forms), the
# engines' usage and response ids, paths, Prometheus pages, Redis replies;
# the byte-level BPE against `tokenizers` (needs scripts/real-engine.sh prepare).
# Minutes, not CI; docs/reliability.md has a run's figures.
FUZZ_CASES ?= 100000
fuzz:
	PROPTEST_CASES=$(FUZZ_CASES) cargo test --release -p routing --lib -- reference:: responses::tests checkpoint:: request::tests::any_form blocks::
	PROPTEST_CASES=$(FUZZ_CASES) cargo test --release -p routing --test fuzz_parse
	PROPTEST_CASES=$(FUZZ_CASES) cargo test --release --lib -- usage:: response_ids:: paths:: engine_load:: shared_pins::bounded::
	PROPTEST_CASES=$(FUZZ_CASES) cargo test --release -p tokens --test bpe

# A bounded soak (~4 min): 256 concurrent clients, a replica killed and
# restarted, a reload; every request accounted for, duplicates counted, RSS
# and fds sampled. Rewrites the figures in docs/reliability.md.
soak: prepare
	cargo build --release --bins
	scripts/soak.py --doc docs/reliability.md

# The Dockerfile verified without Docker: its build stage run on the host as
# written (a release build), its runtime stage replayed in a debootstrapped
# bookworm minbase (cached in bench-out/container-rootfs, ~400 MB), the router
# run there as the image's non-root user, the HEALTHCHECK command run (~1 min
# the first time, then seconds). Needs root.
container-check:
	scripts/container-check.sh
