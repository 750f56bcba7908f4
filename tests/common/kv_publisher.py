"""A KV event publisher as vLLM's: a PUB socket sending [topic, seq, payload]
(seq 8 bytes big-endian from 0, payload a msgpack EventBatch) and a ROUTER
replay socket answering [id, "", start_seq] with every buffered batch from
there ([id, "", topic, seq, payload]) and an end marker (seq -1).

Driven by JSON lines on stdin, one answer line each on stdout:
  {"events": [...], "encoding": "map"|"array", "drop": false, "topic": null}
      publish the next batch (kept for replay; `drop`: kept, not sent;
      `topic`: sent under another topic, not kept, no seq used)
  {"restart": true}       a new engine process: seq from 0, buffer empty
      (`"rebind": true`: its PUB socket closed and bound again on the same
      port, as a process's would be; subscribers are disconnected)
  {"wait_subscribed": true}  "ok" once a subscriber has subscribed again,
      "timeout" if none has within a minute
Events are {"type": "BlockStored"|"BlockRemoved"|"AllBlocksCleared", ...}
with vLLM's field names. Prints "ports <pub_port> <replay_port>" at once,
then "subscribed" when a subscriber has subscribed (an XPUB socket sees
it): nothing is sent before anyone listens.
"""
import json
import sys
import threading
import time

import msgspec
import zmq

TOPIC = sys.argv[1].encode() if len(sys.argv) > 1 else b"kv-events"
ARRAY_FIELDS = {
    "BlockStored": ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"],
    "BlockRemoved": ["block_hashes", "medium"],
    "AllBlocksCleared": [],
}

ctx = zmq.Context()
pub = ctx.socket(zmq.XPUB)
pub_port = pub.bind_to_random_port("tcp://127.0.0.1")


def rebind():
    """Closes the PUB socket and binds a new one on its port (ZMQ's I/O
    thread releases the port a moment after the close)."""
    global pub
    pub.close(linger=0)
    pub = ctx.socket(zmq.XPUB)
    deadline = time.monotonic() + 10
    while True:
        try:
            pub.bind(f"tcp://127.0.0.1:{pub_port}")
            return
        except zmq.ZMQError as e:
            if e.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def wait_subscribed(timeout=60.0):
    """Until a subscription reaches the PUB socket (XPUB receives it as
    \x01 + topic): whether one did within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not pub.poll(int(left * 1000) + 1):
            return False
        if pub.recv()[:1] == b"\x01":
            return True
router = ctx.socket(zmq.ROUTER)
replay_port = router.bind_to_random_port("tcp://127.0.0.1")
lock = threading.Lock()
buffer = []  # (seq, payload)


def serve_replay():
    while True:
        frames = router.recv_multipart()
        ident, start = frames[0], int.from_bytes(frames[-1], "big")
        with lock:
            batches = [b for b in buffer if b[0] >= start]
        for seq, payload in batches:
            router.send_multipart([ident, b"", TOPIC, seq.to_bytes(8, "big"), payload])
        router.send_multipart([ident, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])


threading.Thread(target=serve_replay, daemon=True).start()
print(f"ports {pub_port} {replay_port}", flush=True)
print("subscribed" if wait_subscribed() else "timeout", flush=True)

seq = 0
for line in sys.stdin:
    cmd = json.loads(line)
    if cmd.get("restart"):
        with lock:
            buffer.clear()
        seq = 0
        if cmd.get("rebind"):
            rebind()
        print("ok", flush=True)
        continue
    if cmd.get("wait_subscribed"):
        print("ok" if wait_subscribed() else "timeout", flush=True)
        continue
    events = []
    for e in cmd["events"]:
        if cmd.get("encoding") == "array":
            events.append([e["type"]] + [e.get(f) for f in ARRAY_FIELDS[e["type"]]])
        else:
            events.append({k: v for k, v in e.items() if v is not None})
    payload = msgspec.msgpack.encode([time.time(), events, None])
    if cmd.get("topic"):
        pub.send_multipart([cmd["topic"].encode(), seq.to_bytes(8, "big"), payload])
        print("ok", flush=True)
        continue
    with lock:
        buffer.append((seq, payload))
    if not cmd.get("drop"):
        pub.send_multipart([TOPIC, seq.to_bytes(8, "big"), payload])
    print(f"ok {seq}", flush=True)
    seq += 1
