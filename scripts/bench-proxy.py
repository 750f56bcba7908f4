#!/usr/bin/env python3
"""Proxy overhead: prefix-router against direct, nginx, HAProxy, a plain Pingora
proxy and SMG, on 127.0.0.1, same upstreams, same bodies, same CPU budget.

Every proxy is pinned to one CPU (--proxy-cpu, default 0) with one worker
thread or process; wrk (one thread) and the two static upstreams (one nginx
worker serving two ports) share the other CPUs (--load-cpus, default 1). Arms
are interleaved: each round runs every case for every arm in turn, the arm
order rotated each round, so drift on a shared machine hits all alike.
Reported per arm: median requests/s over rounds (good responses only), p50 and
p99, p50 added over direct, proxy CPU-µs per request (utime+stime of the
process tree from /proc), peak RSS (VmHWM, reset before each run), requests
counted and errors (socket errors, non-200, or a body without its marker).

Installs what it needs: Debian's nginx-light, haproxy and wrk (apt, as root)
and SMG (`pip install smg` into bench-out/venv). An arm whose software is
missing is reported as "not run: reason". The plain Pingora arm is
target/release/examples/plain-pingora (`cargo build --release --examples`).

    make bench-proxy     # or: scripts/bench-proxy.py --doc docs/performance.md
    scripts/bench-proxy.py --quick --arms direct,nginx,router --cases 4k
    scripts/bench-proxy.py --arms pingora,router --baseline /tmp/old-prefix-router
                         # a change's before and after, interleaved in one run
Writes bench-out/proxy/runs.json (every wrk run), summary.json, and with --doc
the section between `<!-- proxy bench -->` and `<!-- /proxy bench -->` of that
Markdown file (appended when absent; the rest of the file is kept).
"""

import argparse
import datetime
import http.client
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TICK = os.sysconf("SC_CLK_TCK")
ARMS = ["direct", "nginx", "haproxy", "pingora", "smg", "router", "router-warn", "baseline"]
ARM_NAMES = {"direct": "direct (no proxy)", "nginx": "nginx", "haproxy": "HAProxy",
             "pingora": "plain Pingora", "smg": "SMG cache_aware", "router": "prefix-router shape (as shipped: access log on)",
             "router-warn": "prefix-router shape, RUST_LOG=warn (no access log)",
             "baseline": "prefix-router shape, --baseline binary"}
# name: (method, path, body bytes, streaming, marker the answer must contain)
CASES = {
    # An engine's own GET (vLLM's `/version`): forwarded, where `/v1/models`
    # is answered by the router and SMG themselves.
    "get": ("GET", "/version", 0, False, '"bench"'),
    "4k": ("POST", "/v1/chat/completions", 4096, False, '"chat.completion"'),
    "400k": ("POST", "/v1/chat/completions", 409600, False, '"chat.completion"'),
    "4k-sse": ("POST", "/v1/chat/completions", 4096, True, "data: [DONE]"),
    "400k-sse": ("POST", "/v1/chat/completions", 409600, True, "data: [DONE]"),
}
DEFAULT_CASES = ["get", "4k", "400k", "4k-sse"]
# Cases an arm cannot serve: SMG routes only its own API paths (404 for
# `/version`) and answers `/v1/models` from its registry.
NOT_SERVED = {("smg", "get"): "SMG forwards no GET outside its own API"}
CASE_TITLES = {"get": "GET /version (no body)", "4k": "POST 4 KiB chat body",
               "400k": "POST 400 KiB chat body", "4k-sse": "POST 4 KiB chat body, SSE answer",
               "400k-sse": "POST 400 KiB chat body, SSE answer"}
# The upstreams answer SSE to requests carrying this API key.
STREAM_KEY = "sk-bench-stream"
MARK_BEGIN, MARK_END = "<!-- proxy bench -->", "<!-- /proxy bench -->"


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


# ---------------------------------------------------------------- bodies

WORDS = ("the of request replica cache prefix token model agent tool call result file line error "
         "function return value config server client stream buffer latency budget index block "
         "hash route proxy upstream health check retry timeout memory thread worker queue").split()


def prose(rng, n):
    out = []
    while sum(len(w) + 1 for w in out) < n:
        out.append(rng.choice(WORDS))
    return " ".join(out)[:n]


def code(rng, n):
    lines = []
    while sum(len(l) + 1 for l in lines) < n:
        a, b = rng.choice(WORDS), rng.choice(WORDS)
        lines.append(f'    let {a}_{b} = {b}.get("{a}")?; // {prose(rng, 30)}')
    return "\n".join(lines)[:n]


def chat_body(size, stream):
    """An agent conversation (system prompt, user/assistant turns, tool output)
    of exactly `size` bytes of JSON, ending in a user turn."""
    rng = random.Random(size)
    turn = max(256, size // 40)
    msgs = [{"role": "system", "content": "You are a coding agent. " + prose(rng, min(2000, size // 4))}]

    def doc(final):
        return json.dumps({"model": "bench", "messages": msgs + [{"role": "user", "content": final}],
                           "max_tokens": 64, "stream": stream}).encode()

    while len(doc("")) + 2 * turn < size:
        msgs.append({"role": "user", "content": prose(rng, turn // 3)})
        msgs.append({"role": "assistant", "content": "Tool output:\n" + code(rng, 2 * turn // 3)})
    body = doc(prose(rng, size - len(doc(""))))
    assert len(body) == size, (len(body), size)
    return body


# ---------------------------------------------------------------- processes

class Procs:
    """Every process this script starts, each in its own session so that one
    killpg of its id ends it and its children, and nothing else."""

    def __init__(self, work):
        self.work, self.all = work, []

    def start(self, name, cmd, cpus, env=None):
        log = open(os.path.join(self.work, f"{name}.log"), "w")
        p = subprocess.Popen(["taskset", "-c", cpus] + cmd, stdout=log, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, start_new_session=True,
                             env={**os.environ, **(env or {})})
        p.bench_name = name
        self.all.append(p)
        return p

    def stop_all(self):
        for p in reversed(self.all):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.time() + 5
        for p in self.all:
            try:
                p.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()


def tree(pid):
    """pid and its descendants."""
    children = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(d))
            except (OSError, IndexError, ValueError):
                pass
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def cpu_s(pids, user_only=False):
    """utime+stime (utime alone with `user_only`) of these processes (all
    their threads, live or exited), seconds."""
    total = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + (0 if user_only else int(fields[12]))
        except OSError:
            pass
    return total / TICK


def status_kib(pids, key):
    total = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(l.split()[1]) for l in f if l.startswith(key + ":"))
        except (OSError, StopIteration):
            pass
    return total


def reset_peak_rss(pids):
    ok = True
    for p in pids:
        try:
            with open(f"/proc/{p}/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            ok = False
    return ok


def cpu_busy():
    """Per-CPU busy, total and steal jiffies from /proc/stat, for the whole
    machine (busy counts steal: the hypervisor's share of the CPU)."""
    out = {}
    with open("/proc/stat") as f:
        for l in f:
            if l.startswith("cpu") and l[3].isdigit():
                v = [int(x) for x in l.split()[1:]]
                out[int(l[3:l.index(" ")])] = (sum(v) - v[3] - v[4], sum(v), v[7])
    return out


# ---------------------------------------------------------------- software

def sh(cmd):
    r = subprocess.run(cmd, shell=True, capture_output=True, text=True)
    return (r.stdout + r.stderr).strip()


def apt_install(pkgs):
    """Debian's packages, as root, without letting their postinst start a service."""
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "not root or no apt-get"
    policy = "/usr/sbin/policy-rc.d"
    made = not os.path.exists(policy)
    if made:
        with open(policy, "w") as f:
            f.write("#!/bin/sh\nexit 101\n")
        os.chmod(policy, 0o755)
    try:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for attempt in ("install", "update"):
            if attempt == "update":
                subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True)
            r = subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends"] + pkgs,
                               env=env, capture_output=True, text=True)
            if r.returncode == 0:
                return None
        return r.stderr.strip().splitlines()[-1] if r.stderr.strip() else "apt-get failed"
    finally:
        if made:
            os.remove(policy)


def ensure_debian(want):
    """{package: binary}; returns {binary: reason} for those still missing."""
    missing = [pkg for pkg, binary in want.items() if not shutil.which(binary)]
    if missing and apt_install(missing):
        for pkg in missing:  # one by one, so one failure does not cost the others
            apt_install([pkg])
    return {b: f"{p} could not be installed" for p, b in want.items() if not shutil.which(b)}


def ensure_smg(venv):
    smg = os.path.join(venv, "bin", "smg")
    if os.path.exists(smg):
        return smg, None
    r = subprocess.run([sys.executable, "-m", "venv", venv], capture_output=True, text=True)
    if r.returncode == 0:
        r = subprocess.run([os.path.join(venv, "bin", "pip"), "install", "-q", "smg"],
                           capture_output=True, text=True)
    if r.returncode != 0 or not os.path.exists(smg):
        return None, "pip install smg failed: " + (r.stderr.strip().splitlines() or ["?"])[-1]
    return smg, None


# ---------------------------------------------------------------- configs

def upstream_conf(work, ports):
    # nginx cannot read the body, so the answer's shape comes from a header the
    # load generator sets and every proxy forwards: SMG forwards only a few
    # (authorization, x-request-id), so it is the client's API key.
    chat = ('{"id":"chatcmpl-bench","object":"chat.completion","created":1700000000,"model":"bench",'
            '"choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],'
            '"usage":{"prompt_tokens":1000,"completion_tokens":1,"total_tokens":1001}}')
    chunk = '{"id":"chatcmpl-bench","object":"chat.completion.chunk","model":"bench","choices":[{"index":0,"delta":%s}]}'
    events = [chunk % '{"role":"assistant"}', chunk % '{"content":"ok"}',
              chunk.replace("}]}", ',"finish_reason":"stop"}]}') % "{}", "[DONE]"]
    # echo_flush: one write per event, a chunked answer as an engine sends it.
    sse = "\n      echo_flush;\n".join(f"      echo 'data: {e}\\n';" for e in events)
    servers = ""
    for name, port in ports.items():
        servers += f"""
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    add_header x-bench-upstream {name} always;
    location = /health {{ return 200 "ok\\n"; }}
    location = /version {{
      default_type application/json;
      return 200 '{{"version":"bench"}}';
    }}
    location = /v1/models {{
      default_type application/json;
      return 200 '{{"object":"list","data":[{{"id":"bench","object":"model"}}]}}';
    }}
    # Both answers come after the whole body is read, as an engine's do.
    location = /v1/chat/completions {{
      if ($http_authorization = "Bearer {STREAM_KEY}") {{ rewrite ^ /sse last; }}
      echo_read_request_body;
      echo_exec /json;
    }}
    location = /json {{
      internal;
      default_type application/json;
      return 200 '{chat}';
    }}
    location = /sse {{
      internal;
      default_type text/event-stream;
      echo_read_request_body;
{sse}
    }}
  }}"""
    return nginx_common(work, "upstream", "load_module /usr/lib/nginx/modules/ngx_http_echo_module.so;") + \
        servers + "\n}\n"


def nginx_common(work, name, head=""):
    return f"""{head}
worker_processes 1;
daemon off;
pid {work}/{name}.pid;
error_log {work}/{name}.err warn;
events {{ worker_connections 8192; }}
http {{
  access_log off;
  client_body_temp_path {work}/{name}-body;
  proxy_temp_path {work}/{name}-proxy;
  keepalive_requests 1000000;
  keepalive_timeout 300s;
  client_max_body_size 0;
  # Bodies up to 1 MiB are held in memory, not spilled to a temp file.
  client_body_buffer_size 1m;
"""


def nginx_proxy_conf(work, port, ups, keepalive=256):
    servers = "\n".join(f"    server 127.0.0.1:{p};" for p in ups)
    return nginx_common(work, "nginx") + f"""
  upstream up {{
{servers}
    keepalive {keepalive};
    keepalive_requests 1000000;
  }}
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    location / {{
      proxy_pass http://up;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_request_buffering on;
      proxy_buffering off;
    }}
  }}
}}
"""


def start_nginx(procs, name, home, port, ups, cpu, keepalive=256):
    """nginx in front of `ups`, its files under `home`; `keepalive`: idle
    connections it keeps to them."""
    os.makedirs(os.path.join(home, "nginx-body"), exist_ok=True)
    cfg = write(os.path.join(home, "nginx.conf"), nginx_proxy_conf(home, port, ups, keepalive))
    return procs.start(name, ["nginx", "-e", os.path.join(home, "nginx.err"), "-p", home, "-c", cfg], cpu)


def start_plain_pingora(procs, name, port, ups, threads, cpu):
    """examples/plain-pingora in front of `ups`: (process, None), or (None, why not)."""
    binary = os.path.join(ROOT, "target/release/examples/plain-pingora")
    if not os.path.exists(binary):
        return None, "target/release/examples/plain-pingora missing (cargo build --release --examples)"
    cmd = [binary, "--listen", f"127.0.0.1:{port}", "--threads", str(threads)]
    for p in ups:
        cmd += ["--upstream", f"127.0.0.1:{p}"]
    return procs.start(name, cmd, cpu, {"RUST_LOG": "warn"}), None


def haproxy_conf(port, ups):
    servers = "\n".join(f"  server u{i} 127.0.0.1:{p}" for i, p in enumerate(ups))
    # http-buffer-request holds at most one buffer: tune.bufsize 512 KiB so the
    # whole 400 KiB body is held before it is sent, as the other proxies do.
    return f"""global
  nbthread 1
  maxconn 4096
  tune.bufsize 524288
defaults
  mode http
  timeout connect 5s
  timeout client 60s
  timeout server 60s
  option http-buffer-request
  http-reuse always
frontend fe
  bind 127.0.0.1:{port}
  default_backend be
backend be
  balance roundrobin
{servers}
"""


async def read_request(reader):
    """Reads one HTTP/1.1 request with a Content-Length body from an asyncio
    stream (the paced replicas of bench-sse.py and bench-memory.py); its head."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    if length:
        await reader.readexactly(length)
    return head


def router_conf(port, mport, ups, threads=1):
    lines = [f'listen: "127.0.0.1:{port}"', f'metrics_listen: "127.0.0.1:{mport}"',
             "policy: shape", f"threads: {threads}", "health_check: {interval_ms: 1000}", "replicas:"]
    lines += [f'  - {{name: u{i}, addr: "127.0.0.1:{p}"}}' for i, p in enumerate(ups)]
    return "\n".join(lines) + "\n"


def write(path, text):
    with open(path, "w") as f:
        f.write(text)
    return path


# ---------------------------------------------------------------- arms

def request(port, method, path, body=None, headers=None, timeout=5):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request(method, path, body=body, headers=headers or {})
        r = c.getresponse()
        return r.status, r.read().decode(errors="replace")
    finally:
        c.close()


def answers(port, bodies, cases):
    """{case: what was wrong} for the cases this port does not answer as expected."""
    wrong = {}
    for case in cases:
        method, path, _, _, marker = CASES[case]
        try:
            st, text = request(port, method, path, bodies.get(case), headers(case))
            if st != 200 or marker not in text:
                wrong[case] = f"{st} {text[:160]!r}"
        except (OSError, http.client.HTTPException) as e:
            wrong[case] = repr(e)
    return wrong


def wait_ready(arm, port, proc, bodies, timeout):
    """Polls until the arm answers a GET and a chat body; returns None or why not."""
    deadline, wrong = time.time() + timeout, {}
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            return f"exited with {proc.returncode}"
        wrong = answers(port, bodies, [c for c in ("get", "4k") if (arm, c) not in NOT_SERVED])
        if not wrong:
            return None
        time.sleep(0.2)
    return f"not ready after {timeout} s: {wrong}"


def headers(case):
    h = {"authorization": f"Bearer {STREAM_KEY if CASES[case][3] else 'sk-bench'}"}
    if CASES[case][0] == "POST":
        h["content-type"] = "application/json"
    return h


def start_arms(a, procs, work, ups, bodies, missing):
    """{arm: {"port", "proc"}} for arms that came up; {arm: reason} for the rest."""
    up, skipped = {}, {}
    cpu = a.proxy_cpu
    for arm in a.arms:
        port, proc, why = free_port(), None, None
        if arm == "direct":
            port = ups[0]
        elif arm == "nginx":
            why = missing.get("nginx")
            if not why:
                proc = start_nginx(procs, "nginx", work, port, ups, cpu)
        elif arm == "haproxy":
            why = missing.get("haproxy")
            if not why:
                cfg = write(os.path.join(work, "haproxy.cfg"), haproxy_conf(port, ups))
                proc = procs.start("haproxy", ["haproxy", "-db", "-f", cfg], cpu)
        elif arm == "pingora":
            proc, why = start_plain_pingora(procs, "pingora", port, ups, a.threads, cpu)
        elif arm == "smg":
            smg, why = ensure_smg(a.venv)
            if smg:
                proc = procs.start("smg", [smg, "launch", "--host", "127.0.0.1", "--port", str(port),
                                           "--worker-urls"] + [f"http://127.0.0.1:{p}" for p in ups] +
                                   ["--policy", "cache_aware", "--prometheus-host", "127.0.0.1",
                                    "--prometheus-port", str(free_port()),
                                    "--log-level", "warn"], cpu)
        elif arm in ("router", "router-warn", "baseline"):
            binary = a.baseline if arm == "baseline" else os.path.join(ROOT, "target/release/prefix-router")
            if not os.path.exists(binary):
                why = f"{binary} missing (cargo build --release --bins)"
            else:
                cfg = write(os.path.join(work, f"{arm}.yaml"), router_conf(port, free_port(), ups, a.threads))
                # As users run it: the default level (`info`) logs a line per
                # request; `router-warn` is the reference without them.
                env = {"RUST_LOG": "warn"} if arm == "router-warn" else {"RUST_LOG": "info"}
                proc = procs.start(arm, [binary, "--config", cfg], cpu, env)
        if not why:
            why = wait_ready(arm, port, proc, bodies, 60)
        if why:
            skipped[arm] = why
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
            print(f"  {arm}: not run: {why}", file=sys.stderr)
            continue
        up[arm] = {"port": port, "proc": proc,
                   "threads": sum(len(os.listdir(f"/proc/{p}/task")) for p in tree(proc.pid)) if proc else 0}
        # A case answered wrongly is still run: its errors show in the tables.
        wrong = answers(port, bodies, a.cases)
        print(f"  {arm}: ready on 127.0.0.1:{port}" + (f"; answers wrongly: {wrong}" if wrong else ""),
              file=sys.stderr)
    return up, skipped


# ---------------------------------------------------------------- load

LUA = r"""
wrk.method = "%(method)s"
%(body)s
%(headers)s
local threads = {}
function setup(thread) table.insert(threads, thread) end
function init(args) bad = 0; up_a = 0; up_b = 0 end
function response(status, headers, body)
  if status ~= 200 or not body or not string.find(body, %(marker)s, 1, true) then bad = bad + 1 end
  for k, v in pairs(headers) do
    if string.lower(k) == "x-bench-upstream" then
      if v == "a" then up_a = up_a + 1 else up_b = up_b + 1 end
    end
  end
end
function done(summary, latency, requests)
  local bad, a, b = 0, 0, 0
  for _, t in ipairs(threads) do bad = bad + t:get("bad"); a = a + t:get("up_a"); b = b + t:get("up_b") end
  local e = summary.errors
  io.write(string.format('BENCH {"requests": %%d, "duration_us": %%d, "bytes": %%d, "connect": %%d, ' ..
    '"read": %%d, "write": %%d, "status": %%d, "timeout": %%d, "bad": %%d, "to_a": %%d, "to_b": %%d, ' ..
    '"p50_us": %%d, "p90_us": %%d, "p99_us": %%d, "mean_us": %%.1f, "max_us": %%d}\n',
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.status, e.timeout,
    bad, a, b, latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.mean,
    latency.max))
end
"""


def lua_script(work, case, body_file):
    method, _, _, _, marker = CASES[case]
    body = f'local f = io.open("{body_file}", "rb"); wrk.body = f:read("*a"); f:close()' if body_file else ""
    hdrs = "\n".join(f'wrk.headers["{k}"] = "{v}"' for k, v in headers(case).items())
    return write(os.path.join(work, f"{case}.lua"),
                 LUA % {"method": method, "body": body, "headers": hdrs, "marker": json.dumps(marker)})


def profile(a, arm, pids, name, seconds):
    """With `--perf`, a profile of a Pingora-based arm for the run's
    `seconds`; its CPU counts in the run's CPU figures (perf's own work at
    its end comes after them), so compare those figures without `--perf`."""
    if not (a.perf and pids and (arm == "pingora" or arm.startswith("router") or arm == "baseline")):
        return None
    out = os.path.join(a.out, "perf", f"{arm}-{name}.data")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    return subprocess.Popen(["perf", "record", "-q", "-F", "1999", "--call-graph", a.perf_call_graph, "-p", ",".join(map(str, pids)),
                             "-o", out, "--", "sleep", str(seconds)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def run_one(a, arm, info, case, conc, seconds, lua, upstream_pids, rnd=None):
    """One wrk run against one arm; CPU and RSS of the arm's processes around it
    (`rnd`: the round of a measured run, None for a warm-up)."""
    pids = tree(info["proc"].pid) if info["proc"] else []
    rss_reset = reset_peak_rss(pids)
    perf = profile(a, arm, pids, f"{case}-c{conc}-r{rnd}", seconds) if rnd is not None else None
    before = cpu_s(pids), cpu_s(upstream_pids), cpu_busy(), time.time()
    url = f"http://127.0.0.1:{info['port']}{CASES[case][1]}"
    cmd = ["taskset", "-c", a.load_cpus, "wrk", "-t1", f"-c{conc}", f"-d{seconds}s",
           "--timeout", "10s", "-s", lua, url]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    run_one.current = p
    out = p.stdout.read()
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    run_one.current = None
    wall = time.time() - before[3]
    busy = cpu_busy()
    if perf:
        perf.wait()
    line = next((l for l in out.splitlines() if l.startswith("BENCH ")), None)
    if line is None:
        raise RuntimeError(f"wrk printed no result for {arm} {case} c={conc}:\n{out}")
    r = json.loads(line[6:])
    r.update(arm=arm, case=case, conc=conc, wall_s=round(wall, 3))
    r["good"] = r["requests"] - r["bad"]
    r["errors"] = r["bad"] + r["connect"] + r["read"] + r["write"] + r["timeout"]
    r["rps"] = r["good"] / (r["duration_us"] / 1e6)
    r["proxy_cpu_s"] = cpu_s(pids) - before[0] if pids else None
    r["peak_rss_kib"] = status_kib(pids, "VmHWM") if pids else None
    r["rss_peak_is_per_run"] = rss_reset
    r["load_cpu_s"] = cpu_s(upstream_pids) - before[1] + ru.ru_utime + ru.ru_stime
    r["cpu_busy_all"] = {c: round((busy[c][0] - before[2][c][0]) / max(1, busy[c][1] - before[2][c][1]), 3)
                         for c in busy}
    # The hypervisor's share of the proxy CPUs (`/proc/stat`'s steal).
    proxy = [int(c) for c in a.proxy_cpu.split(",")]
    r["steal"] = (sum(busy[c][2] - before[2][c][2] for c in proxy) /
                  max(1, sum(busy[c][1] - before[2][c][1] for c in proxy)))
    return r


def guarded_run(a, arm, info, case, conc, seconds, lua, upstream_pids, rnd):
    """`run_one`, run again after a pause while the hypervisor took more than
    `max_steal` of the proxy CPU (up to `steal_tries` runs): this shared
    host has taken up to 70 % of it for minutes, which no ratio survives.
    A run still over it is kept, marked, and left out of the ratios."""
    for tries in range(1, a.steal_tries + 1):
        r = run_one(a, arm, info, case, conc, seconds, lua, upstream_pids, rnd)
        if r["steal"] <= a.max_steal or tries == a.steal_tries:
            break
        time.sleep(3)
    r["tries"] = tries
    return r


# ---------------------------------------------------------------- report

def median(xs):
    return statistics.median(xs) if xs else None


def summarise(runs, arms, cases, concs, load_ncpu):
    rows = {}
    for case in cases:
        for conc in concs:
            for arm in arms:
                rs = [r for r in runs if (r["arm"], r["case"], r["conc"]) == (arm, case, conc)]
                if not rs:
                    continue
                good = sum(r["good"] for r in rs)
                wall = sum(r["wall_s"] for r in rs)
                cpu = sum(r["proxy_cpu_s"] for r in rs) if rs[0]["proxy_cpu_s"] is not None else None
                rows[f"{case}/{conc}/{arm}"] = {
                    "case": case, "conc": conc, "arm": arm, "rounds": len(rs),
                    "rps": median([r["rps"] for r in rs]),
                    "rps_rounds": [round(r["rps"], 1) for r in rs],
                    "p50_us": median([r["p50_us"] for r in rs]), "p99_us": median([r["p99_us"] for r in rs]),
                    "cpu_us_per_req": cpu * 1e6 / good if cpu is not None and good else None,
                    "proxy_busy": cpu / wall if cpu is not None else None,
                    "load_busy": sum(r["load_cpu_s"] for r in rs) / wall / load_ncpu,
                    "peak_rss_kib": max(r["peak_rss_kib"] for r in rs) if cpu is not None else None,
                    "requests": sum(r["requests"] for r in rs), "good": good,
                    "errors": {k: sum(r[k] for r in rs) for k in ("bad", "status", "connect", "read", "write", "timeout")},
                    "to_a": sum(r["to_a"] for r in rs), "to_b": sum(r["to_b"] for r in rs),
                }
    return rows


def fmt_us(us):
    if us is None:
        return "—"
    return f"{us:.0f} µs" if abs(us) < 1000 else f"{us / 1000:.2f} ms"


def fmt_errors(e):
    socket_errs = e["connect"] + e["read"] + e["write"] + e["timeout"]
    if not e["bad"] and not socket_errs:
        return "0"
    parts = [f"{e[k]} {k}" for k in ("connect", "read", "write", "timeout") if e[k]]
    if e["bad"]:
        parts.append(f"{e['bad']} bad answer ({e['status']} status ≥ 400)")
    return f"**{e['bad'] + socket_errs}** ({', '.join(parts)})"


def case_table(rows, case, concs, arms):
    out = ["| arm | conns | req/s (median) | p50 | p99 | p50 added over direct | CPU-µs/req | "
           "CPU busy: proxy / load side | peak RSS | split a:b | requests | errors |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for conc in concs:
        direct = rows.get(f"{case}/{conc}/direct")
        for arm in arms:
            r = rows.get(f"{case}/{conc}/{arm}")
            if not r:
                continue
            added = r["p50_us"] - direct["p50_us"] if direct and arm != "direct" else None
            busy = (f"{r['proxy_busy'] * 100:.0f}% / " if r["proxy_busy"] is not None else "— / ") + \
                f"{r['load_busy'] * 100:.0f}%"
            cpu = f"{r['cpu_us_per_req']:.1f}" if r["cpu_us_per_req"] is not None else "—"
            rss = f"{r['peak_rss_kib'] / 1024:.1f} MiB" if r["peak_rss_kib"] is not None else "—"
            n = r["to_a"] + r["to_b"]
            # No upstream header: the proxy answered itself (SMG lists models from its registry).
            split = f"{r['to_a'] * 100 // n}:{r['to_b'] * 100 // n}" if n else "own answer"
            out.append(f"| {ARM_NAMES[arm]} | {conc} | {r['rps']:,.0f} | {fmt_us(r['p50_us'])} | "
                       f"{fmt_us(r['p99_us'])} | {fmt_us(added) if added is not None else '—'} | {cpu} | "
                       f"{busy} | {rss} | {split} | {r['requests']:,} | {fmt_errors(r['errors'])} |")
    return "\n".join(out)


def stolen(r):
    """A run that lost more than the allowed share of the proxy CPU to the
    hypervisor however often it was run (older runs recorded no steal)."""
    return r.get("steal", 0) > r.get("max_steal", 1)


def steal_note(runs):
    if not any("steal" in r for r in runs):
        return ""
    again = sum(r["tries"] - 1 for r in runs)
    out = sum(map(stolen, runs))
    return (f"A run that lost more than {runs[0]['max_steal']:.0%} of the proxy CPU to the hypervisor "
            f"(`/proc/stat`'s steal) was run again after a pause (`--steal-tries` runs at most): {again} "
            f"reruns; {out} of {len(runs)} runs still over it, left out of the ratios; median steal "
            f"{median([r['steal'] for r in runs]):.1%}.")


def round_ratios(runs, case, conc, other, key):
    """The router's figure over `other`'s, one per round both ran in: arms of
    one round run back to back, so each ratio sees the same machine."""
    def figure(r):
        if key == "cpu":
            return r["proxy_cpu_s"] / r["good"] if r["proxy_cpu_s"] and r["good"] else None
        return r["rps"] or None
    by = {}
    for r in runs:
        if (r["case"], r["conc"]) == (case, conc) and r["arm"] in ("router", other) and not stolen(r):
            by.setdefault(r["round"], {})[r["arm"]] = figure(r)
    return [v["router"] / v[other] for v in by.values() if v.get("router") and v.get(other)]


def fmt_ratio(xs):
    if not xs:
        return "—"
    if len(xs) == 1:
        return f"{xs[0]:.2f}"
    return f"{median(xs):.2f} ({min(xs):.2f}–{max(xs):.2f})"


def ratio_table(runs, cases, concs):
    baseline = any(r["arm"] == "baseline" for r in runs)
    out = ["| case | conns | router ÷ router at `warn` | router ÷ plain Pingora | router ÷ SMG | router ÷ nginx | "
           "router ÷ HAProxy | router CPU-µs/req ÷ plain Pingora | ÷ SMG |" +
           (" router ÷ baseline | CPU-µs/req ÷ baseline |" if baseline else ""),
           "|---|---|---|---|---|---|---|---|---|" + ("---|---|" if baseline else "")]
    for case in cases:
        for conc in concs:
            cells = [fmt_ratio(round_ratios(runs, case, conc, o, "rps"))
                     for o in ("router-warn", "pingora", "smg", "nginx", "haproxy")]
            cells += [fmt_ratio(round_ratios(runs, case, conc, o, "cpu")) for o in ("pingora", "smg")]
            if baseline:
                cells += [fmt_ratio(round_ratios(runs, case, conc, "baseline", k)) for k in ("rps", "cpu")]
            out.append(f"| {case} | {conc} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def arm_table(meta, rows):
    out = ["| arm | OS threads at start | peak RSS over the whole benchmark |", "|---|---|---|"]
    for arm, threads in meta["threads"].items():
        peak = max((r["peak_rss_kib"] for r in rows.values() if r["arm"] == arm), default=None)
        out.append(f"| {ARM_NAMES[arm]} | {threads} | {peak / 1024:.1f} MiB |" if peak else f"| {ARM_NAMES[arm]} | {threads} | — |")
    return "\n".join(out)


def foreign_share(runs, cpus, load_cpus):
    """Median share of the proxies' CPUs that processes outside the benchmark used during runs."""
    ids = {int(c) for c in cpus.split(",")}
    shared = ids & {int(c) for c in load_cpus.split(",")}

    def other(r):
        load = r["load_cpu_s"] / r["wall_s"] if shared else 0
        return sum(r["cpu_busy_all"].get(c, 0) for c in ids) - ((r["proxy_cpu_s"] or 0) / r["wall_s"] + load)
    return median([other(r) for r in runs]) or 0


def section(meta, rows, skipped, runs):
    a = meta
    arms = [x for x in a["arms"] if x not in skipped]
    foreign = foreign_share(runs, a["proxy_cpu"], a["load_cpus"])
    tables = "\n\n".join(f"### {CASE_TITLES[c]}\n\n{case_table(rows, c, a['concs'], arms)}" for c in a["cases"])
    not_run = [f"- {ARM_NAMES[k]}: not run: {v}" for k, v in skipped.items()]
    not_run += [f"- {ARM_NAMES[arm]}, {CASE_TITLES[case]}: not run: {why}"
                for (arm, case), why in NOT_SERVED.items() if arm in arms and case in a["cases"]]
    not_run = "".join(f"{line}\n" for line in not_run) + "\n" * bool(not_run)
    rss_when = "reset before each run" if all(r["rss_peak_is_per_run"] for r in runs) else \
        "over the whole benchmark (could not be reset)"
    versions = "; ".join(f"{k} {v}" for k, v in a["versions"].items())
    n = a["threads_option"]
    workers = "one worker (thread or process)" if n == 1 else \
        f"one worker (thread or process), prefix-router and plain Pingora {n} worker threads,"
    return f"""{MARK_BEGIN}
## Proxy overhead against other proxies

Command: `{a['command']}`, {a['date']}.
Machine: {a['cpu_model']}, {a['cores']} cores, Linux {a['kernel']}; load average {a['loadavg']} at the
start, shared with other work (processes outside the benchmark used a median
{foreign * 100:.0f}% of the proxies' CPU during runs).
Each arm ran {a['duration']} s per case and connection count in each of {a['rounds']} round{'s' * (a['rounds'] != 1)}
({f"after a {a['warmup']} s warm-up per case" if a['warmup'] else "no warm-up"}); every round runs all arms in turn, the order
rotated each round, so drift hits all alike.
Versions: {versions}.

Setup: two static upstreams on 127.0.0.1 (one nginx worker serving two ports;
a 253-byte chat completion, or for requests whose API key is `{STREAM_KEY}`
a chunked `text/event-stream` of four `data:` events ending `data: [DONE]`, one
write each; `/v1/models` lists model `bench`, which SMG needs; `GET /version`
answers `{{"version":"bench"}}`, a GET every proxy but SMG forwards, where the
router and SMG answer `/v1/models` themselves). The API key, not a header of its
own, asks for the stream because SMG forwards only a few headers. Every proxy
runs {workers} pinned to CPU {a['proxy_cpu']}; wrk (one thread) and
the upstreams are pinned to CPU {a['load_cpus']}. nginx: `keepalive` to the upstreams,
`proxy_request_buffering on`, `proxy_buffering off`, bodies held in memory;
HAProxy: `nbthread 1`, `http-reuse always`, `option http-buffer-request` with
`tune.bufsize` 512 KiB so it too holds a 400 KiB body whole; plain Pingora: a
minimal `ProxyHttp` over Pingora's `LoadBalancer<RoundRobin>` that streams the
body through unread, with the router's default timeouts (to clients and to
replicas; `--no-timeouts` runs it without, as before 2026-12-04), built from
this repository (`examples/plain-pingora.rs`);
SMG: `smg launch --policy cache_aware`; prefix-router: `policy: shape`, at the
default log level (`info`: an access line per request, as users run it; the
`router-warn` arm at `RUST_LOG=warn` logs none),
`threads: {a['threads_option']}` (its global allocator is mimalloc; plain Pingora keeps the
system's). Bodies are agent conversations of exactly 4 KiB / 400 KiB, model
`bench`, the same body for every request of a case: from its second request on,
the router reads a 400 KiB body from the checkpoint the one before left (a
conversation's later turn; its first is the decision path's
"400 KiB agent body" row above).

Columns: req/s counts good answers only (200 with the expected body); p50/p99
are medians over rounds of wrk's percentiles (the p50 added over direct includes
the hop to the proxy's CPU: direct runs wrk and the upstream on one CPU);
CPU-µs/req is the proxy's utime+stime (all its processes and threads, from
/proc) over good answers; "CPU busy" is the proxy's CPU time over wall time,
and the load side's (wrk plus upstreams) over its CPUs: when the load side is
near 100% it, not the proxy, caps req/s, and CPU-µs/req is the figure that
compares proxies; peak RSS is VmHWM {rss_when}, summed over
the proxy's processes (memory an allocator kept from an earlier case, such as
the 400 KiB warm-up, counts); "split a:b" is the share of answers from each
upstream ("own answer": the proxy answered without an upstream); requests are
all answers counted by wrk over the rounds; errors are socket errors plus
answers that were not 200 with the expected body.

{not_run}{tables}

### Ratios (req/s, and CPU-µs per request)

Each round's router figure over the other arm's in the same round (arms of a
round run back to back, so a ratio sees one state of the machine): the median
over rounds, then the lowest and highest in brackets. {steal_note(runs)}

{ratio_table(runs, a['cases'], a['concs'])}

### Per proxy

{arm_table(a, rows)}

Raw runs: `{a['out']}/runs.json`; summary: `{a['out']}/summary.json`.
{MARK_END}
"""


def write_doc(path, text):
    old = open(path).read() if os.path.exists(path) else ""
    if MARK_BEGIN in old and MARK_END in old:
        head, rest = old.split(MARK_BEGIN, 1)
        new = head + text.rstrip("\n") + rest.split(MARK_END, 1)[1]
    else:
        new = old.rstrip("\n") + "\n\n" + text
    with open(path, "w") as f:
        f.write(new)


# ---------------------------------------------------------------- main

def machine(a):
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    vers = {"nginx": sh("nginx -v").split("/")[-1], "HAProxy": sh("haproxy -v").split()[2] if shutil.which("haproxy") else "-",
            "wrk": sh("wrk -v").split()[1] if shutil.which("wrk") else "-",
            "smg": sh(f"{a.venv}/bin/pip show smg 2>/dev/null | sed -n 's/^Version: //p'") or "-",
            "prefix-router": sh(f"git -C {ROOT} describe --always --dirty")}
    return {"cpu_model": cpu, "cores": os.cpu_count(), "kernel": os.uname().release,
            "loadavg": open("/proc/loadavg").read().split()[0], "versions": vers}


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=int, default=3, help="seconds per wrk run (whole seconds)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cases", default=",".join(DEFAULT_CASES), help=f"subset of {','.join(CASES)} or 'all'")
    ap.add_argument("--conc", default="1,16,64", help="connection counts")
    ap.add_argument("--arms", default=",".join(ARMS[:-1]), help=f"subset of {','.join(ARMS)}")
    ap.add_argument("--baseline", help="another prefix-router binary, run as arm `baseline` beside "
                    "`router` (before and after a change, in one run)")
    ap.add_argument("--quick", action="store_true", help="smoke test: 1 round of 2 s")
    ap.add_argument("--proxy-cpu", default="0", help="CPUs every proxy is pinned to (taskset list)")
    ap.add_argument("--threads", type=int, default=1,
                    help="worker threads of prefix-router and plain Pingora (the others run one)")
    ap.add_argument("--load-cpus", default="1", help="CPUs for wrk and the upstreams (taskset list)")
    ap.add_argument("--warmup", type=int, default=1, help="seconds per arm and case before round 1")
    ap.add_argument("--max-steal", type=float, default=0.1,
                    help="share of the proxy CPU the hypervisor may take in a run before it is run again")
    ap.add_argument("--steal-tries", type=int, default=4, help="runs of a case while it is stolen")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench-out/proxy"))
    ap.add_argument("--venv", default=os.path.join(ROOT, "bench-out/venv"), help="where SMG is installed")
    ap.add_argument("--doc", help="write the proxy section into this Markdown file")
    ap.add_argument("--perf-call-graph", default="fp",
                    help="perf's --call-graph mode with --perf (`dwarf` walks frames the release build keeps no pointers for)")
    ap.add_argument("--perf", action="store_true",
                    help="record a perf profile of plain Pingora and the router arms in each measured run "
                         "(OUT/perf/ARM-CASE-cCONNS-rROUND.data: `perf report -i` it)")
    a = ap.parse_args()
    a.out = os.path.abspath(a.out)  # nginx resolves paths against its prefix
    if a.quick:
        a.duration, a.rounds = 2, 1
    a.cases = list(CASES) if a.cases == "all" else a.cases.split(",")
    a.arms, a.concs = a.arms.split(","), [int(c) for c in a.conc.split(",")]
    for name, got, known in (("case", a.cases, CASES), ("arm", a.arms, ARMS)):
        bad = [x for x in got if x not in known]
        if bad:
            ap.error(f"unknown {name}: {', '.join(bad)}")
    if a.baseline:
        a.baseline = os.path.abspath(a.baseline)
        a.arms.append("baseline")
    elif "baseline" in a.arms:
        ap.error("arm baseline needs --baseline PATH")
    a.arms = [x for x in ARMS if x in a.arms]
    return a


def bench(a, procs, work):
    missing = ensure_debian({"nginx-light": "nginx", "haproxy": "haproxy", "wrk": "wrk"})
    if "wrk" in missing or "nginx" in missing:
        sys.exit(f"cannot run: {missing}  (the load generator and the upstreams need wrk and nginx)")
    bodies = {c: chat_body(size, stream) for c, (_, _, size, stream, _) in CASES.items() if size}
    body_files = {}
    for c, b in bodies.items():
        with open(os.path.join(work, f"{c}.json"), "wb") as f:
            f.write(b)
        body_files[c] = f.name
    ups = [free_port(), free_port()]
    os.makedirs(os.path.join(work, "upstream-body"), exist_ok=True)
    cfg = write(os.path.join(work, "upstream.conf"), upstream_conf(work, dict(zip("ab", ups))))
    upstream = procs.start("upstream", ["nginx", "-e", os.path.join(work, "upstream.err"), "-p", work, "-c", cfg],
                           a.load_cpus)
    if wait_ready("direct", ups[0], upstream, bodies, 10) or wait_ready("direct", ups[1], upstream, bodies, 10):
        sys.exit(f"upstreams did not come up; see {work}/upstream.log and upstream.err")
    up_pids = tree(upstream.pid)
    print(f"upstreams on 127.0.0.1:{ups[0]} and :{ups[1]}; starting arms", file=sys.stderr)
    arms, skipped = start_arms(a, procs, work, ups, bodies, missing)
    luas = {c: lua_script(work, c, body_files.get(c)) for c in a.cases}
    load_ncpu = len(os.sched_getaffinity(upstream.pid))
    order = [x for x in a.arms if x in arms]
    if a.warmup:
        for arm in order:
            for case in a.cases:
                if (arm, case) in NOT_SERVED:
                    continue
                run_one(a, arm, arms[arm], case, max(a.concs), a.warmup, luas[case], up_pids)
    served = sum((arm, case) not in NOT_SERVED for arm in order for case in a.cases)
    runs, total = [], a.rounds * len(a.concs) * served
    for rnd in range(a.rounds):
        rot = order[rnd % len(order):] + order[:rnd % len(order)] if order else []
        for case in a.cases:
            for conc in a.concs:
                for arm in rot:
                    if (arm, case) in NOT_SERVED:
                        continue
                    r = guarded_run(a, arm, arms[arm], case, conc, a.duration, luas[case], up_pids, rnd)
                    r["round"], r["max_steal"] = rnd, a.max_steal
                    runs.append(r)
                    print(f"[{len(runs)}/{total}] round {rnd + 1} {case:>8} c={conc:<3} {arm:>8}: "
                          f"{r['rps']:9,.0f} req/s  p50 {fmt_us(r['p50_us']):>9}  p99 {fmt_us(r['p99_us']):>9}"
                          f"  errors {r['errors']}  steal {r['steal']:.0%}", file=sys.stderr)
    return runs, skipped, load_ncpu, {k: v["threads"] for k, v in arms.items() if v["proc"]}


def main():
    a = parse_args()
    os.makedirs(a.out, exist_ok=True)
    work = os.path.join(a.out, "work")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    procs = Procs(work)
    # Ctrl-C and SIGTERM both unwind through the finally below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(130))
    try:
        runs, skipped, load_ncpu, threads = bench(a, procs, work)
    finally:
        wrk = getattr(run_one, "current", None)
        if wrk is not None and wrk.poll() is None:
            os.killpg(wrk.pid, signal.SIGKILL)
        procs.stop_all()
    meta = machine(a)  # versions of what was installed on the way
    cmd = "make bench-proxy" if sys.argv[1:] == ["--doc", "docs/performance.md"] else \
        " ".join(["scripts/bench-proxy.py"] + sys.argv[1:])
    meta.update(command=cmd, date=datetime.date.today().isoformat(), duration=a.duration, rounds=a.rounds,
                cases=a.cases, concs=a.concs, arms=a.arms, warmup=a.warmup,
                proxy_cpu=a.proxy_cpu, load_cpus=a.load_cpus, out=os.path.relpath(a.out, ROOT),
                threads_option=a.threads,
                skipped=skipped, threads=threads)
    rows = summarise(runs, a.arms, a.cases, a.concs, load_ncpu)
    with open(os.path.join(a.out, "runs.json"), "w") as f:
        json.dump({"meta": meta, "runs": runs}, f, indent=1)
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    text = section(meta, rows, skipped, runs)
    print(text)
    foreign = foreign_share(runs, a.proxy_cpu, a.load_cpus)
    if foreign > 0.1:
        print(f"warning: processes outside the benchmark used {foreign:.0%} of "
              f"CPU {a.proxy_cpu} during runs; the figures are noisy", file=sys.stderr)
    if a.doc:
        write_doc(a.doc, text)
        print(f"wrote the proxy section of {a.doc}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
