# Multi-stage build of prefix-router (and replica-sim, the simulated engine).
# CI has no Docker engine: scripts/container-check.sh replays this file on a
# debootstrapped bookworm (build-stage RUN lines, runtime RUN/COPY/USER, the
# HEALTHCHECK command) and checks the router serves, probes and drains.
#
#   docker build -t prefix-router .
#   docker run --stop-timeout 30 -p 8080:8080 -p 9091:9091 \
#     -v "$PWD/my-conf:/etc/prefix-router:ro" prefix-router
#
# Config: the image ships conf/example.yaml as /etc/prefix-router/config.yaml
# (metrics listener moved to 0.0.0.0, see below); its replicas are placeholders.
# Mount your own: a directory holding config.yaml over /etc/prefix-router (as
# above) rather than the single file, so edits that replace the file (editors,
# ConfigMaps) reach the router's hot reload (keys marked "(restart)" in
# example.yaml need a restart). `prefix-router --check --config FILE` validates
# a config without starting.
# Stop timeout: SIGTERM drains for up to shutdown_grace_s (default 20 s), but
# `docker stop` kills after 10 s unless given --stop-timeout (compose:
# stop_grace_period; Kubernetes: terminationGracePeriodSeconds, default 30).

FROM rust:1.95-bookworm AS build
# Pingora's build needs cmake. (The build stage is discarded: no list cleanup.)
RUN apt-get update \
 && apt-get install -y --no-install-recommends cmake
WORKDIR /src
# vendor/ (the patched Pingora crates) is committed: no prepare step.
COPY . .
# TLS (listen_tls, replica_tls) needs `--features tls` here (OpenSSL from source).
RUN cargo build --release --locked --bins
# The image's config: example.yaml with the metrics listener (/metrics, /healthz,
# /ready) on all interfaces, since it is scraped and probed from outside the
# container. Written under target/ so a replay in a checkout leaves conf/ alone;
# the grep fails the build if example.yaml's line changes and sed misses it.
RUN sed 's/^metrics_listen: "127\.0\.0\.1:9091"/metrics_listen: "0.0.0.0:9091"/' conf/example.yaml > target/container-config.yaml \
 && grep -q '^metrics_listen: "0\.0\.0\.0:9091"' target/container-config.yaml

FROM debian:bookworm-slim
RUN groupadd --system --gid 10001 prefix-router \
 && useradd --system --uid 10001 --gid prefix-router --no-create-home \
      --home-dir /nonexistent --shell /usr/sbin/nologin prefix-router
COPY --from=build /src/target/release/prefix-router /src/target/release/replica-sim /usr/local/bin/
COPY --from=build /src/target/container-config.yaml /etc/prefix-router/config.yaml
USER prefix-router
EXPOSE 8080 9091
STOPSIGNAL SIGTERM
# Liveness, not readiness: /healthz answers 200 while the process serves.
# /ready is 503 whenever no replica is live, and some orchestrators (Swarm,
# autoheal setups) restart unhealthy containers: a fleet outage must not also
# restart the router (losing its prefix index and connections). Point
# readiness checks (Kubernetes readinessProbe, load balancers) at /ready.
# Slim images have no curl: the router probes itself. Change the port here
# (or override with --health-cmd) if your config moves metrics_listen.
HEALTHCHECK --interval=10s --timeout=5s --start-period=5s --retries=3 \
  CMD ["prefix-router", "--probe", "http://127.0.0.1:9091/healthz"]
ENTRYPOINT ["prefix-router"]
CMD ["--config", "/etc/prefix-router/config.yaml"]
