#!/usr/bin/env python3
"""Scale: how the router's cost grows with its fleet and its open streams,
beside SMG's, in one run (issue 31).

Replicas are `routebench stubs`: N lightweight replicas in one process
(health, `/v1/models`, vLLM-format `/metrics`, a fixed small chat answer or a
slow SSE stream). The router (`policy: shape`, `threads: 1`, health checks
every second, `engine_load` reading every replica's `/metrics` every 500 ms,
its access log on as shipped) and SMG (`cache_aware`) each run pinned to one
CPU (--proxy-cpu); the stubs, wrk and the stream holder share the other
(--load-cpus). Arms alternate at every size.

Curves:
- replicas (2, 16, 128, 1000): the CPU the arm spends idle (health checks,
  model lists, engine reads), then wrk at 16 connections sending distinct
  ~4 KiB one-shot questions (each a single, spread by the counter): req/s,
  p50/p99 and p50 added over the stub direct, CPU-µs per request, RSS, and
  a `/metrics` scrape's size and time;
- open streams (100, 1000, 10000, capped by the descriptor budget: two per
  stream): `routebench hold` opens that many SSE streams (one event a
  second) through the arm, then, with all held: RSS per stream, CPU per SSE
  event, and a new small request's latency (wrk, one connection) against the
  same with nothing held;
- conversations (10,000, 100,000, 1,000,000): wrk places that many distinct
  agent conversations (about 1.2 KiB each, a model turn in it) through the
  arm in front of two stubs, then sends next turns of conversations drawn
  at random: CPU-µs per next turn (its lookup in an index of that size),
  memory per conversation (RSS, and the router's index bytes and entries);
- prompt size (4, 40, 400 KiB): 16 agent loops (each turn the last one's
  body plus a model turn and a user turn; every 8th a new conversation)
  through the arm at 4 connections: CPU-µs per request with the
  checkpoints (a later turn's body read from where its last turn ended)
  and without them (`limits.max_checkpoint_bytes: 0`);
- probes (the replicas curve's sizes): the CPU each arm spends idle under
  four probe schedules of the router (every probe on within its budget, as
  on the replicas curve; the same with no budget; as shipped: health checks
  every second within 250 a second, no engine reads; SMG's default: health
  checks every 60 s) beside SMG's: what the idle curve costs per probe, and
  what it costs at equal work;
- fleet (1, 2, 3 router instances, `fleet: redis`): instances sharing pins
  through one Redis, each placing a share of the conversations, then next
  turns of random ones against all at once: CPU per request of the
  instances and of Redis, lookups and Redis calls per request.

    make bench-scale          # or: scripts/bench-scale.py --doc docs/scale.md
    scripts/bench-scale.py --quick --arms router

Writes bench-out/scale/scale.json, and with --doc the block between
`<!-- scale bench -->` and `<!-- /scale bench -->` of that Markdown file (the
rest is kept) with its plots (SVG) beside it.
"""

import argparse
import importlib.util
import json
import math
import os
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("bench_proxy", os.path.join(HERE, "bench-proxy.py"))
bp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bp)
ROOT, Procs, tree, cpu_s, status_kib, free_port, write = bp.ROOT, bp.Procs, bp.tree, bp.cpu_s, bp.status_kib, bp.free_port, bp.write

ARMS = ["router", "smg"]
# Floors for the flatness part: proxies that only forward, round robin.
FLOORS = ["pingora", "nginx"]
PARTS = ["replicas", "flat", "probes", "streams", "conversations", "prompts", "fleet"]
# The router's probe schedules on the probes curve: name, what, config lines.
# Each within its default budget (`max_per_second`: 250 checks, 500 reads).
ALL_PROBES = ["health_check: {interval_ms: 1000}", "engine_load: {interval_ms: 500}"]
BUDGETS = {"health_check": 250, "engine_load": 500}
SCHEDULES = [("all", "health checks every 1 s, engine load every 500 ms, within their budgets", ALL_PROBES),
             ("all, no budget", "the same on every replica every round (`max_per_second: 0`)",
              ["health_check: {interval_ms: 1000, max_per_second: 0}",
               "engine_load: {interval_ms: 500, max_per_second: 0}"]),
             ("shipped", "health checks every 1 s within 250 a second, no engine reads (the defaults)",
              ["health_check: {interval_ms: 1000}"]),
             ("smg", "health checks every 60 s (SMG's default)", ["health_check: {interval_ms: 60000}"])]


def probes_per_s(lines, n):
    """Probes a second of the schedule's `lines` over `n` replicas: each
    line's replicas every interval, or, past its budget, a slice of them
    (`src/replicas/probes.rs`: one turn in `ceil(n / per round)`)."""
    total = 0.0
    for line in lines:
        key = line.split(":")[0]
        interval = int(re.search(r"interval_ms: (\d+)", line).group(1)) / 1000
        found = re.search(r"max_per_second: (\d+)", line)
        budget = int(found.group(1)) if found else BUDGETS[key]
        spread = math.ceil(n / max(budget * interval, 1)) if budget else 1
        total += n / max(spread, 1) / interval
    return total
# What the report says of how a run was made (kept in scale.json).
RUN_ARGS = ["duration", "idle", "settle", "rate", "window", "probe", "rounds", "cycles", "leg", "max_steal",
            "steal_tries", "flat_think_ms"]
MARK_BEGIN, MARK_END = "<!-- scale bench -->", "<!-- /scale bench -->"
NAMES = {"router": "prefix-router", "smg": "SMG cache_aware", "direct": "stub direct",
         "pingora": "plain Pingora (round robin)", "nginx": "nginx (round robin)",
         "router-nockpt": "prefix-router, no checkpoints", "baseline": "prefix-router, --baseline binary"}
ROUTEBENCH = os.path.join(ROOT, "target/release/routebench")
ROUTER = os.path.join(ROOT, "target/release/prefix-router")
# Distinct one-shot questions of about 4 KiB: a number first, so no two share
# a prefix (each is a single, spread by the counter). wrk's Lua starts every
# run with the same random sequence; seeded from /dev/urandom, a run does not
# repeat an earlier run's questions (which the router would pin as
# continuations of them).
LUA = r"""
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local filler = string.rep("please summarise the following notes for the team meeting. ", 66)
n = 0
bad = 0
local threads = {}
function setup(thread) table.insert(threads, thread) end
function init(args)
  n = 0; bad = 0
  local f = io.open("/dev/urandom", "rb")
  local b1, b2, b3 = f:read(3):byte(1, 3)
  f:close()
  math.randomseed(b1 * 65536 + b2 * 256 + b3)
end
function request()
  n = n + 1
  local body = '{"model":"bench","max_tokens":16,"messages":[{"role":"user","content":"question ' ..
    n .. " " .. math.random(1000000000) .. ": " .. filler .. '"}]}'
  return wrk.format(nil, nil, nil, body)
end
function response(status, headers, body)
  if status ~= 200 or not body or not string.find(body, "chat.completion", 1, true) then bad = bad + 1 end
end
function done(summary, latency, requests)
  local b = 0
  for _, t in ipairs(threads) do b = b + t:get("bad") end
  local e = summary.errors
  io.write(string.format('BENCH {"requests": %d, "duration_us": %d, "bad": %d, "errors": %d, ' ..
    '"p50_us": %d, "p99_us": %d}\n', summary.requests, summary.duration, b,
    e.connect + e.read + e.write + e.timeout, latency:percentile(50), latency:percentile(99)))
end
"""

# Agent conversations (args: first, count, mode). `fill` places
# conversation first, first+1, ... up to count (then next turns); `turn`
# sends the next turn of a conversation drawn at random below count.
CONV_LUA = r"""
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local filler = string.rep("keep the build green and answer in one line. ", 22)
local first, count, mode
n = 0
bad = 0
local threads = {}
function setup(thread) table.insert(threads, thread) end
function init(args) first = tonumber(args[1]); count = tonumber(args[2]); mode = args[3]; n = 0; bad = 0 end
function request()
  local i = first + n
  n = n + 1
  local tail = ""
  if mode ~= "fill" or i >= count then
    i = math.random(0, count - 1)
    tail = ',{"role":"assistant","content":"done two"},{"role":"user","content":"step three"}'
  end
  local body = '{"model":"bench","max_tokens":16,"messages":[{"role":"system","content":"conversation ' ..
    i .. ": " .. filler .. '"},{"role":"user","content":"step one"},{"role":"assistant","content":"done one"},' ..
    '{"role":"user","content":"step two"}' .. tail .. ']}'
  return wrk.format(nil, nil, nil, body)
end
""" + LUA[LUA.index("function response"):]

# Agent loops of a given size (args: bytes): 16 conversations take turns;
# each turn is the conversation's last body plus a model and a user turn;
# every 8th turn starts a new conversation.
LOOP_LUA = r"""
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local size
n = 0
bad = 0
local threads = {}
function setup(thread) table.insert(threads, thread) end
function init(args) size = tonumber(args[1]); n = 0; bad = 0 end
local unit = "the tool printed: build ok, 412 tests passed, \\n next: read src/main.rs and fix the warning. "
function request()
  local c, t = n % 16, math.floor(n / 16)
  n = n + 1
  local epoch, turn = math.floor(t / 8), t % 8
  local head = "loop " .. c .. "." .. epoch .. ": "
  local body = {'{"model":"bench","max_tokens":16,"messages":[{"role":"system","content":"', head,
    string.rep(unit, math.max(1, math.floor((size - 600) / #unit))), '"},{"role":"user","content":"start"}'}
  for k = 1, turn do
    table.insert(body, ',{"role":"assistant","content":"step ' .. k .. ' done"},{"role":"user","content":"go on ' .. k .. '"}')
  end
  table.insert(body, ']}')
  return wrk.format(nil, nil, nil, table.concat(body))
end
""" + LUA[LUA.index("function response"):]


def http_get(url, timeout=10):
    t = time.perf_counter()
    with urllib.request.urlopen(url, timeout=timeout) as r:
        body = r.read()
    return r.status, body, time.perf_counter() - t


def start_stubs(procs, a, name, n, events, gap_ms, delay_ms=0):
    p = subprocess.Popen(["taskset", "-c", a.load_cpus, ROUTEBENCH, "stubs", "--replicas", str(n),
                          "--events", str(events), "--gap-ms", str(gap_ms), "--delay-ms", str(delay_ms)],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    p.bench_name = name
    procs.all.append(p)
    ports = [int(p.stdout.readline()) for _ in range(n)]
    return p, ports


def is_router(arm):
    """The router's arms: this checkout's binary and `--baseline`'s."""
    return arm in ("router", "baseline")


def start_arm(procs, a, work, arm, ports, max_requests=None, extra=(), tag=None, probes=ALL_PROBES):
    """The arm in front of `ports`; `max_requests`: its bound on requests in
    flight, raised for the open-streams curve (both default to about 4,096);
    `extra`: lines of the router's config; `probes`: its probe schedule."""
    port, mport = free_port(), free_port()
    if is_router(arm):
        lines = [f'listen: "127.0.0.1:{port}"', f'metrics_listen: "127.0.0.1:{mport}"', "policy: shape",
                 "threads: 1", *probes]
        if max_requests:
            lines.append(f"limits: {{max_requests: {max_requests}}}")
        lines += extra
        lines.append("replicas:")
        lines += [f'  - {{name: r{i}, addr: "127.0.0.1:{p}"}}' for i, p in enumerate(ports)]
        tag = tag or f"{arm}-{len(ports)}"
        cfg = write(os.path.join(work, f"{tag}.yaml"), "\n".join(lines) + "\n")
        binary = a.baseline if arm == "baseline" else ROUTER
        proc = procs.start(tag, [binary, "--config", cfg], a.proxy_cpu, {"RUST_LOG": "info"})
    elif arm == "pingora":
        proc, why = bp.start_plain_pingora(procs, tag or f"pingora-{len(ports)}", port, ports, 1, a.proxy_cpu)
        if not proc:
            return None, why
    elif arm == "nginx":
        if not shutil.which("nginx"):
            return None, "nginx missing (apt install nginx-light)"
        tag = tag or f"nginx-{len(ports)}"
        # Twice as many idle connections kept as replicas: bench-proxy's 256
        # would close and open connections at 1,000.
        proc = bp.start_nginx(procs, tag, os.path.join(work, tag), port, ports, a.proxy_cpu,
                              keepalive=max(256, 2 * len(ports)))
    else:
        smg, why = bp.ensure_smg(a.venv)
        if not smg:
            return None, why
        proc = procs.start(f"smg-{len(ports)}", [smg, "launch", "--host", "127.0.0.1", "--port", str(port),
                                                 "--worker-urls"] + [f"http://127.0.0.1:{p}" for p in ports] +
                           ["--policy", "cache_aware", "--prometheus-host", "127.0.0.1",
                            "--prometheus-port", str(mport), "--log-level", "warn"] +
                           (["--max-concurrent-requests", str(max_requests)] if max_requests else []),
                           a.proxy_cpu)
    info = {"arm": arm, "port": port, "mport": mport, "proc": proc}
    why = wait_ready(info, len(ports))
    return (info, None) if not why else (None, why)


def ready_count(info):
    """Replicas the arm sees up, or None while it does not answer."""
    try:
        _, page, _ = http_get(f"http://127.0.0.1:{info['mport']}/metrics", 5)
    except OSError:
        return None
    page = page.decode()
    if is_router(info["arm"]):
        return len(re.findall(r'^prefix_router_replica_up\{[^}]*\} 1$', page, re.M))
    # SMG: a chat answered is enough to start; its workers are checked by it.
    return None


def wait_ready(info, n, timeout=180):
    deadline = time.time() + timeout
    body = json.dumps({"model": "bench", "messages": [{"role": "user", "content": "ready?"}]}).encode()
    while time.time() < deadline:
        if info["proc"].poll() is not None:
            return f"exited with {info['proc'].returncode}"
        up = ready_count(info)
        if is_router(info["arm"]) and (up or 0) < n:
            time.sleep(0.2)
            continue
        try:
            req = urllib.request.Request(f"http://127.0.0.1:{info['port']}/v1/chat/completions", body,
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=5) as r:
                if r.status == 200:
                    return None
        except OSError:
            pass
        time.sleep(0.2)
    return "not ready in time"


def pids_of(info):
    return tree(info["proc"].pid)


def wrk_cmd(a, port, lua, conns, seconds, args=()):
    return ["taskset", "-c", a.load_cpus, "wrk", "-t1", f"-c{conns}", f"-d{seconds}s", "--timeout", "10s",
            "-s", lua, f"http://127.0.0.1:{port}/v1/chat/completions", "--", *map(str, args)]


def wrk(a, port, lua, conns, seconds, args=()):
    return wrk_result(subprocess.run(wrk_cmd(a, port, lua, conns, seconds, args), capture_output=True,
                                     text=True).stdout)


def wrk_many(a, runs, seconds):
    """wrk against several ports at once: runs are (port, lua, conns, args)."""
    ps = [subprocess.Popen(wrk_cmd(a, port, lua, conns, seconds, args), stdout=subprocess.PIPE, text=True)
          for port, lua, conns, args in runs]
    return [wrk_result(p.communicate()[0]) for p in ps]


def wrk_result(out):
    line = next((l for l in out.splitlines() if l.startswith("BENCH ")), None)
    if line is None:
        raise RuntimeError(f"wrk printed no result:\n{out}")
    r = json.loads(line[6:])
    r["good"] = r["requests"] - r["bad"]
    r["rps"] = r["good"] / (r["duration_us"] / 1e6)
    return r


def scrape(info, times=5):
    url = f"http://127.0.0.1:{info['mport']}/metrics"
    got = [http_get(url) for _ in range(times)]
    return len(got[-1][1]), statistics.median(t for _, _, t in got)


def profile(a, arm, info, work, name, seconds):
    """With `--perf`, a profile of the router for `seconds` (OUT/perf-NAME.data,
    the baseline's OUT/perf-baseline-NAME.data: `perf report -i` it); the
    caller waits for it."""
    if not (a.perf and is_router(arm)):
        return None
    out = os.path.join(work, f"perf-{name}.data" if arm == "router" else f"perf-{arm}-{name}.data")
    return subprocess.Popen(["perf", "record", "-q", "-F", "999", "-g", "-p", str(info["proc"].pid),
                             "-o", out, "--", "sleep", str(seconds)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def replicas_point(a, procs, work, lua, arm, n, ports, direct):
    info, why = start_arm(procs, a, work, arm, ports)
    if not info:
        return {"arm": arm, "replicas": n, "skipped": why}
    pids = pids_of(info)
    time.sleep(a.settle)
    c0, t0 = cpu_s(pids), time.time()
    time.sleep(a.idle)
    idle = (cpu_s(pids) - c0) / (time.time() - t0)
    wrk(a, info["port"], lua, 16, 1)
    perf = profile(a, arm, info, work, n, a.duration)
    c0 = cpu_s(pids)
    r = wrk(a, info["port"], lua, 16, a.duration)
    cpu = cpu_s(pids) - c0
    if perf:
        perf.wait()
    size, took = scrape(info)
    point = {"arm": arm, "replicas": n, "idle_cpu": idle, "rps": r["rps"], "p50_us": r["p50_us"],
             "p99_us": r["p99_us"], "added_p50_us": r["p50_us"] - direct["p50_us"],
             "cpu_us_per_req": cpu / max(1, r["good"]) * 1e6,
             "cpu_us_per_req_less_idle": max(0.0, cpu - idle * r["duration_us"] / 1e6) / max(1, r["good"]) * 1e6,
             "rss_mib": status_kib(pids, "VmRSS") / 1024, "scrape_bytes": size, "scrape_ms": took * 1e3,
             "requests": r["requests"], "errors": r["bad"] + r["errors"]}
    stop(procs, info["proc"])
    return point


def signal_all(pids, sig):
    for p in pids:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def cpu_ticks(cpus):
    """Ticks of these CPUs (`/proc/stat`): (busy, steal). Busy is every
    tick but idle, iowait and steal."""
    busy = steal = 0
    for line in open("/proc/stat"):
        f = line.split()
        if f[0].startswith("cpu") and f[0][3:] in cpus:
            t = [int(x) for x in f[1:9]]
            busy += sum(t) - t[3] - t[4] - t[7]
            steal += t[7]
    return busy, steal


def flat_leg(a, s, lua):
    """One leg against an arm (warm-up, `flat_conns` connections, one connection),
    run again (after a pause) while the hypervisor took more than
    `max_steal` of the proxy CPU: on this shared host it has taken up to
    70 % of it for minutes, which no ratio survives."""
    port, cpus, load = s["info"]["port"], set(a.proxy_cpu.split(",")), set(a.load_cpus.split(","))
    for attempt in range(a.steal_tries):
        wrk(a, port, lua, a.flat_conns, 1)
        # User mode apart: the arm's own code, without the kernel's work
        # for its sockets, which on loopback includes the receiver's (a
        # write runs the peer's TCP receive and wakes it: across CPUs an
        # interprocessor interrupt, a hypervisor exit here).
        c0, u0, t0 = cpu_s(s["pids"]), cpu_s(s["pids"], user_only=True), time.time()
        (_, st0), (lb0, _) = cpu_ticks(cpus), cpu_ticks(load)
        r = wrk(a, port, lua, a.flat_conns, a.leg)
        wall, cpu, user = time.time() - t0, cpu_s(s["pids"]) - c0, cpu_s(s["pids"], user_only=True) - u0
        steal = (cpu_ticks(cpus)[1] - st0) / bp.TICK / wall / len(cpus)
        load_busy = (cpu_ticks(load)[0] - lb0) / bp.TICK / wall / len(load)
        one = wrk(a, port, lua, 1, a.leg)
        # At a fixed pace (each connection waits between requests): the
        # load an operator runs, not the arm's saturation.
        paced, paced_cpu = {"requests": 0, "bad": 0, "errors": 0}, None
        if a.flat_think_ms > 0:
            pc0 = cpu_s(s["pids"])
            paced = wrk(a, port, a.paced_lua, a.flat_conns, a.leg)
            paced_cpu = (cpu_s(s["pids"]) - pc0) / max(1, paced["good"]) * 1e6
        # Its idle CPU (the probes, timers) at this size, to leave out.
        i0, it0 = cpu_s(s["pids"]), time.time()
        time.sleep(a.leg)
        idle = (cpu_s(s["pids"]) - i0) / (time.time() - it0)
        if steal <= a.max_steal:
            break
        time.sleep(3)
    return {"cpu_us_per_req": cpu / max(1, r["good"]) * 1e6, "user_us_per_req": user / max(1, r["good"]) * 1e6,
            "less_idle_us_per_req": max(0.0, cpu - idle * wall) / max(1, r["good"]) * 1e6, "idle_cpu": idle,
            "p50_us": r["p50_us"], "one_p50_us": one["p50_us"],
            "busy": cpu / wall, "load_busy": load_busy, "steal": steal, "tries": attempt + 1,
            "paced_rps": paced.get("rps"), "paced_cpu_us_per_req": paced_cpu,
            "paced_p50_us": paced.get("p50_us"), "paced_p99_us": paced.get("p99_us"),
            "requests": r["requests"] + one["requests"] + paced["requests"],
            "errors": r["bad"] + r["errors"] + one["bad"] + one["errors"] + paced["bad"] + paced["errors"]}


def flat_part(a, procs, work, lua):
    """The flatness goal, paired: per arm, one instance in front of each
    size's stubs, all started at once; each cycle sends wrk to every size in
    turn (the order reversed every other cycle), the others stopped
    (SIGSTOP: their probes neither run nor take the CPU), so a cycle's
    ratios to the smallest size see one state of this noisy machine. A leg:
    1 s of warm-up, `leg` s at `flat_conns` connections (CPU per request, p50 at
    saturation), `leg` s at one connection (p50 with the arm otherwise
    idle), `leg` s at `flat_conns` connections each waiting `flat_think_ms`
    between requests (p50 and p99 at a fixed load under saturation), then
    `leg` s idle (the arm's CPU at rest: its probes and timers);
    each cycle also times one stub direct at one connection. A cycle
    in which a leg lost more than `max_steal` of the proxy CPU to the
    hypervisor, after `steal_tries`, counts in no ratio."""
    points = []
    for arm in a.arms:
        started, skipped = [], None
        try:
            for n in a.replicas:
                stubs, ports = start_stubs(procs, a, f"flat-stubs-{arm}-{n}", n, 4, 0, a.flat_delay_ms)
                probes = next(x[2] for x in SCHEDULES if x[0] == a.flat_probes)
                extra = a.router_line if arm == "router" else ()
                info, why = start_arm(procs, a, work, arm, ports, extra=extra, tag=f"flat-{arm}-{n}",
                                      probes=probes)
                if not info:
                    skipped = why
                    stop(procs, stubs)
                    break
                pids = pids_of(info)
                signal_all(pids, signal.SIGSTOP)
                started.append({"n": n, "info": info, "pids": pids, "stubs": stubs, "port0": ports[0], "legs": []})
            if skipped:
                points += [{"arm": arm, "replicas": n, "skipped": skipped} for n in a.replicas]
                continue
            for c in range(a.cycles):
                d = wrk(a, started[0]["port0"], lua, 1, a.leg)
                for s in (started if c % 2 == 0 else started[::-1]):
                    signal_all(s["pids"], signal.SIGCONT)
                    leg = flat_leg(a, s, lua)
                    signal_all(s["pids"], signal.SIGSTOP)
                    leg["one_added_us"] = leg["one_p50_us"] - d["p50_us"]
                    s["legs"].append(leg)
                print(json.dumps({"flat": arm, "cycle": c, "cpu": [round(s["legs"][-1]["cpu_us_per_req"], 1)
                                                                  for s in started],
                                  "steal": [round(s["legs"][-1]["steal"], 2) for s in started]}), file=sys.stderr)
        finally:
            for s in started:
                signal_all(s["pids"], signal.SIGCONT)
                stop(procs, s["info"]["proc"])
                stop(procs, s["stubs"])
        clean = [all(s["legs"][c]["steal"] <= a.max_steal for s in started) for c in range(len(started[0]["legs"]))]
        base = started[0]["legs"]
        paired = ("cpu_us_per_req", "less_idle_us_per_req", "user_us_per_req", "p50_us", "one_p50_us",
                  "one_added_us") + (("paced_rps", "paced_cpu_us_per_req", "paced_p50_us", "paced_p99_us")
                                     if a.flat_think_ms > 0 else ())
        for s in started:
            legs = [x for x, ok in zip(s["legs"], clean) if ok]
            pairs = [(x, b) for x, b, ok in zip(s["legs"], base, clean) if ok]
            point = {"arm": arm, "replicas": s["n"], "conns": a.flat_conns, "delay_ms": a.flat_delay_ms,
                     "probes": a.flat_probes, "cycles": len(s["legs"]), "clean_cycles": len(legs),
                     "config": a.router_line if arm == "router" else [],
                     "think_ms": a.flat_think_ms,
                     "tries": sum(x["tries"] for x in s["legs"]),
                     "steal": statistics.median(x["steal"] for x in s["legs"]),
                     "requests": sum(x["requests"] for x in s["legs"]),
                     "errors": sum(x["errors"] for x in s["legs"])}
            for k in ("busy", "load_busy", "idle_cpu", *paired):
                point[k] = statistics.median(x[k] for x in legs) if legs else None
            for k in paired:
                ratios = sorted(x[k] / b[k] for x, b in pairs if b[k] > 0)
                point[k + "_ratio"] = statistics.median(ratios) if ratios else None
                # The middle half of the cycles' ratios.
                q = len(ratios) // 4
                point[k + "_iqr"] = (ratios[q], ratios[-1 - q]) if ratios else None
            points.append(point)
    return points


def probes_point(a, procs, work, arm, n, ports, schedule):
    """The CPU the arm spends idle in front of `n` replicas, and per probe
    (health checks and engine reads a second, from its schedule; SMG's: one
    health check per replica every 60 s)."""
    name, _, lines = next(x for x in SCHEDULES if x[0] == schedule) if is_router(arm) else ("smg", "", [])
    info, why = start_arm(procs, a, work, arm, ports, probes=lines, tag=f"probes-{name}-{n}")
    point = {"arm": arm, "schedule": name, "replicas": n}
    if not info:
        return {**point, "skipped": why}
    pids = pids_of(info)
    time.sleep(a.settle)
    c0, t0 = cpu_s(pids), time.time()
    time.sleep(a.idle)
    idle = (cpu_s(pids) - c0) / (time.time() - t0)
    per_s = probes_per_s(lines, n) if lines else n / 60
    stop(procs, info["proc"])
    return {**point, "idle_cpu": idle, "probes_per_s": per_s,
            "cpu_us_per_probe": idle * 1e6 / per_s}


def stop(procs, p):
    if p.poll() is None:
        os.killpg(p.pid, 15)
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            p.wait()
    procs.all.remove(p)


def hold_lines(proc):
    """The holder's latest report."""
    line = proc.stdout.readline()
    return json.loads(line) if line else None


def threads_s(pids):
    """CPU time of each live thread of these processes, seconds, to the
    nanosecond (schedstat): for idle windows, where utime's 10 ms ticks are
    too coarse."""
    out = {}
    for p in pids:
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tids:
            try:
                with open(f"/proc/{p}/task/{t}/schedstat") as f:
                    out[t] = int(f.read().split()[0]) / 1e9
            except OSError:
                pass  # ended since the listing
    return out


def threads_since(pids, before):
    """CPU time since `before` (a `threads_s`) of the threads alive now: a
    thread that ended in between loses its share, but not, as in a plain
    sum, its whole life. For short idle windows; a window of work is read
    from utime and stime (`cpu_s`), which keep the share of threads that
    ended."""
    return sum(v - before.get(t, 0.0) for t, v in threads_s(pids).items())


def streams_point(a, procs, work, lua, arm, s, ports, body_file, rnd=0):
    info, why = start_arm(procs, a, work, arm, ports, max_requests=2 * s + 100)
    if not info:
        return {"arm": arm, "streams": s, "round": rnd, "skipped": why}
    pids = pids_of(info)
    time.sleep(a.settle)
    idle_probe = wrk(a, info["port"], lua, 1, a.probe)
    # Its probes and timers: a rate that is no event's work, left out of
    # `less_idle_us_per_event` (SMG checks its workers every 60 s, the
    # router every second and reads their load every 500 ms here). Read
    # after the probe has settled, so the window of events that follows
    # holds no aftermath of the probe's thousands of requests (the
    # router's pooled connections' idle timers tick for 4 s after them).
    time.sleep(a.settle)
    i0, t0 = threads_s(pids), time.time()
    time.sleep(a.idle)
    idle = threads_since(pids, i0) / (time.time() - t0)
    rss0 = status_kib(pids, "VmRSS")
    holder = subprocess.Popen(["taskset", "-c", a.load_cpus, ROUTEBENCH, "hold", "--addr",
                               f"127.0.0.1:{info['port']}", "--streams", str(s), "--rate", str(a.rate),
                               "--body-file", body_file, "--report-ms", "500"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    holder.bench_name = "hold"
    procs.all.append(holder)
    rep = hold_lines(holder)
    while rep and rep["opened"] + rep["failed"] < s:
        rep = hold_lines(holder)
    point = {"arm": arm, "streams": s, "round": rnd, "opened": rep["opened"] if rep else 0, "idle_p50_us": idle_probe["p50_us"],
             "idle_p99_us": idle_probe["p99_us"]}
    c0, n0, e0, t0 = cpu_s(pids), threads_s(pids), rep["events"], time.time()
    perf = profile(a, arm, info, work, f"streams-{s}-{rnd}", a.window)
    while rep and time.time() - t0 < a.window:
        rep = hold_lines(holder)
    cpu, n1, events, took = cpu_s(pids) - c0, threads_s(pids), (rep["events"] if rep else e0) - e0, time.time() - t0
    # To the nanosecond when no thread ended in the window (at 100 streams
    # the window's CPU is a few of utime's 10 ms ticks); else from utime and
    # stime, which keep an ended thread's share.
    point["cpu_clock"] = "ticks"
    if set(n0) <= set(n1):
        cpu, point["cpu_clock"] = sum(v - n0.get(t, 0.0) for t, v in n1.items()), "schedstat"
    if perf:
        # Counted before perf's own work at its end, which serves no event.
        perf.wait()
        point["profiled"] = True
    rss = status_kib(pids, "VmRSS")
    probe = wrk(a, info["port"], lua, 1, a.probe)
    point.update(rss_mib=rss / 1024, rss_kib_per_stream=(rss - rss0) / max(1, s), events=events,
                 cpu_us_per_event=cpu / max(1, events) * 1e6, idle_cpu=idle,
                 less_idle_us_per_event=max(0.0, cpu - idle * took) / max(1, events) * 1e6, held_p50_us=probe["p50_us"],
                 held_p99_us=probe["p99_us"], probe_errors=probe["bad"] + probe["errors"])
    while rep:
        rep, last = hold_lines(holder), rep
    point["done"], point["failed"] = last["done"], last["failed"]
    holder.wait()
    procs.all.remove(holder)
    stop(procs, info["proc"])
    return point


def metric_sums(infos, name, *labels):
    """The routers' series of `name` summed by the values of `labels`
    (a tuple of them; `()` with no labels)."""
    out = {}
    for info in infos:
        _, page, _ = http_get(f"http://127.0.0.1:{info['mport']}/metrics")
        for line in page.decode().splitlines():
            if line.split("{", 1)[0].split(" ", 1)[0] != name:
                continue
            got = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}", 1)[0]))
            key = tuple(got.get(l, "") for l in labels)
            out[key] = out.get(key, 0) + float(line.rsplit(" ", 1)[1])
    return out


def fill(a, port, lua, first, end):
    """Places conversations first..end through `port` (wrk, 16 connections,
    in chunks sized by the rate so far); returns requests answered and failed."""
    sent, errors, rate, t0 = 0, 0, None, time.time()
    while first + sent < end:
        secs = 3 if rate is None else min(30, max(1, int((end - first - sent) / rate + 1)))
        r = wrk(a, port, lua, 16, secs, (first + sent, end, "fill"))
        sent += r["good"]
        errors += r["bad"] + r["errors"]
        rate = sent / (time.time() - t0)
    return sent, errors


def conversations_point(a, procs, work, arm, n, ports):
    # About three index entries per conversation (a block, its end, the
    # end of its first turn): the cap holds them all.
    extra = [f"prefix_index: {{max_entries: {max(1 << 20, 4 * n)}}}"]
    info, why = start_arm(procs, a, work, arm, ports, extra=extra)
    if not info:
        return {"arm": arm, "conversations": n, "skipped": why}
    lua = os.path.join(work, "conversations.lua")
    pids = pids_of(info)
    time.sleep(a.settle)
    rss0 = status_kib(pids, "VmRSS")
    t0, c0 = time.time(), cpu_s(pids)
    sent, errors = fill(a, info["port"], lua, 0, n)
    fill_s, fill_cpu = time.time() - t0, cpu_s(pids) - c0
    rss = status_kib(pids, "VmRSS")
    point = {"arm": arm, "conversations": n, "fill_rps": sent / fill_s, "fill_cpu_us_per_req": fill_cpu / sent * 1e6,
             "rss_mib": rss / 1024, "rss_bytes_per_conv": (rss - rss0) * 1024 / n}
    if is_router(arm):
        entries = metric_sums([info], "prefix_router_prefix_index_entries").get((), 0)
        index_bytes = metric_sums([info], "prefix_router_prefix_index_bytes").get((), 0)
        point.update(index_entries=int(entries), index_bytes_per_conv=index_bytes / n)
    c0 = cpu_s(pids)
    r = wrk(a, info["port"], lua, 16, a.duration, (0, n, "turn"))
    cpu = cpu_s(pids) - c0
    point.update(rps=r["rps"], p50_us=r["p50_us"], p99_us=r["p99_us"],
                 cpu_us_per_req=cpu / max(1, r["good"]) * 1e6, requests=r["requests"],
                 errors=errors + r["bad"] + r["errors"])
    if is_router(arm):
        # Every turn should be pinned: decisions over the whole point.
        by = metric_sums([info], "prefix_router_requests_total", "decision")
        point["decisions"] = {d: int(v) for (d,), v in by.items()}
    stop(procs, info["proc"])
    return point


def redis_info(port, section):
    out = subprocess.run(["redis-cli", "-p", str(port), "INFO", section], capture_output=True, text=True).stdout
    return out.splitlines()


def fleet_point(a, procs, work, k, ports, redis, n):
    """`k` router instances sharing pins through one Redis (`fleet: redis`)
    in front of the same two stubs: each places its share of `n`
    conversations, then next turns of random ones reach every instance at
    once (most of them placed by another)."""
    port = redis["port"]
    for cmd in (["FLUSHALL"], ["CONFIG", "RESETSTAT"]):
        subprocess.run(["redis-cli", "-p", str(port), *cmd], capture_output=True)
    extra = [f'fleet: {{mode: redis, redis_url: "redis://127.0.0.1:{port}"}}']
    infos = []
    for i in range(k):
        info, why = start_arm(procs, a, work, "router", ports, extra=extra, tag=f"router-fleet{k}-{i}")
        if not info:
            for up in infos:
                stop(procs, up["proc"])
            return {"arm": "router", "instances": k, "skipped": why}
        infos.append(info)
    lua = os.path.join(work, "conversations.lua")
    pids = [p for info in infos for p in pids_of(info)]
    time.sleep(a.settle)
    errors = 0
    for i, info in enumerate(infos):
        errors += fill(a, info["port"], lua, n * i // k, n * (i + 1) // k)[1]
    def counters():
        """The instances' shared-pin ops and decisions, summed."""
        out = metric_sums(infos, "prefix_router_shared_pins_total", "op", "result")
        out.update({("decision", d): v for (d,), v in
                    metric_sums(infos, "prefix_router_requests_total", "decision").items()})
        return out

    # The next turns only: counters from here, Redis's statistics reset.
    subprocess.run(["redis-cli", "-p", str(port), "CONFIG", "RESETSTAT"], capture_output=True)
    before = counters()
    conns = [16 // k + (j < 16 % k) for j in range(k)]
    c0, r0 = cpu_s(pids), cpu_s(tree(redis["proc"].pid))
    rs = wrk_many(a, [(info["port"], lua, c, (0, n, "turn")) for info, c in zip(infos, conns)], a.duration)
    cpu, rcpu = cpu_s(pids) - c0, cpu_s(tree(redis["proc"].pid)) - r0
    good = sum(r["good"] for r in rs)
    after = counters()
    delta = {key: int(v - before.get(key, 0)) for key, v in after.items() if v - before.get(key, 0)}
    by = {f"{op} {res}": v for (op, res), v in delta.items() if op != "decision"}
    pins = {res: v for (op, res), v in delta.items() if op == "decision"}
    calls = {}
    for line in redis_info(port, "commandstats"):
        m = re.match(r"cmdstat_(\w+):calls=(\d+)", line)
        if m:
            calls[m[1]] = int(m[2])
    for info in infos:
        stop(procs, info["proc"])
    return {"arm": "router", "instances": k, "conversations": n, "rps": sum(r["rps"] for r in rs),
            "p50_us": max(r["p50_us"] for r in rs), "p99_us": max(r["p99_us"] for r in rs),
            "cpu_us_per_req": cpu / max(1, good) * 1e6, "redis_cpu_us_per_req": rcpu / max(1, good) * 1e6,
            "shared_pins": by, "decisions": pins, "redis_calls": calls, "requests": good,
            "errors": errors + sum(r["bad"] + r["errors"] for r in rs)}


def prompts_point(a, procs, work, arm, size, ports, checkpoints):
    extra = [] if checkpoints else ["limits: {max_checkpoint_bytes: 0}"]
    info, why = start_arm(procs, a, work, arm, ports, extra=extra)
    name = arm if arm != "router" else ("router" if checkpoints else "router-nockpt")
    if not info:
        return {"arm": name, "bytes": size, "skipped": why}
    lua = os.path.join(work, "loops.lua")
    pids = pids_of(info)
    time.sleep(a.settle)
    wrk(a, info["port"], lua, 4, 1, (size,))
    c0 = cpu_s(pids)
    r = wrk(a, info["port"], lua, 4, a.duration, (size,))
    cpu = cpu_s(pids) - c0
    point = {"arm": name, "bytes": size, "rps": r["rps"], "p50_us": r["p50_us"], "p99_us": r["p99_us"],
             "cpu_us_per_req": cpu / max(1, r["good"]) * 1e6, "requests": r["requests"],
             "errors": r["bad"] + r["errors"]}
    if is_router(arm):
        got = metric_sums([info], "prefix_router_long_body_parses_total", "from")
        point["parses"] = {k: int(v) for (k,), v in got.items()}
    stop(procs, info["proc"])
    return point


# ---------------------------------------------------------------- report

def svg_chart(title, xlabel, ylabel, series, logx=True, logy=False):
    """A small line chart: series is {name: [(x, y), ...]}."""
    import math
    w, h, l, r, t, b = 360, 240, 56, 12, 26, 40
    pts = [p for s in series.values() for p in s if p[1] is not None]
    if not pts:
        return ""
    fx = (lambda x: math.log10(x)) if logx else (lambda x: x)
    fy = (lambda y: math.log10(max(y, 1e-9))) if logy else (lambda y: y)
    xs, ys = [fx(p[0]) for p in pts], [fy(p[1]) for p in pts]
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y0, y1 = (min(ys), max(ys)) if logy else (0, max(ys) * 1.1 or 1)
    if y1 == y0:
        y1 = y0 + 1
    sx = lambda x: l + (fx(x) - x0) / (x1 - x0) * (w - l - r)
    sy = lambda y: h - b - (fy(y) - y0) / (y1 - y0) * (h - t - b)
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="10">',
           f'<text x="{w / 2}" y="14" text-anchor="middle" font-size="12">{title}</text>',
           f'<line x1="{l}" y1="{h - b}" x2="{w - r}" y2="{h - b}" stroke="#000"/>',
           f'<line x1="{l}" y1="{t}" x2="{l}" y2="{h - b}" stroke="#000"/>',
           f'<text x="{(l + w - r) / 2}" y="{h - 6}" text-anchor="middle">{xlabel}</text>',
           f'<text x="12" y="{(t + h - b) / 2}" text-anchor="middle" transform="rotate(-90 12 {(t + h - b) / 2})">{ylabel}</text>']
    for x in sorted({p[0] for p in pts}):
        out.append(f'<text x="{sx(x):.1f}" y="{h - b + 12}" text-anchor="middle">{x:,}</text>')
    for i in range(5):
        y = y0 + (y1 - y0) * i / 4
        v = 10 ** y if logy else y
        out.append(f'<text x="{l - 4}" y="{h - b - (h - t - b) * i / 4 + 3:.1f}" text-anchor="end">{v:,.0f}</text>' if v >= 10 else
                   f'<text x="{l - 4}" y="{h - b - (h - t - b) * i / 4 + 3:.1f}" text-anchor="end">{v:.3g}</text>')
    for i, (name, s) in enumerate(series.items()):
        s = [p for p in s if p[1] is not None]
        c = colors[i % len(colors)]
        out.append(f'<polyline fill="none" stroke="{c}" stroke-width="1.5" points="' +
                   " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in s) + '"/>')
        out += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" fill="{c}"/>' for x, y in s]
        out.append(f'<text x="{l + 8}" y="{t + 12 + 12 * i}" fill="{c}">{name}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def plots(doc_dir, run):
    made = []
    def series(points, key, x):
        arms = ARMS + ["router-nockpt", "baseline"]
        return {NAMES[arm]: [(p[x], p.get(key)) for p in points if p["arm"] == arm and "skipped" not in p]
                for arm in arms if any(p["arm"] == arm for p in points)}
    for key, title, unit, part, x, xl in (
            ("cpu_us_per_req", "CPU per request", "CPU-µs", "replicas", "replicas", "replicas"),
            ("added_p50_us", "p50 added over direct", "µs", "replicas", "replicas", "replicas"),
            ("idle_cpu", "CPU used idle", "cores", "replicas", "replicas", "replicas"),
            ("scrape_ms", "/metrics scrape", "ms", "replicas", "replicas", "replicas"),
            ("rss_mib", "RSS", "MiB", "streams", "streams", "open streams"),
            ("cpu_us_per_event", "CPU per SSE event", "CPU-µs", "streams", "streams", "open streams"),
            ("held_p50_us", "a new request's p50 while held", "µs", "streams", "streams", "open streams"),
            ("cpu_us_per_req", "CPU per next turn", "CPU-µs", "conversations", "conversations", "conversations"),
            ("rss_mib", "RSS", "MiB", "conversations", "conversations", "conversations"),
            ("cpu_us_per_req", "CPU per agent-loop request", "CPU-µs", "prompts", "bytes", "body bytes"),
            ("cpu_us_per_req", "CPU per request, Redis fleet", "CPU-µs", "fleet", "instances", "instances")):
        points = {"replicas": by_size, "streams": by_streams}.get(part, list)(run.get(part, []))
        svg = svg_chart(title, xl, unit, series(points, key, x))
        if svg:
            name = f"scale-{part}-{key}.svg"
            with open(os.path.join(doc_dir, name), "w") as f:
                f.write(svg)
            made.append((title, name))
    return made


def folded(points, size, sums):
    """Points of several rounds by arm and `size` (the curve's x): for each,
    the points that ran and `m`, the median over them of each figure with
    `sums` summed and the rounds counted (when none ran, no points and the
    first, which says why)."""
    groups = {}
    for p in points:
        groups.setdefault((p["arm"], p[size]), []).append(p)
    for (arm, x), ps in groups.items():
        ran = [p for p in ps if "skipped" not in p]
        if not ran:
            yield ran, ps[0]
            continue
        m = {"arm": arm, size: x, "rounds": len(ran)}
        for k, v in ran[0].items():
            if isinstance(v, (int, float)) and k not in (size, "round"):
                m[k] = statistics.median(p[k] for p in ran)
        for k in sums:
            m[k] = sum(p.get(k, 0) for p in ran)
        yield ran, m


def by_size(points):
    """The replicas curve's rounds folded: per arm and size, the median of
    each figure, the rounds' CPU-µs per request (idle share excluded), and
    the median over rounds of that figure over the same round's at the
    smallest size (`flat`)."""
    out = []
    for ran, m in folded(points, "replicas", ("requests", "errors")):
        if ran:
            arm = m["arm"]
            m["per_round"] = [p["cpu_us_per_req_less_idle"] for p in ran]
            small = min(q["replicas"] for q in points if q["arm"] == arm)
            base = {q.get("round", 0): q for q in points
                    if q["arm"] == arm and q["replicas"] == small and "skipped" not in q}
            ratios = [p["cpu_us_per_req_less_idle"] / base[p.get("round", 0)]["cpu_us_per_req_less_idle"]
                      for p in ran if p.get("round", 0) in base]
            m["flat"] = statistics.median(ratios) if ratios else None
            m["flat_range"] = (min(ratios), max(ratios)) if ratios else None
        out.append(m)
    return out


def by_streams(points):
    """The open streams' rounds folded: per arm and size, the median of each
    figure, the rounds' CPU-µs per event, and the median over rounds of CPU
    per event (and less idle) over SMG's in the same round, with the range
    (`..._vs_smg`)."""
    smg = {(p["streams"], p.get("round", 0)): p for p in points if p["arm"] == "smg" and "skipped" not in p}
    out = []
    for ran, m in folded(points, "streams", ("done", "failed", "events", "probe_errors")):
        if ran:
            s = m["streams"]
            m["per_round"] = [p["cpu_us_per_event"] for p in ran]
            for k in ("cpu_us_per_event", "less_idle_us_per_event"):
                ratios = [p[k] / smg[(s, p.get("round", 0))][k] for p in ran
                          if m["arm"] != "smg" and k in p and smg.get((s, p.get("round", 0)), {}).get(k, 0) > 0]
                m[k + "_vs_smg"] = (statistics.median(ratios), min(ratios), max(ratios)) if ratios else None
        out.append(m)
    return out


def table(columns, points, lead, cells):
    """A Markdown table, a row per point: `lead(p)` its first cells (arm,
    size), `cells(p)` the rest; a point that was not run says why."""
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for p in points:
        first = lead(p)
        rest = ([f"not run: {p['skipped']}"] + [""] * (len(columns) - len(first) - 1)
                if "skipped" in p else cells(p))
        out.append("| " + " | ".join(first + rest) + " |")
    return out


def listing(counts):
    """`{name: count}` as "name 1,234, other 5"."""
    return ", ".join(f"{k} {v:,}" for k, v in sorted((counts or {}).items())) or "—"


def fmt(v, spec=",.0f"):
    return "—" if v is None else format(v, spec)


def doc(a, run, made):
    meta, stream_points = run["meta"], by_streams(run["streams"])
    rep_points = by_size(run["replicas"])
    direct = {}
    for d in run["direct"]:
        direct.setdefault(d["replicas"], []).append(d["p50_us"])
    rounds = max([p.get("rounds", 1) for p in rep_points] or [1])
    out = [MARK_BEGIN, f"Command: `make bench-scale` (`scripts/bench-scale.py {meta.get('command', '--doc docs/scale.md')}`), {meta['date']}, commit "
           f"{meta['commit']}. Machine: {meta['cpu']}, {meta['cores']} cores, Linux {meta['kernel']}, "
           f"load average {meta['loadavg']} at the start; SMG {meta['smg']}.\n",
           __doc__.split("\n\n")[1].replace("\n", " ") + "\n",
           "\n## Replicas\n",
           f"wrk: one thread, 16 connections, {a.duration} s per point after 1 s of warm-up; "
           f"idle CPU over {a.idle} s after {a.settle} s of settling; {rounds} round(s), each a sweep of "
           "every size, so each figure is the median over rounds; `÷ smallest` is the median over rounds "
           "of CPU-µs per request (idle share excluded) over the same round's at the smallest size, with "
           "its range. Stub direct (wrk to one stub port), p50: "
           + ", ".join(f"{n} replicas {statistics.median(v):,.0f} µs" for n, v in direct.items()) + ".\n"]

    def replicas_row(p):
        per_round = ", ".join(f"{v:.0f}" for v in p.get("per_round", [p["cpu_us_per_req_less_idle"]]))
        flat = "—" if p.get("flat") is None else f"{p['flat']:.2f} ({p['flat_range'][0]:.2f}–{p['flat_range'][1]:.2f})"
        return [f"{p['idle_cpu']:.3f}", fmt(p["rps"]), f"{p['p50_us']:,.0f} µs", f"{p['p99_us']:,.0f} µs",
                f"{p['added_p50_us']:,.0f} µs", f"{p['cpu_us_per_req']:.1f}", f"{p['cpu_us_per_req_less_idle']:.1f}",
                per_round, flat, f"{p['rss_mib']:.1f}", f"{p['scrape_bytes'] / 1024:,.0f} KiB",
                f"{p['scrape_ms']:.1f}", f"{p['requests']:,}", f"{p['errors']}"]
    out += table(["arm", "replicas", "idle CPU (cores)", "req/s", "p50", "p99", "p50 added", "CPU-µs/req",
                  "less idle", "per round", "÷ smallest", "RSS MiB", "scrape", "scrape ms", "requests", "errors"],
                 rep_points, lambda p: [NAMES[p["arm"]], f"{p['replicas']:,}"], replicas_row)
    if run.get("flat"):
        cycles = max(p.get("cycles", 0) for p in run["flat"])
        conns = next((p["conns"] for p in run["flat"] if "conns" in p), 16)
        delay = next((p["delay_ms"] for p in run["flat"] if p.get("delay_ms")), 0)
        probes = next((p["probes"] for p in run["flat"] if "probes" in p), "all")
        out += ["\n## Flatness, paired\n",
                f"Each arm started once in front of each size's stubs, all at once; {cycles} cycles, each "
                "sending wrk to every size in turn (order reversed every other cycle) while the others are "
                f"stopped (SIGSTOP){f'; the stubs answer after {delay} ms' if delay else ''}"
                f"{f'; the router probes as `{probes}` in the probes part' if probes != 'all' else ''}. "
                f"A leg: 1 s of warm-up, {a.leg} s at {conns} connections (CPU-µs per "
                f"request, p50 at saturation), {a.leg} s at one connection (p50, and p50 added over a stub "
                "direct timed in the same cycle). A leg that lost more than "
                f"{a.max_steal:.0%} of the proxy CPU to the hypervisor (`/proc/stat`'s steal) is run again "
                f"after a pause, up to {a.steal_tries} times; a cycle with a leg still over it counts in no "
                "figure (`clean`: cycles counted of those run; `steal`: the median share taken; `busy`: the "
                f"arm's CPU time over the {conns}-connection run's wall time, and the load CPUs' (wrk and the "
                "stubs): an arm well under 100 % was not saturated; `idle CPU`: the arm's over "
                f"{a.leg} s idle after each leg (its probes and timers, which grow with the fleet: "
                "`less idle` leaves that rate out of CPU per request); `user`: its CPU in user mode, its own code "
                "without the kernel's work for its sockets, which on loopback includes the receiving side's). Figures "
                "are medians over clean cycles; `÷ smallest` is the median over them of the figure over "
                "the same cycle's at the smallest size, with the middle half of those ratios.\n"]

        def ratio(p, k):
            r, q = p.get(k + "_ratio"), p.get(k + "_iqr")
            return "—" if r is None else f"{r:.2f} ({q[0]:.2f}–{q[1]:.2f})"
        out += table(["arm", "replicas", "clean", "steal", "busy: arm / load", "CPU-µs/req", "÷ smallest",
                      "idle CPU (cores)", "less idle", "÷ smallest", "user CPU-µs/req", "÷ smallest", f"p50, {conns} conns",
                      "÷ smallest", "p50 added, 1 conn", "÷ smallest", "requests", "errors"], run["flat"],
                     lambda p: [NAMES[p["arm"]], f"{p['replicas']:,}"],
                     lambda p: [f"{p['clean_cycles']} of {p['cycles']}", f"{p['steal']:.0%}",
                                "—" if p.get("busy") is None else f"{p['busy']:.0%} / {p['load_busy']:.0%}",
                                fmt(p["cpu_us_per_req"], ".1f"), ratio(p, "cpu_us_per_req"),
                                fmt(p.get("idle_cpu"), ".3f"), fmt(p.get("less_idle_us_per_req"), ".1f"),
                                ratio(p, "less_idle_us_per_req"), fmt(p.get("user_us_per_req"), ".1f"), ratio(p, "user_us_per_req"),
                                fmt(p["p50_us"]) + " µs", ratio(p, "p50_us"), fmt(p["one_added_us"]) + " µs",
                                ratio(p, "one_added_us"), f"{p['requests']:,}", f"{p['errors']}"])
        paced = [p for p in run["flat"] if p.get("paced_p50_us") is not None]
        if paced:
            think = paced[0].get("think_ms", a.flat_think_ms)
            out += [f"\nAt a fixed pace, in the same cycles: {a.leg} s at {conns} connections, each waiting "
                    f"{think} ms between requests (a load well under saturation, as an operator runs it): "
                    "requests a second, CPU-µs per request, and the p50 and p99 a client sees (through the arm "
                    "and a stub, on loopback), medians over clean cycles with `÷ smallest` as above.\n"]
            out += table(["arm", "replicas", "req/s", "CPU-µs/req", "÷ smallest", "p50", "÷ smallest", "p99",
                          "÷ smallest"], paced, lambda p: [NAMES[p["arm"]], f"{p['replicas']:,}"],
                         lambda p: [fmt(p["paced_rps"], ",.0f"), fmt(p["paced_cpu_us_per_req"], ".1f"),
                                    ratio(p, "paced_cpu_us_per_req"), fmt(p["paced_p50_us"]) + " µs",
                                    ratio(p, "paced_p50_us"), fmt(p["paced_p99_us"]) + " µs",
                                    ratio(p, "paced_p99_us")])
    if run.get("probes"):
        out += ["\n## Probes: idle CPU by schedule\n",
                f"Each arm alone in front of the stubs, idle CPU over {a.idle} s after {a.settle} s of "
                "settling, under each probe schedule: "
                + "; ".join(f"`{n}`: {w}" for n, w, _ in SCHEDULES)
                + "; SMG: its default (a health check of each worker every 60 s). Probes a second are the "
                "schedule's (replicas × checks and reads a second, within its budget); CPU-µs per probe is the idle CPU over "
                "them (what the process spends idle without probes is in it).\n"]
        out += table(["arm", "schedule", "replicas", "idle CPU (cores)", "probes a second", "CPU-µs per probe"],
                     run["probes"], lambda p: [NAMES[p["arm"]], f"`{p['schedule']}`", f"{p['replicas']:,}"],
                     lambda p: [f"{p['idle_cpu']:.3f}", fmt(p["probes_per_s"], ",.1f"),
                                fmt(p["cpu_us_per_probe"], ",.1f")])
    out += ["\n## Open streams\n",
            f"`routebench hold` opens the streams at {a.rate:g} a second through the arm in front of two stub "
            f"replicas (one SSE event a second per stream); once all are open, CPU and SSE events are counted "
            f"over {a.window} s, then wrk (one connection, {a.probe} s) sends small non-streamed requests. "
            f"Descriptors: {meta['nofile']} per process here; each stream holds two in the proxy, so "
            f"the top step is {meta['max_streams']:,}. "
            f"{max([p.get('rounds', 1) for p in stream_points] or [1])} round(s) of every size, the arms' order "
            "reversed every other round: figures are medians over rounds (events, done and failed are "
            "sums); `÷ SMG` is the median over rounds of the figure before it over SMG's in the same round, "
            f"with its range; `idle CPU`: the arm's over {a.idle:g} s before the streams open (probes and "
            "timers: the router's here every second and every 500 ms, SMG's every 60 s), a rate `less idle` "
            "leaves out of CPU per event.\n"]

    def vs_smg(p, k):
        r = p.get(k + "_vs_smg")
        return "—" if r is None else f"{r[0]:.2f} ({r[1]:.2f}–{r[2]:.2f})"
    out += table(["arm", "streams", "opened", "RSS MiB", "KiB per stream", "SSE events", "CPU-µs per event",
                  "per round", "÷ SMG", "idle CPU (cores)", "less idle", "÷ SMG", "new request p50 idle / held",
                  "p99 idle / held", "done", "failed"],
                 stream_points, lambda p: [NAMES[p["arm"]], f"{p['streams']:,}"],
                 lambda p: [fmt(p["opened"]), f"{p['rss_mib']:.1f}", f"{p['rss_kib_per_stream']:.1f}",
                            f"{p['events']:,}", f"{p['cpu_us_per_event']:.1f}",
                            ", ".join(f"{v:.1f}" for v in p.get("per_round", [p["cpu_us_per_event"]])),
                            vs_smg(p, "cpu_us_per_event"), fmt(p.get("idle_cpu"), ".3f"),
                            fmt(p.get("less_idle_us_per_event"), ".1f"), vs_smg(p, "less_idle_us_per_event"),
                            f"{fmt(p['idle_p50_us'])} / {fmt(p['held_p50_us'])} µs",
                            f"{fmt(p['idle_p99_us'])} / {fmt(p['held_p99_us'])} µs", f"{p['done']:,}",
                            f"{p['failed']:,}"])
    if run.get("conversations"):
        out += ["\n## Conversations\n",
                "In front of two stubs; wrk (one thread, 16 connections) places the conversations, then "
                f"sends next turns of conversations drawn at random for {a.duration} s. The router's "
                "`prefix_index.max_entries` is set to four entries per conversation (at least its default). "
                "Fill: the placing of the conversations; per conversation: memory grown over the fill "
                "(RSS) and the router's index (its gauges); CPU-µs per next turn is the curve.\n"]
        out += table(["arm", "conversations", "fill req/s", "fill CPU-µs/req", "RSS MiB", "RSS bytes per conversation",
                      "index bytes per conversation", "index entries", "next-turn req/s", "p50", "p99",
                      "CPU-µs per next turn", "decisions", "errors"], run["conversations"],
                     lambda p: [NAMES[p["arm"]], f"{p['conversations']:,}"],
                     lambda p: [fmt(p["fill_rps"]), f"{p['fill_cpu_us_per_req']:.1f}", f"{p['rss_mib']:.1f}",
                                fmt(p["rss_bytes_per_conv"]), fmt(p.get("index_bytes_per_conv")),
                                fmt(p.get("index_entries")), fmt(p["rps"]), f"{p['p50_us']:,} µs",
                                f"{p['p99_us']:,} µs", f"{p['cpu_us_per_req']:.1f}", listing(p.get("decisions")),
                                f"{p['errors']}"])
    if run.get("prompts"):
        out += ["\n## Prompt size\n",
                "In front of two stubs; wrk (one thread, 4 connections, "
                f"{a.duration} s after 1 s of warm-up) runs 16 agent loops: each request is its "
                "conversation's last body plus a model turn and a user turn, every 8th a new "
                "conversation; the system prompt sets the size. Bodies of 32 KiB and more leave "
                "checkpoints; `long-body parses` counts how the router read them (from a checkpoint, "
                "or from the start). At 400 KiB a body is about 100K tokens: cores per 100 req/s "
                "is CPU-µs per request × 100 / 10⁶.\n"]
        out += table(["arm", "body", "req/s", "p50", "p99", "CPU-µs/req", "cores per 100 req/s", "long-body parses",
                      "requests", "errors"], run["prompts"],
                     lambda p: [NAMES[p["arm"]], f"{p['bytes'] // 1024} KiB"],
                     lambda p: [fmt(p["rps"]), f"{p['p50_us']:,} µs", f"{p['p99_us']:,} µs",
                                f"{p['cpu_us_per_req']:.1f}", f"{p['cpu_us_per_req'] * 100 / 1e6:.3f}",
                                listing(p.get("parses")), f"{p['requests']:,}", f"{p['errors']}"])
    if run.get("fleet"):
        out += ["\n## Fleet: Redis shared pins\n",
                "`fleet: {mode: redis}`: 1 to 3 router instances (all on the proxy CPU, one worker "
                "thread each) share pins through one Redis (`redis-server`, no persistence, on the load "
                "CPU) in front of the same two stubs. Each instance places its share of "
                f"{a.fleet_conversations:,} conversations; then wrk against every instance at once "
                f"(16 connections in all, {a.duration} s) sends next turns of conversations drawn at "
                "random, so with k instances about (k−1)/k of them reach an instance that did not "
                "place them (or placed an earlier turn) and look their pin up in Redis. All figures "
                "are of those next turns: CPU-µs per request of the instances together and of "
                "Redis; lookups (one `MGET` round trip each, on the request's path, within "
                "`redis_budget_ms`) and writes (pipelined by a background task) from the router's "
                "`prefix_router_shared_pins_total`; Redis's calls from its `INFO commandstats`.\n"]

        def fleet_row(p):
            lookups = sum(v for k, v in p.get("shared_pins", {}).items() if k.startswith("lookup "))
            return [fmt(p["rps"]), f"{p['p50_us']:,} µs", f"{p['p99_us']:,} µs", f"{p['cpu_us_per_req']:.1f}",
                    f"{p['redis_cpu_us_per_req']:.1f}", f"{lookups / max(1, p['requests']):.2f}",
                    listing(p.get("shared_pins")), listing(p.get("redis_calls")), listing(p.get("decisions")),
                    f"{p['errors']}"]
        out += table(["instances", "req/s", "p50 (slowest instance)", "p99 (slowest)", "router CPU-µs/req",
                      "Redis CPU-µs/req", "round trips per request (lookups)", "shared-pin ops", "Redis calls",
                      "decisions", "errors"], run["fleet"], lambda p: [f"{p['instances']}"], fleet_row)
    out.append("\n## Plots\n")
    out += [f"![{t}]({n})" for t, n in made]
    out.append(MARK_END)
    return "\n".join(out) + "\n"


def write_doc(path, text):
    """Replaces the generated block of `path` (the rest, such as what a
    session read from the figures, is kept), or starts the file."""
    old = open(path).read() if os.path.exists(path) else "# Scale\n\n" + MARK_BEGIN + MARK_END
    head, rest = old.split(MARK_BEGIN, 1)
    with open(path, "w") as f:
        f.write(head + text.rstrip("\n") + rest.split(MARK_END, 1)[1])


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replicas", default="2,16,128,1000")
    ap.add_argument("--streams", default="100,1000,10000")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"subset of {','.join(ARMS)}, and `baseline`; in the flat part also "
                    f"{', '.join(FLOORS)} (proxies that only forward, round robin)")
    ap.add_argument("--baseline", help="another prefix-router binary, run as arm `baseline` (the flatness, "
                                       "replicas and streams parts) to compare two builds in one run")
    ap.add_argument("--conversations", default="10000,100000,1000000")
    ap.add_argument("--prompt-kib", default="4,40,400")
    ap.add_argument("--instances", default="1,2,3", help="router instances of the Redis fleet curve")
    ap.add_argument("--fleet-conversations", type=int, default=10000)
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--duration", type=int, default=5, help="seconds of wrk per replicas point")
    ap.add_argument("--rounds", type=int, default=3, help="sweeps of the replicas curve and of the open streams")
    ap.add_argument("--cycles", type=int, default=12, help="cycles of the paired flatness part")
    ap.add_argument("--leg", type=int, default=2, help="seconds of wrk per leg of the flatness part")
    ap.add_argument("--flat-conns", type=int, default=16,
                    help="connections of the flatness part's saturated leg (as many as the largest fleet: "
                         "with --flat-delay-ms, as many connections to replicas in use at every size)")
    ap.add_argument("--flat-probes", default="all", choices=[x[0] for x in SCHEDULES],
                    help="the router's probe schedule in the flatness part (the probes part's names)")
    ap.add_argument("--flat-delay-ms", type=int, default=0,
                    help="the stubs' delay before a whole answer in the flatness part (a prefill's time: "
                         "requests in flight, and so connections to replicas, at every fleet size)")
    ap.add_argument("--flat-think-ms", type=int, default=2,
                    help="the flatness part's paced leg: its connections each wait this long between requests "
                         "(a fixed load well under saturation: p50/p99 as an operator runs it); 0: no paced leg")
    ap.add_argument("--router-line", action="append", default=[],
                    help="a line added to the `router` arm's config in the flat part, not to `baseline`'s "
                         "(repeat for several): one binary under two settings, with --baseline set to it")
    ap.add_argument("--max-steal", type=float, default=0.1,
                    help="share of the proxy CPU the hypervisor may take in a flatness leg")
    ap.add_argument("--steal-tries", type=int, default=4, help="runs of a flatness leg while it is stolen")
    ap.add_argument("--idle", type=float, default=5, help="seconds of idle CPU measured per replicas point and before each open streams point")
    ap.add_argument("--settle", type=float, default=3, help="seconds after an arm is ready")
    ap.add_argument("--rate", type=float, default=1000, help="streams opened per second")
    ap.add_argument("--window", type=float, default=10, help="seconds of CPU counted with all streams open")
    ap.add_argument("--probe", type=int, default=3, help="seconds of wrk probing a new request's latency")
    ap.add_argument("--proxy-cpu", default="0")
    ap.add_argument("--load-cpus", default="1")
    ap.add_argument("--perf", action="store_true",
                    help="record a perf profile of the router at each replicas and streams point (OUT/perf-*.data)")
    ap.add_argument("--quick", action="store_true", help="smoke test: small sizes, short runs")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench-out/scale"))
    ap.add_argument("--venv", default=os.path.join(ROOT, "bench-out/venv"))
    ap.add_argument("--doc", help="write the report to this Markdown file (plots beside it)")
    ap.add_argument("--from-json", help="write --doc from an earlier run's scale.json; run nothing")
    a = ap.parse_args()
    if a.quick:
        a.replicas, a.streams, a.duration, a.idle, a.settle, a.window, a.probe = "2,16", "100", 2, 1, 1, 2, 1
        a.rounds, a.cycles, a.leg = 1, 2, 1
        a.conversations, a.prompt_kib, a.fleet_conversations = "1000", "4,40", 1000
    a.replicas = [int(x) for x in a.replicas.split(",")]
    a.streams = [int(x) for x in a.streams.split(",")]
    a.conversations = [int(x) for x in a.conversations.split(",")]
    a.prompt_kib = [int(x) for x in a.prompt_kib.split(",")]
    a.instances = [int(x) for x in a.instances.split(",")]
    a.arms, a.parts = a.arms.split(","), a.parts.split(",")
    if a.baseline:
        a.baseline = os.path.abspath(a.baseline)
        if not os.access(a.baseline, os.X_OK):
            ap.error(f"--baseline {a.baseline}: not an executable file")
        if "baseline" not in a.arms:
            a.arms.append("baseline")
    if "baseline" in a.arms and not (a.baseline and set(a.parts) <= {"flat", "replicas", "streams"}):
        ap.error("arm `baseline` needs --baseline BINARY, and runs in the flat, replicas and streams parts only")
    if set(a.arms) & set(FLOORS) and set(a.parts) != {"flat"}:
        ap.error(f"arms {', '.join(FLOORS)} run in the flat part only (--parts flat)")
    if a.flat_conns < 1:
        ap.error("--flat-conns must be at least 1")
    return a


def report(a, run):
    made = plots(os.path.dirname(os.path.abspath(a.doc)), run)
    write_doc(a.doc, doc(a, run, made))


def main():
    a = parse_args()
    if a.from_json:
        run = json.load(open(a.from_json))
        a.__dict__.update(run.get("args", {}))
        return report(a, run)
    if bp.ensure_debian({"wrk": "wrk"}):
        sys.exit("cannot run: wrk could not be installed")
    for b in (ROUTER, ROUTEBENCH):
        if not os.path.exists(b):
            sys.exit(f"{b} missing (cargo build --release --bins)")
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    os.makedirs(a.out, exist_ok=True)
    work = a.out
    lua = write(os.path.join(work, "singles.lua"), LUA)
    a.paced_lua = write(os.path.join(work, "singles-paced.lua"),
                        LUA + f"function delay() return {a.flat_think_ms} end\n")
    write(os.path.join(work, "conversations.lua"), CONV_LUA)
    write(os.path.join(work, "loops.lua"), LOOP_LUA)
    body_file = write(os.path.join(work, "stream.json"), json.dumps(
        {"model": "bench", "stream": True, "max_tokens": 64,
         "messages": [{"role": "user", "content": "tell me a long story, slowly"}]}))
    max_streams = (hard - 256) // 2
    meta = {"date": time.strftime("%Y-%m-%d"), "commit": bp.sh(f"git -C {ROOT} describe --always --dirty"),
            "cpu": next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?"),
            "cores": os.cpu_count(), "kernel": os.uname().release, "loadavg": open("/proc/loadavg").read().split()[0],
            "smg": bp.sh(f"{a.venv}/bin/pip show smg 2>/dev/null | sed -n 's/^Version: //p'") or "-",
            "nofile": hard, "max_streams": max_streams, "command": " ".join(sys.argv[1:])}
    procs = Procs(work)
    run = {"meta": meta, "args": {k: getattr(a, k) for k in RUN_ARGS}, "direct": [],
           **{part: [] for part in PARTS}}

    def keep(part, p):
        run[part].append(p)
        print(json.dumps(p), file=sys.stderr)

    try:
        # Rounds sweep every size in turn, so each round's ratios see one
        # state of this noisy machine.
        for rnd in range(a.rounds if "replicas" in a.parts else 0):
            for n in a.replicas:
                stubs, ports = start_stubs(procs, a, f"stubs-{n}", n, 4, 0)
                d = wrk(a, ports[0], lua, 16, a.duration)
                run["direct"].append({"replicas": n, "round": rnd, "p50_us": d["p50_us"], "p99_us": d["p99_us"]})
                for arm in a.arms:
                    keep("replicas", {**replicas_point(a, procs, work, lua, arm, n, ports, d), "round": rnd})
                stop(procs, stubs)
        if "flat" in a.parts:
            for p in flat_part(a, procs, work, lua):
                keep("flat", p)
        if "probes" in a.parts:
            for n in a.replicas:
                stubs, ports = start_stubs(procs, a, f"stubs-{n}", n, 4, 0)
                for arm in a.arms:
                    for schedule in ([x[0] for x in SCHEDULES] if is_router(arm) else ["smg"]):
                        keep("probes", probes_point(a, procs, work, arm, n, ports, schedule))
                stop(procs, stubs)
        if "streams" in a.parts:
            # Each stream outlasts its point's ramp, window and probe.
            last = int(min(max(a.streams), max_streams) / a.rate + a.window + a.probe + 10)
            stubs, ports = start_stubs(procs, a, "stubs-streams", 2, last, 1000)
            # Rounds of every size, the arms' order reversed every other
            # round, so each round's ratio of the router to SMG sees one
            # state of this noisy machine.
            sizes = sorted({min(s, max_streams) for s in a.streams})
            for rnd in range(a.rounds):
                for s in sizes:
                    for arm in a.arms if rnd % 2 == 0 else a.arms[::-1]:
                        keep("streams", streams_point(a, procs, work, lua, arm, s, ports, body_file, rnd))
            stop(procs, stubs)
        if {"conversations", "prompts", "fleet"} & set(a.parts):
            stubs, ports = start_stubs(procs, a, "stubs-2", 2, 4, 0)
            for n in a.conversations if "conversations" in a.parts else []:
                for arm in a.arms:
                    keep("conversations", conversations_point(a, procs, work, arm, n, ports))
            if "fleet" in a.parts and "router" in a.arms:
                redis_port = free_port()
                proc = procs.start("redis", ["redis-server", "--port", str(redis_port), "--save", "",
                                             "--appendonly", "no"], a.load_cpus)
                redis = {"port": redis_port, "proc": proc}
                while subprocess.run(["redis-cli", "-p", str(redis_port), "PING"], capture_output=True,
                                     text=True).stdout.strip() != "PONG":
                    time.sleep(0.1)
                for k in a.instances:
                    keep("fleet", fleet_point(a, procs, work, k, ports, redis, a.fleet_conversations))
                stop(procs, proc)
            for size in a.prompt_kib if "prompts" in a.parts else []:
                for arm, ckpt in [(arm, True) for arm in a.arms] + [("router", False)] * ("router" in a.arms):
                    keep("prompts", prompts_point(a, procs, work, arm, size * 1024, ports, ckpt))
            stop(procs, stubs)
    finally:
        procs.stop_all()
    with open(os.path.join(a.out, "scale.json"), "w") as f:
        json.dump(run, f, indent=1)
    if a.doc:
        report(a, run)


if __name__ == "__main__":
    main()
