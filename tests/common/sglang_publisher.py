"""SGLang's own KV event publisher, driven by a test.

Usage: python sglang_publisher.py SGLANG_WHEEL [TOPIC]

Loads `sglang/srt/disaggregation/kv_events.py` from the downloaded wheel
(`pip download --no-deps sglang==0.5.23`: the package itself imports torch,
so it is not installed), with its two small `sglang` imports stubbed, and
makes the publisher as the engine does: `EventPublisherFactory.create` on a
`--kv-events-config` JSON string (a bound PUB socket and a replay ROUTER on
127.0.0.1, ports chosen by the kernel). SGLang's code is read from the wheel
at run time, never copied. Needs msgspec, pyzmq and pydantic 2.

Prints "ports <pub_port> <replay_port>" once bound, then reads JSON lines on
stdin, one answer line each on stdout:
  {"events": [{"type": "BlockStored", "block_hashes": [..],
               "parent_block_hash": null, "token_ids": [..], "block_size": 2,
               "medium": "GPU"}, {"type": "BlockRemoved", ...},
              {"type": "AllBlocksCleared"}]}
      one batch (SGLang's KVEventBatch of its BlockStored / BlockRemoved /
      AllBlocksCleared) through the publisher's `publish`; "ok <seq>" once
      its thread has sent it and kept it for replay. `events` may be empty:
      a harmless probe batch (see below).
  {"wait_subscriber": true, "timeout": 10}
      "ok" once a peer has completed the ZMTP handshake on the PUB socket
      (a libzmq socket monitor; SGLang's PUB socket cannot tell), else
      "timeout". That is "connected", not "subscribed": the subscription
      arrives just after, so a batch sent at once may still be dropped.
  {"restart": true}
      a new engine process: the publisher is shut down and made again on the
      same ports (seq from 0, replay buffer empty); "ok".

Synchronising with a router: PUB drops what is sent before the
subscription is in. A router that, on the first batch it hears with seq > 0,
asks the replay socket for batches from 0 recovers everything published
before; so a test publishes its batches, then empty batches until the
router shows one as received (each bumps seq; SGLang's engine itself never
publishes an empty batch).
"""
import ast
import atexit
import json
import sys
import time
import types
import zipfile
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

MODULE = "sglang/srt/disaggregation/kv_events.py"
STUBBED = {
    "sglang.srt.runtime_context": {"get_parallel"},
    "sglang.srt.utils.network": {"NetworkAddress"},
}


@dataclass(frozen=True)
class NetworkAddress:
    """What kv_events.py uses of sglang.srt.utils.network.NetworkAddress
    (the real one imports psutil): parse "host:port" / "[v6]:port"."""

    host: str
    port: int

    @property
    def is_ipv6(self) -> bool:
        return ":" in self.host

    @staticmethod
    def parse(addr: str) -> "NetworkAddress":
        if addr.startswith("["):
            host, _, rest = addr[1:].partition("]")
            if not rest.startswith(":"):
                raise ValueError(f"bad address {addr!r}")
            return NetworkAddress(host, int(rest[1:]))
        host, sep, port = addr.rpartition(":")
        if not sep or not host or ":" in host:
            raise ValueError(f"bad address {addr!r}")
        return NetworkAddress(host, int(port))

    def to_tcp(self) -> str:
        host = f"[{self.host}]" if self.is_ipv6 else self.host
        return f"tcp://{host}:{self.port}"


def get_parallel():
    """A single-rank engine (no TP/PP/DP)."""
    return types.SimpleNamespace(
        pp_rank=0, attn_tp_rank=0, attn_cp_rank=0,
        attn_dp_size=1, attn_dp_rank=0, dp_rank=None,
    )


def load(wheel: str) -> types.ModuleType:
    source = zipfile.ZipFile(wheel).read(MODULE).decode()
    # Refuse a version whose sglang imports differ from the stubs.
    wanted = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sglang"):
            wanted.setdefault(node.module, set()).update(a.name for a in node.names)
        elif isinstance(node, ast.Import) and any(a.name.startswith("sglang") for a in node.names):
            wanted.setdefault("import", set()).update(a.name for a in node.names)
    if wanted != STUBBED:
        sys.exit(f"{MODULE} in {wheel} imports {wanted}; stubs cover {STUBBED}")
    values = {"get_parallel": get_parallel, "NetworkAddress": NetworkAddress}
    for name in ["sglang", "sglang.srt", "sglang.srt.utils", "sglang.srt.disaggregation"]:
        package = types.ModuleType(name)
        package.__path__ = []
        sys.modules[name] = package
    for name, names in STUBBED.items():
        stub = types.ModuleType(name)
        for n in names:
            setattr(stub, n, values[n])
        sys.modules[name] = stub
    name = "sglang.srt.disaggregation.kv_events"
    module = types.ModuleType(name)
    module.__file__ = f"{wheel}/{MODULE}"
    sys.modules[name] = module
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module


def port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def main() -> None:
    kv = load(sys.argv[1])
    topic = sys.argv[2] if len(sys.argv) > 2 else ""
    kinds = {c.__name__: c for c in (kv.BlockStored, kv.BlockRemoved, kv.AllBlocksCleared)}
    media = {m.value: m for m in kv.StorageMedium}

    def create(pub_port="*", replay_port="*"):
        config = json.dumps({
            "publisher": "zmq",
            "endpoint": f"tcp://127.0.0.1:{pub_port}",
            "bind": True,
            "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
            "topic": topic,
        })
        publisher = kv.EventPublisherFactory.create(config, 0)
        # Before any batch, so the publisher thread is not using the socket.
        monitor = publisher._pub.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
        )
        return publisher, monitor

    publisher, monitor = create()
    source = publisher.describe_local_source(block_size=0)
    pub_port, replay_port = port(source["endpoint"]), port(source["replay_endpoint"])
    print(f"ports {pub_port} {replay_port}", flush=True)

    seq = 0
    peers = 0
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("wait_subscriber"):
            deadline = time.monotonic() + float(cmd.get("timeout", 10))
            while True:
                while monitor.poll(0):
                    event = recv_monitor_message(monitor)["event"]
                    peers += 1 if event == zmq.EVENT_HANDSHAKE_SUCCEEDED else -1
                left = deadline - time.monotonic()
                if peers > 0 or left <= 0:
                    break
                monitor.poll(int(left * 1000) + 1)
            print("ok" if peers > 0 else "timeout", flush=True)
        elif cmd.get("restart"):
            publisher._pub.disable_monitor()
            monitor.close(linger=0)
            publisher.shutdown()
            atexit.unregister(publisher.shutdown)
            # The old sockets' ports are released by ZMQ's I/O thread a moment
            # after shutdown: bind again until they are free (as an engine
            # restarting on its port would).
            deadline = time.monotonic() + 10
            while True:
                try:
                    publisher, monitor = create(pub_port, replay_port)
                    break
                except zmq.ZMQError as e:
                    if e.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                        raise
                    time.sleep(0.01)
            seq, peers = 0, 0
            print("ok", flush=True)
        else:
            events = []
            for e in cmd["events"]:
                fields = {k: v for k, v in e.items() if k != "type"}
                if e["type"] == "BlockStored":
                    fields.setdefault("lora_id", None)
                if fields.get("medium") in media:
                    fields["medium"] = media[fields["medium"]]
                events.append(kinds[e["type"]](**fields))
            # As the engine's scheduler does (attn_dp_rank filled in by publish).
            publisher.publish(kv.KVEventBatch(ts=time.time(), events=events))
            deadline = time.monotonic() + 10
            while publisher._event_queue.unfinished_tasks and time.monotonic() < deadline:
                time.sleep(0.001)
            if publisher._event_queue.unfinished_tasks:
                print("error: not sent", flush=True)
            else:
                print(f"ok {seq}", flush=True)
                seq += 1


if __name__ == "__main__":
    main()
