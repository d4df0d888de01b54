"""The floor a task round trip is measured against: a bare zmq fan-out to N rank processes.

The bench process binds a ROUTER on loopback; N child processes connect a DEALER each.  One round
is one small msgpack frame with an HMAC-SHA256 sent to every rank and one such frame back from
each, verified on both sides: the transport and the authentication our queue uses, with no CTM
logic (no scheduler, no copies, no futures).  ``floor_round_trips(n, rounds)`` returns per-round
milliseconds.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import subprocess
import sys
import time

import msgpack
import numpy as np
import zmq

_CHILD = r"""
import hashlib, hmac, sys
import msgpack, zmq
port, rank, key = int(sys.argv[1]), int(sys.argv[2]), bytes.fromhex(sys.argv[3])
ctx = zmq.Context()
s = ctx.socket(zmq.DEALER)
s.connect(f"tcp://127.0.0.1:{port}")
s.send(b"hello")
while True:
    frame = s.recv()
    body, mac = frame[:-32], frame[-32:]
    if not hmac.compare_digest(hmac.new(key, body, hashlib.sha256).digest(), mac):
        continue
    msg = msgpack.unpackb(body)
    if msg.get("stop"):
        break
    out = msgpack.packb({"task_id": msg["task_id"], "rank": rank, "ok": True})
    s.send(out + hmac.new(key, out, hashlib.sha256).digest())
"""


def floor_round_trips(ranks: int, rounds: int, warmup: int = 50, timeout_ms: int = 10_000) -> np.ndarray:
    key = os.urandom(32)
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    children = [subprocess.Popen([sys.executable, "-c", _CHILD, str(port), str(r), key.hex()])
                for r in range(ranks)]
    try:
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        peers = []
        while len(peers) < ranks:
            if not poller.poll(timeout_ms):
                raise TimeoutError("a floor rank did not connect")
            peers.append(router.recv_multipart()[0])
        lat = np.empty(rounds)
        for i in range(-warmup, rounds):
            body = msgpack.packb({"task_id": f"f{i}", "event_type": 1, "gpu_block_ids": [i % 64],
                                  "cpu_block_ids": [i % 64]})
            frame = body + hmac.new(key, body, hashlib.sha256).digest()
            t0 = time.perf_counter()
            for peer in peers:
                router.send_multipart([peer, frame])
            for _ in peers:
                if not poller.poll(timeout_ms):
                    raise TimeoutError("a floor rank did not answer")
                reply = router.recv_multipart()[1]
                if not hmac.compare_digest(hmac.new(key, reply[:-32], hashlib.sha256).digest(), reply[-32:]):
                    raise RuntimeError("a floor reply failed its MAC")
                msgpack.unpackb(reply[:-32])
            if i >= 0:
                lat[i] = (time.perf_counter() - t0) * 1e3
        stop = msgpack.packb({"stop": True})
        for peer in peers:
            router.send_multipart([peer, stop + hmac.new(key, stop, hashlib.sha256).digest()])
        return lat
    finally:
        for child in children:
            try:
                child.wait(5)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        router.close(linger=0)
        ctx.term()
