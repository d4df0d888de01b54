"""FastDeploy's ``EngineCacheQueue``, engine side, over this project's secure queue (zmq, msgpack,
HMAC frames; never pickle).  The contract is in README.md, "Adopting from FastDeploy"; in short:

* ``is_server=True`` hosts one ``EngineCacheQueueServer``, one ``TaskTracker`` and a supervisor
  thread (deadlines, pumping, CTM deaths through pidfds); ``is_server=False`` is a handle on the
  server of that port in this process.  ``local_data_parallel_size > 1`` is refused.
* Secret: ``sha256(b"ctm-queue-secret\\0" + authkey)``, random (with a warning) for FastDeploy's
  public default; exported as ``CTM_QUEUE_SECRET`` for the CTMs the engine launches.
* Done signals are FastDeploy's tuples as its CTMs send them (a read's once per rank), queued only
  once the task resolved *and* every rank let go of its blocks (``future.released``).  A failed
  storage task reports 0 blocks; a failed swap is never reported done, only in ``failed_tasks()``.
"""
from __future__ import annotations

import collections
import enum
import hashlib
import logging
import os
import select
import threading
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from cache_manager.queue import wire
from cache_manager.cache_data import CacheStatus
from cache_manager.cache_tasks import ReadStorageTask as OurReadStorageTask
from cache_manager.queue.server import EngineCacheQueueServer

from .task_tracker import TaskTracker

logger = logging.getLogger(__name__)

DEFAULT_AUTHKEY = b"cache_queue_service"  # FastDeploy's fixed default: public, so never a secret
SECRET_CONTEXT = b"ctm-queue-secret\0"
_TICK = 0.05  # deadlines and rank deaths are noticed within this
_PUMP_EVERY = 1.0
MAX_FAILED_KEPT = 10_000
_SWAPS = (int(CacheStatus.SWAP2CPU), int(CacheStatus.SWAP2GPU))
_STORAGE = (int(CacheStatus.GPU2STORAGE), int(CacheStatus.STORAGE2GPU))
_servers: "weakref.WeakValueDictionary[int, _Core]" = weakref.WeakValueDictionary()  # port -> server here


def queue_secret(authkey: bytes | str) -> tuple[bytes, bool]:
    """(the 32-byte queue secret, whether it derives from ``authkey``); a random one for the default key."""
    key = authkey.encode() if isinstance(authkey, str) else authkey
    if not isinstance(key, (bytes, bytearray)):
        raise ValueError(f"authkey must be bytes, got {type(authkey).__name__}")
    if not key or bytes(key) == DEFAULT_AUTHKEY:
        return wire.new_secret(), False
    return hashlib.sha256(SECRET_CONTEXT + bytes(key)).digest(), True


def _event(value: Any, where: str) -> tuple[int, Any]:
    """(the event's int, the object to report it with): an enum member is kept, an int becomes ours."""
    raw = value.value if isinstance(value, enum.Enum) else value
    if isinstance(raw, bool) or not isinstance(raw, (int, np.integer)) or int(raw) not in _SWAPS + _STORAGE:
        raise ValueError(f"{where}: event_type {value!r} is not SWAP2CPU, SWAP2GPU, GPU2STORAGE or STORAGE2GPU")
    return int(raw), value if isinstance(value, enum.Enum) else CacheStatus(int(raw))


def _ids(value: Any, what: str) -> list[int]:
    value = value.tolist() if isinstance(value, np.ndarray) else value
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{what} must be a list of block ids, got {type(value).__name__}")
    out = []
    for v in value:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise ValueError(f"{what}: {v!r} is not a non-negative integer")
        out.append(int(v))
    return out


def _task_id(value: Any, what: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)) or value == "":
        raise ValueError(f"{what} {value!r} must be a non-empty string or an integer")
    return str(value)


@dataclass
class _Entry:  # what the engine gave, to build its done signal from
    task_id: Any
    event: Any
    kind: str  # "swap", "read", "write"
    report: tuple  # swap: (swap_node_ids, gpu, cpu); storage: (keys,)
    cleared: bool = False


class _Core:
    """The server side: queue, tracker, supervisor, done signals.  Every handle of a port shares it."""

    def __init__(self, host: str, port: int, num_client: int, secret: bytes, task_timeout: float,
                 storage_grace: float, ready_timeout: float):
        self.tp, self.secret = num_client, secret
        self.task_timeout, self.storage_grace, self.ready_timeout = task_timeout, storage_grace, ready_timeout
        self.lock = threading.Lock()
        self.inflight: dict[str, _Entry] = {}  # wire id -> entry, until resolved and released
        self.done: collections.deque = collections.deque()
        self.failed: collections.OrderedDict[Any, str] = collections.OrderedDict()
        self.supervisor_errors, self._all_joined, self._closed = 0, False, False
        self._join_deadline: float | None = None
        self._new_ranks: list[tuple[int, int]] = []
        self._pidfds: dict[int, tuple[int, int]] = {}  # fd -> (rank, pid); supervisor thread only
        self._stop = threading.Event()
        self.tracker = TaskTracker(num_client)
        self.server = EngineCacheQueueServer(num_client, secret, host=host, port=port,
                                             on_result=self.tracker.on_result, on_rank_joined=self._joined)
        self._thread = threading.Thread(target=self._supervise, name="fd-cache-queue-supervisor", daemon=True)
        self._thread.start()

    # -- submission -------------------------------------------------------------
    def submit(self, item: Any) -> None:
        wire_task, entry, timeout, grace = self._parse(item)
        if self._closed:
            raise RuntimeError("the EngineCacheQueue is closed")
        if not self._all_joined:  # CTMs set swap_space_ready a moment before they join: wait, once, bounded
            with self.lock:
                self._join_deadline = self._join_deadline or time.monotonic() + self.ready_timeout
            if not self.wait_ready(self._join_deadline - time.monotonic()):
                logger.warning("not every rank joined the queue within %.0fs of the first task; sending task %s "
                               "anyway (it fails on the ranks missing)", self.ready_timeout, entry.task_id)
        with self.lock:
            wid, n = wire_task["task_id"], 1
            while wid in self.inflight:  # a cleared task under the same id may still be held by a rank
                wid, n = f"{wire_task['task_id']}#{n}", n + 1
            wire_task["task_id"], self.inflight[wid] = wid, entry
        try:
            task, future, send = self.tracker.begin(wire_task, timeout, grace)
        except BaseException:
            with self.lock:
                self.inflight.pop(wid, None)
            raise
        settle = lambda _f: self._settle(wid, future)  # noqa: E731
        future.add_done_callback(settle)
        future.released.add_done_callback(settle)
        if send:
            unreachable = self.server.broadcast(task)
            if unreachable:
                self.tracker.unreachable(wid, unreachable)

    def _parse(self, item: Any) -> tuple[dict, _Entry, float, float]:
        if not isinstance(item, (tuple, list)) or len(item) not in (2, 5):
            raise ValueError(f"a transfer task is a 5-tuple (swap, or legacy storage) or a 2-tuple "
                             f"(event_type, storage task), got {type(item).__name__} of length "
                             f"{len(item) if isinstance(item, (tuple, list)) else '-'}")
        event, report_event = _event(item[0], "transfer task")
        if len(item) == 5 and event in _SWAPS:
            _, tid, nodes, gpu, cpu = item
            gpu, cpu = _ids(gpu, "gpu_block_ids"), _ids(cpu, "cpu_block_ids")
            if len(gpu) != len(cpu):
                raise ValueError(f"swap task: {len(gpu)} gpu_block_ids but {len(cpu)} cpu_block_ids")
            if not isinstance(nodes, (list, tuple, np.ndarray)):
                raise ValueError(f"swap_node_ids must be a list, got {type(nodes).__name__}")
            nodes = list(nodes)  # opaque to the CTMs (FastDeploy's may hold None): echoed from here
            wire_task = {"event_type": event, "task_id": _task_id(tid, "transfer_task_id"), "swap_node_ids": [],
                         "gpu_block_ids": gpu, "cpu_block_ids": cpu}
            return wire_task, _Entry(tid, report_event, "swap", (nodes, gpu, cpu)), self.task_timeout, 0.0
        if len(item) == 5:  # FastDeploy before ReadStorageTask: (event, task_id, keys, gpu_block_ids, timeout)
            _, tid, keys, gpu, timeout = item
            fields = {"task_id": tid, "keys": keys, "token_ids": None, "gpu_block_ids": gpu, "timeout": timeout,
                      "start_read_block_idx": 0}
        elif event in _STORAGE:
            names = ("task_id", "keys", "token_ids", "gpu_block_ids", "timeout") + \
                (("start_read_block_idx",) if event == CacheStatus.STORAGE2GPU else ())
            missing = [n for n in names if not hasattr(item[1], n)]
            if missing:
                raise ValueError(f"storage task {type(item[1]).__name__} has no attribute(s) {missing}")
            fields = {n: getattr(item[1], n) for n in names}
        else:
            raise ValueError(f"a swap task is a 5-tuple (event_type, transfer_task_id, swap_node_ids, "
                             f"gpu_block_ids, cpu_block_ids), got a {len(item)}-tuple")
        return self._storage(event, report_event, fields, isinstance(item[1], OurReadStorageTask))

    def _storage(self, event: int, report_event: Any, f: dict, ours: bool) -> tuple[dict, _Entry, float, float]:
        keys = f["keys"]
        if not isinstance(keys, (list, tuple)) or not all(isinstance(k, str) and k for k in keys):
            raise ValueError("storage task keys must be a list of non-empty strings (block hashes)")
        keys = list(keys)
        gpu = _ids(f["gpu_block_ids"], "gpu_block_ids")
        tokens = _ids(f["token_ids"] if f["token_ids"] is not None else [], "token_ids")
        timeout = f["timeout"]
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < 1e6:
            raise ValueError(f"storage task timeout {timeout!r} must be a positive number of seconds")
        wire_task = {"event_type": event, "task_id": _task_id(f["task_id"], "task_id"), "token_ids": tokens,
                     "timeout": float(timeout)}
        if event == CacheStatus.GPU2STORAGE:
            if len(keys) != len(gpu):
                raise ValueError(f"write task: {len(keys)} keys but {len(gpu)} gpu_block_ids")
            wire_task.update(keys=keys, gpu_block_ids=gpu)
        else:
            start = f["start_read_block_idx"]
            if isinstance(start, bool) or not isinstance(start, int) or start < 0:
                raise ValueError(f"start_read_block_idx {start!r} must be a non-negative integer")
            if ours:  # our ReadStorageTask: keys is the whole chain, loaded from keys[start:]
                if len(gpu) != len(keys) - start:
                    raise ValueError(f"read task: {len(keys) - start} keys from {start} on, {len(gpu)} gpu_block_ids")
                wire_task.update(keys=keys, gpu_block_ids=gpu, start_read_block_idx=start)
            else:  # FastDeploy's: keys[i] loads into gpu_block_ids[i] (which may hold one more, a partial
                # block); start is where keys[0] sits in the request, for token-addressed stores.
                if len(gpu) < len(keys):
                    raise ValueError(f"read task: {len(keys)} keys but only {len(gpu)} gpu_block_ids")
                wire_task.update(keys=[""] * start + keys, gpu_block_ids=gpu[:len(keys)], start_read_block_idx=start)
        kind = "read" if event == CacheStatus.STORAGE2GPU else "write"
        return wire_task, _Entry(f["task_id"], report_event, kind, (keys,)), float(timeout), self.storage_grace

    # -- completion (runs on whichever thread resolves the future) ----------------
    def _settle(self, wid: str, future: Future) -> None:
        if not (future.done() and future.released.done()):
            return
        with self.lock:
            entry = self.inflight.pop(wid, None)
        if entry is None:
            return  # the other callback got there first
        error = future.exception()
        if entry.cleared:
            logger.info("task %s was forgotten (clear_transfer_task or close); its done signal is dropped",
                        entry.task_id)
            return
        if entry.kind == "swap":
            if error is not None:
                self._swap_failed(entry.task_id, f"{type(error).__name__}: {error}")
                return
            nodes, gpu, cpu = entry.report
            signals = [(entry.event, entry.task_id, list(nodes), list(gpu), list(cpu))]
        else:
            if error is not None:
                logger.warning("storage task %s failed; reporting 0 blocks: %s", entry.task_id, error)
            blocks = list(future.result()) if error is None else []
            copies = self.tp if entry.kind == "read" else 1
            signals = [(entry.event, entry.task_id, list(entry.report[0]), list(blocks)) for _ in range(copies)]
        with self.lock:
            self.done.extend(signals)

    def _swap_failed(self, task_id: Any, reason: str) -> None:
        logger.error("swap task %s failed and is NOT reported done: %s", task_id, reason)
        with self.lock:
            self.failed[task_id] = reason
            while len(self.failed) > MAX_FAILED_KEPT:
                self.failed.popitem(last=False)

    # -- ranks ------------------------------------------------------------------------
    def wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + max(0.0, timeout)
        while len(self.server.registered_ranks()) < self.tp:
            if time.monotonic() >= deadline or self._closed:
                return False
            time.sleep(0.02)
        self._all_joined = True
        return True

    def _joined(self, rank: int, pid: int) -> None:  # queue I/O thread: must not block
        self.tracker.mark_up(rank)
        with self.lock:
            self._new_ranks.append((rank, pid))

    def _supervise(self) -> None:
        last_pump = 0.0
        while not self._stop.is_set():
            try:
                fds = list(self._pidfds)
                gone = select.select(fds, [], [], _TICK)[0] if fds else []
                if not fds:
                    self._stop.wait(_TICK)
                self._ranks_gone(gone)
                self._watch_new_ranks()
                now = time.monotonic()
                if now - last_pump >= _PUMP_EVERY:
                    self.server.pump()  # registers task connections of ranks that joined
                    last_pump = now
                self.tracker.expire(now)
            except Exception:  # deadlines must outlive one bad iteration
                self.supervisor_errors += 1
                logger.exception("EngineCacheQueue supervisor iteration failed; supervising on")
                self._stop.wait(_TICK)

    def _ranks_gone(self, fds: list[int]) -> None:
        for fd in fds:
            rank, pid = self._pidfds.pop(fd)
            os.close(fd)
            logger.error("CTM rank %d (pid %d) exited; failing its tasks until it rejoins", rank, pid)
            self.server.forget_rank(rank)
            self.tracker.rank_died(rank, f"(pid {pid}) exited")

    def _watch_new_ranks(self) -> None:
        with self.lock:
            new, self._new_ranks = self._new_ranks, []
        for rank, pid in new:
            for fd in [fd for fd, (r, _) in self._pidfds.items() if r == rank]:
                os.close(fd)
                del self._pidfds[fd]
            try:
                self._pidfds[os.pidfd_open(pid)] = (rank, pid)
            except (AttributeError, OSError) as exc:  # no pidfds here, or already gone
                logger.warning("cannot watch CTM rank %d (pid %d): %s", rank, pid, exc)

    def close(self) -> None:
        with self.lock:
            if self._closed:
                return
            self._closed = True
            for entry in self.inflight.values():
                entry.cleared = True  # nobody reads signals any more
        self._stop.set()
        self._thread.join(5.0)
        self.tracker.close()
        self.server.close()
        if not self._thread.is_alive():
            for fd in self._pidfds:
                os.close(fd)
        logger.info("EngineCacheQueue on port %d closed", self.server.port)


class EngineCacheQueue:
    """FastDeploy's engine-side API over an authenticated msgpack queue (see the module docstring).

    Besides FastDeploy's arguments: ``task_timeout`` (seconds a swap may take), ``storage_grace``
    (added to a storage task's own ``timeout`` for the ranks' answers to arrive) and
    ``ready_timeout`` (how long the first ``put_transfer_task`` waits for every rank to join)."""

    def __init__(self, address: tuple[str, int] = ("127.0.0.1", 56666), authkey: bytes = DEFAULT_AUTHKEY,
                 is_server: bool = False, num_client: int = 1, client_id: int = -1,
                 local_data_parallel_size: int = 1, local_data_parallel_id: int = 0, *,
                 task_timeout: float = 30.0, storage_grace: float = 5.0, ready_timeout: float = 60.0):
        if local_data_parallel_size != 1 or local_data_parallel_id != 0:
            raise ValueError(f"local_data_parallel_size {local_data_parallel_size} / id {local_data_parallel_id}: "
                             "only one data-parallel group per queue is supported; give each engine its own queue")
        if not isinstance(address, (tuple, list)) or len(address) != 2 or not isinstance(address[1], int) \
                or not 0 <= address[1] < 65536 or not isinstance(num_client, int) or num_client < 1:
            raise ValueError(f"address {address!r} must be (host, port), num_client {num_client!r} the TP size")
        if not 0 < task_timeout < 1e6 or not 0 <= storage_grace < 3600 or not 0 <= ready_timeout < 1e6:
            raise ValueError(f"task_timeout {task_timeout!r}, storage_grace {storage_grace!r} or ready_timeout "
                             f"{ready_timeout!r} out of range")
        self.is_server, self.num_client, self.client_id, self._owner = is_server, num_client, client_id, is_server
        if not is_server:
            core = _servers.get(address[1])
            if core is None or core.tp != num_client:
                raise RuntimeError(
                    f"EngineCacheQueue(is_server=False) on port {address[1]}: no server of {num_client} ranks "
                    "in this process.  CTMs connect with their own client (`python -m "
                    "cache_manager.cache_transfer_manager`); an engine-side handle must live in the process "
                    "that created the server (is_server=True)")
            self._core = core
            self.address = (address[0], core.server.port)
            return
        secret, derived = queue_secret(authkey)
        if not derived:
            logger.warning("EngineCacheQueue: authkey is FastDeploy's public default (or empty); using a random "
                           "queue secret, passed to the CTMs in %s", wire.SECRET_ENV)
        self._core = _Core(address[0], address[1], num_client, secret, task_timeout, storage_grace, ready_timeout)
        os.environ[wire.SECRET_ENV] = secret.hex()  # the CTMs this engine launches inherit it
        _servers[self._core.server.port] = self._core
        self.address = (address[0], self._core.server.port)
        logger.info("EngineCacheQueue server for %d ranks on %s", num_client, self._core.server.address)

    # -- FastDeploy's API ------------------------------------------------------------
    def put_transfer_task(self, item: Any) -> None:
        """Send a swap ``(event_type, transfer_task_id, swap_node_ids, gpu_block_ids, cpu_block_ids)`` or a
        storage ``(STORAGE2GPU, ReadStorageTask)`` / ``(GPU2STORAGE, WriteStorageTask)`` to every rank.
        A malformed item raises ``ValueError`` naming what is wrong; nothing is sent."""
        self._core.submit(item)

    def get_transfer_done_signal(self) -> Any:
        """The oldest done signal (FastDeploy's tuple), or None; never blocks."""
        with self._core.lock:
            return self._core.done.popleft() if self._core.done else None

    def empty(self) -> bool:
        """True when no task is in flight: none waits for a rank's answer or for its blocks' release."""
        with self._core.lock:
            return not self._core.inflight

    def result_queue_empty(self) -> bool:
        """True when no done signal waits to be read."""
        with self._core.lock:
            return not self._core.done

    def clear_transfer_task(self) -> None:
        """Forget every task in flight: tasks already sent cannot be recalled, so they run (or expire) on
        the ranks, but their done signals are never delivered, and ``empty()`` stays False until every
        rank let go of their blocks: an engine that waits for ``empty()`` before reusing blocks is safe.
        Done signals already queued stay; later tasks are unaffected."""
        with self._core.lock:
            for entry in self._core.inflight.values():
                entry.cleared = True
            n = len(self._core.inflight)
        logger.info("clear_transfer_task: %d task(s) in flight forgotten", n)

    def get_server_port(self) -> int:
        """The port the server listens on (the one picked when ``address`` gave port 0)."""
        if not self.is_server:
            raise RuntimeError("Only the server instance can provide the port.")
        return self._core.server.port

    # -- ours -----------------------------------------------------------------------------
    def failed_tasks(self) -> dict[Any, str]:
        """Swap tasks that failed, timed out or lost a rank (never reported done): task id -> reason."""
        with self._core.lock:
            return dict(self._core.failed)

    def secret_env(self) -> dict[str, str]:
        """The environment a CTM needs to authenticate to this queue."""
        return {wire.SECRET_ENV: self._core.secret.hex()}

    def wait_ready(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until every rank has joined the queue."""
        return self._core.wait_ready(timeout)

    @property
    def server(self) -> EngineCacheQueueServer:
        return self._core.server

    def close(self) -> None:
        """Stop the supervisor, fail what is pending (no signal is delivered any more) and close the
        server.  Idempotent; a handle that is not the server's owner only lets go of it."""
        if self._owner:
            if _servers.get(self._core.server.port) is self._core:
                del _servers[self._core.server.port]
            self._core.close()

    def __enter__(self) -> "EngineCacheQueue":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
