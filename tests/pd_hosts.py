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
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False


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

    def answer(value) -> None:
        print(json.dumps(value), flush=True)

    def digest(ids) -> dict:
        return {f"{r}/{k}/{l}": hashlib.sha256(v[list(ids)].tobytes()).hexdigest()
                for (r, k, l), v in views(svc).items()}

    def outcome(entry, wait: float) -> dict:
        future, t0 = entry
        try:
            value = future.result(timeout=wait)
            return {"value": value, "seconds": time.monotonic() - t0}
        except Exception as exc:  # noqa: BLE001 - reported to the test
            return {"error": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - t0}

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
                layers = cmd.get("layers")
                future = side.pull_blocks(cmd["peer"], cmd["handle"], cmd["src"], cmd["dst"],
                                          placement=cmd.get("placement", "device"),
                                          layers=tuple(layers) if layers else None, timeout=cmd.get("timeout"))
                pulls[cmd["name"]] = (future, time.monotonic())
                answer("submitted")
            elif op == "outcome":
                answer(outcome(pulls[cmd["name"]], cmd.get("wait", 30.0)))
            elif op == "released":
                answer(released(pulls[cmd["name"]][0], cmd.get("wait", 0.0)))
            elif op == "receive_push":
                targets[cmd["peer"]] = side.receive_push(cmd["peer"], cmd["dst"], timeout=cmd.get("timeout", 30))
                answer(targets[cmd["peer"]].ticket)
            elif op == "push_state":
                target = targets[cmd["peer"]]
                answer({"released": target.released, "words": target._words()})
            elif op == "target_result":
                try:
                    answer({"value": targets[cmd["peer"]].result(timeout=cmd.get("timeout", 30))})
                except Exception as exc:  # noqa: BLE001 - reported to the test
                    answer({"error": type(exc).__name__, "message": str(exc)})
            elif op == "push":
                future = side.push_blocks(cmd["peer"], cmd["ticket"], cmd["src"],
                                          layerwise=cmd.get("layerwise", True), timeout=cmd.get("timeout", 30))
                pushes[cmd["peer"]] = (future, time.monotonic())
                answer("submitted")
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
    side.close()
    svc.shutdown()


if __name__ == "__main__":
    _child(json.loads(sys.argv[1]))
