# Multi-stage build of prefix-router. Not built in CI (no Docker engine there).
#   docker build -t prefix-router . && docker run -p 8080:8080 -p 9091:9091 \
#     -v $PWD/conf/example.yaml:/etc/prefix-router.yaml prefix-router
FROM rust:1.95-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends cmake && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN scripts/prepare-pingora.sh && cargo build --release --bins

FROM debian:bookworm-slim
COPY --from=build /src/target/release/prefix-router /src/target/release/replica-sim /usr/local/bin/
EXPOSE 8080 9091
ENTRYPOINT ["prefix-router"]
CMD ["--config", "/etc/prefix-router.yaml"]
