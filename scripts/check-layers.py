#!/usr/bin/env python3
"""CI's structure check: no import cycle between modules of any crate, the
router's top-level modules import only from layers below their own, and no
source file is longer than MAX_LINES.

usage: scripts/check-layers.py   (from the repository root; exit 1 on a finding)

Edges are the `crate::` and `super::` paths a module names outside its unit
tests (the `#[cfg(test)] mod tests` block at the bottom), as rustc resolves
them: the longest module path that exists.
"""
import os
import re
import sys

MAX_LINES = 600

# The router's modules (src/), lowest layer first; a module imports only
# from layers before its own. The routing crate (policy, request) sits below
# all of them and imports none of them: Cargo enforces that.
LAYERS = [
    # Leaves: the config's types, the error and path vocabularies, usage
    # figures, the response-id store.
    ["config", "errors", "paths", "usage", "listen_tls", "response_ids"],
    # Built from the config: metrics handles, the log, name resolution, the
    # upgrade socket, the router's own requests to engines, the policy's
    # parameters, admission limits, API keys.
    ["metrics", "access_log", "resolve", "upgrade", "engine_client", "policy_config", "admission", "auth", "traces"],
    # The replica set, shared pins.
    ["replicas", "shared_pins", "tenants"],
    # The admin API over the set (the status listener serves it).
    ["admin"],
    # What runs over the set: the health checks, engine
    # load and KV events, capacity, the status listener, drain; the proxy's
    # settings.
    ["health_checks", "engine_load", "kv_events", "capacity", "status", "drain", "settings"],
    # The request body; its tokens.
    ["body"],
    ["exact"],
    # The ProxyHttp seam and hot reload.
    ["proxy", "reload"],
]

USE = re.compile(r"\b(crate|super)((?:::[A-Za-z_][A-Za-z0-9_]*)+)")
TESTS = re.compile(r"#\[cfg\(test\)\]\s*mod tests\s*\{.*", re.S)


def modules(src):
    """{module path tuple: file} for one crate's src dir (bins excluded)."""
    out = {}
    for d, _, files in os.walk(src):
        if os.path.relpath(d, src).split(os.sep)[0] == "bin":
            continue
        for f in files:
            if not f.endswith(".rs"):
                continue
            rel = os.path.relpath(os.path.join(d, f), src)[:-3].split(os.sep)
            if rel in (["lib"], ["main"]):
                key = ()
            elif rel[-1] == "mod":
                key = tuple(rel[:-1])
            else:
                key = tuple(rel)
            out[key] = os.path.join(d, f)
    return out


def edges(mods):
    g = {m: set() for m in mods}
    for m, f in mods.items():
        with open(f, encoding="utf-8") as fh:
            text = TESTS.sub("", fh.read())
        is_mod_file = os.path.basename(f) in ("mod.rs", "lib.rs", "main.rs")
        for kind, rest in USE.findall(text):
            parts = [p for p in rest.split("::") if p]
            if kind == "crate":
                base = []
            else:
                base = list(m) if is_mod_file else list(m[:-1])
                while parts and parts[0] == "super":
                    parts.pop(0)
                    base = base[:-1]
                base = base[:-1] if is_mod_file else base
            path = base + parts
            for n in range(len(path), 0, -1):
                t = tuple(path[:n])
                if t in mods:
                    if t != m:
                        g[m].add(t)
                    break
    return g


def cycles(g):
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def main():
    findings = []
    crates = ["src"] + sorted(
        os.path.join("crates", c, "src") for c in os.listdir("crates") if os.path.isdir(os.path.join("crates", c, "src"))
    )
    for src in crates:
        mods = modules(src)
        g = edges(mods)
        for comp in cycles(g):
            findings.append(f"{src}: import cycle: " + " <-> ".join("::".join(m) for m in comp))
        if src != "src":
            continue
        layer = {name: i for i, names in enumerate(LAYERS) for name in names}
        for m in sorted(mods):
            if len(m) != 1:
                continue
            if m[0] not in layer:
                findings.append(f"src/{m[0]}: not in any layer of scripts/check-layers.py")
                continue
            for t in sorted(g[m]):
                top = t[0]
                if top in layer and layer[top] >= layer[m[0]]:
                    findings.append(
                        f"src/{m[0]} (layer {layer[m[0]]}) imports {'::'.join(t)} (layer {layer[top]}): "
                        "only layers below may be imported"
                    )
    for root in ["src", "crates", "tests", "benches"]:
        for d, _, files in os.walk(root):
            if "target" in d.split(os.sep):
                continue
            for f in files:
                if f.endswith(".rs"):
                    path = os.path.join(d, f)
                    with open(path, encoding="utf-8") as fh:
                        n = sum(1 for _ in fh)
                    if n > MAX_LINES:
                        findings.append(f"{path}: {n} lines (at most {MAX_LINES})")
    for f in findings:
        print(f)
    print(f"check-layers: {len(findings)} finding(s)")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
