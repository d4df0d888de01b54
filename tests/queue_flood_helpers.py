"""What test_queue_flood.py drives: a process that floods the engine's zmq ports with large garbage
frames, a process (of another uid) that floods the local link with connects, swap latencies and the
engine's resident memory.  The floods run in processes of their own, as a local attacker's would:
in the test's process they would share the engine's GIL and measure that instead."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

from engine_hooks import CacheTransferService

# Garbage frames at the engine's ports, in a burst every ``period`` seconds, until killed: one DEALER
# per entry of the plan, each sending its frames (sizes in MiB) every burst.  A frame over a port's
# size limit makes zmq cut that connection, and its DEALER reconnects and goes on.  Paced bursts, not
# a stream: the engine's zmq I/O thread buffers whatever its queue thread has not taken yet, and an
# unpaced stream at the old code, which MACed every frame, would grow the engine by gigabytes.
FRAME_FLOOD = textwrap.dedent("""
    import json, sys, time, zmq
    period, plan = float(sys.argv[1]), json.loads(sys.argv[2])
    ctx = zmq.Context(2)
    socks = []
    for address, sizes in plan:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 1000)
        s.setsockopt(zmq.RECONNECT_IVL, 10)
        s.connect(address)
        socks.append((s, [bytes([1]) * int(n * (1 << 20)) for n in sizes]))
    print("flooding", flush=True)
    while True:
        t0 = time.monotonic()
        for s, frames in socks:
            for frame in frames:
                try:
                    s.send(frame, zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    pass
        time.sleep(max(0.0, period - (time.monotonic() - t0)))
""")


def start_frame_flood(plan: list[tuple[str, list[int]]], period: float) -> subprocess.Popen:
    """Start flooding: ``plan`` is one (address, frame sizes in MiB) per DEALER."""
    proc = subprocess.Popen([sys.executable, "-c", FRAME_FLOOD, str(period), json.dumps(plan)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "flooding"
    return proc


class ConnectFlood:
    """``count`` connects to the Unix socket ``path``, each closed at once, from a forked child that
    drops to ``uid`` (the caller must be root).  A fork, not a new interpreter: another uid may not
    be able to read this one's files.  The child touches only sockets, then ``os._exit``."""

    def __init__(self, path: str, count: int, uid: int):
        read, write = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child
            done = 0
            try:
                os.close(read)
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
                for _ in range(count):
                    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # blocking: waits for room in
                    try:  # the listen queue (a non-blocking connect to a full one fails at once)
                        s.connect(path)
                        done += 1
                    except OSError:
                        pass
                    finally:
                        s.close()
                os.write(write, str(done).encode())
            finally:
                os._exit(0)
        os.close(write)
        self._read = read
        self._status: int | None = None

    def running(self) -> bool:
        if self._status is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self._status = status
        return self._status is None

    def connected(self) -> int:
        """How many connects the kernel took (waits for the child)."""
        if self.running():
            os.waitpid(self.pid, 0)
            self._status = 0
        with os.fdopen(self._read) as f:
            return int(f.read() or 0)

    def kill(self) -> None:
        if self.running():
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            self._status = -1


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)


def swap_latencies(svc: CacheTransferService, count: int, until: float | None = None) -> list[float]:
    """Seconds each of ``count`` one-block swaps took, one at a time (or until ``until``, monotonic)."""
    out = []
    blocks, slots = svc.spec.num_blocks, svc.num_cpu_blocks
    for i in range(count):
        if until is not None and time.monotonic() > until:
            break
        t0 = time.perf_counter()
        if i % 2:
            svc.swap_to_gpu([i % blocks], [i % slots]).result(timeout=30)
        else:
            svc.swap_to_cpu([i % blocks], [i % slots]).result(timeout=30)
        out.append(time.perf_counter() - t0)
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def rss_bytes() -> int:
    """This process's resident memory (VmRSS)."""
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def thread_cpu_seconds(native_id: int) -> float:
    """CPU time (user and system) a thread of this process has used, from /proc (10 ms ticks)."""
    with open(f"/proc/{os.getpid()}/task/{native_id}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
