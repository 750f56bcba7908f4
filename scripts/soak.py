#!/usr/bin/env python3
"""Bounded soak: hundreds of concurrent streaming and non-streaming requests
through the release router to three simulated replicas, through the faults
of a bad day: health checks answered late (every engine busy), one replica
killed and restarted, one that stops accepting connections for a while,
clients trickling their uploads a byte at a time, a Redis that goes silent
without a reset (a partition: the process stopped), and a config reload.
Every request is accounted for; duplicate deliveries are counted from the
simulators' id logs (each request carries a unique `x-soak-id`); the
router's RSS and open file descriptors are sampled every second.

    make soak            # or: scripts/soak.py --duration 180 --concurrency 256
Writes bench-out/soak.json and, with --doc, the figures section of
docs/reliability.md.
"""

import argparse
import collections
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def start_sim(name, port, log_dir):
    p = subprocess.Popen(
        [os.path.join(ROOT, "target/release/replica-sim"), "--listen", f"127.0.0.1:{port}",
         "--name", name, "--time-scale", "20", "--kv-tokens", "400000",
         "--id-log", os.path.join(log_dir, f"{name}.ids")],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = p.stdout.readline()
    assert line.startswith("listening on"), line
    return p


def config(port, metrics_port, sims, comment="", redis_port=None):
    lines = [f'listen: "127.0.0.1:{port}"', f'metrics_listen: "127.0.0.1:{metrics_port}"',
             "reload_interval_ms: 200", "health_check: {interval_ms: 500}",
             # Trickled uploads end (408) within the run.
             "body_read_timeout_ms: 10000",
             # A small index fills within the warm-up, so RSS after it is flat.
             "limits: {max_requests: 100000}", "prefix_index: {max_entries: 65536}",
             comment]
    if redis_port:
        lines.append(f'fleet: {{mode: redis, redis_url: "redis://127.0.0.1:{redis_port}"}}')
    lines.append("replicas:")
    lines += [f'  - {{name: {n}, addr: "127.0.0.1:{p}", kv_tokens: 400000}}' for n, p in sims]
    return "\n".join(lines) + "\n"


def body(worker, seq, stream):
    # A conversation per worker that grows by one turn per request (pinned),
    # every third request a one-shot (spread).
    if seq % 3 == 0:
        msgs = [{"role": "user", "content": f"one-shot {worker}-{seq} " + "q" * 400}]
    else:
        msgs = [{"role": "system", "content": f"agent {worker} " + "s" * 2000}]
        for t in range(seq % 12):
            msgs += [{"role": "user", "content": f"step {t}"},
                     {"role": "assistant", "content": f"result {t}"}]
        msgs.append({"role": "user", "content": f"step {seq}"})
    return json.dumps({"model": "sim", "messages": msgs, "max_tokens": 24, "stream": stream})


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.sent = 0
        self.ok = 0
        self.failed = collections.Counter()
        self.ids = set()

    def add(self, sid, outcome):
        with self.lock:
            self.sent += 1
            self.ids.add(sid)
            if outcome == "ok":
                self.ok += 1
            else:
                self.failed[outcome] += 1


def one(conn, path, payload, sid, stream):
    conn.request("POST", path, body=payload,
                 headers={"content-type": "application/json", "x-soak-id": sid})
    r = conn.getresponse()
    data = r.read()
    if r.status != 200:
        try:
            code = json.loads(data)["error"]["code"]
        except Exception:
            code = "-"
        return f"http {r.status} {code}"
    if stream and b"data: [DONE]" not in data:
        return "stream cut"
    return "ok"


def worker(i, port, deadline, tally):
    conn = None
    seq = 0
    while time.time() < deadline:
        stream = seq % 2 == 0
        sid = f"{i}-{seq}"
        if conn is None:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        try:
            outcome = one(conn, "/v1/chat/completions", body(i, seq, stream), sid, stream)
        except Exception as e:  # connection-level: reset, closed, timeout
            outcome = f"connection {type(e).__name__}"
            conn.close()
            conn = None
        tally.add(sid, outcome)
        seq += 1


def trickler(i, port, deadline, tally):
    """A client that uploads its body a byte every 2 s: it must get its 408
    (or be closed) without holding anyone else up."""
    while time.time() < deadline:
        sid = f"trickle-{i}-{time.time():.0f}"
        outcome = "trickle: no answer"
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=30)
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
                      b"content-length: 100000\r\nx-soak-id: " + sid.encode() + b"\r\n\r\n{")
            while time.time() < deadline:
                try:
                    s.settimeout(2)
                    head = s.recv(64)
                    outcome = "trickle: " + (head.split(b" ")[1].decode() if head.startswith(b"HTTP/") else "closed")
                    break
                except socket.timeout:
                    s.sendall(b" ")
            s.close()
        except OSError as e:
            outcome = f"trickle: {type(e).__name__}"
        tally.add(sid, outcome)


def start_redis(port):
    try:
        p = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                              "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except FileNotFoundError:
        return None
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return p
        except OSError:
            time.sleep(0.05)
    p.kill()
    return None


def sim_post(port, path, conn=None):
    """POSTs a control path; `conn`: on that kept-alive connection (a
    simulator that stopped accepting is resumed over the one that paused it)."""
    c = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    c.request("POST", path)
    c.getresponse().read()


def sample(pid):
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(l.split()[1]) for l in f if l.startswith("VmRSS"))
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


def metric(port, name):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    return sum(float(l.split()[-1]) for l in text.splitlines() if l.startswith(name))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=180)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench-out/soak.json"))
    ap.add_argument("--doc", help="write the figures into this Markdown file")
    ap.add_argument("--tricklers", type=int, default=32, help="clients trickling their uploads")
    a = ap.parse_args()

    work = tempfile.mkdtemp(prefix="prefix-router-soak-")
    names = ["s0", "s1", "s2"]
    ports = {n: free_port() for n in names}
    sims = {n: start_sim(n, ports[n], work) for n in names}
    port, mport = free_port(), free_port()
    redis_port = free_port()
    redis = start_redis(redis_port)
    if redis is None:
        print("redis-server not found: the Redis partition is skipped", file=sys.stderr)
        redis_port = None
    cfg = os.path.join(work, "router.yaml")
    with open(cfg, "w") as f:
        f.write(config(port, mport, ports.items(), redis_port=redis_port))
    router = subprocess.Popen([os.path.join(ROOT, "target/release/prefix-router"), "--config", cfg],
                              stdout=subprocess.DEVNULL, stderr=open(os.path.join(work, "router.log"), "w"),
                              env={**os.environ, "RUST_LOG": "warn"})
    for _ in range(200):
        try:
            if metric(mport, 'prefix_router_replica_up{') == 3:
                break
        except OSError:
            pass
        time.sleep(0.1)
    else:
        sys.exit("router did not come up")

    tally = Tally()
    start = time.time()
    deadline = start + a.duration
    threads = [threading.Thread(target=worker, args=(i, port, deadline, tally), daemon=True)
               for i in range(a.concurrency)]
    threads += [threading.Thread(target=trickler, args=(i, port, deadline, tally), daemon=True)
                for i in range(a.tricklers)]
    for t in threads:
        t.start()
    samples, events = [], []
    plan = [(0.1, "late health checks"), (0.2, "health checks on time"),
            (0.3, "kill s1"), (0.4, "s2 stops accepting"), (0.5, "restart s1"),
            (0.55, "s2 accepts"), (0.6, "redis partition"), (0.7, "reload"),
            (0.75, "redis back")]
    if redis is None:
        plan = [p for p in plan if "redis" not in p[1]]
    while time.time() < deadline:
        el = (time.time() - start) / a.duration
        while plan and el >= plan[0][0]:
            _, what = plan.pop(0)
            if what == "kill s1":
                sims["s1"].send_signal(signal.SIGKILL)
                sims["s1"].wait()
            elif what == "restart s1":
                sims["s1"] = start_sim("s1", ports["s1"], work)
            elif what == "late health checks":
                # Past the check's deadline: every engine looks busy.
                for n in names:
                    sim_post(ports[n], "/sim/health?delay_ms=4000")
            elif what == "health checks on time":
                for n in names:
                    sim_post(ports[n], "/sim/health?delay_ms=0")
            elif what == "s2 stops accepting":
                control = http.client.HTTPConnection("127.0.0.1", ports["s2"], timeout=5)
                sim_post(ports["s2"], "/sim/accept?paused=true", control)
            elif what == "s2 accepts":
                sim_post(ports["s2"], "/sim/accept?paused=false", control)
            elif what == "redis partition":
                redis.send_signal(signal.SIGSTOP)
            elif what == "redis back":
                redis.send_signal(signal.SIGCONT)
            else:
                with open(cfg + ".tmp", "w") as f:
                    f.write(config(port, mport, reversed(list(ports.items())), "# reloaded"))
                os.rename(cfg + ".tmp", cfg)
            events.append((round(time.time() - start, 1), what))
        samples.append((round(time.time() - start, 1), *sample(router.pid)))
        time.sleep(1)
    for t in threads:
        t.join()
    time.sleep(3)  # idle: pooled connections may close, gauges settle
    idle_rss, idle_fds = sample(router.pid)
    reloads_ok = metric(mport, 'prefix_router_config_reloads_total{result="ok"}')
    failovers = metric(mport, "prefix_router_failovers_total")
    ejections = metric(mport, "prefix_router_ejections_total")

    delivered = collections.Counter()
    for n in names:
        with open(os.path.join(work, f"{n}.ids")) as f:
            delivered.update(l.strip() for l in f if l.strip())
    duplicates = sum(1 for sid, c in delivered.items() if c > 1)
    # Every request is answered or failed, each counted once.
    accounted = tally.ok + sum(tally.failed.values()) == tally.sent == len(tally.ids)
    unknown = sum(1 for sid in delivered if sid not in tally.ids)

    warm = [s for s in samples if s[0] >= a.duration * 0.2]
    result = {
        "duration_s": a.duration, "concurrency": a.concurrency,
        "sent": tally.sent, "answered_ok": tally.ok, "failed": dict(tally.failed),
        "delivered_to_replicas": sum(delivered.values()), "duplicates": duplicates,
        "delivered_unknown_ids": unknown, "accounted": accounted,
        "tricklers": a.tricklers, "redis": redis_port is not None,
        "events": events, "reloads_ok": reloads_ok, "failovers": failovers, "ejections": ejections,
        "rss_kib": {"peak": max(s[1] for s in samples), "after_warmup": warm[0][1] if warm else None,
                    "end": samples[-1][1], "idle_after": idle_rss},
        "fds": {"after_warmup": warm[0][2] if warm else None, "peak": max(s[2] for s in samples),
                "end": samples[-1][2], "idle_after": idle_fds},
        "samples": samples,
    }
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    router.terminate()
    for p in sims.values():
        p.kill()
    if redis is not None:
        redis.send_signal(signal.SIGCONT)
        redis.kill()
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1))
    if a.doc:
        write_doc(a.doc, result)
    return 0 if duplicates == 0 and accounted and unknown == 0 else 1


def series(r):
    samples = r["samples"]
    picks = [samples[min(len(samples) - 1, i * len(samples) // 10)] for i in range(10)] + [samples[-1]]
    return ", ".join(f"{t:.0f} s {rss / 1024:.1f}" for t, rss, _ in picks)


def write_doc(path, r):
    with open(path) as f:
        text = f.read()
    marker = "<!-- soak figures -->"
    head = text.split(marker)[0]
    fails = "\n".join(f"| {k} | {v} |" for k, v in sorted(r["failed"].items())) or "| (none) | 0 |"
    rss, fds = r["rss_kib"], r["fds"]
    figures = f"""{marker}
One run of `scripts/soak.py --duration {r['duration_s']:.0f} --concurrency {r['concurrency']} --tricklers {r['tricklers']}` (half of
the requests streaming; {'' if r['redis'] else 'no redis-server here, so no Redis partition; '}events at {', '.join(f'{t} s {w}' for t, w in r['events'])}):

| requests | count |
|---|---|
| sent (trickled uploads included) | {r['sent']} |
| every one answered or failed, once | {'yes' if r['accounted'] else '**no**'} |
| answered 200 (streams complete) | {r['answered_ok']} |
| delivered to replicas (id logs) | {r['delivered_to_replicas']} |
| **delivered twice** | **{r['duplicates']}** |
| reloads applied / failovers / ejections | {r['reloads_ok']:.0f} / {r['failovers']:.0f} / {r['ejections']:.0f} |

| failed by class | count |
|---|---|
{fails}

| router process | after warm-up (20 %) | peak | end of load | 3 s idle after |
|---|---|---|---|---|
| RSS (MiB) | {rss['after_warmup'] / 1024:.1f} | {rss['peak'] / 1024:.1f} | {rss['end'] / 1024:.1f} | {rss['idle_after'] / 1024:.1f} |
| open fds | {fds['after_warmup']} | {fds['peak']} | {fds['end']} | {fds['idle_after']} |

RSS over the run (MiB, one sample per tenth): {series(r)}
"""
    with open(path, "w") as f:
        f.write(head + figures)


if __name__ == "__main__":
    sys.exit(main())
