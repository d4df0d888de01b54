"""A rank process for test_pd_datadist.py (no tests here): it owns device caches on the pyACL
stand-in and a DataDistEndpoint, and runs the test's commands sent over a pipe.  Started with the
'spawn' method (ACL contexts do not survive a fork); ``Agent`` is the test's handle on it."""
from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import time
from typing import Any

import numpy as np

ACL_MEMCPY_HOST_TO_DEVICE, ACL_MEMCPY_DEVICE_TO_HOST = 1, 2


class _Rank:
    """The child's state: caches (random bytes from ``seed``), swap space, the endpoint."""

    def setup(self, role: str, dev: int, cluster: int, port: int, kinds: dict, layers: int, num_blocks: int,
              host_blocks: int, seed: int, board: str = "", layer_board: str = "", sync_ms: int = 1000) -> dict:
        import acl

        from ops.shm import SharedMemorySegment
        from transfer_factory.peer.datadist import DataDistEndpoint

        self.acl, self.dev, self.kinds = acl, dev, kinds
        assert acl.init() in (0, 100002) and acl.rt.set_device(dev) == 0
        rng = np.random.default_rng(seed)
        self.device = {k: [self._malloc(rng.integers(0, 256, num_blocks * bb, dtype=np.uint8)) for _ in range(layers)]
                       for k, bb in kinds.items()}
        self.host = {k: [self._malloc_host(host_blocks * bb) for _ in range(layers)] for k, bb in kinds.items()}
        self.segments = [SharedMemorySegment(name) for name in (board, layer_board) if name]
        addr = [int(np.frombuffer(s.buf, dtype=np.uint8).ctypes.data) for s in self.segments]
        self.ep = DataDistEndpoint(role, dev, cluster, logging.getLogger(f"agent.{role}"), sync_kv_timeout_ms=sync_ms)
        return self.ep.open({k: [p for p, _ in v] for k, v in self.device.items()}, kinds, num_blocks, "bfloat16",
                            layers, "127.0.0.1", port, host={k: [p for p, _ in v] for k, v in self.host.items()},
                            host_blocks=host_blocks, board=addr[0] if board else 0,
                            layer_board=(addr[-1], self.segments[-1].size) if layer_board else None)

    def _malloc(self, data: np.ndarray) -> tuple[int, int]:
        ptr, ret = self.acl.rt.malloc(data.nbytes, 0)
        assert ret == 0
        assert self.acl.rt.memcpy(ptr, data.nbytes, int(data.ctypes.data), data.nbytes, ACL_MEMCPY_HOST_TO_DEVICE) == 0
        return ptr, data.nbytes

    def _malloc_host(self, nbytes: int) -> tuple[int, int]:
        ptr, ret = self.acl.rt.malloc_host(nbytes)
        assert ret == 0
        (np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * nbytes).from_address(ptr)))[:] = 0
        return ptr, nbytes

    def blocks(self, kind: str, layer: int, placement: str = "device") -> bytes:
        """Every block of one kind and layer, as bytes (device memory through acl.rt.memcpy)."""
        ptr, nbytes = (self.device if placement == "device" else self.host)[kind][layer]
        out = np.zeros(nbytes, dtype=np.uint8)
        if placement == "device":
            assert self.acl.rt.memcpy(int(out.ctypes.data), nbytes, ptr, nbytes, ACL_MEMCPY_DEVICE_TO_HOST) == 0
        else:
            out[:] = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * nbytes).from_address(ptr))
        return out.tobytes()

    def link(self, name: str, params: dict, timeout: float = 2.0) -> None:
        self.ep.link(name, params, timeout)

    def unlink(self, name: str) -> bool:
        return self.ep.unlink(name)

    def pull(self, name: str, src: list, dst: list, layers: tuple, placement: str = "device", timeout: float = 5.0) -> int:
        return self.ep.pull(name, src, dst, range(*layers), placement, time.monotonic() + timeout)

    def push(self, name: str, src: list, dst: list, layers: tuple, timeout: float = 5.0) -> int:
        return self.ep.push(name, src, dst, range(*layers), time.monotonic() + timeout)

    def read_board(self, name: str, slot: int, timeout: float = 5.0) -> int:
        return self.ep.read_board(name, slot, time.monotonic() + timeout)

    def write_layer_word(self, name: str, index: int, value: int, timeout: float = 5.0) -> None:
        self.ep.write_layer_word(name, index, value, time.monotonic() + timeout)

    def close(self) -> None:
        self.ep.close()
        for segment in self.segments:
            segment.close()


def _serve(conn: Any) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the test stops it (a command or SIGKILL)
    rank = _Rank()
    while True:
        try:
            cmd, kwargs = conn.recv()
        except EOFError:  # the test went away
            return
        if cmd == "stop":
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", getattr(rank, cmd)(**kwargs)))
        except Exception as exc:  # the test asserts on it
            conn.send(("err", f"{type(exc).__name__}: {exc}", getattr(exc, "status", "")))


class AgentError(RuntimeError):
    def __init__(self, message: str, status: str):
        super().__init__(message)
        self.status = status


class Agent:
    """The test's handle on one rank process; every call waits at most ``timeout`` seconds."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child,), daemon=True)
        self.proc.start()
        child.close()

    def call(self, cmd: str, timeout: float = 20.0, **kwargs: Any) -> Any:
        self.conn.send((cmd, kwargs))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"agent {self.proc.pid}: {cmd} did not answer in {timeout} s")
        reply = self.conn.recv()
        if reply[0] == "err":
            raise AgentError(reply[1], reply[2])
        return reply[1]

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(timeout=10)

    def stop(self) -> None:
        """Close the endpoint and end the process (killed if it does not end in 10 s)."""
        if self.proc.is_alive():
            try:
                self.call("close", timeout=10)
                self.call("stop", timeout=5)
            except (TimeoutError, AgentError, OSError, EOFError):
                pass
            self.proc.join(timeout=5)
        self.kill()
        self.conn.close()
