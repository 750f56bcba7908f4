#!/usr/bin/env bash
# Everything a fresh machine needs before cargo can build prefix-router:
# - cmake (Pingora's zlib-ng compression builds with it): Debian's package when
#   apt is usable, else the PyPI wheel;
# - socat and openssl, which the TLS test uses as a TLS terminator,
#   prometheus (with promtool), which tests/dashboard.rs runs, and
#   redis-server, which tests/fleet.rs runs and kills (Debian).
# - the OpenAI Python SDK in .sdk/venv (PyPI), which tests/sdk.rs drives, and
#   kubernetes-validate (PyPI, the Kubernetes schemas) in .kube/venv, which
#   tests/kubernetes.rs runs over deploy/kubernetes/, and pyzmq, msgspec and
#   pydantic (PyPI) in .kv/venv with SGLang's wheel in .kv/wheels, which
#   tests/kv_events.rs publishes engine events with.
# The patched crates are committed in vendor/ (scripts/prepare-vendor.sh).
# Idempotent and fast when already done.
#   scripts/prepare.sh
set -euo pipefail
cd "$(dirname "$0")/.."

as_root_apt() {
  command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]
}

apt_install() {
  (apt-get install -y -qq "$@" >/dev/null 2>&1) || (apt-get update -qq && apt-get install -y -qq "$@" >/dev/null)
}

if ! command -v cmake >/dev/null 2>&1; then
  if as_root_apt; then apt_install cmake; else python3 -m pip install --quiet cmake; fi
fi
for tool in socat openssl prometheus redis-server; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    if as_root_apt; then
      apt_install "$tool"
    else
      echo "prepare: please install $tool (Debian package $tool; the tests run it)" >&2
      exit 1
    fi
  fi
done

# The SDK version tests/sdk.rs was written against.
if [ ! -x .sdk/venv/bin/python ] || ! .sdk/venv/bin/python -c 'import openai' 2>/dev/null; then
  python3 -m venv .sdk/venv
  .sdk/venv/bin/pip install --quiet 'openai==3.57.0'
fi

# A KV event publisher as vLLM's (tests/common/kv_publisher.py): ZMQ and msgpack.
# SGLang's own publisher (tests/common/sglang_publisher.py) is read from its
# wheel, not installed (the package imports torch): 39 MB, downloaded once.
if [ ! -x .kv/venv/bin/python ] || ! .kv/venv/bin/python -c 'import zmq, msgspec, pydantic' 2>/dev/null; then
  python3 -m venv .kv/venv
  .kv/venv/bin/pip install --quiet 'pyzmq==27.3.0' 'msgspec==0.23.0' 'pydantic==2.14.4'
fi
if ! ls .kv/wheels/sglang-0.5.23-*.whl >/dev/null 2>&1; then
  .kv/venv/bin/pip download --quiet --no-deps 'sglang==0.5.23' -d .kv/wheels
fi

# An OTLP receiver for tests/traces.rs (tests/common/otlp_receiver.py): the
# official OTLP protobuf definitions, decoding what the router exports.
if [ ! -x .otel/venv/bin/python ] || ! .otel/venv/bin/python -c 'import opentelemetry.proto' 2>/dev/null; then
  python3 -m venv .otel/venv
  .otel/venv/bin/pip install --quiet 'opentelemetry-proto==1.45.2' 'protobuf==7.36.2'
fi

# The schemas tests/kubernetes.rs checks the manifests against (offline).
if [ ! -x .kube/venv/bin/kubernetes-validate ]; then
  python3 -m venv .kube/venv
  .kube/venv/bin/pip install --quiet 'kubernetes-validate==1.37.0'
fi
