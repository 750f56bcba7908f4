#!/usr/bin/env python3
"""Router memory under concurrency: resident memory with N routed 400 KiB
chat requests held at once (each body received and forwarded, the replica
not answering yet), per request, and after they are answered.

The replica is an asyncio server in this process that reads each request
whole and holds its answer until all N have arrived; N clients on their own
connections send distinct 400 KiB agent conversations (scripts/bench-proxy.py
builds them). RSS is VmRSS of the router's process, sampled when the replica
holds all N, and again after all are answered; the prefix index's own heap is
read from `prefix_router_prefix_index_bytes` at the end (the index keeps a placed
prompt's block hashes after the request, up to `prefix_index.max_entries`).

    make bench-memory    # or: scripts/bench-memory.py --doc docs/performance.md
    scripts/bench-memory.py --binary /path/to/other/prefix-router   # compare a build
"""

import argparse
import asyncio
import datetime
import importlib.util
import os
import resource
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("bench_proxy", os.path.join(ROOT, "scripts", "bench-proxy.py"))
bp = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bp)

MARK_BEGIN, MARK_END = "<!-- memory bench -->", "<!-- /memory bench -->"
ANSWER = b'{"id":"x","object":"chat.completion","choices":[]}'


class Replica:
    def __init__(self, want):
        self.want, self.held, self.all_held = want, 0, asyncio.Event()

    async def serve(self, reader, writer):
        try:
            while True:
                head = await bp.read_request(reader)
                if head.startswith(b"POST"):
                    self.held += 1
                    if self.held >= self.want:
                        self.all_held.set()
                    await self.all_held.wait()
                body = ANSWER if head.startswith(b"POST") else b'{"data":[{"id":"bench"}]}'
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def rss_kib(pid):
    return sum(bp.status_kib([p], "VmRSS") or 0 for p in bp.tree(pid))


async def post(port, body):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n" % len(body) + body)
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    writer.close()
    return int(head.split(b" ", 2)[1])


async def wait_ready(port, proc):
    for _ in range(300):
        if proc.poll() is not None:
            raise RuntimeError(f"router exited with {proc.returncode}")
        try:
            st, _ = await asyncio.to_thread(bp.request, port, "GET", "/v1/models")
            if st == 200:
                return
        except OSError:
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError("router not ready")


async def run(a, procs, work):
    replica = Replica(a.requests)
    server = await asyncio.start_server(replica.serve, "127.0.0.1", 0, backlog=4096)
    up = server.sockets[0].getsockname()[1]
    port, mport = bp.free_port(), bp.free_port()
    cfg = bp.write(os.path.join(work, "router.yaml"), bp.router_conf(port, mport, [up], a.threads))
    cpus = f"0-{os.cpu_count() - 1}"
    proc = procs.start("router", [a.binary, "--config", cfg], cpus, {"RUST_LOG": "warn"})
    await wait_ready(port, proc)
    base = bp.chat_body(409600, False)
    anchor = b"You are a coding agent. "
    bodies = [base.replace(anchor, b"You are agent #%07d. " % i, 1) for i in range(a.requests)]
    assert all(len(b) == len(base) for b in bodies)
    idle = rss_kib(proc.pid)
    clients = [asyncio.create_task(post(port, b)) for b in bodies]
    await asyncio.wait_for(replica.all_held.wait(), 300)
    held = max(rss_kib(proc.pid) for _ in range(5))
    statuses = await asyncio.gather(*clients)
    await asyncio.sleep(1.5)  # the capacity check refreshes the index gauge every second
    after = rss_kib(proc.pid)
    index = await asyncio.to_thread(index_bytes, mport)
    server.close()
    return {"requests": a.requests, "ok": sum(s == 200 for s in statuses), "idle_kib": idle,
            "held_kib": held, "after_kib": after, "index_bytes": index, "body_bytes": len(base)}


def index_bytes(mport):
    _, text = bp.request(mport, "GET", "/metrics")
    for line in text.splitlines():
        if line.startswith("prefix_router_prefix_index_bytes "):
            return int(float(line.split()[1]))
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--binary", default=os.path.join(ROOT, "target/release/prefix-router"))
    ap.add_argument("--out", default=os.path.join(ROOT, "bench-out", "memory"))
    ap.add_argument("--doc")
    a = ap.parse_args()
    # A client and a replica socket per request here, and two in the router.
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    work = os.path.join(a.out, "work")
    os.makedirs(work, exist_ok=True)
    procs = bp.Procs(work)
    try:
        r = asyncio.run(run(a, procs, work))
    finally:
        procs.stop_all()
    mib = 1024
    per = (r["held_kib"] - r["idle_kib"]) / r["requests"]
    meta = bp.machine(argparse.Namespace(venv=os.path.join(ROOT, "bench-out", "venv")))
    text = "\n".join([
        MARK_BEGIN, "## Memory: concurrent 400 KiB requests", "",
        f"Command: `make bench-memory`, {datetime.date.today().isoformat()}; prefix-router "
        f"{meta['versions']['prefix-router']}, `threads: {a.threads}`, default limits.", "",
        f"{r['requests']:,} clients each send a different {r['body_bytes']:,}-byte agent conversation at "
        "once; the replica reads every request whole and answers none until it holds all of them. "
        f"{r['ok']:,} were answered 200.", "",
        "| router RSS | MiB |", "|---|---|",
        f"| idle, before the requests | {r['idle_kib'] / mib:.1f} |",
        f"| with all {r['requests']:,} requests held at the replica | {r['held_kib'] / mib:.1f} |",
        f"| after all were answered | {r['after_kib'] / mib:.1f} |",
        f"| of which the prefix index (`prefix_router_prefix_index_bytes`) | "
        f"{(r['index_bytes'] or 0) / 2**20:.1f} |", "",
        f"So about {per:.0f} KiB per request in flight, for a {r['body_bytes'] / 1024:.0f} KiB body, "
        f"{(r['index_bytes'] or 0) / 1024 / r['requests']:.0f} KiB of it the index entries of the "
        "conversation it placed (they stay after the request, within `prefix_index.max_entries`): "
        "the body is kept whole until the response head arrives (a request is re-sent to another "
        "replica only from it), and the prompt's canonical text and hash chain only until a replica "
        "is chosen (a retry reads the body again). The remainder is not broken down here (connection "
        "buffers and allocator slack are candidates). Memory freed after a burst mostly stays with the process (glibc keeps it for reuse), "
        "as the last rows show.", "", MARK_END, ""])
    print(text)
    if a.doc:
        bp.MARK_BEGIN, bp.MARK_END = MARK_BEGIN, MARK_END
        bp.write_doc(a.doc, text)
        print(f"wrote the memory section of {a.doc}", file=sys.stderr)


if __name__ == "__main__":
    main()
