"""FastDeploy's ``EngineCacheQueue``, engine side, over this project's secure queue (zmq, msgpack,
HMAC frames; never pickle).  The contract is in README.md, "Adopting from FastDeploy"; in short:

* ``is_server=True`` hosts one ``EngineCacheQueueServer`` and one engine core (``engine_core``, the
  service's too: task tracking, the supervisor with its deadlines, pumping and CTM deaths through
  pidfds on the pids the ranks announce when they join, the host-slot guard, and what a CTM that
  exits or rejoins does); ``is_server=False`` is a handle on the server of that port (or path) in
  this process.  This module only translates FastDeploy's calls.
* ``address`` is ``(host, port)`` or FastDeploy's Unix-socket path ``/dev/shm/fd_task_queue_<port>.sock``,
  a name only: the socket is in the queue's private directory (``engine_hooks.fastdeploy.address``).
  A data-parallel engine has a queue of its own (FastDeploy passes every one
  ``local_data_parallel_size=data_parallel_size``): a queue serves the TP ranks of one engine.
  FastDeploy's task tuples are parsed in ``engine_hooks.fastdeploy.tasks``.
* Secret: HKDF-SHA256 of ``authkey`` under a random salt per queue (``engine_hooks.fastdeploy.secret``), random (with a
  warning) for FastDeploy's public default; written to a private file whose path is exported as
  ``CTM_QUEUE_SECRET_FILE`` for the CTMs the engine launches (``engine_hooks.fastdeploy.secret.SecretFile``): the secret
  itself is in no environment.
* Done signals are FastDeploy's tuples as its CTMs send them (a storage task's once per rank, each
  with the blocks done on every rank: FastDeploy's release/2.6 waits for ``tensor_parallel_size`` of a
  write's, its develop of 2026-05 for the first), queued only once the task resolved *and* every rank
  let go of its blocks (``future.released``).  A failed
  storage task reports 0 blocks; a failed swap is never reported done, only in ``failed_tasks()``:
  so is a swap-in from host slots that a rejoined CTM's new swap space no longer holds.
* Control requests ``(CTRL, ControlRequest)`` are answered by ``get_control_response`` as soon as
  every rank answered, or one failed, died or stayed silent past ``control_timeout``
  (``engine_hooks.fastdeploy.control``).  Each is sent under a wire id of its own (its ranks' barrier is named
  after it), so a request id sent again never meets the barrier of an earlier request.
"""
from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from cache_manager.queue import wire
from cache_manager.queue.server import EngineCacheQueueServer
from ops.procs import pid_alive

from cache_manager.queue.unix_address import fastdeploy_queue_path, note_requested_path, private_socket_path

from ..core.engine_core import EngineCore
from .address import check_data_parallel, parse_address
from .control import ControlRefused, ControlResponse, ControlResponses, response_from
from .secret import DEFAULT_AUTHKEY, SECRET_LABEL, SecretFile, queue_secret
from .tasks import Entry, parse_transfer_task

logger = logging.getLogger(__name__)

SECRET_CONTEXT = SECRET_LABEL  # the HKDF label (``engine_hooks.fastdeploy.secret``)
MAX_FAILED_KEPT = 10_000
# port, or requested Unix-socket path -> the server in this process
_servers: "weakref.WeakValueDictionary[int | str, _Core]" = weakref.WeakValueDictionary()


def control_responses_for(port: int) -> ControlResponses | None:
    """The control responses of this process's queue server for FastDeploy's ``cache_queue_port`` ``port``
    (TCP, or its Unix-socket name), or None: what FastDeploy's ``ctrl_c2e_rank<r>_<port>`` queues read."""
    core = _servers.get(port) or _servers.get(fastdeploy_queue_path(port))
    return core.controls if core is not None else None


@dataclass(frozen=True)
class AnnouncedProcess:
    """A CTM the engine knows by the pid it announced when it joined the queue (FastDeploy launches
    its own CTMs): what the supervisor watches.  A zombie counts as gone."""

    pid: int

    def alive(self) -> bool:
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except (FileNotFoundError, ProcessLookupError):
            return False
        except OSError:  # no /proc here: whether the pid exists
            return pid_alive(self.pid)


class _Core:
    """The server side: queue, done signals, and the engine core (``engine_core.EngineCore``: tracking,
    supervision, the host-slot guard, what a rank going down or rejoining does), which the service
    shares.  Every handle of a port shares it."""

    def __init__(self, host: str, port: int, num_client: int, secret: bytes, task_timeout: float,
                 storage_grace: float, ready_timeout: float, ipc_path: str | None = None,
                 control_timeout: float = 60.0):
        self.tp, self.secret, self.control_timeout = num_client, secret, control_timeout
        self.controls = ControlResponses(num_client)
        self.secret_file: SecretFile | None = None  # the owner's, for the CTMs (set once the server is up)
        self.task_timeout, self.storage_grace, self.ready_timeout = task_timeout, storage_grace, ready_timeout
        self.lock = threading.Lock()
        self.inflight: dict[str, Entry] = {}  # wire id -> entry, until resolved and released
        self.done: collections.deque = collections.deque()
        self.failed: collections.OrderedDict[Any, str] = collections.OrderedDict()
        self._all_joined, self._closed = False, False
        self._join_deadline: float | None = None
        self._joined_ranks: dict[int, AnnouncedProcess] = {}  # rank -> the process that joined last
        self._controls_sent = itertools.count()  # makes each control task's wire id (its barrier's name) unique
        # FastDeploy does not tell the queue its swap space's size: the ranks refuse slots outside it
        self.engine = EngineCore(num_client, None, self._joined_processes, self._pump, self._rank_gone,
                                 control_timeout=control_timeout, supervisor_name="fd-cache-queue-supervisor")
        self.tracker = self.engine.tracker
        self.server = EngineCacheQueueServer(num_client, secret, host=host, port=port,
                                             on_result=self.tracker.on_result, on_rank_joined=self._joined,
                                             ipc_path=ipc_path)
        self.engine.serve(self.server)
        self.engine.start()

    # -- submission -------------------------------------------------------------
    def submit(self, item: Any) -> None:
        try:
            wire_task, entry, timeout, grace = parse_transfer_task(item, self.task_timeout, self.storage_grace,
                                                                   self.control_timeout)
        except ControlRefused as refused:  # the engine waits for an answer: it gets this one, nothing is sent
            logger.error("control request %s refused: %s", refused.response.request_id, refused)
            self.controls.answer(refused.response)
            return
        if self._closed:
            raise RuntimeError("the EngineCacheQueue is closed")
        if not self._all_joined:  # CTMs set swap_space_ready a moment before they join: wait, once, bounded
            with self.lock:
                self._join_deadline = self._join_deadline or time.monotonic() + self.ready_timeout
            if not self.wait_ready(self._join_deadline - time.monotonic()):
                logger.warning("not every rank joined the queue within %.0fs of the first task; sending task %s "
                               "anyway (it fails on the ranks missing)", self.ready_timeout, entry.task_id)
        call = entry.report[0] if entry.kind == "control" else None
        if call is not None:
            self.controls.expect(call.request_id)
            # the ranks meet at a barrier named after the wire id: a request id sent again (after a
            # failed barrier of the same name) must not meet the old one
            wire_task["task_id"] = f"{call.request_id}@{next(self._controls_sent)}"
        with self.lock:
            wid, n = wire_task["task_id"], 1
            while wid in self.inflight:  # a cleared task under the same id may still be held by a rank
                wid, n = f"{wire_task['task_id']}#{n}", n + 1
            wire_task["task_id"], self.inflight[wid] = wid, entry
        try:
            future = self.engine.submit(wire_task, timeout, grace)
        except BaseException:
            with self.lock:
                self.inflight.pop(wid, None)
            if call is not None:
                self.controls.forget(call.request_id)
            raise
        if call is not None:  # answered once resolved: a silent rank's release is not waited for
            future.add_done_callback(lambda f: self.controls.answer(response_from(call, f)))
        settle = lambda _f: self._settle(wid, future)  # noqa: E731
        future.add_done_callback(settle)
        future.released.add_done_callback(settle)

    # -- completion (runs on whichever thread resolves the future) ----------------
    def _settle(self, wid: str, future: Future) -> None:
        """Once the task resolved and was released: its done signals (or its failure) and its leaving
        the in-flight table happen under one lock, so ``empty()`` is never true before they show."""
        if not (future.done() and future.released.done()):
            return
        with self.lock:
            entry = self.inflight.get(wid)
        if entry is None:
            return  # the other callback got there first
        signals: list = []
        failure = None
        if entry.kind == "control" or entry.cleared:
            pass  # a control task was answered when it resolved; a forgotten one's signal is dropped
        elif entry.kind == "swap":
            error = future.exception()
            if error is not None:
                failure = f"{type(error).__name__}: {error}"
            else:
                nodes, gpu, cpu = entry.report
                signals = [(entry.event, entry.task_id, list(nodes), list(gpu), list(cpu))]
        else:
            error = future.exception()
            if error is not None:
                logger.warning("storage task %s failed; reporting 0 blocks: %s", entry.task_id, error)
            blocks = list(future.result()) if error is None else []
            signals = [(entry.event, entry.task_id, list(entry.report[0]), list(blocks)) for _ in range(self.tp)]
        with self.lock:
            if self.inflight.pop(wid, None) is None:
                return
            self.done.extend(signals)
            if failure is not None:
                self.failed[entry.task_id] = failure
                while len(self.failed) > MAX_FAILED_KEPT:
                    self.failed.popitem(last=False)
        if failure is not None:
            logger.error("swap task %s failed and is NOT reported done: %s", entry.task_id, failure)
        elif entry.cleared and entry.kind != "control":
            logger.info("task %s was forgotten (clear_transfer_task or close); its done signal is dropped",
                        entry.task_id)

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
        with self.lock:
            self._joined_ranks[rank] = AnnouncedProcess(pid)
        # a CTM that (re)joins has new, empty swap space and has heard no pause sent before
        self.engine.rank_joined(rank, pid)
        self.engine.rank_up(rank)  # after the new pid is known: the old process's death is not this one's

    def _joined_processes(self) -> dict[int, AnnouncedProcess]:
        with self.lock:
            return dict(self._joined_ranks)

    def _pump(self) -> None:
        self.server.pump()  # registers task connections of ranks that joined

    def _rank_gone(self, rank: int, proc: AnnouncedProcess) -> None:
        logger.error("CTM rank %d (pid %d) exited; failing its tasks until it rejoins", rank, proc.pid)
        self.engine.rank_down(rank, f"(pid {proc.pid}) exited")

    @property
    def supervisor_errors(self) -> int:
        """Iterations of the supervisor that raised and were survived."""
        return self.engine.supervisor.errors

    # -- what the engine reads ------------------------------------------------------
    def next_done(self) -> Any:
        with self.lock:
            return self.done.popleft() if self.done else None

    def idle(self) -> bool:
        with self.lock:
            return not self.inflight

    def no_done(self) -> bool:
        with self.lock:
            return not self.done

    def forget_inflight(self) -> int:
        """Forget every task in flight (its done signal is dropped); returns how many."""
        with self.lock:
            for entry in self.inflight.values():
                entry.forget()
            return len(self.inflight)

    def failed_tasks(self) -> dict[Any, str]:
        with self.lock:
            return dict(self.failed)

    def close(self) -> None:
        with self.lock:
            if self._closed:
                return
            self._closed = True
            for entry in self.inflight.values():
                entry.forget()  # nobody reads signals any more
        self.engine.stop_supervisor(5.0)
        self.tracker.close()
        self.server.close()
        logger.info("EngineCacheQueue on %s closed", self.server.address)


class EngineCacheQueue:
    """FastDeploy's engine-side API over an authenticated msgpack queue (see the module docstring).

    Besides FastDeploy's arguments: ``task_timeout`` (seconds a swap may take), ``storage_grace``
    (added to a storage task's own ``timeout`` for the ranks' answers to arrive) and
    ``ready_timeout`` (how long the first ``put_transfer_task`` waits for every rank to join)."""

    def __init__(self, address: tuple[str, int] | str = ("127.0.0.1", 56666), authkey: bytes = DEFAULT_AUTHKEY,
                 is_server: bool = False, num_client: int = 1, client_id: int = -1,
                 local_data_parallel_size: int = 1, local_data_parallel_id: int = 0, *,
                 task_timeout: float = 30.0, storage_grace: float = 5.0, ready_timeout: float = 60.0,
                 control_timeout: float = 60.0):
        check_data_parallel(local_data_parallel_size, local_data_parallel_id)
        addr = parse_address(address)
        if isinstance(num_client, bool) or not isinstance(num_client, int) or num_client < 1:
            raise ValueError(f"num_client {num_client!r} must be the TP size, a positive integer")
        if not 0 < task_timeout < 1e6 or not 0 <= storage_grace < 3600 or not 0 <= ready_timeout < 1e6 \
                or not 0 < control_timeout < 1e6:
            raise ValueError(f"task_timeout {task_timeout!r}, storage_grace {storage_grace!r}, ready_timeout "
                             f"{ready_timeout!r} or control_timeout {control_timeout!r} out of range")
        self.is_server, self.num_client, self.client_id, self._owner = is_server, num_client, client_id, is_server
        self._key: int | str = addr.key
        self._unix = addr.unix
        if not is_server:
            core = _servers.get(addr.key)
            if core is None or core.tp != num_client:
                where = f"at {addr.unix}" if addr.unix else f"on port {addr.port}"
                raise RuntimeError(
                    f"EngineCacheQueue(is_server=False) {where}: no server of {num_client} ranks "
                    "in this process.  CTMs connect with their own client (`python -m "
                    "cache_manager.cache_transfer_manager`); an engine-side handle must live in the process "
                    "that created the server (is_server=True)")
            self._core = core
            self.address = addr.unix or (addr.host, core.server.port)
            return
        if addr.unix is not None and _servers.get(addr.key) is not None:
            raise RuntimeError(f"EngineCacheQueue at {addr.unix}: this process already serves a queue there; "
                               "close it first or use another cache_queue_port")
        secret, derived = queue_secret(authkey)
        if not derived:
            logger.warning("EngineCacheQueue: authkey is FastDeploy's public default (or empty); using a random "
                           "queue secret, passed to the CTMs in the file named by %s", wire.SECRET_FILE_ENV)
        secret_file = SecretFile(secret)
        try:
            ipc_path = None
            if addr.unix is not None:  # the socket goes beside the secret, in the queue's private directory
                note_requested_path(addr.unix)
                ipc_path = private_socket_path(addr.unix, secret_file.directory)
            self._core = _Core(addr.host, addr.port, num_client, secret, task_timeout, storage_grace,
                               ready_timeout, ipc_path, control_timeout)
        except BaseException:
            secret_file.close()
            raise
        self._core.secret_file = secret_file
        secret_file.export()  # the CTMs this engine launches inherit the file's path, not the secret
        if addr.unix is None:
            self._key = self._core.server.port
        _servers[self._key] = self._core
        self.address = addr.unix or (addr.host, self._core.server.port)
        logger.info("EngineCacheQueue server for %d ranks on %s", num_client, self._core.server.address)

    # -- FastDeploy's API ------------------------------------------------------------
    def put_transfer_task(self, item: Any) -> None:
        """Send a swap ``(event_type, transfer_task_id, swap_node_ids, gpu_block_ids, cpu_block_ids)`` or a
        storage ``(STORAGE2GPU, ReadStorageTask)`` / ``(GPU2STORAGE, WriteStorageTask)`` or a control request
        ``(CTRL, ControlRequest)`` (answered by ``get_control_response``) to every rank.  A malformed item
        raises ``ValueError`` naming what is wrong; nothing is sent."""
        self._core.submit(item)

    def get_transfer_done_signal(self) -> Any:
        """The oldest done signal (FastDeploy's tuple), or None; never blocks."""
        return self._core.next_done()

    def empty(self) -> bool:
        """True when no task is in flight: none waits for a rank's answer or for its blocks' release."""
        return self._core.idle()

    def result_queue_empty(self) -> bool:
        """True when no done signal waits to be read."""
        return self._core.no_done()

    def clear_transfer_task(self) -> None:
        """Forget every task in flight: tasks already sent cannot be recalled, so they run (or expire) on
        the ranks, but their done signals are never delivered, and ``empty()`` stays False until every
        rank let go of their blocks: an engine that waits for ``empty()`` before reusing blocks is safe.
        Done signals already queued stay; later tasks are unaffected."""
        n = self._core.forget_inflight()
        logger.info("clear_transfer_task: %d task(s) in flight forgotten", n)

    def get_server_port(self) -> int:
        """The port the server listens on (the one picked when ``address`` gave port 0)."""
        if not self.is_server:
            raise RuntimeError("Only the server instance can provide the port.")
        if self._unix is not None:
            raise RuntimeError(f"this queue serves the Unix-socket address {self._unix}, which has no port: CTMs "
                               "find it with the --cache_queue_port its name carries")
        return self._core.server.port

    # -- ours -----------------------------------------------------------------------------
    def get_control_response(self, request_id: Any, timeout: float = 60.0) -> ControlResponse:
        """The ``ControlResponse`` to the control request ``request_id`` put before (read once):
        ``TimeoutError`` if not answered within ``timeout`` seconds, ``KeyError`` for an unknown id."""
        return self._core.controls.wait(request_id, timeout)

    def failed_tasks(self) -> dict[Any, str]:
        """Swap tasks that failed, timed out or lost a rank (never reported done): task id -> reason."""
        return self._core.failed_tasks()

    def secret_env(self) -> dict[str, str]:
        """The environment a CTM needs to authenticate to this queue: the path of the private secret
        file (it lives until the server's ``close()``)."""
        return self._core.secret_file.env()

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
            if _servers.get(self._key) is self._core:
                del _servers[self._key]
            self._core.close()
            self._core.secret_file.close()

    def __enter__(self) -> "EngineCacheQueue":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
