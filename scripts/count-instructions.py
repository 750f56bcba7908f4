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

Needs valgrind (Debian's `valgrind`), wrk, nginx, and the release build
(`cargo build --release --bins --examples`). Takes about a minute per arm and
case; Valgrind runs the proxy some 20-50 times slower.
"""
import argparse
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
EVENTS = {"Ir": "instructions", "I1mr": "L1i misses", "D1mr": "L1d read misses",
          "D1mw": "L1d write misses", "Bcm": "mispredicted branches", "Bim": "mispredicted indirect"}


def command(arm, port, ups, work):
    if arm == "pingora":
        cmd = [os.path.join(bp.ROOT, "target/release/examples/plain-pingora"),
               "--listen", f"127.0.0.1:{port}", "--threads", "1"]
        for p in ups:
            cmd += ["--upstream", f"127.0.0.1:{p}"]
        return cmd
    cfg = bp.write(os.path.join(work, f"{arm}.yaml"), bp.router_conf(port, bp.free_port(), ups, 1))
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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="get,4k", help=f"subset of {','.join(bp.CASES)}")
    ap.add_argument("--conc", type=int, default=4, help="wrk connections")
    ap.add_argument("--duration", type=int, default=10, help="seconds of the measured run")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--cache", action="store_true", help="simulate caches and branches too")
    ap.add_argument("--hooks", action="store_true", help="the router's hooks, inclusive")
    ap.add_argument("--proxy-cpu", default="0")
    ap.add_argument("--load-cpus", default="1")
    ap.add_argument("--out", default=os.path.join(bp.ROOT, "bench-out/instructions"))
    a = ap.parse_args()
    a.cases = a.cases.split(",")
    for tool in ("valgrind", "callgrind_control", "callgrind_annotate", "wrk", "nginx"):
        if not shutil.which(tool):
            sys.exit(f"needs {tool} (apt-get install valgrind wrk nginx-light)")
    work = os.path.join(a.out, "work")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    procs = bp.Procs(work)
    try:
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
        rows = [count(a, procs, work, ups, bodies, luas, arm, case) for case in a.cases for arm in ARMS]
    finally:
        procs.stop_all()
    events = [e for e in EVENTS if e in rows[0]["per_request"]]
    print("| case | arm | requests | " + " | ".join(f"{EVENTS[e]} per request" for e in events) + " |")
    print("|---|---|---|" + "---|" * len(events))
    for r in rows:
        print(f"| {r['case']} | {r['arm']} | {r['requests']:,} | " +
              " | ".join(f"{r['per_request'][e]:,.0f}" for e in events) + " |")
    for case in a.cases:
        p, q = (next(r for r in rows if r["case"] == case and r["arm"] == arm) for arm in ARMS)
        print(f"\n{case}: router ÷ plain Pingora, instructions per request: "
              f"{q['per_request']['Ir'] / p['per_request']['Ir']:.2f}")
        for name, ir in q["hooks"].items():
            print(f"  {name}: {ir:,.0f} instructions per request, inclusive")


if __name__ == "__main__":
    main()
