#!/usr/bin/env python3
"""Proxy work counted, not timed: user-mode instructions per request of plain
Pingora and the router (at `warn`), each run under Valgrind's callgrind in
front of the benchmark's two nginx upstreams, in the setup of `make
bench-proxy` (scripts/bench-proxy.py, whose pieces it reuses). This machine's
timings swing ±20 % between rounds and its virtual CPUs have no hardware
counters; instruction counts do not swing (docs/performance.md, issue 33).

Each arm: started under `valgrind --tool=callgrind --instr-atstart=no`, a
warm-up of wrk, then instrumentation on (`callgrind_control -i on`) for one
measured wrk run, a dump, and the totals divided by the requests served.
`--cache` adds callgrind's cache and branch simulation (L1 misses and
mispredicted branches per request: what makes the same instructions slower).

    scripts/count-instructions.py                       # GET and 4 KiB, both arms
    scripts/count-instructions.py --cases 4k --hooks    # and the router's hooks, inclusive
    scripts/count-instructions.py --cache
    scripts/count-instructions.py --sse                 # per SSE event relayed instead

`--sse` counts instructions per SSE event relayed: each arm in front of two
`routebench stubs` sending one event a second per stream, `routebench hold`
holding `--streams` streams open through it (the router without probes),
instrumentation on for `--duration` seconds once all are open.

Needs valgrind (Debian's `valgrind`), wrk, nginx, and the release build
(`cargo build --release --bins --examples`). Takes about a minute per arm and
case; Valgrind runs the proxy some 20-50 times slower.
"""
import argparse
import json
import threading
import time
import importlib.util
import os
import re
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("bench_proxy", os.path.join(HERE, "bench-proxy.py"))
bp = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bp)

ARMS = ("pingora", "router-warn")
ROUTEBENCH = os.path.join(bp.ROOT, "target/release/routebench")
EVENTS = {"Ir": "instructions", "I1mr": "L1i misses", "D1mr": "L1d read misses",
          "D1mw": "L1d write misses", "Bcm": "mispredicted branches", "Bim": "mispredicted indirect"}


def command(arm, port, ups, work, tag="", edit=lambda conf: conf):
    """The arm's command line; the router's config is `edit` of the benchmark's."""
    if arm == "pingora":
        cmd = [os.path.join(bp.ROOT, "target/release/examples/plain-pingora"),
               "--listen", f"127.0.0.1:{port}", "--threads", "1"]
        for p in ups:
            cmd += ["--upstream", f"127.0.0.1:{p}"]
        return cmd
    cfg = bp.write(os.path.join(work, f"{arm}{tag}.yaml"), edit(bp.router_conf(port, bp.free_port(), ups, 1)))
    return [os.path.join(bp.ROOT, "target/release/prefix-router"), "--config", cfg]


def totals(path):
    """{event: count} of a callgrind dump."""
    out = subprocess.run(["callgrind_annotate", path], capture_output=True, text=True).stdout
    events = re.search(r"^Events shown:\s+(.*)$", out, re.M).group(1).split()
    line = next(l for l in out.splitlines() if "PROGRAM TOTALS" in l)
    counts = [int(x.replace(",", "")) for x in re.findall(r"([\d,]+) \(", line)]
    return dict(zip(events, counts))


def hooks(path, requests):
    """The router's `ProxyHttp` hooks, inclusive instructions per request."""
    out = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--threshold=100", path],
                         capture_output=True, text=True).stdout
    seen = {}
    for l in out.splitlines():
        m = re.match(r"\s*([\d,]+) .*Router as pingora_proxy::proxy_trait::ProxyHttp>::(\w+)", l)
        if m and m.group(2) not in seen:
            seen[m.group(2)] = int(m.group(1).replace(",", "")) / requests
    return seen


def count(a, procs, work, ups, bodies, luas, arm, case):
    port = bp.free_port()
    dump = os.path.join(work, f"callgrind-{arm}-{case}.out")
    vg = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={dump}"]
    if a.cache:
        vg += ["--cache-sim=yes", "--branch-sim=yes"]
    proc = procs.start(f"{arm}-{case}", vg + command(arm, port, ups, work), a.proxy_cpu,
                       {"RUST_LOG": "warn"})
    why = bp.wait_ready(arm, port, proc, bodies, 120)
    if why:
        sys.exit(f"{arm} did not come up under valgrind: {why}")
    info = {"port": port, "proc": None}
    bp.run_one(a, arm, info, case, a.conc, a.warmup, luas[case], [])
    subprocess.run(["callgrind_control", "-i", "on", str(proc.pid)], check=True, capture_output=True)
    r = bp.run_one(a, arm, info, case, a.conc, a.duration, luas[case], [])
    subprocess.run(["callgrind_control", "-d", str(proc.pid)], check=True, capture_output=True)
    os.killpg(proc.pid, 9)  # dumped already; a graceful stop under valgrind is slow
    proc.wait()
    first = f"{dump}.1"
    got = totals(first)
    return {"arm": arm, "case": case, "requests": r["requests"], "errors": r["errors"],
            "per_request": {e: got[e] / max(1, r["requests"]) for e in got},
            "hooks": hooks(first, r["requests"]) if a.hooks and arm != "pingora" else {}}


def per_request(a, procs, work):
    """The rows of the per-request count (GET, 4 KiB) behind nginx upstreams."""
    bodies = {c: bp.chat_body(size, stream) for c, (_, _, size, stream, _) in bp.CASES.items() if size}
    files = {}
    for c, b in bodies.items():
        files[c] = os.path.join(work, f"{c}.json")
        with open(files[c], "wb") as f:
            f.write(b)
    ups = [bp.free_port(), bp.free_port()]
    os.makedirs(os.path.join(work, "upstream-body"), exist_ok=True)
    cfg = bp.write(os.path.join(work, "upstream.conf"), bp.upstream_conf(work, dict(zip("ab", ups))))
    upstream = procs.start("upstream", ["nginx", "-e", os.path.join(work, "upstream.err"), "-p", work,
                                        "-c", cfg], a.load_cpus)
    for p in ups:
        if bp.wait_ready("direct", p, upstream, bodies, 10):
            sys.exit(f"upstreams did not come up; see {work}")
    luas = {c: bp.lua_script(work, c, files.get(c)) for c in a.cases}
    return [count(a, procs, work, ups, bodies, luas, arm, case) for case in a.cases for arm in ARMS]


def read_ports(proc, log, n):
    """The first `n` ports the stubs printed."""
    deadline = time.time() + 30
    while time.time() < deadline:
        with open(log) as f:
            ports = [int(l) for l in f.read().split()[:n] if l.isdigit()]
        if len(ports) == n:
            return ports
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    sys.exit(f"stubs did not start; see {log}")


def held_events(holder, latest):
    """Keeps `latest[0]` the holder's newest report (a thread)."""
    for line in holder.stdout:
        if line.startswith("{"):
            latest[0] = json.loads(line)


def count_sse(a, procs, work, ups, body_file, arm):
    port = bp.free_port()
    dump = os.path.join(work, f"callgrind-{arm}-sse.out")
    cmd = command(arm, port, ups, work, "-sse", lambda conf: conf.replace(
        "health_check: {interval_ms: 1000}", "health_check: {interval_ms: 600000}"))
    vg = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={dump}"]
    proc = procs.start(f"{arm}-sse", vg + cmd, a.proxy_cpu, {"RUST_LOG": "warn"})
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if bp.request(port, "GET", "/v1/models")[0] == 200:
                break
        except OSError:
            pass
        time.sleep(0.2)
    else:
        sys.exit(f"{arm} did not come up under valgrind")
    holder = subprocess.Popen(["taskset", "-c", a.load_cpus, ROUTEBENCH, "hold", "--addr", f"127.0.0.1:{port}",
                               "--streams", str(a.streams), "--rate", str(a.streams), "--body-file", body_file,
                               "--report-ms", "100"], stdout=subprocess.PIPE, text=True, start_new_session=True)
    procs.all.append(holder)
    latest = [None]
    threading.Thread(target=held_events, args=(holder, latest), daemon=True).start()
    while not latest[0] or latest[0]["opened"] + latest[0]["failed"] < a.streams:
        time.sleep(0.1)
    time.sleep(a.warmup)
    subprocess.run(["callgrind_control", "-i", "on", str(proc.pid)], check=True, capture_output=True)
    e0 = latest[0]["events"]
    time.sleep(a.duration)
    subprocess.run(["callgrind_control", "-d", str(proc.pid)], check=True, capture_output=True)
    last = latest[0]
    os.killpg(proc.pid, 9)
    proc.wait()
    os.killpg(holder.pid, 9)
    holder.wait()
    events = last["events"] - e0
    got = totals(f"{dump}.1")
    return {"arm": arm, "case": "sse", "requests": events, "errors": last["failed"],
            "per_request": {e: got[e] / max(1, events) for e in got}, "hooks": {}}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="get,4k", help=f"subset of {','.join(bp.CASES)}")
    ap.add_argument("--conc", type=int, default=4, help="wrk connections")
    ap.add_argument("--duration", type=int, default=10, help="seconds of the measured run")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--cache", action="store_true", help="simulate caches and branches too")
    ap.add_argument("--hooks", action="store_true", help="the router's hooks, inclusive")
    ap.add_argument("--sse", action="store_true", help="per SSE event relayed, not per request")
    ap.add_argument("--streams", type=int, default=200, help="streams held open (--sse)")
    ap.add_argument("--proxy-cpu", default="0")
    ap.add_argument("--load-cpus", default="1")
    ap.add_argument("--out", default=os.path.join(bp.ROOT, "bench-out/instructions"))
    a = ap.parse_args()
    a.cases = a.cases.split(",")
    for tool in ("valgrind", "callgrind_control", "callgrind_annotate") + (() if a.sse else ("wrk", "nginx")):
        if not shutil.which(tool):
            sys.exit(f"needs {tool} (apt-get install valgrind wrk nginx-light)")
    work = os.path.join(a.out, "work")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    procs = bp.Procs(work)
    try:
        if a.sse:
            stubs = procs.start("stubs", [ROUTEBENCH, "stubs", "--replicas", "2", "--events", "100000",
                                          "--gap-ms", "1000", "--delay-ms", "0"], a.load_cpus)
            ups = read_ports(stubs, os.path.join(work, "stubs.log"), 2)
            body = bp.write(os.path.join(work, "stream.json"), json.dumps(
                {"model": "bench", "stream": True, "max_tokens": 64,
                 "messages": [{"role": "user", "content": "tell me a long story, slowly"}]}))
            rows = [count_sse(a, procs, work, ups, body, arm) for arm in ARMS]
            a.cases = ["sse"]
        else:
            rows = per_request(a, procs, work)
    finally:
        procs.stop_all()
    report(rows, a)


def report(rows, a):
    unit = "event" if a.sse else "request"
    events = [e for e in EVENTS if e in rows[0]["per_request"]]
    print(f"| case | arm | {unit}s | " + " | ".join(f"{EVENTS[e]} per {unit}" for e in events) + " |")
    print("|---|---|---|" + "---|" * len(events))
    for r in rows:
        print(f"| {r['case']} | {r['arm']} | {r['requests']:,} | " +
              " | ".join(f"{r['per_request'][e]:,.0f}" for e in events) + " |")
    for case in a.cases:
        p, q = (next(r for r in rows if r["case"] == case and r["arm"] == arm) for arm in ARMS)
        print(f"\n{case}: router ÷ plain Pingora, instructions per {unit}: "
              f"{q['per_request']['Ir'] / p['per_request']['Ir']:.2f}")
        for name, ir in q["hooks"].items():
            print(f"  {name}: {ir:,.0f} instructions per {unit}, inclusive")


if __name__ == "__main__":
    main()
