"""The floor a task round trip is measured against: a bare zmq fan-out to N rank processes.

The bench process binds a ROUTER on loopback; N child processes connect a DEALER each.  One round
is one small msgpack frame with an HMAC-SHA256 sent to every rank and one such frame back from
each, verified on both sides: the transport and the authentication our queue uses, with no CTM
logic (no scheduler, no copies, no futures).  ``FloorRanks(n).round_trips(rounds)`` returns per-round
milliseconds; the processes stay up between calls, so a benchmark can interleave floor rounds
with its own and a drifting machine moves both alike.
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


class FloorRanks:
    """The floor's rank processes, kept alive so its rounds can interleave with the measured ones."""

    def __init__(self, ranks: int, timeout_ms: int = 10_000):
        self._key = os.urandom(32)
        self._timeout_ms = timeout_ms
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        port = self._router.bind_to_random_port("tcp://127.0.0.1")
        self._children = [subprocess.Popen([sys.executable, "-c", _CHILD, str(port), str(r), self._key.hex()])
                          for r in range(ranks)]
        self._poller = zmq.Poller()
        self._poller.register(self._router, zmq.POLLIN)
        self._peers: list[bytes] = []
        self._next = 0
        try:
            while len(self._peers) < ranks:
                if not self._poller.poll(timeout_ms):
                    raise TimeoutError("a floor rank did not connect")
                self._peers.append(self._router.recv_multipart()[0])
        except BaseException:
            self.close()
            raise

    def _sealed(self, body: dict) -> bytes:
        packed = msgpack.packb(body)
        return packed + hmac.new(self._key, packed, hashlib.sha256).digest()

    def round_trips(self, rounds: int, warmup: int = 0) -> np.ndarray:
        """Per-round milliseconds of ``rounds`` rounds, after ``warmup`` untimed ones."""
        lat = np.empty(rounds)
        for i in range(-warmup, rounds):
            n = self._next
            self._next += 1
            frame = self._sealed({"task_id": f"f{n}", "event_type": 1, "gpu_block_ids": [n % 64],
                                  "cpu_block_ids": [n % 64]})
            t0 = time.perf_counter()
            for peer in self._peers:
                self._router.send_multipart([peer, frame])
            for _ in self._peers:
                if not self._poller.poll(self._timeout_ms):
                    raise TimeoutError("a floor rank did not answer")
                reply = self._router.recv_multipart()[1]
                if not hmac.compare_digest(hmac.new(self._key, reply[:-32], hashlib.sha256).digest(), reply[-32:]):
                    raise RuntimeError("a floor reply failed its MAC")
                msgpack.unpackb(reply[:-32])
            if i >= 0:
                lat[i] = (time.perf_counter() - t0) * 1e3
        return lat

    def close(self) -> None:
        stop = self._sealed({"stop": True})
        for peer in self._peers:
            self._router.send_multipart([peer, stop])
        for child in self._children:
            try:
                child.wait(5)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        self._router.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> "FloorRanks":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
