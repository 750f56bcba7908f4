#!/usr/bin/env python3
"""Streaming latency: how much later the first SSE event of an answer reaches
the client through prefix-router (and through a plain Pingora proxy) than
straight from the replica, and whether later events arrive as they are sent.

One paced upstream on 127.0.0.1 answers every POST with an SSE stream of
chunked events: the first at once, with the response head, then one every
--gap ms, then `data: [DONE]`. A client on one keep-alive connection per arm
sends the same 4 KiB chat body and times, from the last byte of its request,
the first `data:` event and the gap to the second. Arms take turns request by
request, so drift hits all alike. The proxies are pinned to one CPU
(--proxy-cpu), the upstream and the client to the other (--load-cpus), as in
scripts/bench-proxy.py, whose helpers this uses.

    make bench-sse     # or: scripts/bench-sse.py --doc docs/performance.md
Writes bench-out/sse/summary.json and, with --doc, the section between
`<!-- sse bench -->` and `<!-- /sse bench -->` of that Markdown file.
"""

import argparse
import asyncio
import datetime
import importlib.util
import json
import os
import socket
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("bench_proxy", os.path.join(ROOT, "scripts", "bench-proxy.py"))
bp = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bp)

MARK_BEGIN, MARK_END = "<!-- sse bench -->", "<!-- /sse bench -->"
NAMES = {"direct": "direct (no proxy)", "pingora": "plain Pingora", "router": "prefix-router shape"}


# ---------------------------------------------------------------- upstream

def chunk(data):
    return b"%x\r\n%s\r\n" % (len(data), data)


def now_ns():
    """CLOCK_MONOTONIC: one clock for the upstream and client processes."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def event(n):
    return chunk(b'data: {"n":%d,"sent_ns":%d}\n\n' % (n, now_ns()))


async def serve(reader, writer, gap, events):
    try:
        while True:
            head = await bp.read_request(reader)
            if head.startswith(b"GET"):
                body = b'{"object":"list","data":[{"id":"bench","object":"model"}]}'
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
                continue
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n"
                         + event(0))
            await writer.drain()
            for n in range(1, events):
                await asyncio.sleep(gap)
                writer.write(event(n))
                await writer.drain()
            writer.write(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


def upstream_main(port, gap_ms, events):
    async def main():
        server = await asyncio.start_server(lambda r, w: serve(r, w, gap_ms / 1000, events),
                                            "127.0.0.1", port)
        async with server:
            await server.serve_forever()
    asyncio.run(main())


# ---------------------------------------------------------------- client

class Stream:
    """One keep-alive connection; `once` sends a request and times its events."""

    def __init__(self, port):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def once(self, request):
        """µs from the request to the first event, and from each of the first
        two events leaving the upstream to their arrival here."""
        # Stamped before the send: the replica may answer (on the same CPU)
        # before sendall returns.
        sent = now_ns()
        self.sock.sendall(request)
        buf, arrived = b"", []
        while not buf.endswith(b"0\r\n\r\n"):
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("closed")
            now = now_ns()
            buf += data
            arrived += [now] * (buf.count(b'"sent_ns":') - len(arrived))
        status = buf.split(b" ", 2)[1]
        if status != b"200" or b"[DONE]" not in buf or len(arrived) < 2:
            raise RuntimeError(f"bad answer: {buf[:200]!r}")
        left = [int(x.split(b"}", 1)[0]) for x in buf.split(b'"sent_ns":')[1:3]]
        return ((arrived[0] - sent) / 1e3, (arrived[0] - left[0]) / 1e3,
                (arrived[1] - left[1]) / 1e3)


def request_bytes(port, body):
    return (b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:%d\r\n"
            b"content-type: application/json\r\nauthorization: Bearer sk-bench\r\n"
            b"content-length: %d\r\n\r\n%s" % (port, len(body), body))


def ready(port, proc, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            return f"exited with {proc.returncode}"
        try:
            st, _ = bp.request(port, "GET", "/v1/models")
            if st == 200:
                s = Stream(port)
                s.once(request_bytes(port, b'{"model":"bench","messages":[],"stream":true}'))
                return None
        except (OSError, RuntimeError, bp.http.client.HTTPException):
            pass
        time.sleep(0.2)
    return f"not ready after {timeout} s"


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=2000, help="requests per arm")
    ap.add_argument("--gap", type=float, default=5.0, help="ms between events")
    ap.add_argument("--events", type=int, default=3, help="events before [DONE]")
    ap.add_argument("--arms", default="direct,pingora,router")
    ap.add_argument("--proxy-cpu", default="0")
    ap.add_argument("--load-cpus", default="1")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench-out", "sse"))
    ap.add_argument("--doc")
    ap.add_argument("--upstream", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.upstream:
        return upstream_main(a.upstream, a.gap, a.events)
    arms = a.arms.split(",")
    os.makedirs(a.out, exist_ok=True)
    work = os.path.join(a.out, "work")
    os.makedirs(work, exist_ok=True)
    os.sched_setaffinity(0, {int(c) for c in a.load_cpus.split(",")})
    procs = bp.Procs(work)
    try:
        up_port = bp.free_port()
        up = procs.start("upstream", [sys.executable, os.path.abspath(__file__), "--upstream",
                                      str(up_port), "--gap", str(a.gap), "--events", str(a.events)],
                         a.load_cpus)
        ports, skipped = {}, {}
        for arm in arms:
            port, proc = bp.free_port(), None
            if arm == "direct":
                port = up_port
            elif arm == "pingora":
                binary = os.path.join(ROOT, "target/release/examples/plain-pingora")
                proc = procs.start("pingora", [binary, "--listen", f"127.0.0.1:{port}", "--threads", "1",
                                               "--upstream", f"127.0.0.1:{up_port}"],
                                   a.proxy_cpu, {"RUST_LOG": "warn"})
            elif arm == "router":
                cfg = bp.write(os.path.join(work, "router.yaml"),
                               bp.router_conf(port, bp.free_port(), [up_port]))
                proc = procs.start("router", [os.path.join(ROOT, "target/release/prefix-router"),
                                              "--config", cfg], a.proxy_cpu, {"RUST_LOG": "warn"})
            why = ready(port, proc if arm != "direct" else up)
            if why:
                skipped[arm] = why
                print(f"  {arm}: not run: {why}", file=sys.stderr)
            else:
                ports[arm] = port
        body = bp.chat_body(4096, True)
        streams = {arm: Stream(p) for arm, p in ports.items()}
        reqs = {arm: request_bytes(p, body) for arm, p in ports.items()}
        samples = {arm: [] for arm in ports}
        for arm in ports:  # warm-up
            for _ in range(20):
                streams[arm].once(reqs[arm])
        for i in range(a.requests):
            order = list(ports)[i % len(ports):] + list(ports)[:i % len(ports)]
            for arm in order:
                samples[arm].append(streams[arm].once(reqs[arm]))
    finally:
        procs.stop_all()
    rows = {}
    for arm, xs in samples.items():
        rows[arm] = {"requests": len(xs)}
        for i, name in enumerate(["request_to_first", "first_event", "later_event"]):
            col = [x[i] for x in xs]
            rows[arm][name + "_p50_us"] = statistics.median(col)
            rows[arm][name + "_p99_us"] = pct(col, 0.99)
    meta = {**bp.machine(argparse.Namespace(venv=os.path.join(ROOT, "bench-out", "venv"))),
            "date": datetime.date.today().isoformat(), "command": " ".join(["scripts/bench-sse.py"] + sys.argv[1:]),
            "gap_ms": a.gap, "events": a.events, "skipped": skipped}
    json.dump({"meta": meta, "rows": rows}, open(os.path.join(a.out, "summary.json"), "w"), indent=1)
    text = section(meta, rows)
    print(text)
    if a.doc:
        bp.MARK_BEGIN, bp.MARK_END = MARK_BEGIN, MARK_END
        bp.write_doc(a.doc, text)
        print(f"wrote the SSE section of {a.doc}", file=sys.stderr)


def section(meta, rows):
    direct = rows.get("direct")

    def ms(us):
        return f"{us / 1000:.3f} ms"

    def added(arm, key):
        if arm == "direct" or not direct:
            return "—"
        return f"+{ms(rows[arm][key] - direct[key])}"

    lines = [MARK_BEGIN, "## Streaming: SSE events through the proxy", "",
             f"Command: `make bench-sse`, {meta['date']}. Machine: {meta['cpu_model']}, "
             f"{meta['cores']} cores, load average {meta['loadavg']} at the start; "
             f"prefix-router {meta['versions']['prefix-router']}.", "",
             "One paced upstream answers each POST with a chunked SSE stream: the first event "
             f"with the response head, then one every {meta['gap_ms']:g} ms ({meta['events']} in "
             "all), then `data: [DONE]`; each event carries the upstream's `CLOCK_MONOTONIC` "
             "time of sending, which the client (same machine, same clock) subtracts from its "
             "time of reading it. One client, one keep-alive connection per arm, the same 4 KiB "
             "chat body; the arms take turns request by request. Proxies pinned to one CPU with "
             "one worker, the upstream and the client to the other.", "",
             "| arm | requests | request → first event, p50 / p99 | first event, upstream → client, p50 / p99 "
             "| next event, upstream → client, p50 / p99 | next event p50 added over direct |",
             "|---|---|---|---|---|---|"]
    for arm, r in rows.items():
        lines.append(
            f"| {NAMES[arm]} | {r['requests']:,} "
            f"| {ms(r['request_to_first_p50_us'])} / {ms(r['request_to_first_p99_us'])} "
            f"| {ms(r['first_event_p50_us'])} / {ms(r['first_event_p99_us'])} "
            f"| {ms(r['later_event_p50_us'])} / {ms(r['later_event_p99_us'])} "
            f"| {added(arm, 'later_event_p50_us')} |")
    for arm, why in meta["skipped"].items():
        lines.append(f"| {NAMES[arm]} | not run: {why} | | | | |")
    lines += ["", "Raw: `bench-out/sse/summary.json`.", MARK_END, ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
