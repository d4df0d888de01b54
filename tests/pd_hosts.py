"""Engine instances on the hosts of the two-host bed (tests/two_hosts.py), for P/D between hosts.

``HostInstance(host, instance_id, spec, ...)`` starts ``python -m tests.pd_hosts`` on a bed host
(``Host.popen``: the host's network, /dev/shm, boot id and clock), in this repository with
PYTHONPATH set; the child runs a ``CacheTransferService`` advertising ``pod_ip`` (the host's address
by default) and its ``PrefillDecode`` side, fills its caches with seeded random bytes and answers
JSON commands on stdin, one per line (``call(op, **args)``):

- links: ``descriptor`` (offer), ``link`` (peer, transport, offer), ``unlink`` (peer), ``linked``
- prefill side: ``expose`` (req_id, ttl), ``retract`` (handle), ``push`` (peer, ticket, src,
  layerwise, timeout), ``computed`` (peer, layers), ``push_outcome`` (peer, wait),
  ``push_released`` (peer, wait)
- decode side: ``pull`` (name, peer, handle, src, dst, timeout, layers) submits and answers at once;
  ``outcome`` (name, wait) is ``{"value": ...}`` or ``{"error": class, "message": ...}`` with
  ``"seconds"`` from the submission to its end (the child's clock); ``released`` (name, wait) whether
  no byte of it can land any more; ``receive_push`` (peer, dst, timeout) -> its ticket,
  ``push_state`` (peer), ``target_result`` (peer, timeout)
- push timing: ``push`` answers ``{"submitted": t}`` and ``target_result`` ``{"value"|"error", "at": t}``
  (a thread waits for every target from ``receive_push`` on; the child's CLOCK_MONOTONIC);
  ``target_close`` (peer)
- the raw Transfer Engine floor (scripts/bench_pd_hosts.py): ``raw_open``, then ``raw_read`` (ranks:
  the peer's ``mooncake`` params per rank, src, dst, max_slices) -> ``{"seconds", "runs", "bytes"}``
- engine: ``digest`` (ids: SHA-256 per rank/kind/layer), ``swap`` (gpu, cpu, back: swap out and in,
  then whether the bytes came back), ``pids`` (the ranks' CTM processes now), ``shm`` (this host's
  /dev/shm names), ``quit``.

A command that raises answers ``{"error": "Class: message"}``; ``call`` raises ``ChildError`` with it.
"""
from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from typing import Iterator

from ops.shm_ledger import process_state

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ChildError(RuntimeError):
    """A command the child ran raised; the message is ``Class: message`` from the child."""


class HostInstance:
    """One engine instance (its engine process and TP CTMs) on a bed host."""

    def __init__(self, host, instance_id: str, spec: dict, *, seed: int, log_dir: str, tp: int = 2,
                 pod_ip: str | None = None, task_timeout: float = 20.0, extra_env: dict | None = None,
                 num_cpu_blocks: int = 8):
        self.host, self.instance_id, self.tp = host, instance_id, tp
        self.pod_ip = host.address if pod_ip is None else pod_ip
        log_dir = os.path.join(log_dir, instance_id)  # its CTMs' logs are named by rank only
        os.makedirs(log_dir, exist_ok=True)
        self.log_dir = log_dir
        config = dict(instance=instance_id, spec=spec, tp=tp, seed=seed, pod_ip=self.pod_ip, log_dir=log_dir,
                      task_timeout=task_timeout, extra_env=extra_env or {}, num_cpu_blocks=num_cpu_blocks)
        env = {**os.environ, "PYTHONPATH": REPO, "PYTHONUNBUFFERED": "1"}
        self._stderr = open(os.path.join(log_dir, f"{instance_id}.engine.stderr"), "ab")
        self.proc = host.popen([sys.executable, "-m", "tests.pd_hosts", json.dumps(config)], env=env, cwd=REPO,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True)
        self.pid = self.proc.pid  # nsenter execs the interpreter: this is the engine process
        self.rank_pids: list[int] = []

    def wait_ready(self, timeout: float = 60.0) -> "HostInstance":
        hello = self._read(timeout)
        self.rank_pids = hello["pids"]
        if hello["engine_pid"] != self.pid:
            raise ChildError(f"{self.instance_id}: engine pid {hello['engine_pid']} is not the child {self.pid}")
        return self

    def stderr_tail(self, chars: int = 3000) -> str:
        path = os.path.join(self.log_dir, f"{self.instance_id}.engine.stderr")
        with contextlib.suppress(OSError), open(path, errors="replace") as f:
            return f.read()[-chars:]
        return ""

    def _read(self, timeout: float) -> object:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"instance {self.instance_id} on host {self.host.name} did not answer within "
                               f"{timeout}s")
        line = self.proc.stdout.readline()
        if not line:
            raise ChildError(f"instance {self.instance_id} exited (rc {self.proc.poll()}): {self.stderr_tail()}")
        value = json.loads(line)
        if isinstance(value, dict) and set(value) == {"error"}:
            raise ChildError(value["error"])
        return value

    def call(self, op: str, answer_within: float = 60.0, **args) -> object:
        """Sends ``op`` with ``args`` (a ``timeout`` among them goes to the child: a task's budget)."""
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        return self._read(answer_within)

    def processes(self) -> list[int]:
        """The engine and the CTMs it reported last."""
        return [self.pid] + list(self.rank_pids)

    def signal_ranks(self, sig: int) -> None:
        for pid in self.rank_pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def close(self, timeout: float = 30.0) -> None:
        """Quit (continuing any stopped process first); killed if it does not end in ``timeout``."""
        for pid in self.processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        for stream in (self.proc.stdin, self.proc.stdout, self._stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.close()


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone)."""
    state = process_state(pid)
    return state is not None and state[1] not in ("Z", "X")


def wait_gone(pids, timeout: float) -> list[int]:
    """Waits up to ``timeout`` s for every pid to end; those still running."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in pids if alive(p)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


@contextlib.contextmanager
def instances(*specs: tuple) -> Iterator[list[HostInstance]]:
    """``HostInstance(*args, **kw)`` for each ``(args, kw)``, started at once, ready; all closed after."""
    started: list[HostInstance] = []
    try:
        for args, kw in specs:
            started.append(HostInstance(*args, **kw))
        for inst in started:
            inst.wait_ready()
        yield started
    finally:
        for inst in started:
            inst.close()


# ---------------------------------------------------------------------------------------------- child
def _child(config: dict) -> None:
    import hashlib
    import threading

    from cache_manager.cache_spec import CacheSpec
    from engine_hooks import CacheTransferService
    from engine_hooks.pd import PrefillDecode
    from transfer_factory.peer.handles import TransferHandle
    from tests.service_helpers import fill_distinct, views

    spec = CacheSpec(**config["spec"])
    svc = CacheTransferService(spec, tp=config["tp"], num_cpu_blocks=config["num_cpu_blocks"],
                               task_timeout=config["task_timeout"], pod_ip=config["pod_ip"],
                               log_dir=config["log_dir"], extra_env=config["extra_env"]).start()
    side = PrefillDecode(svc, config["instance"])
    fill_distinct(svc, seed=config["seed"])
    pulls: dict[str, tuple] = {}  # name -> (future, submitted at)
    pushes: dict[str, tuple] = {}  # peer -> (future, submitted at)
    targets: dict = {}
    landed: dict = {}  # peer -> what the push into its target came to, and when
    waiters: dict = {}  # peer -> the thread waiting for it
    raw = None  # this process's own Transfer Engine (``raw_open``), for the benchmark's floor

    def answer(value) -> None:
        print(json.dumps(value), flush=True)

    def digest(ids) -> dict:
        return {f"{r}/{k}/{l}": hashlib.sha256(v[list(ids)].tobytes()).hexdigest()
                for (r, k, l), v in views(svc).items()}

    def started(future, t0: float) -> tuple:
        """(future, submitted at, [ended at]): the end is stamped when the future resolves."""
        entry = (future, t0, [])
        future.add_done_callback(lambda _: entry[2].append(time.monotonic()))
        return entry

    def outcome(entry, wait: float) -> dict:
        future, t0, ended = entry
        try:
            out = {"value": future.result(timeout=wait)}
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out = {"error": type(exc).__name__, "message": str(exc)}
        return {**out, "seconds": (ended[0] if ended else time.monotonic()) - t0}

    def await_target(peer: str, target, timeout: float) -> None:
        """Waits for a push into ``target`` (off the command loop), stamping when it landed."""
        try:
            landed[peer] = {"value": target.result(timeout=timeout), "at": time.monotonic()}
        except Exception as exc:  # noqa: BLE001 - reported to the test
            landed[peer] = {"error": type(exc).__name__, "message": str(exc), "at": time.monotonic()}

    def released(future, wait: float) -> bool:
        try:
            future.released.result(timeout=wait)
        except Exception:  # noqa: BLE001 - a timeout: not released yet
            return future.released.done()
        return True

    answer({"pids": list(svc.pids().values()), "engine_pid": os.getpid()})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        try:
            if op == "descriptor":
                answer(side.descriptor(cmd.get("offer", ["ipc"])))
            elif op == "link":
                answer(side.link(cmd["peer"], transport=cmd.get("transport", "auto"), offer=cmd.get("offer")))
            elif op == "unlink":
                answer(side.unlink(cmd["peer"]))
            elif op == "linked":
                answer(side.linked())
            elif op == "expose":
                answer(side.expose(cmd["req_id"], ttl=cmd.get("ttl", 30.0)).to_wire())
            elif op == "retract":
                answer(side.retract(TransferHandle.from_wire(cmd["handle"])))
            elif op == "pull":
                layers, t0 = cmd.get("layers"), time.monotonic()
                future = side.pull_blocks(cmd["peer"], cmd["handle"], cmd["src"], cmd["dst"],
                                          placement=cmd.get("placement", "device"),
                                          layers=tuple(layers) if layers else None, timeout=cmd.get("timeout"))
                pulls[cmd["name"]] = started(future, t0)
                answer("submitted")
            elif op == "outcome":
                answer(outcome(pulls[cmd["name"]], cmd.get("wait", 30.0)))
            elif op == "released":
                answer(released(pulls[cmd["name"]][0], cmd.get("wait", 0.0)))
            elif op == "receive_push":
                peer = cmd["peer"]
                targets[peer] = side.receive_push(peer, cmd["dst"], timeout=cmd.get("timeout", 30))
                landed.pop(peer, None)
                waiters[peer] = threading.Thread(target=await_target, args=(peer, targets[peer],
                                                                           cmd.get("timeout", 30) + 5), daemon=True)
                waiters[peer].start()
                answer(targets[peer].ticket)
            elif op == "push_state":
                target = targets[cmd["peer"]]
                answer({"released": target.released, "words": target._words()})
            elif op == "target_result":
                waiters[cmd["peer"]].join(cmd.get("timeout", 30))
                answer(landed.get(cmd["peer"], {"error": "TimeoutError", "message": "the push has not landed"}))
            elif op == "target_close":
                answer(targets.pop(cmd["peer"]).close())
            elif op == "raw_open":
                raw = RawReader(svc, config["pod_ip"])
                answer("ok")
            elif op == "raw_read":
                answer(raw.read(cmd["ranks"], cmd["src"], cmd["dst"], cmd.get("max_slices", 1024)))
            elif op == "push":
                t0 = time.monotonic()
                future = side.push_blocks(cmd["peer"], cmd["ticket"], cmd["src"],
                                          layerwise=cmd.get("layerwise", True), timeout=cmd.get("timeout", 30))
                pushes[cmd["peer"]] = started(future, t0)
                answer({"submitted": pushes[cmd["peer"]][1]})
            elif op == "computed":
                pushes[cmd["peer"]][0].layer_computed(cmd["layers"])
                answer("ok")
            elif op == "push_outcome":
                answer(outcome(pushes[cmd["peer"]], cmd.get("wait", 30.0)))
            elif op == "push_released":
                answer(released(pushes[cmd["peer"]][0], cmd.get("wait", 0.0)))
            elif op == "digest":
                answer(digest(cmd["ids"]))
            elif op == "swap":
                gpu, cpu, back = cmd["gpu"], cmd["cpu"], cmd["back"]
                want = list(digest(gpu).values())
                svc.swap_to_cpu(gpu, cpu).result(timeout=cmd.get("timeout", 20))
                svc.swap_to_gpu(back, cpu).result(timeout=cmd.get("timeout", 20))
                answer(list(digest(back).values()) == want)
            elif op == "pids":
                answer(list(svc.pids().values()))
            elif op == "shm":
                answer(sorted(os.listdir("/dev/shm")))
            elif op == "threads":
                answer(sorted(t.name for t in threading.enumerate()))
            elif op == "quit":
                break
            else:
                answer({"error": f"ValueError: unknown op {op!r}"})
        except Exception as exc:  # noqa: BLE001 - reported to the test
            answer({"error": f"{type(exc).__name__}: {exc}"})
    if raw is not None:
        raw.close()
    side.close()
    svc.shutdown()


class RawReader:
    """This engine process's own Transfer Engine at ``pod_ip``, with its caches registered: the
    raw ``batch_transfer_sync_read`` floor of a pull (scripts/bench_pd_hosts.py), over the very runs
    a rank builds (the same ``coalesce`` of the same ids between the same memory)."""

    def __init__(self, svc, pod_ip: str):
        import logging

        from tests.service_helpers import views
        from transfer_factory.peer.te import TransferEngineEndpoint

        self.views = views(svc)  # (rank, kind, layer) -> [num_blocks, block_bytes]
        self.tp, self.layers = svc.tp, svc.spec.num_layers
        self.ep = TransferEngineEndpoint(pod_ip, "tcp", logging.getLogger("raw-te"))
        self.ep.open()
        for v in self.views.values():
            self.ep.register(int(v.ctypes.data), int(v.nbytes))

    def runs(self, rank: int, peer: dict, src: list[int], dst: list[int]) -> tuple[list, list, list]:
        import numpy as np

        from transfer_factory.peer.te import block_addresses, coalesce

        out: tuple[list, list, list] = ([], [], [])
        kinds = sorted({k for r, k, _ in self.views if r == rank})
        for kind in kinds:
            local = np.asarray([self.views[(rank, kind, l)].ctypes.data for l in range(self.layers)], dtype=np.int64)
            remote = np.zeros(self.layers, dtype=np.int64)
            for k, layer, ptr, _ in peer["regions"]:
                if k == kind:
                    remote[layer] = int(ptr)
            stride = self.views[(rank, kind, 0)].shape[1]
            runs = coalesce(block_addresses(local, stride, dst, range(self.layers)),
                            block_addresses(remote, stride, src, range(self.layers)), stride)
            for acc, part in zip(out, runs):
                acc += part
        return out

    def read(self, ranks: list[dict], src: list[int], dst: list[int], max_slices: int) -> dict:
        """Every rank's runs from the peer rank of its index, ranks in parallel, each cut into
        batches of at most ``max_slices`` 64 KiB slices (what the TCP transport accepts at once)."""
        import threading

        engine, errors = self.ep._engine, []
        plans = []
        for rank in range(self.tp):
            batches, cur, slices = [], ([], [], []), 0
            for lo, ro, n in zip(*self.runs(rank, ranks[rank], src, dst)):
                k = -(-n // (64 << 10))
                if cur[2] and slices + k > max_slices:
                    batches.append(cur)
                    cur, slices = ([], [], []), 0
                for acc, v in zip(cur, (lo, ro, n)):
                    acc.append(v)
                slices += k
            batches.append(cur)
            plans.append((ranks[rank]["address"], batches))

        def one(address: str, batches: list) -> None:
            for batch in batches:
                rc = engine.batch_transfer_sync_read(address, *batch)
                if rc != 0:
                    errors.append(f"batch_transfer_sync_read of {len(batch[2])} runs from {address}: {rc}")

        threads = [threading.Thread(target=one, args=plan) for plan in plans]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - t0
        if errors:
            raise RuntimeError("; ".join(errors))
        return {"seconds": seconds, "runs": sum(len(b[2]) for _, batches in plans for b in batches),
                "bytes": sum(sum(b[2]) for _, batches in plans for b in batches)}

    def close(self) -> None:
        self.ep.close()


if __name__ == "__main__":
    _child(json.loads(sys.argv[1]))
