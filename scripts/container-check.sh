#!/usr/bin/env bash
# Checks the Dockerfile's image the way it runs, without a Docker engine:
#  1. runs the build stage's RUN lines, as written, in this checkout (its
#     WORKDIR, since the stage does `COPY . .`): apt-get install cmake (note: it
#     also empties the host's /var/lib/apt/lists), then the release build;
#  2. debootstraps Debian bookworm (minbase, the base of debian:bookworm-slim)
#     once into bench-out/container-rootfs/base, and copies it to .../run;
#  3. replays the runtime stage in order: RUN lines in a chroot, COPY --from
#     the build stage (checkout paths), USER;
#  4. in a private network + mount namespace (the container's own ports,
#     8080/9091 as in the image, free whatever the host runs; /proc and /sys
#     mounted there only, so they vanish with the namespace), starts two
#     replica-sims from the image and the ENTRYPOINT + CMD, chrooted as USER,
#     with the image's config whose `replicas` now name the sims (an operator's
#     mounted config);
#  5. checks: config --check, /ready, the HEALTHCHECK command as written (and
#     that a probe of a closed port fails), a chat completion through the
#     proxy, uid/gid 10001, listeners on 0.0.0.0 at the EXPOSEd ports, and
#     STOPSIGNAL -> exit 0 within shutdown_grace_s.
# Usage (root; needs debootstrap, python3 >= 3.8, curl, util-linux, iproute2):
#   scripts/container-check.sh
#   CONTAINER_CHECK_SKIP_BUILD=1 scripts/container-check.sh   # skip the build
#       stage's apt-get/cargo lines and use the existing target/release binaries
# Env: CONTAINER_CHECK_ROOTFS (default bench-out/container-rootfs; delete its
# base/ to re-debootstrap), CONTAINER_CHECK_MIRROR (default deb.debian.org).
# Prints PASS/FAIL per check and a summary; exit 0 only when all pass.
set -euo pipefail
cd "$(dirname "$0")/.."
cache=$(realpath -m "${CONTAINER_CHECK_ROOTFS:-bench-out/container-rootfs}")
base=$cache/base
root=$cache/run
logs=$cache/logs
mirror=${CONTAINER_CHECK_MIRROR:-http://deb.debian.org/debian}
skip_build=${CONTAINER_CHECK_SKIP_BUILD:-0}
expected_id=10001 # the Dockerfile's fixed uid/gid
docker_path=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

results=()
failed=0
pids=()
ns_pid=
# One line per check: command output folded, long errors cut.
line() { tr -s '\n\t ' ' ' <<<"$*" | sed 's/ *$//' | cut -c1-400; }
pass() { results+=("PASS  $(line "$*")"); echo "PASS  $(line "$*")"; }
fail() { results+=("FAIL  $(line "$*")"); echo "FAIL  $(line "$*")"; failed=1; }
skip() { results+=("SKIP  $(line "$*")"); echo "SKIP  $(line "$*")"; }
die() { fail "$*"; exit 1; }
finish() {
    local rc=$?
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    if [[ -n $ns_pid ]]; then kill "$ns_pid" 2>/dev/null || true; fi
    wait 2>/dev/null || true
    echo
    echo "== container-check summary"
    printf '%s\n' "${results[@]}"
    if ((rc == 0 && failed == 0)); then
        echo "container-check: PASS (${#results[@]} checks)"
    else
        echo "container-check: FAIL (logs: $logs)"
        exit 1
    fi
}
trap finish EXIT
trap 'exit 130' INT TERM

# Repeats "$@" until it succeeds or $1 seconds pass.
poll() {
    local end=$((SECONDS + $1))
    shift
    until "$@"; do
        ((SECONDS < end)) || return 1
        sleep 0.1
    done
}

((EUID == 0)) || die "run as root (debootstrap, chroot, namespaces)"
for tool in debootstrap python3 curl unshare nsenter chroot ip ss timeout; do
    command -v "$tool" >/dev/null || die "missing tool: $tool"
done

# --- The Dockerfile, as a plan: bash assignments printed by the parser below.
# Anything it does not model (ENV, ARG, ADD, a runtime WORKDIR, COPY flags
# other than --from, shell-form ENTRYPOINT/CMD, more than two stages) is an
# error, so the replay cannot silently differ from a docker build.
plan=$(
    python3 - Dockerfile 2>&1 <<'PY'
import json, re, shlex, sys

def q(s): return shlex.quote(s)
def arr(name, xs): return f"{name}=({' '.join(q(x) for x in xs)})"
def bad(n, msg): sys.exit(f"Dockerfile:{n}: {msg}")

text = open(sys.argv[1]).read().split("\n")
instrs, buf, start = [], "", None
for n, raw in enumerate(text, 1):
    s = raw.strip()
    if s.startswith("#") or (not s and start is None):
        continue
    start = start or n
    if re.search(r"\\[ \t]*$", raw):          # line continuation: drop "\" + newline
        buf += re.sub(r"\\[ \t]*$", "", raw)
        continue
    buf += raw
    kw, _, rest = buf.strip().partition(" ")
    instrs.append((start, kw.upper(), rest.strip()))
    buf, start = "", None

stages, out = [], []
for n, kw, rest in instrs:
    if kw == "FROM":
        m = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", rest, re.I)
        if not m: bad(n, f"FROM {rest}")
        stages.append({"image": m[1], "name": m[2], "instrs": []})
    elif not stages:
        bad(n, f"{kw} before FROM")
    else:
        stages[-1]["instrs"].append((n, kw, rest))
if len(stages) != 2:
    sys.exit(f"Dockerfile: {len(stages)} stages; the check models a build and a runtime stage")
build, runtime = stages

ctx_dir, workdir = None, None
for n, kw, rest in build["instrs"]:
    if kw == "RUN":
        if rest.startswith("["): bad(n, "exec-form RUN")
        out.append(f"BUILD_RUN+=({q(rest)})")
    elif kw == "WORKDIR":
        workdir = rest
    elif kw == "COPY":
        if rest.split() != [".", "."] or not workdir: bad(n, "build stage COPY other than `COPY . .` after WORKDIR")
        ctx_dir = workdir.rstrip("/")
    else:
        bad(n, f"{kw} in the build stage is not modelled")
if not ctx_dir: sys.exit("Dockerfile: build stage never does `COPY . .`")
out.append(f"BUILD_IMAGE={q(build['image'])}")
out.append(f"RUNTIME_IMAGE={q(runtime['image'])}")

def exec_form(n, kw, rest):
    try:
        v = json.loads(rest)
        assert isinstance(v, list) and all(isinstance(x, str) for x in v)
        return v
    except Exception:
        bad(n, f"{kw} must be exec form (a JSON array)")

def seconds(n, d):
    m = re.fullmatch(r"(?:(\d+)m)?(?:(\d+)s)?", d)
    if not m or not d: bad(n, f"duration {d}")
    return int(m[1] or 0) * 60 + int(m[2] or 0)

for n, kw, rest in runtime["instrs"]:
    if kw == "RUN":
        if rest.startswith("["): bad(n, "exec-form RUN")
        out.append(f"RT_STEP+=({q('rt_run ' + q(rest))})")
    elif kw == "COPY":
        words = shlex.split(rest)
        flags = [w for w in words if w.startswith("--")]
        paths = [w for w in words if not w.startswith("--")]
        if flags != [f"--from={build['name']}"] and flags != ["--from=0"]:
            bad(n, f"COPY flags {flags}: only --from=<build stage> is modelled")
        *srcs, dest = paths
        rel = []
        for s in srcs:
            if not s.startswith(ctx_dir + "/"): bad(n, f"{s} is outside the build stage's {ctx_dir}")
            rel.append(s[len(ctx_dir) + 1:])
        if not dest.startswith("/"): bad(n, "relative COPY destination")
        out.append(f"RT_STEP+=({q('rt_copy ' + ' '.join(q(x) for x in [dest] + rel))})")
    elif kw == "USER":
        out.append(f"RT_STEP+=({q('rt_user ' + q(rest))})")
    elif kw == "EXPOSE":
        out.append(arr("EXPOSE", [p.split("/")[0] for p in rest.split()]))
    elif kw == "STOPSIGNAL":
        out.append(f"STOPSIGNAL={q(rest)}")
    elif kw == "HEALTHCHECK":
        opts, timeout = rest.split(), 30
        while opts and opts[0].startswith("--"):
            k, _, v = opts.pop(0).partition("=")
            if k == "--timeout": timeout = seconds(n, v)
        if not opts or opts[0] != "CMD": bad(n, "HEALTHCHECK without CMD")
        cmd = rest[rest.index("CMD") + 3:].strip()
        argv = exec_form(n, kw, cmd) if cmd.startswith("[") else ["/bin/sh", "-c", cmd]
        out.append(arr("HEALTHCHECK", argv))
        out.append(f"HEALTHCHECK_TIMEOUT={timeout}")
    elif kw in ("ENTRYPOINT", "CMD"):
        out.append(arr(kw, exec_form(n, kw, rest)))
    elif kw == "LABEL":
        pass
    else:
        bad(n, f"{kw} in the runtime stage is not modelled")
print("\n".join(out))
PY
) || die "Dockerfile parse: $plan"
BUILD_RUN=() RT_STEP=() EXPOSE=() HEALTHCHECK=() ENTRYPOINT=() CMD=() STOPSIGNAL=SIGTERM HEALTHCHECK_TIMEOUT=30
eval "$plan"
echo "== plan (from Dockerfile)"
echo "$plan"
((${#HEALTHCHECK[@]})) || die "Dockerfile has no HEALTHCHECK"
((${#ENTRYPOINT[@]})) || die "Dockerfile has no exec-form ENTRYPOINT"
pass "Dockerfile parsed: build on $BUILD_IMAGE, runtime on $RUNTIME_IMAGE, ${#RT_STEP[@]} runtime steps"

# --- 1. Build stage: its RUN lines, as written, in the checkout.
echo "== build stage"
skipped=0
for line in "${BUILD_RUN[@]}"; do
    if [[ $skip_build == 1 ]] && grep -qE '\b(cargo|apt-get)\b' <<<"$line"; then
        echo "SKIP (CONTAINER_CHECK_SKIP_BUILD=1): RUN $line"
        skipped=$((skipped + 1))
        continue
    fi
    echo "+ RUN $line"
    /bin/sh -c "$line" || die "build stage: RUN $line"
done
if ((skipped)); then
    pass "build stage: $((${#BUILD_RUN[@]} - skipped)) RUN lines run, $skipped skipped (existing target/release binaries, built $(date -r target/release/prefix-router '+%F %T'))"
else
    pass "build stage: ${#BUILD_RUN[@]} RUN lines run as written"
fi

# --- 2. Base system: a cached minbase bookworm (what debian:bookworm-slim is cut from).
if [[ ! -d $base ]]; then
    echo "== debootstrap bookworm (minbase) into $base"
    rm -rf "$base.partial"
    mkdir -p "$cache"
    debootstrap --variant=minbase bookworm "$base.partial" "$mirror" >"$cache/debootstrap.log" 2>&1 ||
        die "debootstrap (log: $cache/debootstrap.log)"
    mv "$base.partial" "$base"
fi
if grep -q " ${root}[/ ]" /proc/self/mountinfo; then
    die "something is mounted under $root on the host; unmount it first"
fi
rm -rf "$root" "$logs"
mkdir -p "$logs"
cp -a "$base" "$root"
echo "== rootfs $root (copy of $base)"

# --- The container's namespaces: own loopback-only network, own mounts.
unshare --net --mount --propagation private sleep infinity &
ns_pid=$!
separate_ns() { [[ $(readlink "/proc/$ns_pid/ns/net") != "$(readlink /proc/self/ns/net)" ]]; }
poll 5 separate_ns || die "unshare --net --mount (is this root with CAP_SYS_ADMIN?)"
inns() { nsenter --target "$ns_pid" --net --mount -- "$@"; }
inns ip link set lo up
inns mount -t proc proc "$root/proc"
inns mount -t sysfs -o ro sysfs "$root/sys"

# --- 3. Runtime stage, in Dockerfile order.
rt_uid=0 rt_gid=0 rt_home=/root
# RUN: in the mounts' namespace but on the host's network, as a docker build
# gives RUN network access (apt-get).
rt_run() {
    echo "+ RUN (chroot, uid $rt_uid) $1"
    env -i PATH="$docker_path" HOME="$rt_home" nsenter --target "$ns_pid" --mount -- \
        chroot --userspec="$rt_uid:$rt_gid" "$root" /bin/sh -c "$1"
}
rt_copy() {
    local dest=$1 src
    shift
    echo "+ COPY $* -> $dest"
    for src in "$@"; do
        [[ -e $src ]] || { echo "missing $src" >&2; return 1; }
        if [[ $dest == */ || $# -gt 1 ]]; then
            mkdir -p "$root$dest" || return 1
            if [[ -d $src ]]; then src=$src/.; fi
            cp -R --preserve=mode,timestamps "$src" "$root$dest" || return 1
        else
            mkdir -p "$(dirname "$root$dest")" || return 1
            cp -R --preserve=mode,timestamps "$src" "$root$dest" || return 1
        fi
    done
}
rt_user() {
    local user=${1%%:*} group='' entry
    [[ $1 == *:* ]] && group=${1#*:}
    entry=$(awk -F: -v u="$user" '$1 == u || $3 == u { print $3 ":" $4 ":" $6; exit }' "$root/etc/passwd")
    [[ -n $entry ]] || { echo "USER $1: no such user in the image" >&2; return 1; }
    IFS=: read -r rt_uid rt_gid rt_home <<<"$entry"
    if [[ -n $group ]]; then
        rt_gid=$(awk -F: -v g="$group" '$1 == g || $3 == g { print $3; exit }' "$root/etc/group")
        [[ -n $rt_gid ]] || { echo "USER $1: no such group" >&2; return 1; }
    fi
    echo "+ USER $1 (uid $rt_uid gid $rt_gid)"
}
echo "== runtime stage"
for step in "${RT_STEP[@]}"; do
    eval "$step" || die "runtime stage: $step"
done
pass "runtime stage replayed: user $(awk -F: -v u="$rt_uid" '$3 == u { print $1 ":" $3 ":" $4 }' "$root/etc/passwd"), $(cd "$root/usr/local/bin" && printf '%s ' *)"
# Every command "in the container": Docker's env, the USER, chrooted, in the namespaces.
in_image=(env -i PATH="$docker_path" HOSTNAME=container-check HOME="$rt_home"
    nsenter --target "$ns_pid" --net --mount -- chroot --userspec="$rt_uid:$rt_gid" "$root")

# --- 4. The config an operator mounts: the image's, with replicas = two sims.
config=
for ((i = 0; i < ${#CMD[@]}; i++)); do
    [[ ${CMD[i]} == --config ]] && config=${CMD[i + 1]:-}
done
[[ -n $config && -f $root$config ]] || die "CMD names no --config file present in the image (${CMD[*]})"
sims=("sim0 127.0.0.1:18001" "sim1 127.0.0.1:18002")
settings=$(
    python3 - "$root$config" "${sims[@]}" <<'PY'
import re, sys
path, sims = sys.argv[1], [s.split() for s in sys.argv[2:]]
lines = open(path).read().split("\n")
def key(k, default):
    for l in lines:
        m = re.match(rf"{k}:\s*\"?([^\"#\s]+)", l)
        if m: return m[1]
    return default
print(f"listen={key('listen', '0.0.0.0:8080')}")
print(f"metrics_listen={key('metrics_listen', '0.0.0.0:9091')}")
print(f"grace={key('shutdown_grace_s', '20')}")
out, skipping = [], False
for l in lines:
    if re.match(r"replicas:", l):
        skipping = True
        continue
    if skipping and (l == "" or l[0] in " \t-#"):
        continue
    skipping = False
    out.append(l)
while out and out[-1] == "": out.pop()
out.append("replicas:                       # container-check: the image's replica-sims")
for name, addr in sims:
    out += [f"  - name: {name}", f'    addr: "{addr}"', "    kv_tokens: 122636         # replica-sim's default"]
open(path, "w").write("\n".join(out) + "\n")
PY
) || die "config rewrite"
listen='' metrics_listen='' grace=''
eval "$settings"
listen_port=${listen##*:}
metrics_port=${metrics_listen##*:}
echo "== config $config: listen $listen, metrics_listen $metrics_listen, shutdown_grace_s $grace"
if out=$("${in_image[@]}" "${ENTRYPOINT[@]}" --check --config "$config" 2>&1); then
    pass "config check: $out"
else
    fail "config check: $out"
fi
if [[ " ${EXPOSE[*]} " == *" $listen_port "* && " ${EXPOSE[*]} " == *" $metrics_port "* ]]; then
    pass "EXPOSE ${EXPOSE[*]} covers listen :$listen_port and metrics_listen :$metrics_port"
else
    fail "EXPOSE ${EXPOSE[*]} vs listen :$listen_port, metrics_listen :$metrics_port"
fi

# --- 5. Run it.
http_code() { inns curl -s -o /dev/null -w '%{http_code}' --max-time 2 "$@" || true; }
is_200() { [[ $(http_code "$1") == 200 ]]; }
for s in "${sims[@]}"; do
    read -r name addr <<<"$s"
    "${in_image[@]}" replica-sim --listen "$addr" --name "$name" --time-scale 100 >"$logs/$name.log" 2>&1 &
    pids+=($!)
done
for s in "${sims[@]}"; do
    read -r name addr <<<"$s"
    poll 10 is_200 "http://$addr/health" || die "replica-sim $name never answered /health (log: $logs/$name.log)"
done
echo "+ ${ENTRYPOINT[*]} ${CMD[*]}  (uid $rt_uid, chroot $root)"
"${in_image[@]}" "${ENTRYPOINT[@]}" "${CMD[@]}" >"$logs/router.log" 2>&1 &
router=$!
pids+=("$router")
alive() { kill -0 "$1" 2>/dev/null && [[ $(awk '/^State:/ { print $2 }' "/proc/$1/status" 2>/dev/null) != Z ]]; }
router_up() {
    alive "$router" || { tail -20 "$logs/router.log"; die "router exited at start"; }
    is_200 "http://127.0.0.1:$metrics_port/ready"
}
if poll 30 router_up; then
    pass "router ready: /ready 200 on :$metrics_port ($(readlink "/proc/$router/exe" | sed "s|^$root||"))"
else
    tail -20 "$logs/router.log"
    die "router not ready within 30 s (log: $logs/router.log)"
fi

echo "+ HEALTHCHECK ${HEALTHCHECK[*]} (timeout ${HEALTHCHECK_TIMEOUT}s)"
if out=$(timeout "$HEALTHCHECK_TIMEOUT" "${in_image[@]}" "${HEALTHCHECK[@]}" 2>&1); then
    pass "HEALTHCHECK exit 0: $out"
    # It must also be able to fail: the same command on a closed port (9, discard).
    probe_closed=("${HEALTHCHECK[@]}")
    probe_closed[${#probe_closed[@]} - 1]=http://127.0.0.1:9/healthz
    if out=$(timeout "$HEALTHCHECK_TIMEOUT" "${in_image[@]}" "${probe_closed[@]}" 2>&1); then
        fail "HEALTHCHECK command on a closed port exited 0: $out"
    else
        pass "HEALTHCHECK command on a closed port exits $?: $out"
    fi
else
    fail "HEALTHCHECK exit $?: $out"
    skip "HEALTHCHECK command on a closed port: not tried (the HEALTHCHECK failed)"
fi

body='{"model":"sim","messages":[{"role":"user","content":"hello from container-check"}],"max_tokens":4}'
answer=$(inns curl -s -i --max-time 10 -H 'content-type: application/json' -d "$body" \
    "http://127.0.0.1:$listen_port/v1/chat/completions" || true)
status=$(head -1 <<<"$answer" | tr -d '\r')
replica=$(grep -i '^x-prefix-router-replica:' <<<"$answer" | tr -d '\r' || true)
if [[ $status == *" 200"* ]]; then
    pass "chat completion through :$listen_port: $status; $replica"
else
    fail "chat completion through :$listen_port: ${status:-no answer}"
fi

uid_line=$(awk '/^Uid:/ { print $2, $3, $4, $5 }' "/proc/$router/status")
gid_line=$(awk '/^Gid:/ { print $2, $3, $4, $5 }' "/proc/$router/status")
want="$expected_id $expected_id $expected_id $expected_id"
if [[ $uid_line == "$want" && $gid_line == "$want" ]]; then
    pass "router runs as uid/gid $expected_id (Uid: $uid_line; Gid: $gid_line)"
else
    fail "router uid/gid: Uid: $uid_line; Gid: $gid_line (want $expected_id)"
fi

listening=$(inns ss -Hltn | awk '{ print $4 }' | sort -u | tr '\n' ' ')
if [[ " $listening " == *" 0.0.0.0:$listen_port "* && " $listening " == *" 0.0.0.0:$metrics_port "* ]]; then
    pass "proxy and metrics listen on 0.0.0.0 (reachable via published ports): $listening"
else
    fail "listeners not on 0.0.0.0:$listen_port and 0.0.0.0:$metrics_port: $listening"
fi

echo "+ kill -$STOPSIGNAL (STOPSIGNAL) router"
start=$SECONDS
kill -s "${STOPSIGNAL#SIG}" "$router"
gone() { ! alive "$router"; }
if poll "$grace" gone; then
    rc=0
    wait "$router" || rc=$?
    if ((rc == 0)); then
        pass "$STOPSIGNAL: router exited 0 after $((SECONDS - start)) s (grace ${grace} s)"
    else
        fail "$STOPSIGNAL: router exited $rc"
    fi
else
    fail "$STOPSIGNAL: router still running after shutdown_grace_s ${grace} s"
fi
