#!/usr/bin/env python3
"""One host's Mooncake store clients, driven by JSON lines on stdin: for tests and benchmarks of a
pool across hosts (tests/transfer_factory/mooncake/test_mooncake_two_hosts.py,
scripts/bench_mooncake_hosts.py), usually started on a host of the two-host bed.

    python scripts/mooncake_pool_client.py --master 10.77.1.2:50051 --local-hostname 10.77.1.1 --ranks 2

starts ``--ranks`` ``MooncakeStore`` clients (this repo's backend, so its configuration checks and
bind rules apply), each mounting ``--segment-size`` bytes (0: none) in the pool, and prints one
JSON line: ``{"ready": true, "pid", "segments": [...]}``, or ``{"ready": false, "error": ...}``
and exits 1.  Then every line read is a command and gets one JSON line back:

* ``{"op": "put", "tag", "blocks", "size", "kinds"}``: block ``i`` is, for every rank ``r`` and
  kind ``k``, the object ``{ns}/{tag}{i}/{r}/{k}`` of ``size`` bytes (content derived from its
  key), each rank writing its own objects in one batch; answers ``{"ok": objects written, "codes"}``;
* ``{"op": "get", ...}`` (the same fields): reads every object back and compares; answers
  ``{"readable": blocks whose every object read back intact, "objects_ok", "codes"}``;
* ``{"op": "bench", "blocks", "size", "repeats"}``: rank 0 writes then reads ``blocks`` objects
  ``repeats`` times (keys never used before, in this process or another); answers the seconds of
  every put and get batch;
* ``{"op": "listeners"}``: ``[address, port]`` of every TCP socket this process listens on
  (read from ``/proc/net/tcp*``, which show this host's network namespace);
* ``{"op": "quit"}``: answers, then leaves with ``os._exit`` (no close: it holds the GIL ~2 s per
  client, and this process is done).

``PoolClient.start(host, master, *args)`` runs it on a bed host and ``ask`` sends a command; every
wait is bounded.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import time
import traceback

import numpy as np

if __package__ in (None, ""):            # run as a script: put the repo on sys.path
    import _common  # noqa: F401

from ops.procs import listening_sockets  # noqa: E402  (after the repo is on sys.path)


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class PoolClient:
    """This script running on a host of the two-host bed (tests/two_hosts.py), asked over its pipes."""

    def __init__(self, proc, name: str) -> None:
        self.proc, self.name = proc, name
        self.info: dict = {}

    @classmethod
    def start(cls, host, master: str, *args: str, local_hostname: str | None = "host") -> "PoolClient":
        """Starts it on ``host`` (``local_hostname`` "host": the host's address; None: not given);
        ``ready`` waits for its first line."""
        import subprocess
        env = {**os.environ, "PYTHONPATH": REPO, "GLOG_minloglevel": "2"}
        argv = [sys.executable, os.path.join(REPO, "scripts", "mooncake_pool_client.py"), "--master", master, *args]
        if local_hostname is not None:
            argv += ["--local-hostname", host.address if local_hostname == "host" else local_hostname]
        proc = host.popen(argv, cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True)
        return cls(proc, f"{host.name}:{' '.join(args)}")

    def _line(self, timeout: float) -> dict:
        import selectors
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout):
                raise TimeoutError(f"pool client {self.name}: no answer within {timeout:.0f}s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"pool client {self.name}: ended (status {self.proc.poll()})")
        return json.loads(line)

    def ready(self, timeout: float = 30.0) -> dict:
        """Its first line: {"ready": true, ...} or {"ready": false, "error": ...}."""
        self.info = self._line(timeout)
        return self.info

    def ask(self, timeout: float = 30.0, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._line(timeout)

    def quit(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            try:
                self.ask(timeout, op="quit")
                self.proc.wait(timeout)
            except (OSError, TimeoutError, RuntimeError, ValueError):
                self.proc.kill()


def listeners(pid: int | str = "self") -> list[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state that ``pid`` holds, in its netns."""
    return sorted(listening_sockets(pid))


def _fill(buf: np.ndarray, key: str) -> None:
    """Content derived from the key (so a reader elsewhere can check it): a repeated digest."""
    digest = np.frombuffer(hashlib.sha256(key.encode()).digest(), dtype=np.uint8)
    reps = -(-buf.size // digest.size)
    buf[:] = np.tile(digest, reps)[:buf.size]


class Pool:
    def __init__(self, args: argparse.Namespace) -> None:
        from transfer_factory.mooncake.store import MooncakeStore

        options = {"master_server_addr": args.master, "global_segment_size": args.segment_size,
                   "local_buffer_size": args.buffer_size, **json.loads(args.options)}
        if args.local_hostname is not None:
            options["local_hostname"] = args.local_hostname
        self.ns = args.namespace
        self.stores = [MooncakeStore(namespace=self.ns, rank=r, options=options) for r in range(args.ranks)]
        self.arena = np.zeros(args.arena, dtype=np.uint8)
        self._bench_runs = 0
        for s in self.stores:
            s.register_buffer(self.arena.ctypes.data, self.arena.nbytes)

    def segments(self) -> list[str]:
        out = []
        for s in self.stores:
            client = s._connection.current
            try:
                out.append(str(client.store.get_hostname()))
            except Exception as e:  # diagnostics only
                out.append(f"? ({e})")
        return out

    def _objects(self, cmd: dict, rank: int) -> list[str]:
        return [f"{self.ns}/{cmd['tag']}{i:05d}/{rank}/{k}" for i in range(cmd["blocks"]) for k in cmd["kinds"]]

    def _views(self, n: int, size: int, half: int) -> list[np.ndarray]:
        need = 2 * n * size
        if need > self.arena.nbytes:
            raise ValueError(f"{n} objects of {size} bytes need an arena of {need} bytes (--arena)")
        base = half * n * size
        return [self.arena[base + i * size: base + (i + 1) * size] for i in range(n)]

    def put(self, cmd: dict) -> dict:
        size, codes = int(cmd["size"]), []
        for rank, s in enumerate(self.stores):
            keys = self._objects(cmd, rank)
            views = self._views(len(keys), size, 0)
            for key, v in zip(keys, views):
                _fill(v, key)
            codes += s.batch_set(keys, [v.ctypes.data for v in views], [size] * len(keys))
        return {"ok": sum(1 for c in codes if c == 0), "objects": len(codes), "codes": sorted(set(codes))}

    def get(self, cmd: dict) -> dict:
        size = int(cmd["size"])
        per_block = len(cmd["kinds"])
        good = np.ones(cmd["blocks"], dtype=bool)
        codes_seen: set[int] = set()
        objects_ok = 0
        for rank, s in enumerate(self.stores):
            keys = self._objects(cmd, rank)
            views = self._views(len(keys), size, 1)
            for v in views:
                v[:] = 0
            codes = s.batch_get(keys, [v.ctypes.data for v in views], [size] * len(keys))
            expect = np.empty(size, dtype=np.uint8)
            for j, (key, v, code) in enumerate(zip(keys, views, codes)):
                codes_seen.add(int(code))
                _fill(expect, key)
                ok = code == size and np.array_equal(v, expect)
                objects_ok += int(ok)
                if not ok:
                    good[j // per_block] = False
        return {"readable": int(good.sum()), "blocks": int(good.size), "objects_ok": objects_ok,
                "codes": sorted(codes_seen)}

    def bench(self, cmd: dict) -> dict:
        s, n, size = self.stores[0], int(cmd["blocks"]), int(cmd["size"])
        puts, gets = [], []
        self._bench_runs += 1
        for rep in range(int(cmd["repeats"])):
            # fresh keys: a put of a key that exists answers 0 at once (and a read's lease can
            # keep an object past delete)
            keys = [f"{self.ns}/bench{os.getpid()}-{self._bench_runs}-{rep}-{i:05d}/0/k" for i in range(n)]
            src, dst = self._views(n, size, 0), self._views(n, size, 1)
            for key, v in zip(keys, src):
                _fill(v, key)
            t0 = time.perf_counter()
            wcodes = s.batch_set(keys, [v.ctypes.data for v in src], [size] * n)
            t1 = time.perf_counter()
            rcodes = s.batch_get(keys, [v.ctypes.data for v in dst], [size] * n)
            t2 = time.perf_counter()
            if any(c != 0 for c in wcodes) or any(c != size for c in rcodes):
                return {"error": f"bench repeat {rep}: put codes {sorted(set(wcodes))}, get codes "
                                 f"{sorted(set(rcodes))}"}
            if not all(np.array_equal(a, b) for a, b in zip(src, dst)):
                return {"error": f"bench repeat {rep}: the bytes read differ from those written"}
            puts.append(t1 - t0)
            gets.append(t2 - t1)
            s.delete(keys)
        return {"put_s": puts, "get_s": gets, "bytes": n * size}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--master", required=True, help="master_server_addr, host:port")
    p.add_argument("--local-hostname", default=None, help="local_hostname of the clients (default: the backend's)")
    p.add_argument("--ranks", type=int, default=1, help="clients (ranks), each mounting a segment")
    p.add_argument("--segment-size", type=int, default=64 << 20, help="global_segment_size of each client")
    p.add_argument("--buffer-size", type=int, default=16 << 20, help="local_buffer_size of each client")
    p.add_argument("--arena", type=int, default=96 << 20, help="bytes of registered memory for puts and gets")
    p.add_argument("--namespace", default="pool")
    p.add_argument("--options", default="{}", help="more storage options, a JSON object")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        pool = Pool(args)
    except Exception as e:
        print(json.dumps({"ready": False, "error": f"{type(e).__name__}: {e}"}), flush=True)
        os._exit(1)
    print(json.dumps({"ready": True, "pid": os.getpid(), "segments": pool.segments()}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            cmd = json.loads(line)
            op = cmd["op"]
            if op == "quit":
                print(json.dumps({"bye": True}), flush=True)
                break
            if op == "listeners":
                answer = {"listeners": listeners()}
            elif op in ("put", "get", "bench"):
                answer = getattr(pool, op)(cmd)
            else:
                answer = {"error": f"unknown op {op!r}"}
        except Exception as e:
            answer = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc(limit=3)}
        print(json.dumps(answer), flush=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
